"""An exponential moving average of the weights, the same on every rank (the `ema` builder).

After optimizer step s (every ``ema.every`` steps), each averaged parameter moves toward the
model's: ``ema += (1 - decay) * (model - ema)``; during the first ``ema.warmup`` steps it copies
the weights instead. The parameters are identical on every rank because DDP's parameters are;
under FSDP2 the average is laid out as the model is (``mirror``), each rank averaging its own
slices. Buffers (BatchNorm running stats) are not: each rank updates its own from its own
batch, so the average takes rank 0's, broadcast, and every rank holds the same EMA module at
every step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ddp_template.config.schema import EmaConfig
from ddp_template.distributed import DistInfo


class EMA:
    def __init__(
        self,
        *,
        model: nn.Module,
        cfg: EmaConfig,
        info: DistInfo,
        mirror: Callable[[nn.Module], nn.Module] | None = None,
    ) -> None:
        averaged = copy.deepcopy(model).eval().requires_grad_(False)
        self.module = mirror(averaged) if mirror is not None else averaged
        self.source = model  # what it averages (a checkpoint without an EMA restarts from it)
        assert cfg.decay is not None  # the switch is on only with a decay (EmaConfig.on)
        self.decay = float(cfg.decay)
        self.every = cfg.every
        self.warmup = cfg.warmup
        self.info = info
        self.updates = 0  # averaging (or warm-up copy) updates done

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """After optimizer step ``step`` (1-based); a collective when the model has buffers."""
        if step % self.every:
            return
        mine: list[torch.Tensor] = [p for p in self.module.parameters()]
        theirs = [p.detach() for p in model.parameters()]
        if step <= self.warmup:
            torch._foreach_copy_(mine, theirs)
        else:
            torch._foreach_lerp_(mine, theirs, 1.0 - self.decay)
        self._copy_buffers(model)
        self.updates += 1

    def after_step(self, state: Any) -> None:
        """The step hook: average after optimizer step ``state.step``."""
        self.update(self.source, state.step)

    def _copy_buffers(self, model: nn.Module) -> None:
        buffers = list(self.module.buffers())
        if not buffers:
            return
        torch._foreach_copy_(buffers, list(model.buffers()))
        if self.info.distributed:  # one broadcast for all buffers: rank 0's running stats
            flat = torch.cat([b.reshape(-1).double() for b in buffers])
            torch.distributed.broadcast(flat, src=0)
            parts = flat.split([b.numel() for b in buffers])
            torch._foreach_copy_(
                buffers, [p.view_as(b) for p, b in zip(parts, buffers, strict=True)]
            )

    def state_dict(self) -> dict[str, Any]:
        """``model`` is the averaged module's state_dict (what ``finetune.init_from`` reads)."""
        return {
            "model": self.module.state_dict(),
            "updates": self.updates,
            "decay": self.decay,
            "every": self.every,
            "warmup": self.warmup,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.updates = int(state["updates"])

    def start_fresh(self) -> str:
        """A checkpoint without an EMA: start from the (restored) weights."""
        self.load_state_dict({"model": self.source.state_dict(), "updates": 0})
        return "the EMA starts from its weights"


def build_ema(
    cfg: EmaConfig,
    model: nn.Module,
    info: DistInfo,
    mirror: Callable[[nn.Module], nn.Module] | None = None,
) -> EMA | None:
    """The ``ema`` builder: an averaged copy of the (unwrapped, on-device) model, laid out by
    ``mirror`` as the model will be, or None."""
    return None if cfg.decay is None else EMA(model=model, cfg=cfg, info=info, mirror=mirror)
