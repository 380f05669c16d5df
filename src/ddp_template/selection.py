"""Best-so-far and early stopping (the ``selection`` group): which epoch was best by
``selection.monitor``, and when to stop for want of a better one (``selection.patience``).

A stateful part of the checkpoint: a resumed run continues the same record. Every rank holds
the same all-reduced metrics, so every rank decides alike, with no collective of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ddp_template.config.loop import SelectionConfig
from ddp_template.errors import ConfigError
from ddp_template.task import Task, objective

log = logging.getLogger("ddp_template")

BEST_FILE = "best.pt"  # a copy of the checkpoint written at the best epoch's end


@dataclass(kw_only=True)
class Selection:
    monitor: str | None  # a metric evaluated each epoch, e.g. test/accuracy; None: no record
    mode: str  # max or min
    patience: int | None  # epochs without a new best before stopping; None: never stop
    value: float | None = None  # the best value of ``monitor`` so far
    epoch: int | None = None  # the epoch it was reached at

    def observe(self, metrics: dict[str, float], epoch: int) -> bool:
        """Record ``metrics[monitor]`` of ``epoch``; True when it is a new best."""
        if self.monitor is None:
            return False
        if self.monitor not in metrics:
            raise ConfigError(
                f"selection.monitor={self.monitor} is not logged by this run (it logs "
                f"{sorted(metrics)}); monitor one of those."
            )
        value = float(metrics[self.monitor])
        best = self.value
        better = best is None or (value > best if self.mode == "max" else value < best)
        if better:
            self.value, self.epoch = value, epoch
        return better

    def copies(self, improved: bool) -> tuple[str, ...]:
        """The checkpoint's extra file names at an epoch end: best.pt after a new best."""
        return (BEST_FILE,) if improved else ()

    def stops_before(self, epoch: int) -> bool:
        """Whether ``patience`` epochs have passed without a new best before ``epoch``."""
        stale = 0 if self.epoch is None else epoch - 1 - self.epoch
        if self.patience is None or stale < self.patience:
            return False
        log.info(
            "early stop before epoch %d: no better %s for %d epochs (best %.6g at epoch %d)",
            epoch,
            self.monitor,
            self.patience,
            self.value,
            self.epoch,
        )
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "value": self.value, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A record of another metric (the run now monitors something else) starts afresh."""
        if state["monitor"] == self.monitor:
            self.value, self.epoch = state["value"], state["epoch"]


def build_selection(cfg: SelectionConfig, task: Task) -> Selection:
    """The ``selection`` group's builder; ``selection.mode`` defaults to the task's direction
    for the monitored metric."""
    _, mode = objective(task, cfg.monitor, cfg.mode)
    return Selection(monitor=cfg.monitor, mode=mode, patience=cfg.patience)
