"""The rest of an epoch after a prefix read at another world size: what elastic resume deals.

An epoch's order is a function of (seed, epoch, N) alone; only the dealing of its slots to W
ranks depends on W. When a run stops mid-epoch at position p (every rank has consumed p
positions of its list) and resumes at W' ranks, the samples the prefix did not consume are a
sequence R of M dataset indices, in the epoch's own order, and the sampler mode deals R over W'
by its usual rules (padding or dropping only what it defines for M samples at W').

Each ``Prefix`` maps the rest's positions ``k`` in [0, M) to positions of the sequence it was
cut from (the epoch's slots, or an earlier rest when a run resized twice in one epoch), in
O(W) memory whatever N is:

- strided modes (``padded``, ``drop_last``, ``exact``): the prefix consumed the slots
  [0, p·W), so R is the slots [p·W, n) in order (``drop_last``'s dropped tail included: the
  mode drops only what it defines at W');
- contiguous (``sequential``): rank r consumed [r·L, r·L + p), so R is the ranks' unread
  blocks [r·L + p, min((r+1)·L, n)), rank by rank.

A prefix that ended its epoch (``complete``: its last step ran) leaves nothing to deal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ddp_template.data.sampler_modes import SlotRule


@dataclass(frozen=True, kw_only=True)
class Prefix:
    """Positions [0, ``position``) of every list of an epoch's deal over ``world`` ranks of a
    sequence of ``n`` samples, consumed; ``size`` samples of it are left."""

    rule: SlotRule
    n: int
    world: int
    position: int
    complete: bool = False

    @property
    def _length(self) -> int:
        return self.rule.length(self.n, self.world)

    def _blocks(self) -> tuple[np.ndarray, np.ndarray]:
        """Contiguous deal: each rank's first unread slot and its unread count."""
        length = self._length
        ranks = np.arange(self.world, dtype=np.int64)
        lo = ranks * length + self.position
        hi = np.minimum((ranks + 1) * length, self.n)
        return lo, np.maximum(hi - lo, 0)

    @property
    def size(self) -> int:
        """M: the samples the prefix left unread."""
        if self.complete:
            return 0
        if self.rule.contiguous:
            return int(self._blocks()[1].sum())
        return max(0, self.n - self.position * self.world)

    def source(self, k: np.ndarray) -> np.ndarray:
        """The position in the cut sequence of each rest position ``k`` (in [0, size))."""
        if not self.rule.contiguous:
            return k + self.position * self.world
        lo, counts = self._blocks()
        starts = np.cumsum(counts) - counts
        owner = np.searchsorted(starts, k, side="right") - 1  # past empty blocks' equal starts
        return lo[owner] + (k - starts[owner])

    def rest_of(self, j: np.ndarray) -> np.ndarray:
        """The rest position of each cut-sequence position ``j``, or -1 where it was consumed."""
        if self.complete:
            return np.full_like(j, -1)
        if not self.rule.contiguous:
            k = j - self.position * self.world
            return np.where((k >= 0) & (j < self.n), k, -1)
        lo, counts = self._blocks()
        starts = np.cumsum(counts) - counts
        rank = np.minimum(j // max(self._length, 1), self.world - 1)
        offset = j - lo[rank]
        unread = (offset >= 0) & (offset < counts[rank]) & (j < self.n)
        return np.where(unread, starts[rank] + offset, -1)

    def as_record(self) -> dict[str, Any]:
        return {"world_size": self.world, "position": self.position, "complete": self.complete}


def prefixes(rule: SlotRule, n: int, records: list[dict[str, Any]]) -> list[Prefix]:
    """The chain of prefixes one epoch was read in before this deal (oldest first), from
    their records (``world_size``, ``position``, ``complete``): each cuts what the one before
    it left."""
    chain = []
    for record in records:
        prefix = Prefix(
            rule=rule,
            n=n,
            world=int(record["world_size"]),
            position=int(record["position"]),
            complete=bool(record["complete"]),
        )
        chain.append(prefix)
        n = prefix.size
    return chain


def to_slots(chain: list[Prefix], k: np.ndarray) -> np.ndarray:
    """The epoch slot (in [0, N)) each position of the newest rest holds."""
    for prefix in reversed(chain):
        k = prefix.source(k)
    return k


def from_slots(chain: list[Prefix], j: np.ndarray) -> np.ndarray:
    """The newest rest's position of each epoch slot, or -1 where a prefix consumed it."""
    for prefix in chain:
        j = np.where(j >= 0, prefix.rest_of(np.maximum(j, 0)), -1)
    return j
