"""What trains: the model laid out over the ranks (the ``parallel`` builder: DDP, the default,
with the ``ddp`` group's options; or FSDP2, the optional ``fsdp2/`` folder), then
torch.compile'd (``compile``).

``Parallel`` is what the loop, the evaluation, the EMA and the checkpoint ask of a layout: how a
micro-batch's gradients are held or reduced, the gradient norm over every rank's part, whether a
forward is a collective (``sliced``: every rank must run as many), a copy laid out like the
model, and the optimizer as a checkpoint part. A layout other than DDP is named by string in
``PARALLEL``, so the core never imports its folder.

The order is DDP's recommended one: SyncBN conversion, then DDP, then ``torch.compile`` of the
DDP module, so Dynamo's DDPOptimizer splits the graph at DDP's bucket boundaries and the
all-reduces still overlap the backward. The unwrapped module (``Trainer.module``) is what is
evaluated and checkpointed, so a compiled run's checkpoint resumes uncompiled and back.
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._pytree import tree_leaves, tree_map

from ddp_template.config.schema import DDPConfig, ParallelConfig
from ddp_template.distributed import DistInfo
from ddp_template.errors import ConfigError
from ddp_template.registry import load

# parallel.name → the builder of that layout, ``(cfg: ParallelConfig, info, amp=) -> Parallel``
# (ddp is this module's own).
PARALLEL = {"fsdp2": "ddp_template.optional.fsdp2.layout:build_fsdp2"}


class Parallel(Protocol):
    """How the model is laid out over the ranks: what trains, and what the loop, the evaluation,
    the EMA and the checkpoint ask of it."""

    # Each rank holds a slice of the weights: every forward is a collective (the ranks run as
    # many, evaluation included), and the weights are checkpointed through DCP, a file per rank.
    sliced: bool

    def wrap(self, module: nn.Module) -> nn.Module:
        """What trains (``module`` itself where the layout wraps in place)."""

    def mirror(self, copy: nn.Module) -> nn.Module:
        """A copy of the model (the EMA's), laid out as the model is."""

    def sync(self, trained: nn.Module, sync: bool) -> AbstractContextManager:
        """What a micro-batch's forward and backward run inside: its gradients reduced across
        the ranks with ``sync``, else held on this rank for the step's last micro-batch."""

    def clip(self, trained: nn.Module, limit: float) -> torch.Tensor:
        """The gradient's total norm over every rank's part, the gradients clipped to ``limit``."""

    def settle(self, trained: nn.Module, x: Any) -> None:
        """Before a launch's first step (``settle_buckets`` for DDP)."""

    def optimizer_part(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        """The optimizer as a checkpoint part."""

    def autocast(self, amp_mode: str) -> str:
        """The autocast mode the loop runs (a layout may take the mixed precision over)."""

    def describe(self) -> str:
        """One log line: how the model is laid out."""


def build_parallel(cfg: ParallelConfig, ddp: DDPConfig, info: DistInfo, *, amp: str) -> Parallel:
    """The ``parallel`` builder: DDP with the ``ddp`` group's options, or the layout ``PARALLEL``
    names."""
    if cfg.name == "ddp":
        return Replicated(cfg=ddp, info=info)
    builder = load(PARALLEL[str(cfg.name)], key=f"parallel={cfg.name}", fix="set parallel=ddp.")
    return builder(cfg, info, amp=amp)


@dataclass(kw_only=True)
class Replicated:
    """``parallel=ddp``: a whole replica per rank (one rank: the module itself)."""

    cfg: DDPConfig
    info: DistInfo
    sliced: bool = False

    def wrap(self, module: nn.Module) -> nn.Module:
        return build_ddp(self.cfg, module, self.info)

    def mirror(self, copy: nn.Module) -> nn.Module:
        return copy

    def sync(self, trained: nn.Module, sync: bool) -> AbstractContextManager:
        ddp = ddp_of(trained)
        return nullcontext() if sync or ddp is None else ddp.no_sync()

    def clip(self, trained: nn.Module, limit: float) -> torch.Tensor:
        return nn.utils.clip_grad_norm_(trained.parameters(), limit)

    def settle(self, trained: nn.Module, x: Any) -> None:
        settle_buckets(ddp_of(trained), x)

    def optimizer_part(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        return optimizer

    def autocast(self, amp_mode: str) -> str:
        return amp_mode

    def describe(self) -> str:
        return (
            "ddp: a whole replica of the model per rank"
            if self.info.distributed
            else "ddp: one process"
        )


def uncompiled(trained: nn.Module) -> nn.Module:
    """What trains without torch.compile's wrapper: the DDP module, or the (sliced) model."""
    return getattr(trained, "_orig_mod", trained)


def ddp_of(trained: nn.Module) -> DDP | None:
    """The DDP module of what trains, or None (one process, FSDP2)."""
    inner = uncompiled(trained)
    return inner if isinstance(inner, DDP) else None


def build_ddp(cfg: DDPConfig, module: nn.Module, info: DistInfo) -> nn.Module:
    """The ``ddp`` builder: ``module`` in DDP with the group's options (one rank: unwrapped)."""
    if not info.distributed:
        return module
    # torch >= 2.14 renamed the per-forward buffer broadcast (the weights start equal on every
    # rank here, so the init-time sync it keeps changes nothing).
    renamed = "forward_sync_buffers" in inspect.signature(DDP).parameters
    buffers = "forward_sync_buffers" if renamed else "broadcast_buffers"
    by_version: dict[str, Any] = {buffers: cfg.broadcast_buffers}  # one name or the other
    return DDP(
        module,
        device_ids=[info.local_rank] if info.device.type == "cuda" else None,
        find_unused_parameters=cfg.find_unused_parameters,
        static_graph=cfg.static_graph,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        bucket_cap_mb=cfg.bucket_cap_mb,
        **by_version,
    )


def settle_buckets(ddp: DDP | None, x: Any) -> None:
    """One zero-loss backward of the input ``x`` before a launch's first step, so that every
    launch, fresh or resumed, trains from its first step on the buckets DDP rebuilds after a
    first backward (nothing to do without DDP)."""
    if ddp is None:
        return
    # DDP first lays its buckets out in parameter order, then, after the first backward,
    # rebuilds them in the order the gradients became ready. With three or more ranks the
    # position of a gradient in its bucket decides the order the ranks' values are summed in,
    # so a resumed launch whose first step ran on the first layout would round differently
    # from the uninterrupted run's same step, which ran on the rebuilt one.
    module = ddp.module
    was_training = module.training
    module.eval()  # no running statistics updated, no dropout drawn
    output = ddp(tree_map(lambda t: t[:1], x))
    (sum(t.sum() for t in tree_leaves(output) if t.is_floating_point()) * 0.0).backward()
    module.train(was_training)
    for param in module.parameters():
        param.grad = None


def compile_model(model: nn.Module) -> nn.Module:
    """``torch.compile`` (Inductor) of what trains; ``Trainer.module`` still unwraps it."""
    compiled = torch.compile(model)
    assert isinstance(compiled, nn.Module)  # torch.compile of a module: an OptimizedModule
    return compiled


def check_compile(device_type: str) -> None:
    """``compile=true`` needs Dynamo on this Python and Inductor's compiler for the device:
    a C++ compiler on CPU, Triton on CUDA. Refused here rather than at the first step."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise ConfigError(
            "compile=true needs torch.compile, which this Python/torch build does not support; "
            "set compile=false."
        )
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise ConfigError(
                "compile=true on CUDA needs Triton, which is not installed; install triton or "
                "set compile=false."
            )
        return
    from torch._inductor import config as inductor_config
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception:
        tried = ", ".join(str(c) for c in inductor_config.cpp.cxx if c)
        raise ConfigError(
            f"compile=true on CPU needs a C++ compiler for Inductor and none works ({tried}); "
            f"install g++ (or set CXX to a working compiler), or set compile=false."
        ) from None
