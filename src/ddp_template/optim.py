"""Optimizer and learning-rate schedule (the ``optim`` config group)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddp_template.config.schema import OptimConfig, OptimName, Schedule


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on biases and norm parameters (1-d tensors), the usual recipe."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def fused(cfg: OptimConfig, model: nn.Module) -> bool:
    """``optim.fused``; unset: fused where the parameters live on CUDA.

    A fused optimizer takes the GradScaler's inf check as a tensor; any other one makes
    ``GradScaler.step`` read it with ``.item()``, a host sync every fp16 step.
    """
    if cfg.fused is not None:
        return cfg.fused
    return any(p.is_cuda for p in model.parameters())


def build_optimizer(cfg: OptimConfig, model: nn.Module) -> torch.optim.Optimizer:
    groups = _param_groups(model, cfg.weight_decay)
    kernel = fused(cfg, model)
    if cfg.name == OptimName.adamw:
        beta1, beta2 = cfg.betas
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(beta1, beta2), fused=kernel)
    nesterov = cfg.nesterov and cfg.momentum > 0
    return torch.optim.SGD(
        groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=nesterov, fused=kernel
    )


@dataclass
class WarmupCosine:
    """The LR factor at a step: linear warm-up, then cosine to zero at ``total_steps`` (or
    constant). An object, not a closure: LambdaLR checkpoints its fields, so a resumed run
    keeps its horizon (and an elastic one that changes the global batch sets a new one)."""

    warmup: int
    cosine: bool
    total_steps: int

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if not self.cosine:
            return 1.0
        progress = (step - self.warmup) / max(1, self.total_steps - self.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_scheduler(
    cfg: OptimConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-step schedule: linear warm-up, then cosine to zero (or constant with ``none``)."""
    factor = WarmupCosine(cfg.warmup_steps, cfg.schedule == Schedule.cosine, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def set_horizon(scheduler: torch.optim.lr_scheduler.LambdaLR, total_steps: int) -> None:
    """Re-derive the schedule for a run that now ends at ``total_steps``."""
    for factor in scheduler.lr_lambdas:
        assert isinstance(factor, WarmupCosine)  # build_scheduler's
        factor.total_steps = total_steps
