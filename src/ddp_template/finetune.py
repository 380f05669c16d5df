"""Fine-tuning: a fresh run that starts from another run's checkpoint weights (``init_from``)."""

from __future__ import annotations

from pathlib import Path

import torch

from ddp_template.checkpoint import load
from ddp_template.errors import ConfigError
from ddp_template.models import LoadReport, load_matching


def init_weights(path_str: str, module: torch.nn.Module, *, ema: bool, strict: bool) -> LoadReport:
    """``init_from``: a checkpoint's model (or EMA) weights into a fresh run's model.

    Only the weights are read, so the checkpoint's world size, sampler mode, optimizer and step
    do not matter. Every rank reads the same file; tensors whose shape differs (a head for
    another number of classes) keep the model's fresh, seeded initialisation.
    """
    path = Path(path_str).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"init_from={path_str} is not a file; give a checkpoint's path, e.g. "
            f"outputs/<run id>/checkpoints/last.pt or best.pt."
        )
    payload = load(path, fix="pass another checkpoint with init_from=<path>")
    if ema:
        if not isinstance(payload.get("ema"), dict) or "model" not in payload["ema"]:
            raise ConfigError(
                f"init_from_ema=true but checkpoint {path} holds no EMA weights (it was written "
                f"without EMA); set init_from_ema=false to take its model weights."
            )
        state = payload["ema"]["model"]
    else:
        state = payload["model"]
    source = f"init_from={path_str}" + (" (EMA)" if ema else "")
    fix = ", or set init_from_strict=false to load only the keys both have"
    return load_matching(module, state, strict=strict, source=source, fix=fix)
