"""The W&B runs choice, each rank's W&B settings, alerts and checkpoint artifacts, in-process.

The settings are W&B's own ``Settings`` objects (so W&B validates them); alerts and artifacts are
read back from a real offline run.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import wandb
from omegaconf import DictConfig
from wandb_reader import find_runs

from ddp_template.checks import check
from ddp_template.config.boundary import typed
from ddp_template.config.schema import LoggerConfig, SystemMetrics, WandbMode, WandbRuns
from ddp_template.distributed import DistInfo
from ddp_template.errors import ConfigError
from ddp_template.ledger.records import EpochReport
from ddp_template.ledger.tally import fingerprint_sum
from ddp_template.ledger.verify import share_report
from ddp_template.run_identity import RunInfo
from ddp_template.sinks.metrics import RankLogger
from ddp_template.sinks.wandb_run import SHARED_MIN_VERSION, _settings, choose_runs


def rank(r: int, local_rank: int, world_size: int = 4) -> DistInfo:
    return DistInfo(
        rank=r,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=2,
        backend=None,
        device=torch.device("cpu"),
        host="localhost",
    )


def test_auto_is_per_rank_up_to_per_rank_max_then_main() -> None:
    cfg = LoggerConfig(per_rank_max=2)
    assert choose_runs(cfg, 3).name == "main"
    assert choose_runs(cfg, 3).reason == "auto: 3 ranks > logger.per_rank_max=2"
    assert choose_runs(cfg, 2).name == "per_rank" and choose_runs(cfg, 1).name == "per_rank"
    assert choose_runs(LoggerConfig(), 8).name == "per_rank"
    assert choose_runs(LoggerConfig(), 9).name == "main"
    for runs in ("per_rank", "main"):
        assert choose_runs(LoggerConfig(runs=WandbRuns(runs)), 100).name == runs


def test_shared_needs_online_and_a_new_enough_wandb() -> None:
    online = LoggerConfig(runs=WandbRuns.shared, mode=WandbMode.online)
    assert choose_runs(online, 2, installed=SHARED_MIN_VERSION).name == "shared"
    old = choose_runs(online, 2, installed="0.19.1")
    assert (old.name, old.fallback) == (
        "main",
        f"W&B's shared mode needs wandb>={SHARED_MIN_VERSION}, not 0.19.1",
    )
    offline = choose_runs(LoggerConfig(runs=WandbRuns.shared), 2, installed="0.31.0")
    assert offline.name == "main" and "logger.mode=online, not offline" in offline.fallback


@pytest.mark.parametrize(
    "metrics,on", [("node", [True, False, True, False]), ("all", [True] * 4), ("off", [False] * 4)]
)
def test_system_metrics_and_labels_per_rank(metrics: str, on: list[bool]) -> None:
    """2 nodes x 2 ranks: node samples on each node's local rank 0."""
    cfg = LoggerConfig(system_metrics=SystemMetrics(metrics))
    runs = choose_runs(cfg, 4)
    ranks = [rank(r, r % 2) for r in range(4)]
    settings = [_settings(wandb, cfg, runs, info) for info in ranks]
    assert [not s.x_disable_stats for s in settings] == on
    assert [s.x_label for s in settings] == ["rank0", "rank1", "rank2", "rank3"]


def test_shared_settings_make_rank0_primary() -> None:
    cfg = LoggerConfig(runs=WandbRuns.shared, mode=WandbMode.online)
    runs = choose_runs(cfg, 4)
    settings = [_settings(wandb, cfg, runs, rank(r, r % 2)) for r in range(4)]
    assert [s.x_primary for s in settings] == [True, False, False, False]
    assert [s.x_update_finish_state for s in settings] == [True, False, False, False]
    assert [s.x_label for s in settings] == ["rank0", "rank1", "rank2", "rank3"]


def _report(ok: bool, ratio: float) -> EpochReport:
    seen = fingerprint_sum(np.arange(4))
    observed = [{"samples": 4, "duplicates": 0, "fingerprint": seen}]
    report = share_report("padded", 4, observed, [seen if ok else seen + 1])
    return dataclasses.replace(report, slowest_rank=0, step_s_max_over_min=ratio)


def test_alerts_once_and_best_checkpoint_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    cfg = LoggerConfig(log_checkpoints="best", straggler_alert=1.5)
    logger = RankLogger(
        cfg=cfg,
        run=RunInfo(run_id="alerts", run_dir=tmp_path),
        info=rank(0, 0, world_size=1),
        config={"sampler": {"mode": "padded"}},
    )
    logger.ready()
    best = tmp_path / "best.pt"
    best.write_bytes(b"epoch 0")
    caplog.set_level(logging.WARNING, logger="ddp_template")
    for epoch, (ok, ratio, rewritten) in enumerate(
        [(True, 1.2, True), (False, 2.0, False), (False, 3.0, True)]
    ):
        logger.log_share_report(_report(ok, ratio), epoch, step=epoch + 1)
        if rewritten:
            best.write_bytes(f"epoch {epoch}".encode())
        metrics = {"test/accuracy": epoch / 10}
        logger.log_checkpoint(
            best, kind="best", step=epoch + 1, epoch=epoch, metrics=metrics, rewritten=rewritten
        )
        logger.log_checkpoint(tmp_path / "last.pt", kind="last", step=0, epoch=0, metrics={})
    logger.finish()
    wandb.teardown()  # as at process exit: W&B's service has written the whole file
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("SHARE MISMATCH in epoch" in m for m in warnings) == 2
    assert sum("STRAGGLER in epoch" in m for m in warnings) == 2
    (wb,) = find_runs(tmp_path)
    assert [(a["title"], a["level"]) for a in wb.alerts] == [
        ("SHARE MISMATCH", "WARN"),
        ("STRAGGLER", "WARN"),
    ]
    assert wb.alerts[1]["text"].startswith("epoch 1: rank 0's step time is 2.00x")
    models = [a for a in wb.artifacts if a["type"] == "model"]
    assert [(a["files"], a["metadata"]) for a in models] == [
        (["best.pt"], {"kind": "best", "step": 1, "epoch": 0, "test/accuracy": 0.0}),
        (["best.pt"], {"kind": "best", "step": 3, "epoch": 2, "test/accuracy": 0.2}),
    ]
    assert {"best", "epoch-2"} <= set(models[1]["aliases"])


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["logger.per_rank_max=0"], "logger.per_rank_max=0 must be >= 1"),
        (["logger.straggler_alert=0.9"], "logger.straggler_alert=0.9 must be > 1"),
        (["logger=none", "logger.log_checkpoints=last"], "needs logger=wandb and checkpoint"),
        (["logger.log_checkpoints=last", "checkpoint.enabled=false"], "checkpoint.enabled=False"),
        (["logger.log_checkpoints=best"], "which only selection.monitor keeps"),
    ],
)
def test_logger_settings_are_checked_at_startup(
    compose_cfg: Callable[..., DictConfig], overrides: list[str], needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        check(typed(compose_cfg(*overrides)))


def test_log_checkpoints_is_a_closed_set(compose_cfg: Callable[..., DictConfig]) -> None:
    cfg = typed(compose_cfg("logger.log_checkpoints=none", "logger.straggler_alert=null"))
    check(cfg)
    assert cfg.logger.log_checkpoints == "none" and cfg.logger.straggler_alert is None
    check(typed(compose_cfg("logger.log_checkpoints=last")))
    with pytest.raises(Exception, match="every"):  # Hydra's own message names the value
        compose_cfg("logger.log_checkpoints=every")


@pytest.mark.parametrize("r", [0, 1])
def test_shared_mode_that_cannot_reach_a_server(
    r: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """W&B itself takes the shared settings; with no server the primary (rank 0) goes offline,
    and a worker, which alone offline would be a stray run, logs to its JSONL only."""
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for var in ("HOME", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # a closed local port
    cfg = LoggerConfig(runs=WandbRuns.shared, mode=WandbMode.online)
    logger = RankLogger(
        cfg=cfg,
        run=RunInfo(run_id="shared", run_dir=tmp_path),
        info=rank(r, r, world_size=2),
        config={"sampler": {"mode": "padded"}},
    )
    assert logger.runs.name == "shared"
    logger.ready()
    started = logger.wandb is not None
    logger.finish()
    wandb.teardown()  # as at process exit: W&B's service has written the whole file
    warnings = [x.getMessage() for x in caplog.records if x.levelno == logging.WARNING]
    if r == 0:
        assert started and len(warnings) == 1 and "logging offline instead" in warnings[0]
        (wb,) = find_runs(tmp_path)
        assert (wb.name, wb.config["wandb_runs"]) == ("shared", "shared")
    else:
        assert not started and len(warnings) == 1 and "metrics.jsonl only" in warnings[0]
        assert not find_runs(tmp_path)
