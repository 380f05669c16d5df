"""Schemas of the research-loop groups: DDP's options, the EMA switch (with its checks) and the
profiler window (``compile`` is the top-level key)."""

from __future__ import annotations

from dataclasses import dataclass

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
class EmaConfig:
    decay: float | None = None  # None: no EMA; e.g. 0.999
    every: int = 1  # optimizer steps between EMA updates
    warmup: int = 0  # optimizer steps during which the EMA copies the weights (no averaging)

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
