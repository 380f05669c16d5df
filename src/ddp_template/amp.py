"""Mixed precision (the ``amp`` group): autocast dtype, the startup probe, the GradScaler."""

from __future__ import annotations

import contextlib

import torch

from ddp_template.config.schema import AmpConfig, AmpMode
from ddp_template.errors import ConfigError, Guarded

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_amp(mode: str, device: torch.device) -> None:
    """Refuse an AMP mode this device/build cannot run, at startup rather than mid-run."""
    mode = str(mode)
    if mode == "off":
        return
    if mode == "bf16" and device.type == "cuda":
        _check_native_bf16(device)
    dtype = AMP_DTYPES[mode]
    try:
        with torch.autocast(device.type, dtype=dtype):
            probe = torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
        if probe.dtype != dtype:
            raise RuntimeError(f"autocast produced {probe.dtype}")
        if mode == "fp16":
            torch.amp.GradScaler(device.type)
    except Exception as exc:
        fix = "use amp=off" if mode == "bf16" else "use amp=bf16 or amp=off"
        raise ConfigError(
            f"amp.mode={mode} is not supported on {device.type} with torch {torch.__version__} "
            f"({exc}); {fix}."
        ) from exc


def _check_native_bf16(device: torch.device) -> None:
    """bf16 needs compute capability 8.0 (Ampere) or newer: on older GPUs (V100, T4) torch
    emulates it, ``is_bf16_supported()`` says yes, and the autocast probe passes, but it is slow."""
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"amp.mode=bf16 needs a GPU with native bf16 (compute capability 8.0 or newer) but "
            f"{device} is a {name} ({major}.{minor}); use amp=fp16 or amp=off."
        )


def autocast(mode: str, device: torch.device) -> contextlib.AbstractContextManager:
    if mode == "off":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AMP_DTYPES[str(mode)])


def build_scaler(cfg: AmpConfig, device: torch.device) -> torch.amp.GradScaler:
    """The ``amp`` group's builder: a GradScaler that is a no-op unless fp16 (one code path for
    every AMP mode), after checking that this device can run the mode."""
    check_amp(str(cfg.mode), device)
    return torch.amp.GradScaler(
        device.type,
        init_scale=cfg.init_scale,
        growth_interval=cfg.growth_interval,
        enabled=cfg.mode == AmpMode.fp16,
    )


def scaler_part(scaler: torch.amp.GradScaler) -> Guarded:
    """The GradScaler as a checkpoint part; refuses another amp mode's state."""
    return Guarded(
        scaler,
        lambda _: (
            "it was written with another amp mode (its GradScaler state does not fit this "
            "run's); resume with the amp mode it was written with, or resume=never."
        ),
    )
