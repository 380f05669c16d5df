"""Starting W&B in one of its three ways to log distributed training (``logger.runs``), and
the fallbacks.

* ``per_rank``: every rank its own run, grouped by the run id (``job_type`` main on rank 0,
  worker elsewhere): every rank's data and system metrics apart.
* ``main``: one run, on rank 0; the other ranks' per-epoch numbers reach it through a gather
  (``RankLogger.log_epoch``).
* ``shared``: one run every rank writes into (W&B's shared mode): rank 0 primary, each rank
  labelled ``rank<r>``. It needs ``logger.mode=online`` and wandb >= ``SHARED_MIN_VERSION``;
  elsewhere it falls back to ``main``.

``choose_runs`` reads only the config, the world size and the installed W&B version, so every
rank reaches the same answer without talking to the others. W&B trouble never stops training: a
failed start falls back to offline, then to JSONL only.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

from packaging.version import Version

from ddp_template.config.schema import LoggerConfig, SystemMetrics, WandbMode, WandbRuns
from ddp_template.distributed import DistInfo
from ddp_template.run_identity import RunInfo

log = logging.getLogger("ddp_template")

SHARED_MIN_VERSION = "0.19.6"  # the first whose Settings take x_primary (0.19.5: x_primary_node)


@dataclass(frozen=True)
class Runs:
    name: str  # per_rank | main | shared: what this run uses
    reason: str  # why, for rank 0's log line
    fallback: str | None = None  # why logger.runs=shared became main (rank 0 warns once)

    @property
    def one_run(self) -> bool:
        """One W&B run for the whole job: every rank's epoch numbers are gathered to rank 0."""
        return self.name != WandbRuns.per_rank

    def starts_run(self, info: DistInfo) -> bool:
        return self.name != WandbRuns.main or info.is_main

    def logs_history(self, info: DistInfo) -> bool:
        """Whether this rank's ``log`` rows go to W&B (with one run, only rank 0's do)."""
        return not self.one_run or info.is_main


def choose_runs(cfg: LoggerConfig, world_size: int, installed: str | None = None) -> Runs:
    """The W&B runs for ``world_size`` ranks; ``installed`` is the wandb version (default: this
    environment's)."""
    runs, limit = cfg.runs, cfg.per_rank_max
    if runs == WandbRuns.auto:
        if world_size <= limit:
            return Runs("per_rank", f"auto: {world_size} ranks <= logger.per_rank_max={limit}")
        return Runs("main", f"auto: {world_size} ranks > logger.per_rank_max={limit}")
    if runs == WandbRuns.shared:
        installed = installed or version("wandb")
        problem = None
        if cfg.mode != WandbMode.online:
            problem = f"W&B's shared mode needs logger.mode=online, not {cfg.mode}"
        elif Version(installed) < Version(SHARED_MIN_VERSION):
            problem = f"W&B's shared mode needs wandb>={SHARED_MIN_VERSION}, not {installed}"
        if problem is not None:
            return Runs("main", "logger.runs=shared, fallen back", fallback=problem)
    return Runs(str(runs), f"logger.runs={runs}")


def system_metrics_on(cfg: LoggerConfig, info: DistInfo) -> bool:
    """node: one sampler per node (local rank 0 sees all of the node's GPUs); all: every rank."""
    mode = cfg.system_metrics
    return mode == SystemMetrics.all or (mode == SystemMetrics.node and info.local_rank == 0)


def wandb_id(run_id: str, rank: int | None = None) -> str:
    """Deterministic W&B id (per rank, or the job's one run): a resumed run continues it."""
    name = run_id if rank is None else f"{run_id}-rank{rank}"
    return re.sub(r"[^A-Za-z0-9_-]", "-", name)[-120:]


def _init_kwargs(
    cfg: LoggerConfig, runs: Runs, run: RunInfo, info: DistInfo, config: dict[str, Any]
) -> dict[str, Any]:
    config = dict(config)
    config.update(
        rank=info.rank,
        local_rank=info.local_rank,
        world_size=info.world_size,
        host=info.host,
        backend=info.backend or "none",
        launcher=info.launcher,
        sampler=config["sampler"]["mode"],
        wandb_runs=runs.name,
        system_metrics=system_metrics_on(cfg, info),
    )
    per_rank = not runs.one_run
    kwargs = dict(
        project=cfg.project,
        entity=cfg.entity,
        tags=list(cfg.tags),
        group=run.run_id,
        job_type="main" if info.is_main else "worker",
        name=f"{run.run_id}-rank{info.rank}" if per_rank else run.run_id,
        id=wandb_id(run.run_id, info.rank if per_rank else None),
        resume="allow",
        dir=str(run.run_dir / f"rank{info.rank}"),
        config=config,
    )
    if runs.name == WandbRuns.shared and not info.is_main:
        del kwargs["config"]  # the primary's config is the run's; a worker's would overwrite it
    return kwargs


def _settings(wandb: Any, cfg: LoggerConfig, runs: Runs, info: DistInfo) -> Any:
    extra = {}
    if runs.name == WandbRuns.shared:
        # Only the primary writes the run's files and decides its final state.
        extra = dict(x_primary=info.is_main, x_update_finish_state=info.is_main)
    return wandb.Settings(
        console="off",
        silent=True,
        x_label=f"rank{info.rank}",
        x_disable_stats=not system_metrics_on(cfg, info),
        **extra,
    )


def start_wandb(
    cfg: LoggerConfig, runs: Runs, *, run: RunInfo, info: DistInfo, config: dict[str, Any]
) -> Any:
    """This rank's W&B run, or None when W&B cannot start (training goes on without it)."""
    import wandb

    kwargs = _init_kwargs(cfg, runs, run, info, config)
    mode = "shared" if runs.name == WandbRuns.shared else str(cfg.mode)
    attempts: list[Any] = [mode]  # wandb.init's mode: one of its Literal strings
    if mode != "offline" and (runs.name != WandbRuns.shared or info.is_main):
        attempts.append("offline")  # a shared-mode worker alone offline would be a stray run
    error: Exception | None = None
    for attempt in attempts:
        try:
            settings = _settings(wandb, cfg, runs, info)  # an older W&B refuses them here
            wb = wandb.init(mode=attempt, settings=settings, **kwargs)
        except Exception as exc:  # W&B must never stop training
            error = exc
            continue
        if error is not None:
            log.warning(
                "W&B (%s) failed to start on rank %d (%s); logging offline instead",
                mode,
                info.rank,
                str(error).splitlines()[0],
            )
        wb.define_metric("step")
        wb.define_metric("*", step_metric="step")
        return wb
    log.warning(
        "W&B failed to start on rank %d (%s); metrics go to metrics.jsonl only",
        info.rank,
        error,
    )
    return None
