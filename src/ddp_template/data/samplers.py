"""The training sampler, whose per-rank index lists are defined, not incidental.

`ShardSampler` reproduces `torch.utils.data.distributed.DistributedSampler` exactly in its
`padded` and `drop_last` modes (same seed + epoch -> same per-rank lists), adds libtorch's
`sequential` layout, a resumable position, and a keyed Feistel permutation that shuffles
huge datasets without materialising `randperm(N)`. `SAMPLER_MODES` is the one table of what
each mode does; docs/ARCHITECTURE.md states the semantics.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ddp_template.data.feistel import FeistelPermutation


@dataclass(frozen=True)
class ModeRule:
    """How one sampler mode lays an epoch out over W ranks (one row of ``SAMPLER_MODES``).

    Slots ``j >= N`` of the global list are padding: they repeat ``perm(j mod N)``.
    """

    summary: str
    shuffles: bool  # may shuffle (the permutation applies to the slots)
    drops_tail: bool  # floor(N/W) per rank, the tail dropped; else ceil(N/W), the tail padded
    contiguous: bool  # rank r holds the block r*L..(r+1)*L-1; else the slots r, r+W, r+2W, ...

    def length(self, n: int, world: int) -> int:
        """Positions per rank (L)."""
        return n // world if self.drops_tail else _ceil_div(n, world)

    def slots(self, positions: np.ndarray, rank: int, length: int, world: int) -> np.ndarray:
        """Global slot of each of ``rank``'s positions."""
        return rank * length + positions if self.contiguous else rank + positions * world

    def real_positions(self, n: int, rank: int, length: int, world: int) -> int:
        """How many of ``rank``'s positions come before its first padding slot."""
        return max(0, n - rank * length if self.contiguous else _ceil_div(n - rank, world))


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
        summary="contiguous shards, never shuffled, the tail padded",
        shuffles=False,
        drops_tail=False,
        contiguous=True,
    ),
}
_FIRST_BLOCK = 1024  # small first block: the first index arrives in well under a millisecond
_MAX_BLOCK = 16384  # later blocks: amortise numpy overhead, yet keep temporaries ~1 MiB
PERMUTATIONS = ("auto", "randperm", "feistel")

# `permutation="auto"` keeps torch's randperm (bit-identical to DistributedSampler, so existing
# results stay reproducible) below this size and switches to the Feistel permutation at and
# above it. Measured on a 2-core CPU, W=8 (benchmarks/sampler_results.md): randperm here costs
# ~0.25 s and ~77 MiB per rank per epoch at N=1e7 (so ~0.45 s and 128 MiB at 2**24) and grows
# linearly (1e8: 3.6 s, 763 MiB; torch's own sampler: 10-13 s, 4.6 GiB), while Feistel needs
# < 1 ms and ~1 MiB at any N. Up to 2**24 the cost is small next to an epoch of that many
# samples, so exact reproducibility wins; beyond it the per-epoch stall and memory do not pay.
AUTO_FEISTEL_THRESHOLD = 2**24


def resolve_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """World size and rank from the arguments, else from the initialised process group."""
    if num_replicas is None or rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "num_replicas and rank were not given and torch.distributed is not initialised; "
                "pass num_replicas= and rank= or call init_process_group first."
            )
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        rank = dist.get_rank() if rank is None else rank
    if num_replicas < 1:
        raise ValueError(f"Invalid num_replicas {num_replicas}, it should be >= 1")
    if rank >= num_replicas or rank < 0:
        raise ValueError(
            f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
        )
    return num_replicas, rank


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class ShardSampler(Sampler[int]):
    """Drop-in DistributedSampler with explicit modes, O(1)-memory shuffling and resumption.

    The rank's epoch list is defined through a global list of `total_size` slots: slot j holds
    dataset index perm(j mod N). `padded`/`drop_last` give rank r the slots r, r+W, r+2W, ...
    (exactly torch's layout); `sequential` gives it the block r*L ... (r+1)*L-1 unshuffled.
    Slots j >= N are padding (repeats). Everything is computed per position, so iteration,
    resumption and the padding count never need the whole list.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        *,
        mode: str = "padded",
        permutation: str = "auto",
    ) -> None:
        mode = str(mode)
        if mode not in SAMPLER_MODES:
            choices = ", ".join(SAMPLER_MODES)
            raise ValueError(f"Unknown sampler mode {mode!r}; choose one of {choices}.")
        if permutation not in PERMUTATIONS:
            raise ValueError(
                f"Unknown permutation {permutation!r}; choose one of {', '.join(PERMUTATIONS)}."
            )
        self.rule = SAMPLER_MODES[mode]
        if shuffle and not self.rule.shuffles:
            raise ValueError(
                f"Sampler mode {mode!r} does not shuffle, but shuffle=True was given; "
                "set shuffle=False (or pick mode 'padded' or 'drop_last')."
            )
        self.num_replicas, self.rank = resolve_world(num_replicas, rank)
        self.dataset = dataset
        self.dataset_size = len(dataset)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.mode = mode
        self.epoch = 0
        if permutation == "auto":
            big = self.dataset_size >= AUTO_FEISTEL_THRESHOLD
            permutation = "feistel" if big else "randperm"
        self.permutation = permutation
        n, w = self.dataset_size, self.num_replicas
        self.num_samples = self.rule.length(n, w)
        self.total_size = self.num_samples * w
        self._start = 0  # pending resume offset, consumed by the next __iter__
        self._perm_cache: tuple[int, Any] | None = None

    # ----------------------------------------------------------------- epoch & length
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's shuffle; a pending resume offset survives only the same epoch."""
        if epoch != self.epoch:
            self._start = 0
        self.epoch = epoch

    def __len__(self) -> int:
        """Number of indices the next __iter__ yields (less than num_samples after a resume)."""
        return self.num_samples - self._start

    def __iter__(self) -> Iterator[int]:
        start, self._start = self._start, 0
        # Snapshot the epoch's permutation now, so a set_epoch during iteration cannot mix epochs.
        return self._iterate(start, self._permutation())

    def _iterate(self, start: int, perm: Any) -> Iterator[int]:
        block, pos = _FIRST_BLOCK, start
        while pos < self.num_samples:
            stop = min(pos + block, self.num_samples)
            slots = self._slots(np.arange(pos, stop, dtype=np.int64), self.rank)
            yield from self._lookup(slots, perm).tolist()
            pos, block = stop, min(2 * block, _MAX_BLOCK)

    # ----------------------------------------------------------------- index arithmetic
    def _permutation(self) -> Any:
        """The epoch's permutation: None (identity), a randperm array or a FeistelPermutation."""
        if not self.shuffle or self.dataset_size == 0:
            return None
        if self._perm_cache is None or self._perm_cache[0] != self.epoch:
            if self.permutation == "randperm":
                g = torch.Generator()
                g.manual_seed(self.seed + self.epoch)  # exactly DistributedSampler's seeding
                perm: Any = torch.randperm(self.dataset_size, generator=g).numpy()
            else:
                perm = FeistelPermutation(self.dataset_size, self.seed, self.epoch)
            self._perm_cache = (self.epoch, perm)
        return self._perm_cache[1]

    def _rank(self, rank: int | None) -> int:
        if rank is None:
            return self.rank
        if not 0 <= rank < self.num_replicas:
            raise ValueError(f"Invalid rank {rank}, expected 0 <= rank < {self.num_replicas}.")
        return rank

    def _slots(self, positions: np.ndarray, rank: int) -> np.ndarray:
        """Global slot of each of this rank's positions (validated to lie in the epoch)."""
        if positions.size and (positions.min() < 0 or positions.max() >= self.num_samples):
            raise IndexError(f"Positions must lie in [0, {self.num_samples}) for this sampler.")
        return self.rule.slots(positions, rank, self.num_samples, self.num_replicas)

    def _lookup(self, slots: np.ndarray, perm: Any) -> np.ndarray:
        """Dataset index held by each global slot: perm(slot mod N)."""
        base = slots % self.dataset_size if self.dataset_size else slots
        if perm is None:
            return base
        return perm[base] if isinstance(perm, np.ndarray) else perm(base)

    def index_at(self, positions: np.ndarray, rank: int | None = None) -> np.ndarray:
        """This rank's dataset indices (int64) at the given positions of the current epoch."""
        positions = np.asarray(positions, dtype=np.int64)
        return self._lookup(self._slots(positions, self._rank(rank)), self._permutation())

    def rank_indices(self, rank: int | None = None) -> np.ndarray:
        """A rank's whole current-epoch list; materialises it, so meant for tests and reports."""
        return self.index_at(np.arange(self.num_samples, dtype=np.int64), rank)

    def is_padding(self, positions: np.ndarray, rank: int | None = None) -> np.ndarray:
        """True where a position holds a padding slot (a repeat of an earlier index)."""
        positions = np.asarray(positions, dtype=np.int64)
        return self._slots(positions, self._rank(rank)) >= self.dataset_size

    def padding_in_prefix(self, n: int, rank: int | None = None) -> int:
        """How many of a rank's first n positions are padding; O(1), for `data/duplicates`."""
        rank = self._rank(rank)
        n = max(0, min(n, self.num_samples))
        rule, size = self.rule, self.dataset_size
        real = rule.real_positions(size, rank, self.num_samples, self.num_replicas)
        return max(0, n - real)

    # ----------------------------------------------------------------- resumption
    def state_dict(self, position: int = 0) -> dict[str, Any]:
        """Where to resume: `position` = indices of this epoch's list the loop has consumed.

        Only the training loop knows `position` (the DataLoader prefetches ahead of it). It
        counts from the start of the epoch's list, including any offset this sampler resumed at.
        """
        if not 0 <= position <= self.num_samples:
            raise ValueError(
                f"position={position} is outside this rank's epoch [0, {self.num_samples}]; "
                "pass the number of indices consumed this epoch."
            )
        return {
            "epoch": int(self.epoch),
            "position": int(position),
            "mode": self.mode,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "permutation": self.permutation,
            "dataset_size": int(self.dataset_size),
            "num_replicas": int(self.num_replicas),
            "rank": int(self.rank),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next __iter__ (only that one) starts at the saved position."""
        keys = ["mode", "seed", "shuffle", "dataset_size", "num_replicas", "rank"]
        if self.shuffle:
            keys.append("permutation")  # without shuffling the order is the identity anyway
        for key in [*keys, "epoch", "position"]:
            if key not in state:
                raise ValueError(f"Sampler state_dict is missing key {key!r}; it cannot resume.")
        for key in keys:
            saved, current = state[key], getattr(self, key)
            if saved != current:
                raise ValueError(
                    f"Sampler state_dict key {key!r} was saved as {saved!r} but this sampler has "
                    f"{current!r}; resume with {key}={saved!r} or start a fresh run."
                )
        position = int(state["position"])
        if not 0 <= position <= self.num_samples:
            raise ValueError(
                f"Sampler state_dict key 'position' is {position}, outside [0, "
                f"{self.num_samples}]; the checkpoint does not belong to this sampler."
            )
        self.epoch = int(state["epoch"])
        self._start = position
