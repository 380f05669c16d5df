"""Which positions of each rank's epoch list an optimizer step consumes: the step arithmetic.

Every rank runs the same number of steps per epoch: its list has L positions (the sampler
mode's length), the DataLoader cuts it into micro-batches of B (the last one short, or dropped
with ``sampler.drop_last_batch``), an optimizer step takes the next A of them
(``optim.accumulate``; an epoch whose micro-batch count is not a multiple of A ends with one
step of the micro-batches left), and ``max_steps_per_epoch`` caps the steps. The run's
``max_steps`` ends it after that many steps in all: the epoch it falls in stops there, mid-way,
a prefix of every rank's list read as a capped epoch's is (``steps_in_epoch``). Steps are numbered
as the logs number them: the run's first optimizer step is step 1, and step S is step
``(S - 1) mod K`` of epoch ``(S - 1) div K`` for K steps per epoch. A resumed run continues at
the exact position it stopped at, so a resume never changes which batch belongs to which step.

Ranks may hold lists of different lengths (``sampler=exact``: ceil or floor(N/W)). Positions
then count in the longest list, which every rank steps through: a shorter rank's micro-batch
past the end of its list holds fewer samples or none, yet the rank runs it (DDP all-reduces
every rank's gradients at each step), and each micro-batch's loss weight is its share of the
samples the step really had on all ranks, so the update is their mean. With
``sampler.drop_last_batch`` only micro-batches full on every rank are kept: the epoch's last
incomplete global batch is dropped, as one process with W times the batch would drop it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, NamedTuple, TypeVar

import numpy as np

from ddp_template.data.contract import Sampler
from ddp_template.errors import ConfigError

_Steps = TypeVar("_Steps", bound="EpochSteps")


class StepBatch(NamedTuple):
    """The positions [start, stop) of every rank's epoch list that one step consumed (all of
    its micro-batches)."""

    step: int
    epoch: int
    start: int
    stop: int

    @property
    def positions(self) -> np.ndarray:
        return np.arange(self.start, self.stop, dtype=np.int64)


@dataclass(frozen=True, kw_only=True)
class EpochSteps:
    length: int  # L: positions per rank per epoch (the longest list: ShareSampler.epoch_length)
    batch_size: int
    epochs: int
    max_steps_per_epoch: int | None = None
    drop_last_batch: bool = False
    accumulate: int = 1  # A: micro-batches per optimizer step
    # Every rank's list length (ShareSampler.rank_lengths); () counts one rank of `length`.
    rank_lengths: tuple[int, ...] = ()
    max_steps: int | None = None  # the run's last step (``max_steps``); None: its epochs' end
    start_step: int = 0  # the run's steps before position 0 of this epoch (``from_step``)
    exact: ClassVar[bool] = True  # steps_per_epoch is known, not estimated (a stream's is)

    @property
    def lengths(self) -> tuple[int, ...]:
        return self.rank_lengths or (self.length,)

    @classmethod
    def of_run(
        cls: type[_Steps],
        cfg: Any,
        *,
        length: int,
        rank_lengths: tuple[int, ...],
        steps_before: int = 0,
    ) -> _Steps:
        """The run's step arithmetic (``train.build`` and ``replay`` both read it): ``cfg`` is
        the run's ``Config``, ``length`` its sampler's positions per rank (the longest list),
        ``rank_lengths`` each rank's own where they differ (``sampler=exact``). The rest of an
        epoch resumed at another world size has its own (``length`` of the rest's lists), capped
        at what ``max_steps_per_epoch`` leaves after the ``steps_before`` it ran already.
        A ``max_steps`` past the end of the run's epochs is refused (a whole epoch's arithmetic:
        ``steps_before`` 0, exact steps, epochs to train)."""
        cap = cfg.max_steps_per_epoch
        steps = cls(
            length=length,
            rank_lengths=rank_lengths,
            batch_size=cfg.loader.batch_size,
            epochs=cfg.epochs,
            max_steps_per_epoch=None if cap is None else max(0, cap - steps_before),
            drop_last_batch=cfg.sampler.drop_last_batch,
            accumulate=cfg.optim.accumulate,
            max_steps=cfg.max_steps,
        )
        if steps_before == 0 and steps.exact and steps.epochs:
            steps.check_reach()
        return steps

    def check_reach(self) -> None:
        """Refuse a ``max_steps`` the run's epochs end before (one sentence)."""
        k, total = self.steps_per_epoch, self.epochs * self.steps_per_epoch
        if self.max_steps is not None and self.max_steps > total:
            raise ConfigError(
                f"max_steps={self.max_steps} is past the run's last step: epochs={self.epochs} "
                f"of {k} steps end at step {total}; set epochs={-(-self.max_steps // max(k, 1))} "
                f"(or more: the run still ends at max_steps), or a smaller max_steps."
            )

    def from_step(self: _Steps, step: int, position: int) -> _Steps:
        """This epoch's steps for a run at ``step`` with ``position`` of the epoch read (a step
        boundary): where the run's ``max_steps`` falls in it (``steps_in_epoch``)."""
        return replace(self, start_step=step - self.steps_done(position))

    @classmethod
    def of_sampler(
        cls: type[_Steps], cfg: Any, sampler: Sampler, *, steps_before: int = 0
    ) -> _Steps:
        """:meth:`of_run` for ``sampler``'s current epoch (its lengths)."""
        return cls.of_run(
            cfg,
            length=sampler.epoch_length,
            rank_lengths=sampler.rank_lengths,
            steps_before=steps_before,
        )

    @property
    def micro_batches(self) -> int:
        """The DataLoader's length: ceil(L / B), or floor (of the shortest list) with
        drop_last_batch."""
        if self.drop_last_batch:
            return min(self.lengths) // self.batch_size
        return -(-self.length // self.batch_size)

    @property
    def steps_per_epoch(self) -> int:
        """K: ceil(micro-batches / A), then the cap."""
        steps = -(-self.micro_batches // self.accumulate)
        cap = self.max_steps_per_epoch
        return steps if cap is None else min(steps, cap)

    @property
    def steps_in_epoch(self) -> int:
        """The steps this epoch runs: K, fewer in the epoch where the run reaches ``max_steps``
        (none after it)."""
        if self.max_steps is None:
            return self.steps_per_epoch
        return max(0, min(self.steps_per_epoch, self.max_steps - self.start_step))

    @property
    def cap(self) -> int | None:
        """The most steps this epoch may run where its length is not known before it ends (a
        stream's): ``max_steps_per_epoch``'s cap and what ``max_steps`` leaves the run."""
        left = None if self.max_steps is None else max(0, self.max_steps - self.start_step)
        caps = [c for c in (self.max_steps_per_epoch, left) if c is not None]
        return min(caps) if caps else None

    @property
    def step_size(self) -> int:
        """Positions a full optimizer step consumes per rank: A x B."""
        return self.accumulate * self.batch_size

    def steps_done(self, position: int) -> int:
        """Steps of an epoch already run once ``position`` positions were consumed (a step
        boundary: a multiple of A x B, or the end of the epoch's last, shorter step)."""
        if position >= self.consumed_per_epoch:
            return self.steps_per_epoch
        return position // self.step_size

    def steps_left(self, position: int) -> int:
        """Optimizer steps the epoch runs from ``position`` (after any cap and ``max_steps``)."""
        return max(0, self.steps_in_epoch - self.steps_done(position))

    def ended(self, step: int, position: int) -> bool:
        """Whether the run has taken its ``max_steps`` by ``step`` and the epoch they ended in
        has met its end (``position`` 0: the next epoch's start)."""
        return self.max_steps is not None and step >= self.max_steps and position == 0

    def horizon(self, step: int, position: int, later: int) -> int:
        """The run's last step as seen at ``step`` with ``position`` of this epoch read: the
        epoch's steps left, ``later`` steps of the epochs after it, no further than
        ``max_steps`` (the LR schedule's horizon, re-derived)."""
        end = step + self.steps_per_epoch - self.steps_done(position) + later
        return end if self.max_steps is None else min(end, self.max_steps)

    def span(self, k: int) -> tuple[int, int]:
        """The positions [start, stop) that step ``k`` (0-based, within an epoch) reads."""
        readable = min(self.micro_batches * self.batch_size, self.length)
        start = k * self.step_size
        return start, min(start + self.step_size, readable)

    def next_boundary(self, position: int) -> int:
        """Where the step that starts at ``position`` (a step boundary) ends."""
        return self.span(self.steps_done(position))[1]

    def held(self, rank: int, start: int, stop: int) -> int:
        """How many of positions [start, stop) ``rank``'s own list holds."""
        length = self.lengths[rank] if self.rank_lengths else self.length
        return max(0, min(stop, length) - start)

    def weight(self, samples: int, k: int) -> float:
        """The loss weight of a micro-batch of ``samples`` in step ``k`` (0-based): its share of
        the step's samples on all ranks, times the ranks DDP averages over, so the averaged
        gradient is the mean over the samples the step really had (no communication)."""
        start, stop = self.span(k)
        ranks = range(len(self.lengths))
        return samples * len(ranks) / sum(self.held(r, start, stop) for r in ranks)

    @property
    def total_steps(self) -> int:
        """The run's steps: its epochs', or ``max_steps`` where that comes first."""
        total = self.epochs * self.steps_per_epoch
        return total if self.max_steps is None else min(total, self.max_steps)

    @property
    def consumed_per_epoch(self) -> int:
        """Positions of each rank's list that an epoch's steps read (a prefix of the list)."""
        return self.span(self.steps_per_epoch - 1)[1] if self.steps_per_epoch else 0

    @property
    def last_micro_batch(self) -> int:
        """Samples in each rank's last micro-batch of an epoch, the fewest where ranks differ
        (an empty one aside; 0 without training)."""
        if self.total_steps == 0:
            return 0
        start, stop = self.span(self.steps_per_epoch - 1)
        first = stop - ((stop - start - 1) % self.batch_size + 1)
        return min(filter(None, (self.held(r, first, stop) for r in range(len(self.lengths)))))

    def batch(self, step: int) -> StepBatch:
        """The positions step ``step`` (1-based) consumed; ValueError outside the run."""
        if not 1 <= step <= self.total_steps:
            raise ValueError(self._outside(step))
        epoch, k = divmod(step - 1, self.steps_per_epoch)
        return StepBatch(step, epoch, *self.span(k))

    def _outside(self, step: int) -> str:
        if self.total_steps == 0:
            return (
                f"step={step} does not exist: this run trains no step ({self.epochs} epochs of "
                f"{self.steps_per_epoch} steps)."
            )
        return (
            f"step={step} is outside this run's steps [1, {self.total_steps}] ({self.epochs} "
            f"epochs of {self.steps_per_epoch} steps); pass a step in that range."
        )
