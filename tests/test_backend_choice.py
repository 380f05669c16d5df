"""The backend each node can run, fork with CUDA and bf16 without native support, on a CPU machine
with the GPUs faked: ``torch.cuda.is_available``/``device_count``/``get_device_capability``
report what a GPU host would, everything else (Hydra, the checks, train.py's exit) is real.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import ROOT, free_port, run, run_env
from omegaconf import DictConfig

from ddp_template import checks, distributed
from ddp_template.amp import check_amp
from ddp_template.config import boundary
from ddp_template.config.schema import BackendConfig
from ddp_template.distributed import choose_backend
from ddp_template.errors import ConfigError


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def one_sentence(message: str) -> None:
    assert "\n" not in message and message.endswith(".") and message.count(". ") == 0, message


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "TORCHELASTIC_USE_AGENT_STORE",
    ):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize(
    "gpus,ranks,backend,why",
    [
        (0, 1, "gloo", "auto: no GPU visible"),
        (1, 2, "gloo", "auto: 1 visible GPU for 2 local ranks, nccl needs one GPU per rank"),
        (2, 2, "nccl", "auto: 2 visible GPUs for 2 local ranks"),
        (4, 2, "nccl", "auto: 4 visible GPUs for 2 local ranks"),
    ],
)
def test_auto_takes_nccl_only_with_a_gpu_per_local_rank(
    monkeypatch: pytest.MonkeyPatch, gpus: int, ranks: int, backend: str, why: str
) -> None:
    fake_gpus(monkeypatch, gpus)
    assert choose_backend("auto", ranks) == (backend, why)


def test_one_gpu_two_local_ranks_join_on_gloo_and_say_why(
    monkeypatch: pytest.MonkeyPatch, no_launcher: None
) -> None:
    """The real setup of rank 0 of 2 on a 1-GPU node (its group pre-made, world 1: no peer
    here): gloo on the CPU, no set_device, and rank 0's first log line says why."""
    fake_gpus(monkeypatch, 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda _: pytest.fail("set_device called"))
    env = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    try:
        info = distributed.setup(BackendConfig())
    finally:
        distributed.teardown()
    assert (info.backend, info.device, info.local_world_size) == ("gloo", torch.device("cpu"), 2)
    assert info.describe().endswith(
        "backend gloo, device cpu (auto: 1 visible GPU for 2 local ranks, nccl needs one GPU "
        "per rank)"
    ), info.describe()


def test_explicit_nccl_with_too_few_gpus_is_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 1)
    with pytest.raises(ConfigError) as err:
        choose_backend("nccl", 2)
    message = str(err.value)
    one_sentence(message)
    assert "backend.name=nccl" in message and "1 visible GPU for 2 local ranks" in message
    assert "backend=auto" in message
    assert choose_backend("nccl", 1) == ("nccl", "backend=nccl: 1 visible GPU for 1 local rank")


def test_a_launcher_without_local_rank_gets_gloo_or_a_refusal(
    monkeypatch: pytest.MonkeyPatch, no_launcher: None
) -> None:
    """RANK and WORLD_SIZE alone (a hand-rolled launcher): every rank would take cuda:0."""
    fake_gpus(monkeypatch, 8)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distributed.node_ranks(nproc=1) == (2, False)
    name, why = choose_backend("auto", 2, local_rank_given=False)
    assert (name, why) == ("gloo", "auto: the launcher gave no LOCAL_RANK to pick a GPU by")
    with pytest.raises(ConfigError, match="needs LOCAL_RANK") as err:
        choose_backend("nccl", 2, local_rank_given=False)
    one_sentence(str(err.value))
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.node_ranks(nproc=1) == (2, True)


def test_fork_is_refused_where_cuda_is_available(
    monkeypatch: pytest.MonkeyPatch, no_launcher: None, compose_cfg: Callable[..., DictConfig]
) -> None:
    cfg = boundary.typed(compose_cfg("dist.nproc=2", "dist.start_method=fork", "backend=gloo"))
    fake_gpus(monkeypatch, 0)
    checks.check(cfg)  # no CUDA: fork is fine
    fake_gpus(monkeypatch, 2)
    with pytest.raises(ConfigError) as err:
        checks.check(cfg)
    message = str(err.value)
    one_sentence(message)
    assert "dist.start_method=fork" in message and "forkserver" in message
    checks.check(boundary.typed(compose_cfg("dist.nproc=2", "backend=gloo")))  # the default


def test_explicit_nccl_two_ranks_on_one_gpu_exits_2_in_one_sentence(tmp_path: Path) -> None:
    """train.py for real, in a process whose torch sees one (fake) GPU: refused at startup."""
    fake = (
        "import runpy, sys, torch; "
        "torch.cuda.is_available = lambda: True; torch.cuda.device_count = lambda: 1; "
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    cmd = [
        sys.executable, "-c", fake, str(ROOT / "train.py"), "backend=nccl", "dist.nproc=2",
        "logger=none", f"paths.output_root={tmp_path / 'outputs'}",
    ]  # fmt: skip
    proc = run(cmd, env=run_env(), check=False, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    [line] = [x for x in out.splitlines() if "backend.name=nccl" in x]
    one_sentence(line.split(" - ", 1)[-1])
    assert "1 visible GPU for 2 local ranks" in line and "Traceback" not in out
    assert not list((tmp_path / "outputs").glob("*/rank*"))  # refused before any rank started


def test_bf16_is_refused_on_a_gpu_without_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """A V100 (7.0): torch.cuda.is_bf16_supported() counts emulation, the check does not."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _=None: "Tesla V100-SXM2-16GB")
    with pytest.raises(ConfigError) as err:
        check_amp("bf16", torch.device("cuda", 0))
    message = str(err.value)
    one_sentence(message)
    assert "amp.mode=bf16" in message and "Tesla V100-SXM2-16GB (7.0)" in message
    assert "amp=fp16" in message
