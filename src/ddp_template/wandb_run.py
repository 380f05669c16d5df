"""Starting one rank's W&B run: its id, group and config, and the fallbacks when W&B fails.

W&B trouble never stops training: a failed start falls back to offline, then to JSONL only.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from ddp_template.config import LoggerConfig
from ddp_template.distributed import DistInfo
from ddp_template.run_identity import RunInfo

log = logging.getLogger("ddp_template")


def wandb_id(run_id: str, rank: int) -> str:
    """Deterministic per-rank W&B id: a resumed run continues the same W&B runs."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", f"{run_id}-rank{rank}")[-120:]


def _init_kwargs(
    cfg: LoggerConfig, run: RunInfo, info: DistInfo, config: dict[str, Any]
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
    )
    return dict(
        project=cfg.project,
        entity=cfg.entity,
        tags=list(cfg.tags),
        group=run.run_id,
        job_type="main" if info.is_main else "worker",
        name=f"{run.run_id}-rank{info.rank}",
        id=wandb_id(run.run_id, info.rank),
        resume="allow",
        dir=str(run.run_dir / f"rank{info.rank}"),
        config=config,
    )


def start_wandb(cfg: LoggerConfig, *, run: RunInfo, info: DistInfo, config: dict[str, Any]) -> Any:
    """This rank's W&B run, or None when W&B cannot start (training goes on without it)."""
    import wandb

    kwargs = _init_kwargs(cfg, run, info, config)
    settings = wandb.Settings(console="off", silent=True, x_disable_stats=True)
    mode = str(cfg.mode)
    error: Exception | None = None
    for attempt in [mode] + (["offline"] if mode != "offline" else []):
        try:
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
