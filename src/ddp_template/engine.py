"""Train one epoch and evaluate exactly (AMP, GradScaler, per-rank data accounting).

The loop keeps the host and the device apart: the loss is accumulated as a tensor and read
(``.item()``) only at log intervals and at the end of the epoch, so no step waits for the GPU
just to print. Every batch carries its dataset indices, which feed the rank's IndexTally.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ddp_template.amp import autocast
from ddp_template.data.accounting import IndexTally
from ddp_template.distributed import DistInfo, all_reduce_sum


@dataclass
class TrainState:
    """Where training stands: what a checkpoint restores besides the tensors."""

    epoch: int = 0
    step: int = 0  # optimizer steps since the start of the run
    position: int = 0  # this rank's samples consumed in the current epoch


@dataclass(kw_only=True)
class Trainer:
    model: nn.Module  # the DDP-wrapped model (or the plain one in a single process)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    loader: Any
    sampler: Any
    info: DistInfo
    amp_mode: str = "off"
    grad_clip: float | None = None
    log_every: int = 10
    max_steps_per_epoch: int | None = None
    keep_indices: bool = False
    label_smoothing: float = 0.0

    @property
    def module(self) -> nn.Module:
        """The unwrapped model: what is evaluated and checkpointed."""
        return getattr(self.model, "module", self.model)


@dataclass
class EpochStats:
    tally: IndexTally
    loss_sum: float = 0.0
    data_wait_s: float = 0.0
    wall_s: float = 0.0
    stopped: bool = False  # the step hook asked to stop (preemption)

    def as_metrics(self, duplicates: int) -> dict[str, Any]:
        t, compute = self.tally, max(self.wall_s - self.data_wait_s, 0.0)
        return {
            "data/samples": t.samples,
            "data/batches": t.batches,
            "data/duplicates": duplicates,
            "data/first_index": t.first_index,
            "data/last_index": t.last_index,
            "perf/data_wait_s": self.data_wait_s,
            "perf/step_s": compute / t.batches if t.batches else 0.0,
            "perf/samples_per_s": t.samples / self.wall_s if self.wall_s > 0 else 0.0,
            "train/loss_local": self.loss_sum / t.samples if t.samples else float("nan"),
        }


StepHook = Callable[[TrainState], bool]  # returns True to stop at this step boundary


class StepOut(NamedTuple):
    loss: torch.Tensor  # detached, on the device: read it only when logging
    grad_norm: torch.Tensor | None  # only when clipping or logging this step


def _step(tr: Trainer, x: torch.Tensor, y: torch.Tensor, want_norm: bool) -> StepOut:
    with autocast(tr.amp_mode, tr.info.device):
        loss = F.cross_entropy(tr.model(x), y, label_smoothing=tr.label_smoothing)
    tr.scaler.scale(loss).backward()
    norm = None
    if tr.grad_clip is not None or want_norm:
        tr.scaler.unscale_(tr.optimizer)  # clip the true gradients, not the scaled ones
        limit = tr.grad_clip if tr.grad_clip is not None else float("inf")
        norm = nn.utils.clip_grad_norm_(tr.model.parameters(), limit)
    tr.scaler.step(tr.optimizer)
    tr.scaler.update()
    tr.optimizer.zero_grad(set_to_none=True)
    tr.scheduler.step()
    return StepOut(loss.detach(), norm)


def steps_this_epoch(tr: Trainer, state: TrainState) -> int:
    """Steps the coming epoch will run from ``state.position`` (after any step cap)."""
    remaining = len(tr.loader)
    if tr.max_steps_per_epoch is not None:
        done = state.position // tr.loader.batch_size
        remaining = min(remaining, max(0, tr.max_steps_per_epoch - done))
    return remaining


def train_one_epoch(
    tr: Trainer,
    state: TrainState,
    on_step: StepHook,
    on_interval: Callable[[dict[str, float], int], None],
) -> EpochStats:
    """One pass over this rank's shard from ``state.position``; updates ``state`` in place."""
    tr.model.train()
    stats = EpochStats(IndexTally(keep=tr.keep_indices))
    limit = steps_this_epoch(tr, state)
    if limit == 0:
        return stats
    loss_acc = torch.zeros((), device=tr.info.device)  # sum of loss x batch size
    interval_t, interval_n, interval_start = time.perf_counter(), 0, loss_acc.clone()
    start = waited = time.perf_counter()
    for i, (x, y, idx) in enumerate(tr.loader):
        stats.data_wait_s += time.perf_counter() - waited
        x = x.to(tr.info.device, non_blocking=True)
        y = y.to(tr.info.device, non_blocking=True)
        want_norm = (state.step + 1) % tr.log_every == 0
        loss, norm = _step(tr, x, y, want_norm)
        stats.tally.add(idx.numpy())
        loss_acc += loss * len(idx)
        interval_n += len(idx)
        state.step += 1
        state.position += len(idx)
        if want_norm:
            now = time.perf_counter()
            on_interval(
                {
                    "train/loss": ((loss_acc - interval_start) / interval_n).item(),
                    "train/lr": tr.scheduler.get_last_lr()[0],
                    "train/grad_norm": float(norm),
                    "perf/interval_samples_per_s": interval_n / (now - interval_t),
                },
                state.step,
            )
            interval_t, interval_n = now, 0
            interval_start.copy_(loss_acc)
        if on_step(state):
            stats.stopped = True
            break
        if i + 1 >= limit:
            break
        waited = time.perf_counter()
    stats.loss_sum = float(loss_acc.item())  # waits for the device: time the whole epoch
    stats.wall_s = time.perf_counter() - start
    return stats


TOP_K = 5  # eval/top5, for data with at least this many classes


@dataclass
class EvalResult:
    """Exact counts over the whole split (summed over ranks, never averaged ratios)."""

    correct: int
    count: int
    loss_sum: float
    top5_correct: int | None = None  # None with fewer than TOP_K classes
    class_correct: list[int] = field(default_factory=list)
    class_count: list[int] = field(default_factory=list)
    split: str = "test"  # which split summary.json's eval_* keys describe (eval_split)

    @property
    def accuracy(self) -> float:
        return self.correct / self.count if self.count else 0.0

    @property
    def loss(self) -> float:
        return self.loss_sum / self.count if self.count else float("nan")

    @property
    def top5(self) -> float | None:
        if self.top5_correct is None:
            return None
        return self.top5_correct / self.count if self.count else 0.0

    @property
    def class_accuracy(self) -> list[float | None]:
        return [
            c / n if n else None for c, n in zip(self.class_correct, self.class_count, strict=True)
        ]

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        """The per-epoch keys: <prefix>/accuracy, /loss, /correct and /top5 (>= 5 classes)."""
        out = {
            f"{prefix}/accuracy": self.accuracy,
            f"{prefix}/loss": self.loss,
            f"{prefix}/correct": self.correct,
        }
        if self.top5 is not None:
            out[f"{prefix}/top5"] = self.top5
        return out

    def summary(self, prefix: str = "eval") -> dict[str, Any]:
        """summary.json's keys for this split."""
        out = {
            f"{prefix}_split": self.split,
            f"{prefix}_accuracy": self.accuracy,
            f"{prefix}_correct": self.correct,
            f"{prefix}_count": self.count,
            f"{prefix}_loss": self.loss,
            f"{prefix}_per_class_correct": self.class_correct,
            f"{prefix}_per_class_count": self.class_count,
            f"{prefix}_per_class_accuracy": self.class_accuracy,
        }
        if self.top5 is not None:
            out[f"{prefix}_top5"] = self.top5
            out[f"{prefix}_top5_correct"] = self.top5_correct
        return out


def sync_buffers(module: nn.Module, info: DistInfo) -> None:
    """Give every rank rank 0's buffers (BN running stats).

    DDP broadcasts buffers at the start of each forward, then every rank updates them from its
    own batch; after the last step the ranks' running stats differ. Evaluating rank 0's model
    everywhere makes the distributed result equal the single-process one.
    """
    if info.distributed:
        for buf in module.buffers():
            torch.distributed.broadcast(buf, src=0)


@torch.no_grad()
def evaluate(
    module: nn.Module, loader: Any, info: DistInfo, amp_mode: str, *, num_classes: int
) -> EvalResult:
    """Exact evaluation: unpadded shards, sums all-reduced.

    ``module`` is the unwrapped model: a DDP forward may run collectives (buffer broadcast,
    SyncBN), and ranks with different (or empty) shards would then deadlock or mismatch.
    ``num_classes`` sizes the per-class counts, which a rank with an empty shard cannot infer.
    """
    sync_buffers(module, info)
    was_training = module.training
    module.eval()
    c = num_classes
    # correct, count, loss, top-k correct, then per class: correct (c values), count (c values)
    sums = torch.zeros(4 + 2 * c, dtype=torch.float64, device=info.device)
    for x, y, _ in loader:
        x, y = x.to(info.device, non_blocking=True), y.to(info.device, non_blocking=True)
        with autocast(amp_mode, info.device):
            logits = module(x)
        hit = logits.argmax(dim=1) == y
        sums[0] += hit.sum()
        sums[1] += len(y)
        sums[2] += F.cross_entropy(logits.float(), y, reduction="sum").double()
        if c >= TOP_K:
            top = logits.topk(TOP_K, dim=1).indices
            sums[3] += (top == y[:, None]).any(dim=1).sum()
        sums[4 : 4 + c] += torch.bincount(y[hit], minlength=c)[:c].double()
        sums[4 + c :] += torch.bincount(y, minlength=c)[:c].double()
    all_reduce_sum(sums, info)
    module.train(was_training)
    n = [int(v) for v in sums.tolist()]
    return EvalResult(
        correct=n[0],
        count=n[1],
        loss_sum=float(sums[2].item()),
        top5_correct=n[3] if c >= TOP_K else None,
        class_correct=n[4 : 4 + c],
        class_count=n[4 + c :],
    )
