"""The epoch plan of sharded data: which (rank, worker) reads which samples, from (seed, epoch).

The epoch's **order** is the shards in a shuffled order, each read in blocks of
``shuffle_block`` consecutive samples whose order is shuffled within the block (bounded: a
worker holds one block, and a resume reads at most one block to get back in place). Slot ``j``
of the epoch holds ``order[j mod N]``; the sampler mode (``SAMPLER_MODES``) decides how many
slots there are (padded: ``W x ceil(N/W)``, the repeats at the end named as pads; drop_last:
``W x floor(N/W)``, the rest named as drops; exact: N) and how long each rank's list is. Rank r
holds one **contiguous** range of slots; its range is cut into batches of ``batch_size`` and
the batches into one contiguous range per loader worker, so every rank has the same number of
samples (and of steps) whatever the shard sizes, and each worker reads its part of the order
sequentially. A rank's *positions* count in the order its DataLoader hands batches out: round
robin over its workers, batch ``c`` from worker ``c mod K``; the worker ranges are laid out so
that the one short batch comes last.

:class:`PlanSampler` is a :class:`ShareSampler` of this deal: the share check, the coverage,
``replay``, the shares picture and the checkpoint's position read it as they read any sampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ddp_template.data.sampler_modes import SAMPLER_MODES, ModeRule, ceil_div
from ddp_template.data.samplers import ShareSampler
from ddp_template.errors import Misfit

DEFAULT_SHUFFLE_BLOCK = 256


@dataclass(frozen=True)
class ShardOrder:
    """The epoch's order: shard order, then block-shuffled samples, from (seed, epoch)."""

    sizes: tuple[int, ...]  # samples per shard, url order
    seed: int
    shuffle: bool
    block: int = DEFAULT_SHUFFLE_BLOCK

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)]).astype(np.int64)

    def blocks(self, epoch: int) -> np.ndarray:
        """The epoch's blocks in the order, one row (shard, first offset, length) each."""
        order = np.arange(len(self.sizes))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch, 0]).permutation(len(self.sizes))
        rows = [
            (s, lo, min(self.block, self.sizes[s] - lo))
            for s in order
            for lo in range(0, self.sizes[s], self.block)
        ]
        return np.array(rows, dtype=np.int64).reshape(-1, 3)

    def order(self, epoch: int) -> np.ndarray:
        """The global index of every position of the order (a permutation of 0..N-1)."""
        blocks = self.blocks(epoch)
        lengths = blocks[:, 2]
        first = self.offsets[blocks[:, 0]] + blocks[:, 1]  # each block's first global index
        block_of = np.repeat(np.arange(len(blocks)), lengths)
        within = np.arange(len(block_of)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        if self.shuffle:  # a random order within each block, the blocks kept in place
            keys = np.random.default_rng([self.seed, epoch, 1]).random(len(block_of))
            within = within[np.lexsort((keys, block_of))]
        return first[block_of] + within


@dataclass(frozen=True)
class OrderRule:
    """A sampler mode's lengths with the plan's order: one contiguous range of slots per
    rank, cut into one contiguous range of whole batches per worker, positions counted in the
    DataLoader's round-robin order. ``slots``/``owners`` are ``ModeRule``'s, in this order."""

    mode: ModeRule
    n: int
    world: int
    batch_size: int
    workers: int

    # lengths, tail, summary: the mode's own
    @property
    def summary(self) -> str:
        return self.mode.summary

    @property
    def shuffles(self) -> bool:
        return self.mode.shuffles

    @property
    def drops_tail(self) -> bool:
        return self.mode.drops_tail

    @property
    def contiguous(self) -> bool:
        return self.mode.contiguous

    @property
    def uneven(self) -> bool:
        return self.mode.uneven

    def length(self, n: int, world: int) -> int:
        return self.mode.length(n, world)

    def rank_length(self, n: int, rank: int, world: int) -> int:
        return self.mode.rank_length(n, rank, world)

    def total(self, n: int, world: int) -> int:
        return self.mode.total(n, world)

    def real_positions(self, n: int, rank: int, length: int, world: int) -> int:
        return self.mode.real_positions(n, rank, length, world)

    def rank_offsets(self) -> np.ndarray:
        lengths = [self.mode.rank_length(self.n, r, self.world) for r in range(self.world)]
        return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    def worker_batches(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(first batch, batch count) of each worker's range within ``rank``'s list. Workers
        ``m = batches mod K`` onwards come first, so the short batch is the last handed out."""
        length = self.mode.rank_length(self.n, rank, self.world)
        batches, k = ceil_div(length, self.batch_size), self.workers
        counts = batches // k + (np.arange(k) < batches % k)
        order = np.roll(np.arange(k), -(batches % k))  # the workers in slot order
        first = np.zeros(k, dtype=np.int64)
        first[order] = np.cumsum(counts[order]) - counts[order]
        return first, counts.astype(np.int64)

    def worker_of(self, positions: np.ndarray) -> np.ndarray:
        return (positions // self.batch_size) % self.workers

    def slots(self, positions: np.ndarray, rank: int, length: int, world: int) -> np.ndarray:
        b, k = self.batch_size, self.workers
        first, _ = self.worker_batches(rank)
        batch, within = positions // b, positions % b
        return self.rank_offsets()[rank] + (first[batch % k] + batch // k) * b + within

    def owners(self, slots: np.ndarray, length: int, world: int) -> tuple[np.ndarray, np.ndarray]:
        b, k = self.batch_size, self.workers
        offsets = self.rank_offsets()
        ranks = np.searchsorted(offsets, slots, side="right") - 1
        ranks = np.minimum(ranks, self.world - 1)
        positions = np.zeros_like(slots)
        for r in np.unique(ranks):
            mine = ranks == r
            first, counts = self.worker_batches(int(r))
            local = slots[mine] - offsets[r]
            batch, within = local // b, local % b
            ends = first + counts
            worker = np.argmax((batch[:, None] >= first) & (batch[:, None] < ends), axis=1)
            positions[mine] = ((batch - first[worker]) * k + worker) * b + within
        return ranks, positions


class PlanSampler(ShareSampler):
    """One rank's view of the epoch plan, with ``ShareSampler``'s interface (positions, index
    arithmetic, padding, state): what the loader's workers read, and what the checks expect.

    The training DataLoader does not iterate it (iterating yields the rank's list, as any
    ShareSampler): it reads an iterable dataset whose workers ask it for their ranges
    (:meth:`worker_indices`). ``set_epoch`` and a resumed position
    reach persistent workers through a shared tensor.
    """

    rule: OrderRule  # the mode's lengths in the plan's order

    def __init__(
        self,
        order: ShardOrder,
        *,
        num_replicas: int,
        rank: int,
        mode: str,
        batch_size: int,
        workers: int,
        keys: tuple[str, ...] = (),
    ) -> None:
        n = int(sum(order.sizes))
        super().__init__(
            range(n), num_replicas, rank, shuffle=order.shuffle, seed=order.seed, mode=mode
        )
        self.shard_order, self.batch_size, self.workers = order, batch_size, max(1, workers)
        self.keys = keys  # each sample's __key__, by global index (reports name samples by it)
        mode_rule = SAMPLER_MODES[self.mode]  # what ShareSampler set self.rule to
        self.rule = OrderRule(mode_rule, n, num_replicas, batch_size, self.workers)
        self.permutation = "plan"
        self.shared = torch.zeros(2, dtype=torch.int64).share_memory_()  # epoch, start

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_perm_cache"] = None  # each worker draws its own epoch's order
        state["_block"] = None
        state["_iterator_token"] = None
        return state

    def _permutation(self) -> Any:
        return self.order(self.epoch)

    def continue_epoch(self, epoch: int, prior: list[dict[str, Any]]) -> None:
        raise Misfit(
            "sharded data's plan cuts each epoch's stream into ranges per rank and loader "
            "worker, so the rest of a mid-epoch checkpoint's epoch cannot be dealt to another "
            "world size; resume with the world size it was written with, or from an epoch-end "
            "checkpoint (resume=<run dir>/checkpoints/epoch_<k>.pt)."
        )

    def order(self, epoch: int) -> np.ndarray:
        """The order of ``epoch`` (the last one asked for is cached)."""
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            self._perm_cache = (epoch, self.shard_order.order(epoch))
        return self._perm_cache[1]

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.shared[0], self.shared[1] = self.epoch, self.next_yielded or 0

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("plan")
        mine = self.plan_identity()
        if saved is not None and saved != mine:
            diff = next(k for k in mine if saved.get(k) != mine[k])
            raise Misfit(
                f"its data plan has {diff}={saved.get(diff)} but this run has {diff}="
                f"{mine[diff]}; resume with the same shards, loader.batch_size, "
                f"loader.num_workers and data.shuffle_block, or start a new run."
            )
        super().load_state_dict(state)
        self.shared[0], self.shared[1] = self.epoch, self.next_yielded or 0

    def plan_identity(self) -> dict[str, Any]:
        return {
            "shard_sizes": list(self.shard_order.sizes),
            "batch_size": self.batch_size,
            "num_workers": self.workers,
            "shuffle_block": self.shard_order.block,
        }

    def state_dict(self, position: int | None = None) -> dict[str, Any]:
        """The sampler's state plus each worker's cursor: the next slot its range reads."""
        state = super().state_dict(position)
        start = state["position"]
        cursors = [int(self.worker_cursor(self.rank, k, start)) for k in range(self.workers)]
        return state | {"plan": self.plan_identity(), "worker_cursors": cursors}

    # ----------------------------------------------------------------- the workers' ranges
    def worker_at(self, position: int) -> int:
        """The worker whose batch comes first from ``position`` (a batch boundary)."""
        return (ceil_div(position, self.batch_size)) % self.workers

    def worker_lanes(self, position: int) -> tuple[int, int]:
        """(workers, the worker of the first batch) for a tally of the epoch from here."""
        return self.workers, self.worker_at(position)

    def worker_cursor(self, rank: int, worker: int, start: int) -> int:
        """The first slot of ``worker``'s range on ``rank`` not consumed by ``start``."""
        first, counts = self.rule.worker_batches(rank)
        done = ceil_div(start, self.batch_size)
        taken = max(0, ceil_div(done - worker, self.workers))
        length = self.length_of(rank)
        slot = (first[worker] + min(taken, counts[worker])) * self.batch_size
        return int(self.rule.rank_offsets()[rank] + min(slot, length))

    def worker_slots(self, rank: int, worker: int, start: int) -> tuple[int, int]:
        """The slots [cursor, end) ``worker`` still reads on ``rank`` from ``start``."""
        first, counts = self.rule.worker_batches(rank)
        end = min((first[worker] + counts[worker]) * self.batch_size, self.length_of(rank))
        return self.worker_cursor(rank, worker, start), int(self.rule.rank_offsets()[rank] + end)

    def worker_indices(self, rank: int, worker: int, start: int, epoch: int) -> np.ndarray:
        """The global indices ``worker`` reads on ``rank`` from ``start``, in order."""
        lo, hi = self.worker_slots(rank, worker, start)
        return self.order(epoch)[np.arange(lo, hi, dtype=np.int64) % max(self.dataset_size, 1)]

    def loader_worker(self, loader_worker: int, start: int) -> int:
        """The plan's worker that loader worker ``loader_worker`` plays from ``start``: a fresh
        DataLoader hands its first batch out from worker 0, the plan's next batch is
        ``worker_at(start)``'s."""
        return (loader_worker + self.worker_at(start)) % self.workers

    def worker_of(self, positions: np.ndarray) -> np.ndarray:
        """The plan's worker of each of a rank's positions."""
        return self.rule.worker_of(np.asarray(positions, dtype=np.int64))

    def padding_in_prefix(self, n: int, rank: int | None = None) -> int:
        rank = self._rank(rank)
        n = max(0, min(int(n), self.length_of(rank)))
        return int(self.is_padding(np.arange(n, dtype=np.int64), rank).sum())

    def key_of(self, index: int) -> str:
        return self.keys[index] if self.keys else str(index)

    def tail_names(self) -> dict[str, list[str]]:
        """The epoch's named pads (repeated samples) and drops (samples no rank reads)."""
        order, n, total = self._permutation(), self.dataset_size, self.total_size
        return {
            "pads": [self.key_of(int(order[j % n])) for j in range(n, total)],
            "drops": [self.key_of(int(order[j])) for j in range(total, n)],
        }
