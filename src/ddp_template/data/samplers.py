"""Training and evaluation samplers whose per-rank index lists are defined, not incidental.

`ShardSampler` reproduces `torch.utils.data.distributed.DistributedSampler` exactly in its
`padded` and `drop_last` modes (same seed + epoch -> same per-rank lists), adds libtorch's
`sequential` layout, a resumable position, and a keyed Feistel permutation that shuffles
huge datasets without materialising `randperm(N)` (see DESIGN.md §3).
`EvalShardSampler` gives evaluation contiguous, unpadded shards so metrics summed over ranks
equal the single-process result exactly (DESIGN.md §4).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

MODES = ("padded", "drop_last", "sequential")
PERMUTATIONS = ("auto", "randperm", "feistel")

# `permutation="auto"` keeps torch's randperm (bit-identical to DistributedSampler, so existing
# results stay reproducible) below this size and switches to the Feistel permutation at and
# above it. Measured on a 2-core CPU, W=8 (benchmarks/sampler_results.md): randperm here costs
# ~0.25 s and ~77 MiB per rank per epoch at N=1e7 (so ~0.45 s and 128 MiB at 2**24) and grows
# linearly (1e8: 3.6 s, 763 MiB; torch's own sampler: 10-13 s, 4.6 GiB), while Feistel needs
# < 1 ms and ~1 MiB at any N. Up to 2**24 the cost is small next to an epoch of that many
# samples, so exact reproducibility wins; beyond it the per-epoch stall and memory do not pay.
AUTO_FEISTEL_THRESHOLD = 2**24

_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_FEISTEL_ROUNDS = 8
_FIRST_BLOCK = 1024  # small first block: the first index arrives in well under a millisecond
_MAX_BLOCK = 16384  # later blocks: amortise numpy overhead, yet keep temporaries ~1 MiB
_C1 = np.uint64(0x9E3779B97F4A7C15)
_C2 = np.uint64(0xBF58476D1CE4E5B9)
_C3 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: int) -> int:
    """SplitMix64 on Python ints: derives independent-looking round keys from (seed, epoch)."""
    x = (x + _GAMMA) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class FeistelPermutation:
    """A keyed bijection of range(n) evaluated pointwise: O(1) memory, vectorised over arrays.

    An unbalanced Feistel network permutes [0, 2**b) with 2**b the next power of two >= n;
    cycle-walking (re-encrypting values that land >= n) restricts it to a bijection of [0, n).
    Because 2**b < 2n, a value needs fewer than two encryptions on average.
    """

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        if n < 1:
            raise ValueError(f"FeistelPermutation needs n >= 1, got n={n}.")
        if n > 2**63:
            raise ValueError(f"FeistelPermutation supports n <= 2**63 (int64 results), got n={n}.")
        self.n = n
        bits = (n - 1).bit_length()
        self._left_bits = bits // 2
        self._right_bits = bits - self._left_bits
        base = _splitmix64(_splitmix64(seed & _M64) ^ (epoch & _M64))
        self._keys = [np.uint64(_splitmix64((base + i) & _M64)) for i in range(_FEISTEL_ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        """One pass over [0, 2**b); half widths swap each round, restored after an even count."""
        right_bits = self._right_bits
        left = x >> np.uint64(right_bits)
        right = x & np.uint64((1 << right_bits) - 1)
        widths = (self._left_bits, right_bits)
        for key in self._keys:
            f = right * _C1
            f += key
            f ^= f >> np.uint64(31)
            f *= _C2
            f ^= f >> np.uint64(29)
            f *= _C3
            f ^= f >> np.uint64(32)
            f &= np.uint64((1 << widths[0]) - 1)
            f ^= left
            left, right = right, f
            widths = (widths[1], widths[0])
        return (left << np.uint64(right_bits)) | right

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Permuted values of x (integers in [0, n)), as int64."""
        y = self._encrypt(np.asarray(x, dtype=np.uint64))
        outside = np.flatnonzero(y >= np.uint64(self.n))
        while outside.size:
            walked = self._encrypt(y[outside])
            y[outside] = walked
            outside = outside[walked >= np.uint64(self.n)]
        return y.astype(np.int64)


def _resolve_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
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
        mode: str = "padded",
        permutation: str = "auto",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"Unknown sampler mode {mode!r}; choose one of {', '.join(MODES)}.")
        if permutation not in PERMUTATIONS:
            raise ValueError(
                f"Unknown permutation {permutation!r}; choose one of {', '.join(PERMUTATIONS)}."
            )
        if mode == "sequential" and shuffle:
            raise ValueError(
                "Sampler mode 'sequential' does not shuffle, but shuffle=True was given; "
                "set shuffle=False (or pick mode 'padded' or 'drop_last')."
            )
        self.num_replicas, self.rank = _resolve_world(num_replicas, rank)
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
        self.num_samples = n // w if mode == "drop_last" else _ceil_div(n, w)
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
        if not self.shuffle or self.mode == "sequential" or self.dataset_size == 0:
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
        if self.mode == "sequential":
            return rank * self.num_samples + positions
        return rank + positions * self.num_replicas

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
        size = self.dataset_size
        if self.mode == "drop_last":
            return 0
        if self.mode == "sequential":
            first = size - rank * self.num_samples
        else:
            first = _ceil_div(size - rank, self.num_replicas)
        return max(0, n - max(0, first))

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


class EvalShardSampler(Sampler[int]):
    """Exact evaluation sharding: contiguous, unpadded, every index exactly once.

    Rank r gets range(r*N//W, (r+1)*N//W), so shard sizes differ by at most one and some are
    empty when N < W; summing metrics over ranks then equals the single-process result.
    """

    def __init__(
        self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None
    ) -> None:
        self.num_replicas, self.rank = _resolve_world(num_replicas, rank)
        self.dataset = dataset
        self.dataset_size = len(dataset)
        self.start = self.rank * self.dataset_size // self.num_replicas
        self.stop = (self.rank + 1) * self.dataset_size // self.num_replicas

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))
