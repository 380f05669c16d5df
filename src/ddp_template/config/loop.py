"""Schemas of the research-loop groups, each with its own checks: how the model is laid out
(``parallel``) and DDP's options, the EMA switch,
the profiler window (``compile`` is the top-level key), selection (best.pt, early stopping),
spike forensics and fine-tuning (``init_from``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ddp_template.config.choices import MonitorMode, Parallelism
from ddp_template.errors import ConfigError


@dataclass
class DDPConfig:
    """Arguments of torch's DistributedDataParallel (only with more than one rank)."""

    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    bucket_cap_mb: float = 25.0
    broadcast_buffers: bool = True


@dataclass
class ParallelConfig:
    """How the model is laid out over the ranks: ``ddp`` (a whole replica per rank; its options
    are the ``ddp`` group's) or ``fsdp2`` (torch's ``fully_shard``: each rank holds a slice of
    every parameter, of its gradient and of its optimizer state). The other keys are fsdp2's."""

    name: Parallelism = Parallelism.ddp
    # The modules fully_shard wraps besides the root, each gathered on its own: glob patterns
    # over module names (e.g. [blocks.*]); null: every member of the model's ModuleLists.
    units: list[str] | None = None
    reshard_after_forward: bool = True  # free the gathered parameters after each forward
    offload: bool = False  # keep the slices and the optimizer state in CPU memory (CUDA runs)
    replicate: int = 1  # HSDP: groups of ranks holding whole copies (a replicate x slice mesh)

    def check(self) -> None:
        if self.name == Parallelism.ddp:
            given = [
                f"parallel.{f.name}={getattr(self, f.name)}"
                for f in fields(self)
                if f.name != "name" and getattr(self, f.name) != f.default
            ]
            if given:
                raise ConfigError(
                    f"{given[0]} is an option of parallel=fsdp2, which this run does not use "
                    f"(parallel=ddp); set parallel=fsdp2 or drop it."
                )
        if self.replicate < 1:
            raise ConfigError(
                f"parallel.replicate={self.replicate} must be >= 1 (1: one group of ranks that "
                f"slices the model; 2: two groups, each holding a whole copy, e.g. one per node)."
            )
        for pattern in self.units or ():
            if not pattern:
                raise ConfigError(
                    "parallel.units holds an empty pattern; name modules like blocks.* or drop it."
                )


@dataclass
class EmaConfig:
    decay: float | None = None  # None: no EMA; e.g. 0.999
    every: int = 1  # optimizer steps between EMA updates
    warmup: int = 0  # optimizer steps during which the EMA copies the weights (no averaging)

    @property
    def on(self) -> bool:
        return self.decay is not None

    def check(self) -> None:
        if self.decay is not None and not 0.0 < self.decay < 1.0:
            raise ConfigError(
                f"ema.decay={self.decay} must be in (0, 1), e.g. 0.999, or null for no EMA."
            )
        if self.every < 1:
            raise ConfigError(f"ema.every={self.every} must be >= 1 (optimizer steps); e.g. 1.")
        if self.warmup < 0:
            raise ConfigError(f"ema.warmup={self.warmup} must be >= 0 (optimizer steps).")


@dataclass
class ProfilerConfig:
    enabled: bool = False
    wait: int = 1  # optimizer steps skipped first
    warmup: int = 1  # steps profiled but discarded
    active: int = 3  # steps recorded into rank<r>/trace_step<k>.pt.trace.json


@dataclass
class SelectionConfig:
    """best.pt and early stopping (``selection.build_selection``)."""

    # Keep best.pt beside last.pt: the epoch whose <split>/<metric> was best (one of the task's
    # metrics, e.g. test/accuracy, val/mse with data.val_fraction > 0), by mode. null: no best.pt.
    monitor: str | None = None
    mode: MonitorMode | None = None  # null: the direction the task gives the metric
    patience: int | None = None  # stop after this many epochs without a new best of monitor

    def check(self) -> None:
        if self.patience is None:
            return
        if self.patience < 1:
            raise ConfigError(
                f"selection.patience={self.patience} must be >= 1 (epochs without a new best); "
                f"e.g. selection.patience=3, or null."
            )
        if self.monitor is None:
            raise ConfigError(
                f"selection.patience={self.patience} needs a metric to watch; set "
                f"selection.monitor=test/accuracy (and selection.mode=max)."
            )


@dataclass
class SpikeConfig:
    """Spike forensics (``spike``): a step whose loss over a rank's samples, gradient norm or
    largest per-sample input RMS (``watch``) exceeds ``factor`` x the median of that signal's
    last ``window`` steps names its samples, with their losses and input RMS."""

    factor: float | None = 10.0  # null: off (no rule)
    # What each rank judges every step: its loss, the step's gradient norm, the largest RMS of a
    # sample's input (what a poisoned sample moves when BatchNorm hides its loss).
    watch: list[str] = field(default_factory=lambda: ["loss", "grad_norm", "input"])
    window: int = 50  # steps whose median loss is the reference
    # steps in the window before the rule judges the loss and gradient norm (the first steps are
    # noisy); the input, which training does not move, is judged from the second step
    after: int = 10
    skip: bool = False  # skip a spiking step's update; its samples are named in the verdict
    top: int = 5  # samples named on the console (the JSONL and W&B hold every one)

    @property
    def on(self) -> bool:
        return self.factor is not None

    def check(self) -> None:
        if self.factor is not None and not self.factor > 1.0:
            raise ConfigError(
                f"spike.factor={self.factor} must be > 1 (a spike is a loss above factor x the "
                f"running median); e.g. spike.factor=10, or null for no spike forensics."
            )
        for key in ("window", "after", "top"):
            if getattr(self, key) < 1:
                raise ConfigError(f"spike.{key}={getattr(self, key)} must be >= 1; e.g. 10.")
        if self.after > self.window:
            raise ConfigError(
                f"spike.after={self.after} exceeds spike.window={self.window}: the rule would "
                f"never judge; set spike.after <= spike.window."
            )
        if self.skip and self.factor is None:
            raise ConfigError(
                "spike.skip=true needs the rule on; set spike.factor (e.g. 10) or drop spike.skip."
            )
        signals = ("loss", "grad_norm", "input")
        unknown = [str(w) for w in self.watch if w not in signals]
        if unknown or not self.watch:
            raise ConfigError(
                f"spike.watch={list(self.watch)} must name some of {', '.join(signals)}; e.g. "
                f"spike.watch=[loss,grad_norm,input]."
            )


@dataclass
class FinetuneConfig:
    """Start a fresh run from a checkpoint's weights (any world size; resume wins once this run
    has a checkpoint of its own). Tensors whose shape differs (a new head) start fresh."""

    init_from: str | None = None
    ema: bool = False  # take the checkpoint's EMA weights instead
    strict: bool = True  # refuse missing/unexpected keys

    def check(self) -> None:
        for key, default in (("ema", False), ("strict", True)):
            value = getattr(self, key)
            if self.init_from is None and value != default:
                raise ConfigError(
                    f"finetune.{key}={str(value).lower()} only applies to finetune.init_from, "
                    f"which is not set; set finetune.init_from=<checkpoint> or drop "
                    f"finetune.{key}."
                )
