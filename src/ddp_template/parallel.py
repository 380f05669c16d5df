"""What trains: the module wrapped in DDP (the `ddp` builder), then torch.compile'd (`compile`).

The order is DDP's recommended one: SyncBN conversion, then DDP, then ``torch.compile`` of the
DDP module, so Dynamo's DDPOptimizer splits the graph at DDP's bucket boundaries and the
all-reduces still overlap the backward. The unwrapped module (``Trainer.module``) is what is
evaluated and checkpointed, so a compiled run's checkpoint resumes uncompiled and back.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._pytree import tree_leaves, tree_map

from ddp_template.config.schema import DDPConfig
from ddp_template.distributed import DistInfo
from ddp_template.errors import ConfigError


def build_ddp(cfg: DDPConfig, module: nn.Module, info: DistInfo) -> nn.Module:
    """The ``ddp`` builder: ``module`` in DDP with the group's options (one rank: unwrapped)."""
    if not info.distributed:
        return module
    # torch >= 2.14 renamed the per-forward buffer broadcast (the weights start equal on every
    # rank here, so the init-time sync it keeps changes nothing).
    renamed = "forward_sync_buffers" in inspect.signature(DDP).parameters
    buffers = "forward_sync_buffers" if renamed else "broadcast_buffers"
    return DDP(
        module,
        device_ids=[info.local_rank] if info.device.type == "cuda" else None,
        find_unused_parameters=cfg.find_unused_parameters,
        static_graph=cfg.static_graph,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        bucket_cap_mb=cfg.bucket_cap_mb,
        **{buffers: cfg.broadcast_buffers},
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
    return torch.compile(model)


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
