"""The training sampler, whose per-rank index lists are defined, not incidental.

`ShareSampler` is a `torch.utils.data.distributed.DistributedSampler` (a subclass, same
arguments) giving torch's exact lists in its `padded` and `drop_last` modes, plus libtorch's
`sequential` deal, the `exact` deal (every sample once, no padding, no drop), a resumable
position (torchdata's stateful protocol too) and a keyed
Feistel permutation that shuffles huge datasets without materialising `randperm(N)`.
`data.sampler_modes.SAMPLER_MODES` is the one table of the modes; docs/ARCHITECTURE.md states
the semantics.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data.distributed import DistributedSampler

from ddp_template.data.feistel import FeistelPermutation
from ddp_template.data.rest import Prefix, from_slots, prefixes, to_slots
from ddp_template.data.sampler_args import as_bool, as_int, as_positions, resolve_world
from ddp_template.data.sampler_modes import SAMPLER_MODES, SlotRule
from ddp_template.data.sampler_state import resume_point, state_of

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


def _resolve_mode(mode: Any, drop_last: bool) -> str:
    """The mode as a plain str: ``None`` means DistributedSampler's choice from ``drop_last``."""
    if mode is None:
        return "drop_last" if drop_last else "padded"
    mode = str(mode)  # a config enum member -> its plain value
    if mode not in SAMPLER_MODES:
        choices = ", ".join(SAMPLER_MODES)
        raise ValueError(f"Unknown sampler mode {mode!r}; choose one of {choices}.")
    if drop_last and not SAMPLER_MODES[mode].drops_tail:
        keeps = "keeps every sample" if SAMPLER_MODES[mode].uneven else "pads the tail"
        raise ValueError(
            f"drop_last=True contradicts mode={mode!r}, which {keeps}; pass "
            f"mode='drop_last' (or no mode) with drop_last=True, or drop_last=False."
        )
    return mode


class ShareSampler(DistributedSampler[int]):
    """DistributedSampler with explicit modes, O(1)-memory shuffling and a resumable position.

    The rank's epoch list is defined through a global list of `total_size` slots: slot j holds
    dataset index perm(j mod N). `padded`/`drop_last` give rank r the slots r, r+W, r+2W, ...
    (exactly torch's deal); `sequential` gives it the block r*L ... (r+1)*L-1 unshuffled;
    `exact` deals the N slots as `padded` does but stops at slot N-1, so `num_samples` (this
    rank's own length) is ceil or floor(N/W) and `epoch_length` (the longest list, the positions
    every rank steps through) may exceed it. Slots j >= N are padding (repeats). Everything is
    computed per position, so iteration, resumption and the padding count never need the whole
    list.

    The arguments are DistributedSampler's, in its order, then keyword-only `mode` and
    `permutation`. Without `mode`, `drop_last` picks `drop_last` or `padded` as torch does; a
    padding mode with `drop_last=True` is refused. `.drop_last` is True exactly when the tail
    is dropped. DistributedSampler.__init__ only stores arguments and two lengths (O(1)).
    The sampler counts what it has yielded (`yielded`, as torchdata names it): see state_dict.
    """

    rule: SlotRule  # the mode's deal (SAMPLER_MODES[mode]), or a subclass's own

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        mode: str | None = None,
        permutation: str = "auto",
    ) -> None:
        shuffle, seed = as_bool("shuffle", shuffle), as_int("seed", seed)
        mode = _resolve_mode(mode, as_bool("drop_last", drop_last))
        if permutation not in PERMUTATIONS:
            raise ValueError(
                f"Unknown permutation {permutation!r}; choose one of {', '.join(PERMUTATIONS)}."
            )
        rule = SAMPLER_MODES[mode]
        if shuffle and not rule.shuffles:
            raise ValueError(
                f"Sampler mode {mode!r} does not shuffle, but shuffle=True was given; "
                "set shuffle=False (or pick mode 'padded' or 'drop_last')."
            )
        num_replicas, rank = resolve_world(num_replicas, rank)
        # torch's stub asks a Dataset; DistributedSampler only takes len() of it (a Sized)
        super().__init__(
            dataset,  # type: ignore[arg-type]
            num_replicas,
            rank,
            shuffle,
            seed,
            drop_last=rule.drops_tail,
        )
        self.rule, self.mode = rule, mode
        self.base_size = self.dataset_size = len(dataset)
        if permutation == "auto":
            big = self.base_size >= AUTO_FEISTEL_THRESHOLD
            permutation = "feistel" if big else "randperm"
        self.permutation = str(permutation)
        # An epoch resumed at another world size: (epoch, its prefixes' records, their chain).
        self._rest: tuple[int, list[dict[str, Any]], list[Prefix]] | None = None
        self._lay_out()
        self.next_yielded: int | None = None  # a pending resume offset, for the next __iter__
        self.yielded = 0
        self._iterator_token: object | None = None
        self._perm_cache: tuple[int, Any] | None = None

    # ----------------------------------------------------------------- epoch & length
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's shuffle; a pending resume offset survives only the same epoch."""
        epoch = as_int("epoch", epoch)
        if epoch != self.epoch:  # an iterator still running over the old epoch stops counting
            self.next_yielded, self.yielded, self._iterator_token = None, 0, None
        self.epoch = epoch
        self._lay_out()

    def continue_epoch(self, epoch: int, prior: list[dict[str, Any]]) -> None:
        """Deal only the rest of ``epoch``: what the prefixes in ``prior`` (records of
        ``data.rest.Prefix``, oldest first: each read at another world size) left unread."""
        epoch = as_int("epoch", epoch)
        records = [{k: p[k] for k in ("world_size", "position", "complete")} for p in prior]
        self._rest = (epoch, records, prefixes(self.rule, self.base_size, records))
        self._lay_out()

    @property
    def prior(self) -> list[dict[str, Any]]:
        """The current epoch's prefixes read at other world sizes (none in a plain epoch)."""
        return list(self._rest[1]) if self._rest and self._rest[0] == self.epoch else []

    def prefix_sampler(self, i: int) -> ShareSampler:
        """The sampler that dealt this epoch's ``i``-th prefix (its world size, rank 0): what
        the old ranks' ledgers are checked against."""
        prior = self.prior
        sampler = ShareSampler(
            range(self.base_size),
            prior[i]["world_size"],
            0,
            shuffle=self.shuffle,
            seed=self.seed,
            mode=self.mode,
            permutation=self.permutation,
        )
        sampler.set_epoch(self.epoch)
        if i:
            sampler.continue_epoch(self.epoch, prior[:i])
        return sampler

    def _chain(self) -> list[Prefix]:
        return self._rest[2] if self._rest and self._rest[0] == self.epoch else []

    def _lay_out(self) -> None:
        """The lengths of the current epoch: over N samples, or over the M its prefixes left."""
        chain = self._chain()
        self.dataset_size = chain[-1].size if chain else self.base_size
        self.epoch_length = self.rule.length(self.dataset_size, self.num_replicas)
        self.num_samples = self.length_of(self.rank)
        self.total_size = self.rule.total(self.dataset_size, self.num_replicas)

    def __len__(self) -> int:
        """Number of indices the next __iter__ yields (less than num_samples after a resume)."""
        return max(0, self.num_samples - (self.next_yielded or 0))

    @property
    def yielded(self) -> int:
        """Indices of this epoch's list yielded so far, counting the offset resumed at."""
        pending = operator.length_hint(self._block) if self._block is not None else 0
        return self._block_end - pending

    @yielded.setter
    def yielded(self, value: int) -> None:
        self._block: Iterator[int] | None = None
        self._block_end = as_int("yielded", value)

    def __iter__(self) -> Iterator[int]:
        start, self.next_yielded = min(self.next_yielded or 0, self.num_samples), None
        self.yielded = start
        token = self._iterator_token = object()  # only the newest iterator keeps the count
        # Snapshot the epoch's permutation now, so a set_epoch during iteration cannot mix epochs.
        return self._iterate(start, self._permutation(), token)

    def _iterate(self, start: int, perm: Any, token: object) -> Iterator[int]:
        block, pos = _FIRST_BLOCK, start
        while pos < self.num_samples:
            stop = min(pos + block, self.num_samples)
            slots = self._slots(np.arange(pos, stop, dtype=np.int64), self.rank)
            values = iter(self._lookup(slots, perm).tolist())
            if self._iterator_token is token:  # counted per block: no per-index bookkeeping
                self._block, self._block_end = values, stop
            yield from values
            pos, block = stop, min(2 * block, _MAX_BLOCK)

    # ----------------------------------------------------------------- index arithmetic
    def _permutation(self) -> Any:
        """The epoch's permutation: None (identity), a randperm array or a FeistelPermutation."""
        if not self.shuffle or self.base_size == 0:
            return None
        if self._perm_cache is None or self._perm_cache[0] != self.epoch:
            if self.permutation == "randperm":
                g = torch.Generator()
                g.manual_seed(self.seed + self.epoch)  # exactly DistributedSampler's seeding
                perm: Any = torch.randperm(self.base_size, generator=g).numpy()
            else:
                perm = FeistelPermutation(self.base_size, self.seed, self.epoch)
            self._perm_cache = (self.epoch, perm)
        return self._perm_cache[1]

    def length_of(self, rank: int) -> int:
        """Positions of ``rank``'s list this epoch (``num_samples`` for this rank)."""
        return self.rule.rank_length(self.dataset_size, rank, self.num_replicas)

    @property
    def rank_lengths(self) -> tuple[int, ...]:
        """Every rank's list length, in rank order: equal but in an uneven mode."""
        return tuple(self.length_of(r) for r in range(self.num_replicas))

    def _rank(self, rank: int | None) -> int:
        if rank is None:
            return self.rank
        rank = as_int("rank", rank)
        if not 0 <= rank < self.num_replicas:
            raise ValueError(f"Invalid rank {rank}, expected 0 <= rank < {self.num_replicas}.")
        return rank

    def _slots(self, positions: np.ndarray, rank: int) -> np.ndarray:
        """Global slot of each of ``rank``'s positions (validated to lie in its list)."""
        length = self.length_of(rank)
        if positions.size and (positions.min() < 0 or positions.max() >= length):
            raise IndexError(f"Positions must lie in [0, {length}) for rank {rank}'s list.")
        return self.rule.slots(positions, rank, self.epoch_length, self.num_replicas)

    def _lookup(self, slots: np.ndarray, perm: Any) -> np.ndarray:
        """Dataset index held by each global slot: perm(slot mod N) (after a resize, the slot
        of the epoch the rest's slot mod M stands for)."""
        base = slots % self.dataset_size if self.dataset_size else slots
        if chain := self._chain():
            base = to_slots(chain, base)
        if perm is None:
            return base
        return perm[base] if isinstance(perm, np.ndarray) else perm(base)

    def index_at(self, positions: Any, rank: int | None = None) -> np.ndarray:
        """A rank's dataset indices (int64, positions' shape) at positions of the current epoch."""
        positions = as_positions(positions)
        return self._lookup(self._slots(positions, self._rank(rank)), self._permutation())

    def locate(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Every (rank, position) of this epoch reading dataset ``index``: slot perm^-1(index)
        and its padding repeats every N slots; O(1) without shuffling or with Feistel."""
        index = as_int("index", index)
        if not 0 <= index < self.base_size:
            raise IndexError(f"index={index} is outside the dataset [0, {self.base_size}).")
        perm = self._permutation()
        if perm is None:
            first = index
        elif isinstance(perm, np.ndarray):
            first = int(np.flatnonzero(perm == index)[0])
        else:
            first = int(perm.inverse(index))
        if chain := self._chain():  # -1: a prefix read it before the resize
            first = int(from_slots(chain, np.array([first], dtype=np.int64))[0])
            if first < 0:
                return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        slots = np.arange(first, self.total_size, self.dataset_size, dtype=np.int64)
        return self.rule.owners(slots, self.epoch_length, self.num_replicas)

    def rank_indices(self, rank: int | None = None) -> np.ndarray:
        """A rank's whole current-epoch list; materialises it, so meant for tests and reports."""
        rank = self._rank(rank)
        return self.index_at(np.arange(self.length_of(rank), dtype=np.int64), rank)

    def is_padding(self, positions: Any, rank: int | None = None) -> np.ndarray:
        """True where a position holds a padding slot (a repeat of an earlier index)."""
        positions = as_positions(positions)
        return self._slots(positions, self._rank(rank)) >= self.dataset_size

    def worker_lanes(self, position: int) -> tuple[int, int]:
        """(workers, the worker of the first batch) for a tally of the epoch from here: one
        lane, since this sampler deals no ranges to loader workers (the plan of tar shards
        does)."""
        return 1, 0

    def tail_names(self) -> dict[str, list[str]]:
        """The epoch's pads and drops by name: none, since map-style samples have no key to
        name them by (the plan of tar shards names its samples' ``__key__``)."""
        return {"pads": [], "drops": []}

    def padding_in_prefix(self, n: int, rank: int | None = None) -> int:
        """How many of a rank's first n positions are padding; O(1), for `data/duplicates`."""
        rank = self._rank(rank)
        n = max(0, min(as_int("n", n), self.length_of(rank)))
        rule, size = self.rule, self.dataset_size
        real = rule.real_positions(size, rank, self.epoch_length, self.num_replicas)
        return max(0, n - real)

    # ----------------------------------------------------------------- resumption
    def state_dict(self, position: int | None = None) -> dict[str, Any]:
        """Where to resume: `position` = indices of this epoch's list consumed so far (in
        `exact`, positions stepped through: a shorter rank has read min(position, num_samples)).

        Without `position`, what this sampler has yielded: right under torchdata's
        StatefulDataLoader, which asks at the moment matching the batch it hands out. A plain
        DataLoader prefetches ahead, so the template's loop passes the count it consumed. Both
        count from the start of the epoch's list, including any offset resumed at.
        """
        return state_of(self, self.yielded if position is None else position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next __iter__ (only that one) starts at the saved position."""
        epoch, position = resume_point(self, state)
        if epoch is not None:
            self.epoch = epoch
        if state.get("prior"):
            self.continue_epoch(self.epoch, state["prior"])
        self._lay_out()
        if position > self.epoch_length:
            raise ValueError(
                f"Sampler state_dict position {position} is outside the rest of epoch "
                f"{self.epoch} [0, {self.epoch_length}]; the state does not belong to this sampler."
            )
        self.next_yielded = position
