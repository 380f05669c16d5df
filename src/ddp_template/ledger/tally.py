"""What each rank saw: index tallies and fingerprints.

The fingerprint is a sum of splitmix64 hashes modulo 2**64: independent of order and additive
across ranks, so rank 0 can check from a few numbers whether each rank saw
exactly the samples its sampler mode defines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ddp_template.ledger.records import SavedLedger, Tallied
from ddp_template.splitmix import splitmix64

_M64 = 2**64 - 1


def fingerprint_sum(indices: np.ndarray) -> int:
    """Sum of splitmix64 hashes mod 2**64, as a Python int."""
    if len(indices) == 0:
        return 0
    with np.errstate(over="ignore"):
        return int(splitmix64(indices).sum(dtype=np.uint64))


def fingerprint_hex(value: int) -> str:
    return f"{value & (2**64 - 1):016x}"


def fingerprint(indices: np.ndarray) -> str:
    """The 16-hex-digit fingerprint of a collection of dataset indices."""
    return fingerprint_hex(fingerprint_sum(indices))


@dataclass
class IndexTally:
    """Accumulates one rank's indices for one epoch without keeping them (unless asked).

    Batches are hashed in chunks of ``FOLD`` batches rather than one by one: per-batch numpy
    calls on tiny arrays cost microseconds that a small model's step notices. With ``workers``
    > 1 it also keeps a count and a fingerprint per loader worker: a DataLoader hands batches
    out round robin, so batch ``b`` came from worker ``(first_worker + b) mod workers``, unless
    ``add`` is told the worker (a stream's batches say which worker read them).
    """

    keep: bool = False  # keep the indices themselves (small N: exact coverage/overlap report)
    workers: int = 1
    first_worker: int = 0
    samples: int = 0
    batches: int = 0
    first_index: int = -1
    last_index: int = -1
    kept: list[np.ndarray] = field(default_factory=list)
    _fp: int = 0
    _pending: list[np.ndarray] = field(default_factory=list)
    worker_samples: list[int] = field(default_factory=list)
    _worker_fp: list[int] = field(default_factory=list)
    _pending_workers: list[int] = field(default_factory=list)
    kept_workers: list[np.ndarray] = field(default_factory=list)

    FOLD = 256

    def __post_init__(self) -> None:
        self.worker_samples = [0] * self.workers
        self._worker_fp = [0] * self.workers

    def add(self, indices: np.ndarray, worker: int | None = None) -> None:
        if len(indices) == 0:
            return
        if self.samples == 0:
            self.first_index = int(indices[0])
        self.last_index = int(indices[-1])
        if worker is None:
            worker = (self.first_worker + self.batches) % self.workers
        self.worker_samples[worker] += len(indices)
        self._pending_workers.append(worker)
        self.samples += len(indices)
        self.batches += 1
        self._pending.append(indices)
        if len(self._pending) >= self.FOLD:
            self._fold()

    def _fold(self) -> None:
        if not self._pending:
            return
        chunk = np.concatenate(self._pending).astype(np.int64, copy=False)
        owner = np.repeat(self._pending_workers, [len(p) for p in self._pending])
        if self.workers > 1:
            for w in range(self.workers):
                own = fingerprint_sum(chunk[owner == w])
                self._worker_fp[w] = (self._worker_fp[w] + own) & (2**64 - 1)
        self._pending.clear()
        self._pending_workers.clear()
        self._fp = (self._fp + fingerprint_sum(chunk)) & (2**64 - 1)
        if self.keep:
            self.kept.append(chunk)
            self.kept_workers.append(owner)

    @property
    def fp(self) -> int:
        """The fingerprint (sum of splitmix64 hashes mod 2**64) of everything added so far."""
        self._fold()
        return self._fp

    @property
    def worker_fps(self) -> list[int]:
        """Each loader worker's fingerprint (with one worker: the rank's)."""
        self._fold()
        return list(self._worker_fp) if self.workers > 1 else [self._fp]

    def indices(self) -> np.ndarray:
        self._fold()
        return np.concatenate(self.kept) if self.kept else np.zeros(0, dtype=np.int64)

    def worker_indices(self) -> list[np.ndarray]:
        """The kept indices of each loader worker."""
        every, owner = self.indices(), self._owners()
        return [every[owner == w] for w in range(self.workers)]

    def _owners(self) -> np.ndarray:
        return np.concatenate(self.kept_workers) if self.kept_workers else np.zeros(0, np.int64)


def join_ledgers(before: SavedLedger | None, tally: IndexTally) -> Tallied:
    """``tally``'s counts and fingerprints (per worker too), plus ``before``'s: the ledger of
    an epoch read partly before a resume (``before``, from the checkpoint) and partly after."""
    workers = [[n, fp] for n, fp in zip(tally.worker_samples, tally.worker_fps, strict=True)]
    joined = Tallied(samples=tally.samples, fingerprint=tally.fp, workers=workers)
    if before:
        joined["samples"] += before["samples"]
        joined["fingerprint"] = (joined["fingerprint"] + before["fingerprint"]) & _M64
        for mine, earlier in zip(workers, before["workers"], strict=True):
            mine[0] += earlier[0]
            mine[1] = (mine[1] + earlier[1]) & _M64
    return joined
