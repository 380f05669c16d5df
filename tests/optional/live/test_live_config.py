"""fault_tolerance=live's refusals at startup, and the restart path where torch lacks the API."""

from __future__ import annotations

import pytest
import torch.distributed
from conftest import compose_conf

from ddp_template import launch, tolerance
from ddp_template.checks import check
from ddp_template.config.boundary import typed
from ddp_template.errors import ConfigError
from ddp_template.run_identity import RunInfo

TWO_HOSTS = ["dist.nproc=2", "dist.nnodes=2", "fault_tolerance.coordinator=node0:29400"]


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["dist.nproc=1"], "dist.nproc=1"),
        (["dist.nproc=2", "backend=nccl"], "backend=nccl"),
        pytest.param(
            ["dist.nproc=2", "parallel=fsdp2"], "parallel=fsdp2", marks=pytest.mark.needs("fsdp2")
        ),
        (["dist.nproc=2", "fault_tolerance.min_members=3"], "min_members=3"),
        (["dist.nproc=2", "fault_tolerance.dead_after_s=0.5"], "dead_after_s=0.5"),
        (["dist.nproc=2", "dist.nnodes=2"], "fault_tolerance.coordinator=<host>:<port>"),
        (["dist.nnodes=2", "fault_tolerance.coordinator=node0"], "coordinator=node0 is not"),
        (["dist.nnodes=2", "dist.node_rank=2", "fault_tolerance.coordinator=n:1"], "node_rank=2"),
        ([*TWO_HOSTS, "fault_tolerance.min_members=5"], "min_members=5"),
    ],
)
def test_live_refuses_what_it_cannot_survive_in_one_sentence(
    overrides: list[str], named: str
) -> None:
    cfg = typed(compose_conf("fault_tolerance=live", "logger=none", *overrides))
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        check(cfg)


def test_several_hosts_of_the_templates_launcher_are_the_live_modes_alone() -> None:
    cfg = typed(compose_conf("dist.nnodes=2", "logger=none"))
    with pytest.raises(ConfigError, match="dist.nnodes=2 starts the template's launcher"):
        check(cfg)


def test_without_torchs_api_the_launcher_says_so_and_restarts_instead(
    monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.delattr(torch.distributed, "_reconfigure")
    assert (
        tolerance.reconfigurable()
        == f"torch {torch.__version__} has no torch.distributed._reconfigure"
    )
    cfg = typed(compose_conf("fault_tolerance=live", "dist.nproc=2", "logger=none"))
    calls = []

    def elastic(config, fn):  # torch's elastic launch: the restart path
        calls.append(config.nproc_per_node)
        return lambda *args: {0: 0.5, 1: 0.5}

    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", elastic)
    run = RunInfo(run_id="fallback", run_dir=tmp_path)
    assert launch.launch(lambda cfg, run: None, cfg, run) == 0.5
    assert calls == [2]
    err = capsys.readouterr().err
    assert "fault_tolerance=live is unavailable (torch" in err and "restart path" in err, err
    assert isinstance(
        tolerance.build_tolerance(cfg.fault_tolerance, cfg.backend), tolerance.Restart
    )
