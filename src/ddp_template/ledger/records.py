"""The ledger's records: the data model of the promise that every rank reads exactly what its
sampler mode defines (a stream: what its split yields, once), from a rank's tally to the verdict.

What crosses a process boundary is a TypedDict, plain containers on the wire and on disk: a
checkpoint loads under ``weights_only=True``, stretches.json is JSON, a gather pickles. What rank
0 makes of the gathered rows, the report and its verdict, is frozen dataclasses. Fingerprints
are ints mod 2**64 until the report, which shows them as 16 hex digits. Readers:

- ``Tallied``, ``SavedLedger``: ``ledger.tally.join_ledgers`` (writes), ``ledger.verify.
  epoch_metrics`` (the ``data/epoch_*`` keys), ``checkpoint_parts.Ledger`` (the checkpoint's
  ledger part, ``engine.TrainState.carried``).
- ``PriorStretch``: ``engine.TrainState`` (``prior``, ``steps_before``), ``checkpoint_parts``
  (``Progress`` writes it, ``Ledger.load_resized`` its ledgers, ``SamplerPosition``),
  ``data.samplers.ShareSampler.continue_epoch``, ``ledger.verify.prior_checks``,
  ``elastic.record_stretch`` (stretches.json, without the ledgers) and ``replay``.
- ``Seen``, ``RankRow``, ``WorkerCheck``, ``PriorCheck``: ``ledger.verify`` (``own_check`` and
  ``prior_checks`` write a rank's row; ``epoch_report`` and ``share_report`` read the rows).
- ``StreamRow``: ``streams.verify.verify_stream`` (a stream's gathered row).
- ``EpochReport`` (``RankLine``, ``WorkerLine``, ``PriorLine``, ``Coverage``, ``Verdict``):
  written by ``ledger.verify.epoch_report`` and ``streams.verify.key_report``; read by
  ``sinks.metrics.RankLogger.log_share_report`` (the ``shares/*`` keys and tables, the warning,
  the alerts), ``sinks.console.report_lines`` (the console block), ``kind`` (``verify``)
  and whoever calls ``streams.audited.Audited.verdict``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypedDict

if sys.version_info >= (3, 11):
    from typing import NotRequired
else:  # Python 3.10 (requires-python): typing has no NotRequired yet
    from typing_extensions import NotRequired

if TYPE_CHECKING:
    import numpy as np

WorkerTally = list[int]  # one loader worker's [samples, fingerprint], as checkpoints hold it
Definition = tuple[str, int, int, int, int]  # mode, N, W, L, a digest of the epoch's slots
Unread = tuple[int, list[str]]  # what a stream's loader worker left unread: count, first keys


class Tallied(TypedDict):
    """One rank's counts and fingerprints of (part of) an epoch, per loader worker too."""

    samples: int
    fingerprint: int
    workers: list[WorkerTally]
    derived: NotRequired[bool]  # fault_tolerance=live: a lost rank's, derived from the deal


class _Place(TypedDict):
    epoch: int
    position: int
    samples: int


class SavedLedger(_Place, total=False):
    """The checkpoint's ledger part: a ``Tallied`` at (epoch, position); no fingerprints while
    ``samples`` is 0."""

    fingerprint: int
    workers: list[WorkerTally]
    derived: bool  # fault_tolerance=live: a lost rank's, derived from the deal (its tally died)


class _Prefix(TypedDict):
    world_size: int
    position: int
    complete: bool  # its last step ran
    steps: int
    batch_size: int
    accumulate: int
    first_step: int


class PriorStretch(_Prefix, total=False):
    """A prefix of the current epoch read at another world size (elastic resume), in the
    checkpoint's progress part; ``ledgers`` (the old ranks', None until the ledger part loads)
    is left out of stretches.json."""

    ledgers: list[Tallied] | None


class WorkerCheck(TypedDict):
    """One loader worker of a rank's row, where the sampler deals workers ranges."""

    samples: int
    fingerprint: int
    expected: int  # the fingerprint of the worker's range of the plan


class PriorCheck(TypedDict):
    """An old rank's ledger of a ``PriorStretch``, checked by rank ``rank mod W``."""

    stretch: int
    world_size: int
    rank: int
    samples: int
    fingerprint: int
    expected: int
    derived: bool  # a lost rank's ledger, derived from the deal (fault_tolerance=live)


class _Counts(TypedDict):
    samples: int
    duplicates: int  # padding slots among them
    fingerprint: int


class Seen(_Counts, total=False):
    """What one rank read, as ``share_report`` weighs it."""

    workers: list[WorkerCheck]
    indices: np.ndarray  # only after a mismatch, where N <= share_report_max_n


class RankRow(Seen):
    """One rank's row of the epoch's gather (a few dozen bytes)."""

    expected: int  # the fingerprint of what its own sampler defines from ``start``
    definition: Definition  # its sampler's epoch, compared across ranks
    step_s: float
    start: int  # the position the epoch was resumed at
    kept: bool  # whether it kept its indices (gathered after a mismatch)
    prior: list[PriorCheck]  # the old ranks it checked


class StreamRow(TypedDict):
    """One rank's row of a stream's gather."""

    workers: list[WorkerTally]
    unread: list[Unread]
    step_s: float
    kept: bool  # whether it kept its key hashes


@dataclass(frozen=True)
class Verdict:
    """Whether every rank read what it should: ok, the problems found, or why nothing could be
    checked. ``str`` is what the logs say: ``ok``, ``MISMATCH: a; b`` or ``UNCHECKED: why``."""

    problems: tuple[str, ...] = ()
    unchecked: str | None = None
    # What the data's accounting holds beside ok or not: samples read whose update the spike
    # rule skipped (spike.skip), by step and index.
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems and self.unchecked is None

    def plus(self, problems: Sequence[str]) -> Verdict:
        return replace(self, problems=(*self.problems, *problems))

    def noted(self, notes: Sequence[str]) -> Verdict:
        return replace(self, notes=(*self.notes, *notes))

    def __str__(self) -> str:
        if self.problems:
            said = "MISMATCH: " + "; ".join(self.problems)
        else:
            said = "ok" if self.unchecked is None else f"UNCHECKED: {self.unchecked}"
        return said + "".join(f"; {note}" for note in self.notes)


@dataclass(frozen=True)
class Coverage:
    """How the epoch's reads covered the dataset."""

    fraction: float | None  # unique samples read / N (None: a stream of unknown size)
    covered: int  # unique samples read
    overlap: int  # samples read by more than one rank (a stream: (rank, worker) pair)
    repeats: int  # reads beyond the first of each sample


@dataclass(frozen=True)
class RankLine:
    """One rank in the report (a row of the ``shares/report`` table)."""

    rank: int
    samples: int
    duplicates: int  # padded (a stream: read twice)
    fingerprint: str
    matches: bool


@dataclass(frozen=True)
class WorkerLine:
    """One (rank, loader worker) in the report (a row of the ``shares/workers`` table)."""

    rank: int
    worker: int
    samples: int
    fingerprint: str
    duplicates: int | None  # a stream's: read twice (planned data: None, no column)
    matches: bool


@dataclass(frozen=True)
class PriorLine:
    """An old rank of a prefix in the report (a row of the ``shares/prior`` table)."""

    world_size: int
    rank: int
    samples: int
    fingerprint: str
    matches: bool
    derived: bool = False  # a lost rank's ledger, derived from the deal (fault_tolerance=live)


@dataclass(frozen=True)
class EpochReport:
    """Rank 0's verdict on one epoch, with what it rests on."""

    mode: str  # the sampler mode, or "stream"
    dataset_size: int
    ranks: list[RankLine]
    total_samples: int
    verdict: Verdict
    coverage: Coverage | None = None  # None: not derivable (a mismatch without the lists)
    workers: list[WorkerLine] = field(default_factory=list)
    prior: list[PriorLine] = field(default_factory=list)  # after a resize: the old ranks
    pads: list[str] = field(default_factory=list)  # sharded data: the keys padded, dropped
    drops: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)  # a stream's: keys left at uneven ends
    unread_samples: int | None = None  # a stream's: how many
    replayed: int | None = None  # a stream's: read before a resume and again after it
    hint: str | None = None  # the likely cause of a mismatch, where the kind knows better
    slowest_rank: int = 0
    step_s_max_over_min: float = math.nan

    def timed(self, step_s: Sequence[float], *, idle: float = math.nan) -> EpochReport:
        """With the ranks' step-time spread: the slowest rank's step time over the fastest's
        (``idle`` where the fastest rank's is 0)."""
        slowest = max(range(len(step_s)), key=step_s.__getitem__)
        fastest = min(step_s)
        ratio = step_s[slowest] / fastest if fastest > 0 else idle
        return replace(self, slowest_rank=slowest, step_s_max_over_min=ratio)
