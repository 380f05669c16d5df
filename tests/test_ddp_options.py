"""The ddp group: every option reaches DDP; an unused branch needs find_unused_parameters."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import ROOT, run, run_env, train_cmd
from test_ema import rank_info

from ddp_template.config.schema import DDPConfig
from ddp_template.models import small_cnn
from ddp_template.parallel import build_ddp


# torch warns that static_graph makes find_unused_parameters redundant: both set on purpose here.
@pytest.mark.filterwarnings("ignore:You passed find_unused_parameters=true:UserWarning")
def test_every_option_reaches_ddp(tmp_path: Path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        cfg = DDPConfig(
            find_unused_parameters=True,
            static_graph=True,
            gradient_as_bucket_view=True,
            bucket_cap_mb=2.5,
            broadcast_buffers=False,
        )
        info = rank_info(0, 2)  # any distributed DistInfo: build_ddp wraps, the group is 1 rank
        ddp = build_ddp(cfg, small_cnn(num_classes=10, in_channels=1, image_size=8), info)
        assert ddp.find_unused_parameters and ddp.static_graph and ddp.gradient_as_bucket_view
        assert ddp.bucket_bytes_cap == int(2.5 * 1024 * 1024)
        assert (
            getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None)) is False
        )
        default = build_ddp(
            DDPConfig(), small_cnn(num_classes=10, in_channels=1, image_size=8), info
        )
        assert not (default.find_unused_parameters or default.static_graph)
        assert default.bucket_bytes_cap == 25 * 1024 * 1024
    finally:
        dist.destroy_process_group()


TINY = [
    "dist.nproc=2",
    "data=synthetic",
    "data.size=64",
    "data.test_size=16",
    "data.image_size=8",
    "loader.batch_size=8",
    "epochs=1",
    "max_steps_per_epoch=3",
    "logger=none",
    "checkpoint.enabled=false",
    "model=unused",
]


@pytest.mark.slow
def test_unused_branch_needs_find_unused_parameters(tmp_path: Path) -> None:
    """Without the option DDP's reducer fails at the second step, as it does today."""
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "unused.yaml").write_text("_target_: unused_branch.unused_branch\n")
    env = run_env(PYTHONPATH=str(ROOT / "tests"))
    tiny = [*TINY, f"hydra.searchpath=[file://{conf}]"]
    failed = run(train_cmd(tmp_path / "a", *tiny), env=env, check=False)
    assert failed.returncode == 1, failed.stderr[-2000:]
    assert "find_unused_parameters=True" in failed.stdout + failed.stderr
    options = [
        "ddp.gradient_as_bucket_view=true",
        "ddp.bucket_cap_mb=1",
        "ddp.broadcast_buffers=false",
    ]
    ok = run(train_cmd(tmp_path / "b", *tiny, "ddp.find_unused_parameters=true", *options), env=env)
    assert "final test accuracy" in ok.stdout
