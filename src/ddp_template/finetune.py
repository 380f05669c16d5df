"""Fine-tuning (the ``finetune`` group): a fresh run that starts from another run's checkpoint
weights (``finetune.init_from``)."""

from __future__ import annotations

import os

import torch

from ddp_template.checkpoint import checkpoint_file, load, whole
from ddp_template.config.loop import FinetuneConfig
from ddp_template.errors import ConfigError
from ddp_template.models import LoadReport, load_matching


def init_weights(cfg: FinetuneConfig, module: torch.nn.Module) -> LoadReport:
    """The ``finetune`` group's builder: a checkpoint's model (or EMA) weights into a fresh
    run's model.

    Only the weights are read, so the checkpoint's world size, sampler mode, optimizer, step
    and layout (whole, or sliced by parallel=fsdp2) do not matter. Called before the model is
    laid out over the ranks. Every rank reads the same file; tensors whose shape differs (a head for
    another number of classes) keep the model's fresh, seeded initialisation.
    """
    fix = "give a checkpoint's path, e.g. outputs/<run id>/checkpoints/last.pt or best.pt"
    path = checkpoint_file(
        os.path.expanduser(str(cfg.init_from)), said="finetune.init_from=", fix=fix
    )
    payload = load(path, fix="pass another checkpoint with finetune.init_from=<path>")
    state = whole(path, payload, *(("ema", "model") if cfg.ema else ("model",)))
    if state is None:
        raise ConfigError(
            f"finetune.ema=true but checkpoint {path} holds no EMA weights (it was written "
            f"without EMA); set finetune.ema=false to take its model weights."
            if cfg.ema
            else f"checkpoint {path} holds no model weights; pass a training checkpoint."
        )
    source = f"finetune.init_from={cfg.init_from}" + (" (EMA)" if cfg.ema else "")
    fix = ", or set finetune.strict=false to load only the keys both have"
    return load_matching(module, state, strict=cfg.strict, source=source, fix=fix)
