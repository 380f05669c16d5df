"""``parallel=fsdp2``: the model laid out by torch's ``fully_shard`` (the ``parallel`` group's
fsdp2 builder).

``fully_shard`` goes on each unit ``parallel.units`` names (by default every member of the
model's ModuleLists: a GPT's blocks), innermost first, then on the root, over a mesh of all
ranks (``parallel.replicate`` > 1: a 2-D mesh, HSDP). Each rank then holds a slice of every
parameter as a DTensor; a unit's forward all-gathers its parameters and its backward
reduce-scatters the gradients. With ``amp=bf16`` the mixed precision is FSDP2's own policy
(bfloat16 parameters in the forward, float32 reduction, float32 output), not autocast.
One process alone joins a process group of one, so the layout is the same at every world size.
"""

from __future__ import annotations

import fnmatch
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ddp_template.config.schema import ParallelConfig
from ddp_template.distributed import DistInfo
from ddp_template.errors import Misfit, Unanimous
from ddp_template.parallel import uncompiled


def build_fsdp2(cfg: ParallelConfig, info: DistInfo, *, amp: str) -> Fsdp2Layout:
    """The ``parallel=fsdp2`` builder: the mesh over this run's ranks and the policies (its
    refusals, decided from the config and the world size, are every rank's alike)."""
    if cfg.offload and info.device.type != "cuda":
        raise Unanimous(
            f"parallel.offload=true keeps the slices in CPU memory between uses, but this run "
            f"trains on {info.device.type}, where they already are; set parallel.offload=false."
        )
    world = info.world_size
    if world % cfg.replicate:
        raise Unanimous(
            f"parallel.replicate={cfg.replicate} does not divide the world size {world} into "
            f"groups of equal size; choose a divisor of {world} (1: slice over all ranks)."
        )
    if not dist.is_initialized():  # one process: a group of one, so fully_shard has a mesh
        backend = "nccl" if info.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    shape = (cfg.replicate, world // cfg.replicate) if cfg.replicate > 1 else (world,)
    names = ("replicate", "slice") if cfg.replicate > 1 else ("slice",)
    mesh = init_device_mesh(info.device.type, shape, mesh_dim_names=names)
    bf16 = torch.bfloat16 if amp == "bf16" else None
    return Fsdp2Layout(cfg=cfg, mesh=mesh, param_dtype=bf16)


@dataclass(kw_only=True)
class Fsdp2Layout:
    """The ``Parallel`` of ``parallel=fsdp2`` (see ``ddp_template.parallel``)."""

    cfg: ParallelConfig
    mesh: DeviceMesh
    param_dtype: torch.dtype | None  # amp=bf16: the forward's parameters in bfloat16
    sliced: bool = True
    units: list[str] = field(default_factory=list)  # what was sliced besides the root

    def wrap(self, module: nn.Module) -> nn.Module:
        """``fully_shard`` on each unit, innermost first, then on the root (in place)."""
        self._slice(module)
        return module

    def mirror(self, copy: nn.Module) -> nn.Module:
        self._slice(copy)
        return copy

    def _slice(self, module: nn.Module) -> None:
        self.units = unit_names(module, self.cfg.units)  # a copy of the model has the same
        kwargs: dict[str, Any] = {
            "mesh": self.mesh,
            "reshard_after_forward": self.cfg.reshard_after_forward,
        }
        if self.cfg.offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        inner = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
        for name in sorted(self.units, key=lambda n: -n.count(".")):  # innermost first
            fully_shard(module.get_submodule(name), mp_policy=inner, **kwargs)
        root = MixedPrecisionPolicy(
            param_dtype=self.param_dtype, reduce_dtype=torch.float32, output_dtype=torch.float32
        )
        fully_shard(module, mp_policy=root, **kwargs)

    def sync(self, trained: nn.Module, sync: bool) -> AbstractContextManager:
        # Off: the micro-batch's gradients accumulate whole on this rank, with no
        # reduce-scatter, until the step's last micro-batch reduces their sum.
        # fully_shard made the root an FSDPModule (the module's class, extended in place)
        cast(FSDPModule, uncompiled(trained)).set_requires_gradient_sync(sync)
        return nullcontext()

    def clip(self, trained: nn.Module, limit: float) -> torch.Tensor:
        params = [p for p in trained.parameters() if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]  # all of them: typed Tensor
        total = nn.utils.get_total_norm(grads, foreach=True)
        if isinstance(total, DTensor):  # each rank's slices' norm: reduced over the mesh
            total = total.full_tensor()
        nn.utils.clip_grads_with_norm_(params, limit, total, foreach=True)
        return total

    def settle(self, trained: nn.Module, x: Any) -> None:
        """Nothing to settle: FSDP2 reduces each unit's gradients in one fixed layout."""

    def optimizer_part(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        return OptimizerSlices(module=module, optimizer=optimizer)

    def autocast(self, amp_mode: str) -> str:
        return "off"  # bf16 is the mixed-precision policy's

    def describe(self) -> str:
        units = f"{len(self.units)} units ({_names(self.units)}) and the root"
        assert self.mesh.mesh_dim_names is not None  # build_fsdp2 names every dimension
        mesh = " x ".join(
            f"{n} {s}" for n, s in zip(self.mesh.mesh_dim_names, self.mesh.shape, strict=True)
        )
        dtype = "bf16 forward, fp32 reduction" if self.param_dtype else "fp32"
        return f"fsdp2: fully_shard on {units if self.units else 'the root'}; mesh {mesh}; {dtype}"


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f", … ({len(names)})" if len(names) > 3 else "")


def unit_names(module: nn.Module, patterns: list[str] | None) -> list[str]:
    """The submodules ``patterns`` name (globs over module names); None: every member of the
    model's ModuleLists. A pattern that names nothing, or a container without a forward of its
    own, is refused."""
    named = dict(module.named_modules())
    if patterns is None:
        return [
            f"{name}.{child}" if name else child
            for name, m in named.items()
            if isinstance(m, nn.ModuleList)
            for child in m._modules
        ]
    chosen: list[str] = []
    for pattern in patterns:
        hits = [n for n in named if n and fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise Unanimous(
                f"parallel.units pattern {pattern!r} names no module of this model (its modules: "
                f"{_names([n for n in named if n])}); name some of those, or set "
                f"parallel.units=null."
            )
        bare = [n for n in hits if isinstance(named[n], nn.ModuleList | nn.ModuleDict)]
        if bare:
            raise Unanimous(
                f"parallel.units pattern {pattern!r} names {bare[0]}, a container that never runs "
                f"a forward of its own; name its members instead, e.g. {bare[0]}.*."
            )
        chosen += [n for n in hits if n not in chosen]
    return chosen


@dataclass(kw_only=True)
class OptimizerSlices:
    """The optimizer as a checkpoint part: its state by parameter name, each rank's slices
    (``get_optimizer_state_dict``), so DCP can lay it out again at another world size."""

    module: nn.Module
    optimizer: torch.optim.Optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            set_optimizer_state_dict(self.module, self.optimizer, state)
        except (KeyError, RuntimeError) as exc:
            raise Misfit(
                f"its optimizer state does not fit this model and optimizer ({exc}); resume "
                f"with the model and optim config it was written with, or resume=never."
            ) from None
