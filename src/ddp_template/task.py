"""The task seam: what is learned and how it is scored lives in the task's own file.

A task (the ``task`` group's ``_target_``, instantiated like ``model`` and ``data``) owns, for
its kind of problem: the loss of a micro-batch (the mean over its samples, or their sum for an
empty one, so the engine's exact weights keep meaning "the mean over the step's real samples"),
the evaluation state as a vector of **sums** the evaluation all-reduces, the metrics computed
from those sums, the direction each metric improves in (what ``selection.monitor`` may name,
the sweep's direction), and any torchmetrics metrics its YAML lists (``metrics:``), which run
on the unpadded evaluation shares and sync their own states. The engine and the evaluation know
none of it. Readers: ``engine`` (``loss``), ``spike`` (``sample_losses``), ``probe`` (``loss``,
``sums`` and ``update`` on a few samples before the first step, unless ``batch_level``),
``evaluation.evaluate`` (``begin``, ``sums``, ``update``, ``result``), ``config.boundary``
(``directions``), ``train`` (``setup``, ``training_data``, the objective), ``replay``
(``training_data``, ``sample_losses``), ``run_identity`` (the sweep's
direction). A new task is one file and one YAML
(README "Make it yours"); ``tasks/`` holds the shipped ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from omegaconf import OmegaConf
from torch import Tensor
from torch.utils._pytree import tree_map

from ddp_template.data.contract import DataInfo, Splits, batch_len
from ddp_template.errors import ConfigError, instantiate_clean

Direction = Literal["max", "min"]


@dataclass
class EvalResult:
    """One split's evaluation: the task's metrics over every sample of it, exact."""

    values: dict[str, float]  # metric → value, logged as <split>/<metric>
    count: int  # samples evaluated
    details: dict[str, Any] = field(default_factory=dict)  # summary.json only (per class, ...)
    headline: str = ""  # the final line's, e.g. "accuracy 0.9889 (355/359)"
    line: str = ""  # an epoch's, e.g. "accuracy 0.9889, loss 0.0401"
    split: str = "test"  # which split summary.json's eval_* keys describe (eval_split)

    def metrics(self, prefix: str) -> dict[str, float]:
        """The per-epoch keys: ``<prefix>/<metric>``."""
        return {f"{prefix}/{name}": value for name, value in self.values.items()}

    def summary(self, prefix: str = "eval") -> dict[str, Any]:
        """summary.json's keys for the final evaluation (``eval_split`` names its split)."""
        out = {f"{prefix}_split": self.split}
        out.update({f"{prefix}_{name}": value for name, value in self.details.items()})
        return out


class Task:
    """A task's part the shipped tasks share: the torchmetrics metrics its YAML lists.

    A subclass sets ``directions`` (its own metrics) and ``monitor`` (the metric a sweep
    optimises unless ``selection.monitor`` names another) and writes ``loss``, ``sums``,
    ``update`` and ``result``; ``result`` adds :meth:`computed` for the torchmetrics.
    """

    directions: ClassVar[Mapping[str, Direction]] = {}
    monitor: ClassVar[str] = ""
    # A loss (or evaluation sums) over the batch as a whole by design (a contrastive loss, a
    # batch's ranking): the start-up probe (``probe``) then leaves out its per-sample checks.
    batch_level: ClassVar[bool] = False

    def __init__(self, metrics: Mapping[str, Any] | None = None) -> None:
        self.extra = dict(metrics or {})  # name → torchmetrics.Metric

    def metric_directions(self) -> dict[str, Direction]:
        """Every metric this task reports and the direction it improves in."""
        extra: dict[str, Direction] = {
            name: ("max" if getattr(m, "higher_is_better", True) else "min")
            for name, m in self.extra.items()
        }
        return {**self.directions, **extra}

    def setup(self, info: DataInfo, device: torch.device) -> None:
        """Told the data (before ``training_data`` and training): the torchmetrics go to the
        device."""
        for metric in self.extra.values():
            metric.to(device)

    def training_data(self, splits: Splits, seed: int) -> Splits:
        """The splits training reads (``build``, ``replay --losses``): as they are, unless the
        task draws its own inputs from each sample (``task=contrastive``'s two views)."""
        return splits

    def begin(self) -> None:
        """Before each evaluation: the torchmetrics start empty."""
        for metric in self.extra.values():
            metric.reset()

    def loss(self, output: Any, y: Any, reduction: str) -> Tensor:
        raise NotImplementedError

    def sample_losses(self, output: Any, y: Any) -> Tensor:
        """Each sample's loss (spike forensics, ``replay --losses``): ``loss`` of each sample
        alone; a task overrides it with one vectorised call where that matters."""

        def alone(i: int) -> tuple[Any, Any]:
            return tree_map(lambda t: t[i : i + 1] if isinstance(t, Tensor) else t, (output, y))

        one = [self.loss(*alone(i), "sum") for i in range(batch_len(y))]
        return torch.stack(one) if one else torch.zeros(0)

    def sums(self, device: torch.device) -> Tensor:
        """The evaluation's zero state: float64 sums the evaluation all-reduces."""
        raise NotImplementedError

    def update(self, sums: Tensor, output: Any, y: Any) -> None:
        """Add one batch's (possibly empty) contribution to ``sums`` and the torchmetrics."""
        raise NotImplementedError

    def result(self, sums: Tensor) -> EvalResult:
        """The metrics from the all-reduced ``sums`` (and the torchmetrics, synced: every rank
        calls this)."""
        raise NotImplementedError

    def metric_inputs(self, output: Any, y: Any) -> tuple[Any, Any]:
        """What the torchmetrics are updated with: ``(preds, target)``."""
        return output, y

    def update_extra(self, output: Any, y: Any) -> None:
        if self.extra:
            preds, target = self.metric_inputs(output, y)
            empty = batch_len(target) == 0
            for metric in self.extra.values():
                if empty and not _concatenates(metric):
                    continue  # its zero states sync as they are (stat scores refuse no samples)
                metric.update(preds, target)

    def scored(self, result: EvalResult) -> EvalResult:
        """``result`` with the torchmetrics' values added to its metrics, summary and line."""
        extra = self.computed()
        result.values.update(extra)
        result.details.update(extra)
        result.line += "".join(f", {name} {value:.4f}" for name, value in extra.items())
        return result

    def computed(self) -> dict[str, float]:
        """The torchmetrics' values, synced over the ranks by torchmetrics (a collective)."""
        return {name: float(metric.compute()) for name, metric in self.extra.items()}


def _concatenates(metric: Any) -> bool:
    """Whether a torchmetrics metric keeps list states (every sample's predictions), which an
    empty rank must still fill with a zero-length tensor of its shape to sync: torchmetrics'
    own stand-in for an empty list is 1-D, a mismatch for (N, C) predictions."""
    return any(isinstance(state, list) for state in metric.metric_state.values())


def check_monitor(task: Task, monitor: str | None, split: str) -> None:
    """``selection.monitor`` names one of the task's metrics on the split evaluated each
    epoch: refused in one sentence listing the valid ones."""
    if monitor is None:
        return
    allowed = [f"{split}/{name}" for name in task.metric_directions()]
    if monitor not in allowed:
        raise ConfigError(
            f"selection.monitor={monitor} is not a metric evaluated each epoch of this run; "
            f"use one of {allowed} (val/* needs data.val_fraction > 0), or null."
        )


def objective(task: Task, monitor: str | None, mode: str | None) -> tuple[str, Direction]:
    """The metric that selection watches and a sweep optimises (``selection.monitor``'s, else
    the task's) and its direction (``selection.mode``, else the task's for that metric)."""
    name = monitor.split("/", 1)[1] if monitor else task.monitor
    direction = str(mode) if mode is not None else task.metric_directions()[name]
    return name, direction  # type: ignore[return-value]


def build_task(task_cfg: Any) -> Task:
    """The ``task`` group's builder (its ``metrics:`` torchmetrics instantiated with it)."""
    task = instantiate_clean(task_cfg)
    if not isinstance(task, Task):
        raise ConfigError(
            f"task._target_={task_cfg.get('_target_')} returned {type(task).__name__}; a task "
            f'must subclass ddp_template.task.Task (README "Make it yours").'
        )
    return task


def sweep_direction(*, _root_: Any) -> str:
    """``${sweep_direction:}`` (conf/hydra/sweeper/): ``maximize`` or ``minimize``, the
    direction of the metric the jobs return (``selection.monitor``'s, else the task's)."""
    selection = _root_.selection
    _, direction = objective(build_task(_root_.task), selection.monitor, selection.mode)
    return "maximize" if direction == "max" else "minimize"


def register_sweep_direction() -> None:
    """Register ``${sweep_direction:}``; idempotent, called before Hydra composes."""
    if not OmegaConf.has_resolver("sweep_direction"):
        OmegaConf.register_new_resolver("sweep_direction", sweep_direction)
