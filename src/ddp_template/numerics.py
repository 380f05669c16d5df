"""Numerics and GPU speed settings, applied on each rank before it builds anything.

``deterministic``, ``matmul_precision``, ``cudnn_benchmark`` and ``channels_last`` are process
state in torch (flags, an environment variable, memory formats), not arguments of a builder, so
every rank sets them itself: a rank started by forkserver or spawn does not inherit them from
the launching process.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ddp_template.config.schema import NumericsConfig
from ddp_template.errors import ConfigError

# cuBLAS's deterministic workspace setting; read when the rank creates its first cuBLAS handle.
CUBLAS_WORKSPACE = ":4096:8"


def apply(cfg: NumericsConfig) -> None:
    """Set this process's numerics; call at the start of each rank, before its CUDA work."""
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if cfg.deterministic or torch.are_deterministic_algorithms_enabled():
        # Only when asked (or to switch it off again): the call imports torch._inductor,
        # seconds of start-up per rank. An op with no deterministic kernel then raises, naming
        # itself, rather than silently breaking the bit-identical claim.
        torch.use_deterministic_algorithms(cfg.deterministic)
    torch.backends.cudnn.deterministic = cfg.deterministic
    benchmark = not cfg.deterministic if cfg.cudnn_benchmark is None else cfg.cudnn_benchmark
    torch.backends.cudnn.benchmark = benchmark
    torch.set_float32_matmul_precision(str(cfg.matmul_precision))


def describe() -> str:
    """This process's numerics as torch reports them (each rank logs it after ``apply``)."""
    state = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "matmul_precision": torch.get_float32_matmul_precision(),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
    return " ".join(f"{k}={v}" for k, v in state.items())


def to_channels_last(model: nn.Module) -> None:
    """Weights in NHWC and every 4-D input batch converted on the way in (train and eval), so
    cuDNN runs its channels-last kernels without a memory-format change inside each convolution."""
    if not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        raise ConfigError(
            f"numerics.channels_last=true needs a model with 2-D convolutions but "
            f"{type(model).__name__} has none; drop channels_last."
        )
    model.to(memory_format=torch.channels_last)
    model.register_forward_pre_hook(_inputs_to_channels_last)


def _inputs_to_channels_last(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(
        a.contiguous(memory_format=torch.channels_last)
        if isinstance(a, torch.Tensor) and a.ndim == 4
        else a
        for a in args
    )
