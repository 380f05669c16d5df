"""``data=webdataset``: WebDataset tar shards as ``(x, y, index)`` samples, read by plan.

    python train.py data=webdataset data.train_urls=/data/train-{000000..000127}.tar \\
        data.test_urls=/data/test-{000000..000003}.tar

A sample is ``<key>.png|jpg|jpeg|npy`` + ``<key>.cls`` (WebDataset's naming); its index is
its global index in the shard index (``webdataset.index``). :class:`ShardSamples` reads any
sample by index (evaluation, ``replay --save``); for training, :class:`PlanReader` is the
DataLoader's iterable dataset: each loader worker reads its range of the epoch plan
(``webdataset.plan``) sequentially, one shuffle block's byte range at a time, the next few
read ahead meanwhile (the network's latency hidden behind the samples already read).
"""

from __future__ import annotations

import io
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from ddp_template.data.contract import Batch
from ddp_template.data.identity import array_fingerprint
from ddp_template.optional.webdataset.index import ShardIndex
from ddp_template.optional.webdataset.plan import DEFAULT_SHUFFLE_BLOCK, PlanSampler

Augment = Callable[[torch.Tensor, int], torch.Tensor]  # (input, sample index) -> input

READ_AHEAD = 4  # block runs a loader worker reads ahead of the one it hands out


def decode(ext: str, raw: bytes) -> torch.Tensor:
    """An input member as a float32 tensor: images (C, H, W) in [0, 1], .npy's values as
    stored (cast to float32)."""
    if ext == "npy":
        return torch.from_numpy(np.load(io.BytesIO(raw), allow_pickle=False)).to(torch.float32)
    from PIL import Image

    with Image.open(io.BytesIO(raw)) as image:
        pixels = np.asarray(image)
    pixels = pixels[:, :, None] if pixels.ndim == 2 else pixels
    return torch.from_numpy(pixels.transpose(2, 0, 1).astype(np.float32) / 255.0)


class ShardSamples(Dataset):
    """Every sample of some shards, by global index: item ``i`` is ``(x, label, i)``."""

    def __init__(self, index: ShardIndex, shuffle_block: int = DEFAULT_SHUFFLE_BLOCK) -> None:
        self.index, self.shuffle_block = index, shuffle_block

    def __len__(self) -> int:
        return len(self.index)

    def fingerprint(self) -> str:
        """The shard index: every sample's key, label and byte ranges, shard by shard."""
        ix = self.index
        names = [s.name for s in ix.shards]
        return array_fingerprint([names, ix.sizes, ix.keys, ix.labels, ix.starts, ix.stops])

    def key_of(self, i: int) -> str:
        return self.index.keys[i]

    def read(self, shard: int, lo: int, hi: int) -> tuple[int, bytes]:
        """The bytes of global samples ``lo..hi`` (one shard) in one read, and where they
        begin in the shard."""
        ix, where = self.index, self.index.shards[shard]
        begin, end = int(ix.starts[lo]), int(ix.stops[hi])
        return begin, where.storage.read_range(where.name, begin, end)

    def runs(self, indices: np.ndarray) -> list[np.ndarray]:
        """``indices`` cut where the shard or the shuffle block changes: a run is one read."""
        ix = self.index
        shard = np.searchsorted(ix.offsets, indices, side="right") - 1
        group = shard * (1 << 40) + (indices - ix.offsets[shard]) // self.shuffle_block
        return [run for run in np.split(indices, np.flatnonzero(np.diff(group)) + 1) if len(run)]

    def read_run(self, run: np.ndarray) -> tuple[int, bytes]:
        return self.read(self.index.shard_of(int(run[0])), int(run.min()), int(run.max()))

    def get_batch(self, indices: list[int]) -> Batch | list:
        """Items ``indices`` collated (as torch's default collate would), one read per run:
        an evaluation's batch of consecutive samples is one range."""
        index = np.asarray(indices, dtype=np.int64)
        if not len(index):
            return []
        items = []
        for run in self.runs(index):
            base, buffer = self.read_run(run)
            items += [self.item(i, base, buffer) for i in run.tolist()]
        x = torch.stack([x for x, _, _ in items])
        y = torch.tensor([y for _, y, _ in items], dtype=torch.int64)
        return Batch((x, y, torch.from_numpy(index)))

    def item(self, i: int, base: int, buffer: bytes) -> tuple[torch.Tensor, int, int]:
        ix = self.index
        lo = int(ix.input_offset[i]) - base
        return (
            decode(ix.input_ext[i], buffer[lo : lo + int(ix.input_size[i])]),
            int(ix.labels[i]),
            i,
        )

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        i = int(i)
        base, buffer = self.read(self.index.shard_of(i), i, i)
        return self.item(i, base, buffer)


class PlanReader(IterableDataset):
    """The training DataLoader's dataset: loader worker ``w`` reads the plan's range of the
    worker it plays (``PlanSampler.loader_worker``) from the epoch and position in the
    sampler's shared tensor, grouping consecutive samples of one block into one read."""

    def __init__(
        self, samples: ShardSamples, sampler: PlanSampler, augment: Augment | None = None
    ) -> None:
        self.samples, self.sampler, self.augment = samples, sampler, augment

    def __getitem__(self, i: int) -> Any:  # an empty micro-batch's shape (engine)
        return self._augmented(self.samples[i])

    def _augmented(self, item: tuple[torch.Tensor, int, int]) -> tuple[torch.Tensor, int, int]:
        if self.augment is None:
            return item
        x, y, index = item
        return self.augment(x, index), y, index

    def indices(self, loader_worker: int, epoch: int, start: int) -> np.ndarray:
        s = self.sampler
        return s.worker_indices(s.rank, s.loader_worker(loader_worker, start), start, epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int, int]]:
        info = get_worker_info()
        epoch, start = (int(v) for v in self.sampler.shared)
        yield from self.read(self.indices(0 if info is None else info.id, epoch, start))

    def read(self, indices: np.ndarray) -> Iterator[tuple[torch.Tensor, int, int]]:
        """The samples ``indices`` in order, one read per run of one shard's block; the next
        ``READ_AHEAD`` runs are read meanwhile (threads), their samples still yielded in order."""
        runs, fetch = iter(self.samples.runs(indices)), self.samples.read_run
        pool = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="read-ahead")
        try:
            # the first run alone, so the epoch's first batch does not wait on the ones after
            ahead = deque((run, pool.submit(fetch, run)) for run in islice(runs, 1))
            while ahead:
                run, reading = ahead.popleft()
                base, buffer = reading.result()
                for following in islice(runs, READ_AHEAD - len(ahead)):
                    ahead.append((following, pool.submit(fetch, following)))
                for i in run.tolist():
                    yield self._augmented(self.samples.item(i, base, buffer))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)


def sharded_source(dataset: Any) -> tuple[ShardSamples, Augment | None] | None:
    """The shard samples a training split streams from and the augmentation on top of them
    (``transforms``: a wrapper with ``base`` and ``augment(x, index)``), or None: map-style."""
    if isinstance(dataset, ShardSamples):
        return dataset, None
    base, augment = getattr(dataset, "base", None), getattr(dataset, "augment", None)
    if isinstance(base, ShardSamples) and callable(augment):
        return base, augment
    return None
