"""Train one epoch (AMP, GradScaler, per-rank data accounting); ``evaluation`` evaluates.

An optimizer step takes ``optim.accumulate`` micro-batches (the step arithmetic is
``data.epoch_steps.EpochSteps``'s): each micro-batch's loss is weighted by its share of the step's
samples, so the update is the one a single batch of them all would give, and DDP all-reduces
the gradients once per step (``no_sync`` on the others). Where ranks hold lists of different
lengths (``sampler=exact``) a rank past the end of its list still runs every micro-batch, an
empty one included, so every rank joins every all-reduce; the weights make the update the mean
over the samples the step really had. The loop keeps the host and the device
apart: the loss is accumulated as a tensor and read
(``.item()``) only at log intervals and at the end of the epoch, so no step waits for the GPU
just to print. Every batch carries its dataset indices, which feed the rank's IndexTally.
How the batches come and how the epoch's end is met is ``Trainer.feed``'s (the data kind's):
a planned epoch's micro-batches (:class:`PlannedFeed`), or a stream's, where every rank stops at
one step (``streams.stop.Agreement``) or the loop runs inside torch's ``Join`` and a rank whose
stream ended shadows the others' steps (``streams.join.Joined``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_template.amp import autocast
from ddp_template.data.contract import Sampler, batch_len, empty_batch, to_device
from ddp_template.data.epoch_steps import EpochSteps
from ddp_template.distributed import DistInfo
from ddp_template.ledger.records import PriorStretch, SavedLedger
from ddp_template.ledger.tally import IndexTally
from ddp_template.parallel import Parallel, ddp_of, uncompiled
from ddp_template.task import Task


class Feed(Protocol):
    """How an epoch's micro-batches come and how its end is met: ``micro_batches`` yields
    ``(batch, weight, last)`` from ``position``; the epoch's loop runs inside ``tail``.
    ``saves_stop_at_end``: a stop's checkpoint is written after the epoch's loop (once the tail
    has caught every rank up), not by the step hook at the stop's step."""

    saves_stop_at_end: ClassVar[bool]

    def micro_batches(self, tr: Trainer, position: int) -> Iterator[tuple[tuple, float, bool]]:
        """The epoch's micro-batches from ``position`` (a step boundary)."""

    def tail(
        self, tr: Trainer, state: TrainState, on_step: StepHook
    ) -> AbstractContextManager[Any]:
        """What the epoch's loop runs inside (a ``nullcontext`` where nothing needs to)."""


class StepRule(Protocol):
    """Sees a step's micro-batches (``hold`` before each forward, ``count`` its loss) and
    judges the step before its update, its gradients in place (``judge``, with the GradScaler
    they are scaled by: True skips it; ``own``: this rank's samples of the step judged last).
    The spike rule's (``spike.Spikes``); :class:`NoRule` by default."""

    own: int

    def hold(self, x: Any, y: Any, idx: Any, module: nn.Module) -> None: ...

    def count(self, loss: torch.Tensor, n: int) -> None: ...

    def judge(self, module: nn.Module, step: int, epoch: int, scaler: Any = None) -> bool: ...


class NoRule:
    """No rule: every step's update is applied."""

    own = 0

    def hold(self, x: Any, y: Any, idx: Any, module: nn.Module) -> None:
        return None

    def count(self, loss: torch.Tensor, n: int) -> None:
        return None

    def judge(self, module: nn.Module, step: int, epoch: int, scaler: Any = None) -> bool:
        return False


NO_RULE = NoRule()


class PlannedFeed:
    """A planned epoch's: every rank's micro-batches are dealt by ``Trainer.steps``."""

    saves_stop_at_end: ClassVar[bool] = False

    def micro_batches(self, tr: Trainer, position: int) -> Iterator[tuple[tuple, float, bool]]:
        return micro_batches(tr.loader, tr.steps, position, tr.info.rank)

    def tail(self, tr: Trainer, state: TrainState, on_step: StepHook) -> AbstractContextManager:
        return nullcontext()


@dataclass
class TrainState:
    """Where training stands: what a checkpoint restores besides the tensors."""

    epoch: int = 0
    step: int = 0  # optimizer steps since the start of the run
    position: int = 0  # positions of the current epoch stepped through (alike on every rank)
    tally: IndexTally | None = None  # this launch's tally of the current epoch (the ledger part)
    # The ledger of the current epoch's part read before a resume (from the checkpoint).
    carried: SavedLedger | None = None
    # The current epoch's prefixes read at other world sizes, oldest first (elastic resume).
    prior: list[PriorStretch] = field(default_factory=list)
    # The micro-batches of the step in flight (indices, worker...): they join the tally once
    # the step commits, so a step broken by a lost rank leaves no trace (fault_tolerance=live).
    held: list[tuple] = field(default_factory=list)

    def hold(self, idx: torch.Tensor, worker: list) -> None:
        """A micro-batch of the step in flight: the ledger's once the step commits."""
        self.held.append((idx.numpy(), *worker))

    def commit(self, tally: IndexTally) -> None:
        """The held micro-batches join the tally (the step committed, or the epoch ended)."""
        for batch in self.held:
            tally.add(*batch)
        self.held.clear()

    @property
    def steps_before(self) -> int:
        """Steps of the current epoch run at other world sizes."""
        return sum(p["steps"] for p in self.prior)


@dataclass(kw_only=True)
class Trainer:
    model: nn.Module  # what trains: DDP-wrapped and/or torch.compiled (or the plain module)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    loader: Any
    sampler: Sampler
    info: DistInfo
    amp_mode: str = "off"
    grad_clip: float | None = None
    log_every: int = 10
    steps: EpochSteps  # which micro-batches make each optimizer step
    keep_indices: bool = False
    task: Task  # what is learned: the loss of a micro-batch (ddp_template.task)
    parallel: Parallel  # how the model is laid out over the ranks (DDP, FSDP2)
    feed: Feed = field(default_factory=PlannedFeed)  # the data kind's (data.kind)
    spikes: Any = None  # spike forensics (spike.Spikes): judges each step before its update
    settled: bool = False  # this launch's first step prepared (parallel.settle_buckets)

    @property
    def rule(self) -> StepRule:
        """What judges each step before its update: the spike rule, or nothing."""
        return self.spikes if self.spikes is not None else NO_RULE

    @property
    def ddp(self) -> DDP | None:
        return ddp_of(self.model)

    @property
    def module(self) -> nn.Module:
        """The unwrapped, uncompiled model: what is evaluated and checkpointed."""
        ddp = ddp_of(self.model)
        return ddp.module if ddp is not None else uncompiled(self.model)


@dataclass
class EpochStats:
    tally: IndexTally
    loss_sum: float = 0.0
    data_wait_s: float = 0.0
    wall_s: float = 0.0
    steps: int = 0  # optimizer steps (tally.batches counts micro-batches)
    stopped: bool = False  # the step hook asked to stop (preemption)
    spiked: int = 0  # samples read whose update the spike rule skipped (spike.skip)

    def as_metrics(self, duplicates: int) -> dict[str, Any]:
        t, compute = self.tally, max(self.wall_s - self.data_wait_s, 0.0)
        return {
            "data/samples": t.samples,
            "data/batches": t.batches,
            "data/duplicates": duplicates,
            "data/spike_skipped": self.spiked,
            "data/first_index": t.first_index,
            "data/last_index": t.last_index,
            "perf/data_wait_s": self.data_wait_s,
            "perf/step_s": compute / self.steps if self.steps else 0.0,
            "perf/samples_per_s": t.samples / self.wall_s if self.wall_s > 0 else 0.0,
            "train/loss_local": self.loss_sum / t.samples if t.samples else float("nan"),
        }


StepHook = Callable[[TrainState], bool]  # returns True to stop at this step boundary


class StepOut(NamedTuple):
    loss: torch.Tensor  # detached, on the device: read it only when logging
    grad_norm: torch.Tensor | None  # only when clipping or logging this step


def _forward_backward(
    tr: Trainer, x: torch.Tensor, y: torch.Tensor, weight: float, sync: bool
) -> torch.Tensor:
    """One micro-batch; its gradients are reduced across the ranks only with ``sync``."""
    with tr.parallel.sync(tr.model, sync):  # the forward and the backward both inside
        with autocast(tr.amp_mode, tr.info.device):
            # An empty micro-batch's mean is NaN; its sum is 0, so are its gradients, and its
            # backward still runs DDP's all-reduce: the rank contributes zero and nobody hangs.
            reduction = "mean" if batch_len(y) else "sum"
            loss = tr.task.loss(tr.model(x), y, reduction)
        tr.scaler.scale(loss if weight == 1.0 else loss * weight).backward()
    return loss.detach()


def _optimizer_step(tr: Trainer, want_norm: bool, skip: bool = False) -> torch.Tensor | None:
    """Clip, step, zero the gradients, advance the LR schedule; ``skip`` (the spike rule): the
    gradients are dropped instead of applied."""
    if skip:
        tr.optimizer.zero_grad(set_to_none=True)
        tr.scheduler.step()
        return torch.tensor(float("nan")) if want_norm else None
    norm = None
    if tr.grad_clip is not None or want_norm:
        tr.scaler.unscale_(tr.optimizer)  # clip the true gradients, not the scaled ones
        limit = tr.grad_clip if tr.grad_clip is not None else float("inf")
        norm = tr.parallel.clip(tr.model, limit)
    tr.scaler.step(tr.optimizer)
    tr.scaler.update()
    tr.optimizer.zero_grad(set_to_none=True)
    tr.scheduler.step()
    return norm


def _step(tr: Trainer, x: torch.Tensor, y: torch.Tensor, want_norm: bool) -> StepOut:
    """One optimizer step on one batch (no accumulation)."""
    loss = _forward_backward(tr, x, y, weight=1.0, sync=True)
    return StepOut(loss, _optimizer_step(tr, want_norm))


def micro_batches(loader: Any, steps: EpochSteps, position: int, rank: int = 0) -> Iterator[tuple]:
    """The epoch's micro-batches from ``position`` (a step boundary), as ``(batch, weight,
    last)``: ``weight`` is the batch's share of its optimizer step's samples (``steps.weight``),
    ``last`` ends the step. Stops after the epoch's last (possibly capped) step, or where the
    run reaches ``max_steps`` (``steps.steps_in_epoch``). Where
    ``rank``'s list has ended (``sampler=exact``) the batch is empty, with weight 0."""
    it, previous = iter(loader), None
    size = steps.batch_size
    for k in range(steps.steps_done(position), steps.steps_in_epoch):
        start, stop = steps.span(k)
        n = -(-(stop - start) // size)
        for j in range(n):
            lo = start + j * size
            if steps.held(rank, lo, min(lo + size, stop)):
                batch = previous = next(it)
            else:
                batch = empty_batch(loader, previous)
            yield batch, steps.weight(len(batch[2]), k), j == n - 1


def new_tally(tr: Trainer, position: int) -> IndexTally:
    """This epoch's tally; per loader worker where the sampler deals them ranges
    (``worker_lanes``)."""
    workers, first = tr.sampler.worker_lanes(position)
    return IndexTally(keep=tr.keep_indices, workers=workers, first_worker=first)


class Meter:
    """The epoch's loss and time, kept on the device and read (``.item()``) only at log
    intervals and at the epoch's end; the interval's row of the logs."""

    def __init__(self, tr: Trainer, stats: EpochStats) -> None:
        self.tr, self.stats = tr, stats
        self.loss = torch.zeros((), device=tr.info.device)  # sum of loss x batch size
        self.since, self.n, self.start = time.perf_counter(), 0, self.loss.clone()
        self.began, self.steps = (
            time.perf_counter(),
            0,
        )  # steps: stats.steps at the interval's start

    def timed(self, batches: Iterator[tuple]) -> Iterator[tuple]:
        """``batches``, the wait for each added to ``data_wait_s``."""
        it = iter(batches)
        while True:
            waited = time.perf_counter()
            batch = next(it, None)
            if batch is None:
                return
            self.stats.data_wait_s += time.perf_counter() - waited
            yield batch

    def add(self, loss: torch.Tensor, n: int) -> None:
        self.loss += loss * n
        self.n += n

    def row(self, norm: torch.Tensor | None) -> dict[str, float]:
        """The interval's row of the logs; the next interval starts."""
        now = time.perf_counter()
        row = {
            "train/lr": self.tr.scheduler.get_last_lr()[0],
            "train/grad_norm": float(norm) if norm is not None else float("nan"),
            "perf/interval_samples_per_s": self.n / (now - self.since),
            "perf/interval_step_ms": 1e3
            * (now - self.since)
            / max(self.stats.steps - self.steps, 1),
        }
        if self.n:  # sampler=exact: a rank whose list has ended has no loss to report
            row["train/loss"] = ((self.loss - self.start) / self.n).item()
        self.since, self.n, self.steps = now, 0, self.stats.steps
        self.start.copy_(self.loss)
        return row

    def close(self) -> None:
        self.stats.loss_sum = float(self.loss.item())  # waits for the device: the whole epoch
        self.stats.wall_s = time.perf_counter() - self.began


def _settle(tr: Trainer, x: Any) -> None:
    """This launch's first step on DDP's rebuilt buckets."""
    if not tr.settled:
        tr.parallel.settle(tr.model, x)
        tr.settled = True


def train_one_epoch(
    tr: Trainer,
    state: TrainState,
    on_step: StepHook,
    on_interval: Callable[[dict[str, float], int], None],
) -> EpochStats:
    """One pass over this rank's share from ``state.position``; updates ``state`` in place."""
    tr.model.train()
    stats = EpochStats(new_tally(tr, state.position))
    state.tally = stats.tally
    if tr.steps.steps_left(state.position) == 0:
        return stats
    meter, rule = Meter(tr, stats), tr.rule
    batches = meter.timed(tr.feed.micro_batches(tr, state.position))
    with tr.feed.tail(tr, state, on_step) as shadow:  # a joined stream's: Join over DDP, the hook
        for (x, y, idx, *worker), weight, last in batches:  # a stream's batches name their worker
            x, y = to_device(x, tr.info.device), to_device(y, tr.info.device)
            _settle(tr, x)
            rule.hold(x, y, idx, tr.module)  # before the forward: the RNG state it starts from
            state.hold(idx, worker)  # the ledger's once the step commits
            loss = _forward_backward(tr, x, y, weight, sync=last)
            meter.add(loss, len(idx))
            rule.count(loss, len(idx))
            if not last:
                continue
            want_norm = (state.step + 1) % tr.log_every == 0
            skip = rule.judge(tr.module, state.step + 1, state.epoch, tr.scaler)
            stats.spiked += rule.own if skip else 0
            norm = _optimizer_step(tr, want_norm, skip)
            state.commit(stats.tally)
            state.position = tr.steps.next_boundary(state.position)  # the same on every rank
            state.step += 1
            stats.steps += 1
            if want_norm:
                on_interval(meter.row(norm), state.step)
            if on_step(state):
                stats.stopped = True
                break
        state.commit(stats.tally)  # a stream's last micro-batches past a step's end
        meter.close()  # before Join's exit: a joined rank's wait is not its step time
    stats.stopped |= shadow is not None and shadow.stopped  # a stop at a step it shadowed
    return stats
