"""Synchronised BatchNorm that also works on CPU (gloo), where ``nn.SyncBatchNorm`` refuses.

``torch.nn.SyncBatchNorm`` only accepts GPU/XPU tensors, so a CPU run with ``syncbn=on`` would
crash. :class:`CpuSyncBatchNorm` is a drop-in equivalent written with plain tensor ops and
``torch.distributed.all_reduce``, so it runs on any device whose backend can all-reduce.

What "synchronised" means, and the distributed subtleties that follow from it:

* **Training forward** normalises with the mean/variance of the *global* batch (all ranks of
  the process group), as if one process had seen every sample. Ranks may hold different
  numbers of samples (a ragged last batch, uneven shares, even an empty batch), so per-rank
  statistics are combined weighted by their counts (Chan et al.'s parallel variance, the same
  result as torch's ``batch_norm_gather_stats_with_counts``). Averaging per-rank means
  unweighted would be wrong whenever counts differ.
* **Training backward** needs two global per-channel sums, ``sum(dy)`` and ``sum(dy * (x -
  mean))``, because every input's gradient depends on every other rank's samples through the
  shared mean/variance. ``weight``/``bias`` gradients stay local: DDP all-reduces them.
* **One collective per pass**, in the same order on every rank, so ranks cannot deadlock: a
  rank with an empty batch still joins both all-reduces (with zeros).
* **Running statistics** are updated from the global mean and the global *unbiased* variance,
  so they are identical on every rank and match a single-process run on the whole batch.
* **Eval mode runs no collective**: it normalises with the running statistics, exactly like
  plain BN. That is what makes exact evaluation possible (ranks may run different
  numbers of eval batches, or only rank 0 evaluates) without hanging.
* Statistics are computed in float32 (or float64 for float64 input) even when autocast feeds
  bf16/fp16 activations; the output has the input's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["CpuSyncBatchNorm", "convert_sync_batchnorm"]


def _reduce_dims(x: Tensor) -> list[int]:
    """All dims except the channel dim 1: (N, C, *) -> statistics per channel."""
    return [0, *range(2, x.dim())]


def _per_channel(v: Tensor, x: Tensor) -> Tensor:
    """Reshape a (C,) vector so it broadcasts against an (N, C, *) tensor."""
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def _compute_dtype(x: Tensor) -> torch.dtype:
    """float32 at least, so bf16/fp16 activations do not lose the statistics."""
    return torch.promote_types(x.dtype, torch.float32)


def _global_mean_var(x: Tensor, group: Any) -> tuple[Tensor, Tensor, float]:
    """Global per-channel mean, biased variance and count over all ranks of ``group``.

    Each rank writes (count, mean, M2 = sum of squared deviations) into its own row of a
    (world, 2C + 1) zero tensor and ONE all_reduce(SUM) gathers every row on every rank. Rows
    are then merged weighted by count (Chan's parallel variance): stable, unlike summing raw
    squares, and exact for uneven counts. An empty rank sends count 0 and adds nothing.
    """
    dims, channels = _reduce_dims(x), x.size(1)
    count = x.numel() // channels
    mean = x.sum(dims) / max(count, 1)
    m2 = (x - _per_channel(mean, x)).square().sum(dims)
    rows = x.new_zeros(dist.get_world_size(group), 2 * channels + 1)
    rows[dist.get_rank(group)] = torch.cat([mean, m2, mean.new_tensor([count])])
    dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=group)
    means, m2s, counts = rows[:, :channels], rows[:, channels:-1], rows[:, -1:]
    total = float(counts.sum())
    if total <= 1:
        # Every rank sees the same total, so every rank raises: no peer is left waiting.
        raise ValueError(
            f"Expected more than 1 value per channel when training, got {total:g} in total"
        )
    global_mean = (counts * means).sum(0) / total
    global_m2 = (m2s + counts * (means - global_mean).square()).sum(0)
    return global_mean, global_m2 / total, total


def _update_running(buf: Tensor | None, value: Tensor, factor: float) -> None:
    """buf <- (1 - factor) * buf + factor * value, in the buffer's own dtype."""
    if buf is not None:
        buf.mul_(1 - factor).add_(value.to(buf.dtype), alpha=factor)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode BN with statistics and input-gradient sums all-reduced over a group."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        input: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        eps: float,
        momentum: float,
        group: Any,
    ) -> Tensor:
        x = input.to(_compute_dtype(input))
        mean, var, total = _global_mean_var(x, group)
        _update_running(running_mean, mean, momentum)
        _update_running(running_var, var * (total / (total - 1)), momentum)  # unbiased
        invstd = torch.rsqrt(var + eps)
        y = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
        if weight is not None:
            y = y * _per_channel(weight.to(x.dtype), x)
        if bias is not None:
            y = y + _per_channel(bias.to(x.dtype), x)
        # torch's stub says Tensor; save_for_backward documents None as allowed
        ctx.save_for_backward(input, weight, mean, invstd)  # type: ignore[arg-type]
        ctx.group, ctx.total = group, total  # type: ignore[attr-defined]
        return y.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        input, weight, mean, invstd = ctx.saved_tensors
        x = input.to(mean.dtype)
        dy = grad_output.to(mean.dtype)
        dims = _reduce_dims(x)
        xmu = x - _per_channel(mean, x)
        sum_dy, sum_dy_xmu = dy.sum(dims), (dy * xmu).sum(dims)
        # weight/bias gradients are local sums; DDP averages them across ranks like any other.
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight.dtype) if ctx.needs_input_grad[2] else None
        grad_input = None
        if ctx.needs_input_grad[0]:
            # Every rank's input moved the global mean/var, so its gradient needs the global
            # sums. The same model on every rank makes this condition agree across ranks.
            sums = torch.cat([sum_dy, sum_dy_xmu])
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=ctx.group)
            mean_dy, mean_dy_xmu = (sums / ctx.total).chunk(2)
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            grad_x = dy - _per_channel(mean_dy, x)
            grad_x = grad_x - xmu * _per_channel(invstd.square() * mean_dy_xmu, x)
            grad_input = (grad_x * _per_channel(scale, x)).to(input.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class CpuSyncBatchNorm(_BatchNorm):
    """BatchNorm over (N, C, *) inputs whose training statistics span a process group.

    Equivalent to ``torch.nn.SyncBatchNorm`` but works on CPU with gloo (and any backend that
    supports all_reduce). Without an initialised process group, with a group of one rank, or in
    eval mode it is exactly plain BatchNorm and runs no collective.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        # Only pass ``bias`` when it is False: older torch versions do not know the keyword.
        extra = {} if bias else {"bias": False}
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device, dtype, **extra
        )
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _sync_group(self) -> Any:
        """The group to synchronise over, or None when plain BN gives the same answer."""
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def _momentum_factor(self) -> float:
        """Count this batch and return the running-stats factor, exactly as ``_BatchNorm``."""
        if not self.track_running_stats:
            return 0.0
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average
            return 1.0 / float(self.num_batches_tracked.item())
        return self.momentum

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        group = self._sync_group()
        if group is None:
            return super().forward(input)
        factor = self._momentum_factor()
        return _SyncBatchNormFunction.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if self.track_running_stats else None,
            self.running_var if self.track_running_stats else None,
            self.eps,
            factor,
            group,
        )


def _to_cpu_sync(bn: _BatchNorm, process_group: Any) -> CpuSyncBatchNorm:
    """A CpuSyncBatchNorm sharing ``bn``'s parameters and buffers (as torch's converter does,
    so optimizers and requires_grad flags keep pointing at the same tensors)."""
    sync = CpuSyncBatchNorm(
        bn.num_features,
        bn.eps,
        bn.momentum,
        bn.affine,
        bn.track_running_stats,
        process_group,
        bias=not bn.affine or bn.bias is not None,
    )
    if bn.affine:
        sync.weight, sync.bias = bn.weight, bn.bias
    sync.running_mean, sync.running_var = bn.running_mean, bn.running_var
    sync.num_batches_tracked = bn.num_batches_tracked
    sync.train(bn.training)
    if hasattr(bn, "qconfig"):
        sync.qconfig = bn.qconfig
    return sync


def convert_sync_batchnorm(
    module: nn.Module, process_group: Any = None, device_type: str = "cpu"
) -> nn.Module:
    """Replace every BatchNorm in ``module`` by a synchronised one; call it BEFORE wrapping in DDP.

    On CUDA this is ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` (NCCL-optimised kernels);
    elsewhere each ``_BatchNorm`` that is not already synchronised becomes a
    :class:`CpuSyncBatchNorm`. Like torch's converter, a bare BN argument is returned as a new
    module and containers are modified in place and returned.
    """
    if device_type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    output = module
    if isinstance(module, _BatchNorm) and not isinstance(
        module, (CpuSyncBatchNorm, nn.SyncBatchNorm)
    ):
        output = _to_cpu_sync(module, process_group)
    for name, child in module.named_children():
        output.add_module(name, convert_sync_batchnorm(child, process_group, device_type))
    return output
