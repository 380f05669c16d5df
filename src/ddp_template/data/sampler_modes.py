"""``SAMPLER_MODES``: the one table of sampler modes, how each lays an epoch out over W ranks.

The config enum, the startup checks, the size checks, the sampler, the step arithmetic, the
share check and the shares picture all read it; docs/ARCHITECTURE.md states the semantics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class SlotRule(Protocol):
    """What a sampler reads of its mode's deal: ``ModeRule``'s members. A ``ModeRule`` is
    one; a sampler with a deal of its own (``optional.webdataset.plan.OrderRule``) gives the
    mode's lengths with its own ``slots``/``owners``."""

    @property
    def summary(self) -> str: ...
    @property
    def shuffles(self) -> bool: ...
    @property
    def drops_tail(self) -> bool: ...
    @property
    def contiguous(self) -> bool: ...
    @property
    def uneven(self) -> bool: ...
    def length(self, n: int, world: int) -> int: ...
    def rank_length(self, n: int, rank: int, world: int) -> int: ...
    def total(self, n: int, world: int) -> int: ...
    def slots(self, positions: np.ndarray, rank: int, length: int, world: int) -> np.ndarray: ...
    def owners(
        self, slots: np.ndarray, length: int, world: int
    ) -> tuple[np.ndarray, np.ndarray]: ...
    def real_positions(self, n: int, rank: int, length: int, world: int) -> int: ...


@dataclass(frozen=True)
class ModeRule:
    """How one sampler mode lays an epoch out over W ranks (one row of ``SAMPLER_MODES``).

    Slots ``j >= N`` of the global list are padding: they repeat ``perm(j mod N)``.
    """

    summary: str
    shuffles: bool  # may shuffle (the permutation applies to the slots)
    drops_tail: bool  # floor(N/W) per rank, the tail dropped; else ceil(N/W), the tail padded
    contiguous: bool  # rank r holds the block r*L..(r+1)*L-1; else the slots r, r+W, r+2W, ...
    # Rank r holds only its real slots, ceil or floor(N/W) of them: nothing padded or dropped.
    uneven: bool = False

    def length(self, n: int, world: int) -> int:
        """Positions per rank (L): the longest rank's list, the positions every rank steps
        through."""
        return n // world if self.drops_tail else ceil_div(n, world)

    def rank_length(self, n: int, rank: int, world: int) -> int:
        """Positions of ``rank``'s own list: L, or only its real ones in an uneven mode."""
        length = self.length(n, world)
        return self.real_positions(n, rank, length, world) if self.uneven else length

    def total(self, n: int, world: int) -> int:
        """Slots of the epoch over all ranks: N in an uneven mode, else W x L."""
        return n if self.uneven else self.length(n, world) * world

    def slots(self, positions: np.ndarray, rank: int, length: int, world: int) -> np.ndarray:
        """Global slot of each of ``rank``'s positions."""
        return rank * length + positions if self.contiguous else rank + positions * world

    def owners(self, slots: np.ndarray, length: int, world: int) -> tuple[np.ndarray, np.ndarray]:
        """(rank, position) holding each global slot: the inverse of ``slots``."""
        if self.contiguous:
            return slots // length, slots % length
        return slots % world, slots // world

    def real_positions(self, n: int, rank: int, length: int, world: int) -> int:
        """How many of ``rank``'s positions come before its first padding slot."""
        return max(0, n - rank * length if self.contiguous else ceil_div(n - rank, world))


SAMPLER_MODES = {
    "padded": ModeRule(
        summary="shuffled, the tail padded with repeats (DistributedSampler's default)",
        shuffles=True,
        drops_tail=False,
        contiguous=False,
    ),
    "drop_last": ModeRule(
        summary="shuffled, the tail dropped (DistributedSampler with drop_last=True)",
        shuffles=True,
        drops_tail=True,
        contiguous=False,
    ),
    "sequential": ModeRule(
        summary="contiguous shares, never shuffled, the tail padded",
        shuffles=False,
        drops_tail=False,
        contiguous=True,
    ),
    "exact": ModeRule(
        summary="shuffled, every sample exactly once: ranks hold ceil or floor(N/W)",
        shuffles=True,
        drops_tail=False,
        contiguous=False,
        uneven=True,
    ),
}
