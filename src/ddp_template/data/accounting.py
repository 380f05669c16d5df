"""What each rank saw: index tallies and fingerprints.

The fingerprint is a sum of splitmix64 hashes modulo 2**64: independent of order and additive
across ranks, so rank 0 can check from a few numbers whether each rank saw
exactly the samples its sampler mode defines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ddp_template.data.splitmix import splitmix64


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
    calls on tiny arrays cost microseconds that a small model's step notices.
    """

    keep: bool = False  # keep the indices themselves (small N: exact coverage/overlap report)
    samples: int = 0
    batches: int = 0
    first_index: int = -1
    last_index: int = -1
    kept: list[np.ndarray] = field(default_factory=list)
    _fp: int = 0
    _pending: list[np.ndarray] = field(default_factory=list)

    FOLD = 256

    def add(self, indices: np.ndarray) -> None:
        if len(indices) == 0:
            return
        if self.samples == 0:
            self.first_index = int(indices[0])
        self.last_index = int(indices[-1])
        self.samples += len(indices)
        self.batches += 1
        self._pending.append(indices)
        if len(self._pending) >= self.FOLD:
            self._fold()

    def _fold(self) -> None:
        if not self._pending:
            return
        chunk = np.concatenate(self._pending).astype(np.int64, copy=False)
        self._pending.clear()
        self._fp = (self._fp + fingerprint_sum(chunk)) & (2**64 - 1)
        if self.keep:
            self.kept.append(chunk)

    @property
    def fp(self) -> int:
        """The fingerprint (sum of splitmix64 hashes mod 2**64) of everything added so far."""
        self._fold()
        return self._fp

    def indices(self) -> np.ndarray:
        self._fold()
        return np.concatenate(self.kept) if self.kept else np.zeros(0, dtype=np.int64)
