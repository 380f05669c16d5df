"""Uneven ends of a stream: every step, the ranks agree whether all still have data.

A stream the template cannot plan may end on one rank before another (a file count the
world size does not divide, a filter that drops more on one rank): a rank whose loader is
exhausted would leave DDP's all-reduce waiting for it for good. So before each optimizer step
every rank all-reduces one int (MIN of "I have this step's micro-batches"): all train the step
only if all have it, and all stop at the first rank that runs out. The collective is issued one
step ahead (asynchronously, on a gloo group of its own) and waited for only when that step
begins, so its latency hides behind the current step's compute. The ranks that still had data
read the rest of their stream without training on it, and those samples are counted and named,
per worker, in the epoch's verdict (``streams.verify``). This is ``data.uneven=stop``,
the default; ``data.uneven=join`` (``streams.join.Joined``) trains every rank on all of its data
instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ddp_template.data.epoch_steps import EpochSteps
from ddp_template.distributed import DistInfo

NAMED = 12  # unread keys named per worker


class StreamSteps(EpochSteps):
    """A stream's steps, counted as they come: the epoch ends where the ranks agree it does, so
    a position is simply the micro-batch slots consumed; ``steps_per_epoch`` is the estimate
    the LR schedule and the progress bar read."""

    exact: ClassVar[bool] = False  # an estimate: a max_steps past it is not refused

    def steps_done(self, position: int) -> int:
        return position // self.step_size

    def next_boundary(self, position: int) -> int:
        return position + self.step_size

    @property
    def last_micro_batch(self) -> int:
        """Unknown before the stream ends: a full batch."""
        return self.batch_size


@dataclass(kw_only=True)
class Agreement:
    """The per-step agreement over a stream, and what this rank left unread this epoch."""

    info: DistInfo
    workers: int = 1
    group: Any = None
    saves_stop_at_end: ClassVar[bool] = False  # every rank stops at the same step
    unread: list[tuple[int, list[str]]] = field(default_factory=list)  # per worker

    def __post_init__(self) -> None:
        if self.info.distributed and self.group is None:
            # A CPU-side gloo group even under nccl: the flag is read on the host anyway.
            self.group = dist.new_group(backend="gloo")

    def micro_batches(self, tr: Any, position: int) -> Iterator[tuple[tuple, float, bool]]:
        """The epoch's micro-batches as ``((x, y, keys, worker), weight, last)`` while every
        rank has a whole step of them, up to ``max_steps_per_epoch`` (and the run's
        ``max_steps``)."""
        self.unread = [(0, []) for _ in range(self.workers)]
        loader, steps = tr.loader, tr.steps
        it, k, cap = iter(loader), steps.steps_done(position), steps.cap
        step = _take(it, steps.accumulate)
        agreed = self._agree(step, steps.accumulate)
        while cap is None or k < cap:
            if not _wait(agreed):
                self._leave(step, it)
                return
            k += 1
            ahead = None
            if cap is None or k < cap:  # the next step's agreement overlaps this step
                upcoming = _take(it, steps.accumulate)
                ahead = self._agree(upcoming, steps.accumulate)
            total = sum(len(b[1]) for b in step)
            for j, ((x, y, _), keys, worker, _names) in enumerate(step):
                yield (x, y, keys, worker), len(keys) / total, j == len(step) - 1
            if ahead is None:
                return
            step, agreed = upcoming, ahead

    def tail(
        self, trainer: Any, state: Any, on_step: Callable[[Any], bool]
    ) -> AbstractContextManager[None]:
        """No tail to shadow: every rank stops at the same step."""
        return nullcontext()

    def _agree(self, step: list, needed: int) -> tuple[torch.Tensor, Any]:
        flag = torch.tensor([int(len(step) == needed)], dtype=torch.int32)
        if not self.info.distributed:
            return flag, None
        return flag, dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group, async_op=True)

    def _leave(self, fetched: list, it: Iterator) -> None:
        """Read the rest of this rank's stream without training on it: count and name it."""
        for _, keys, worker, names in [*fetched, *it]:
            n, named = self.unread[worker]
            self.unread[worker] = (n + len(keys), named + names[: NAMED - len(named)])


def _take(it: Iterator, n: int) -> list:
    """Up to ``n`` batches from ``it`` (fewer at its end)."""
    out = []
    for batch in it:
        out.append(batch)
        if len(out) == n:
            break
    return out


def _wait(agreed: tuple[torch.Tensor, Any]) -> bool:
    flag, work = agreed
    if work is not None:
        work.wait()
    return bool(flag.item())
