"""``data=webdataset``: WebDataset tar shards as ``(x, y, index)`` samples, read by plan.

    python train.py data=webdataset data.train_urls=/data/train-{000000..000127}.tar \\
        data.test_urls=/data/test-{000000..000003}.tar

A sample is ``<key>.png|jpg|jpeg|npy`` + ``<key>.cls`` (WebDataset's naming); its index is
its global index in the shard index (``webdataset.index``). :class:`ShardSamples` reads any
sample by index (evaluation, ``replay --save``); for training, :class:`PlanReader` is the
DataLoader's iterable dataset: each loader worker reads its range of the epoch plan
(``webdataset.plan``) sequentially, one shuffle block's byte range at a time.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from ddp_template.data.identity import array_fingerprint
from ddp_template.optional.webdataset.index import ShardIndex
from ddp_template.optional.webdataset.plan import DEFAULT_SHUFFLE_BLOCK, PlanSampler

Augment = Callable[[torch.Tensor, int], torch.Tensor]  # (input, sample index) -> input

OPEN_SHARDS = 16  # file handles a process keeps (the least recently opened is closed first)


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
        self._files: dict[int, Any] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_files": {}}

    def __len__(self) -> int:
        return len(self.index)

    def fingerprint(self) -> str:
        """The shard index: every sample's key, label and byte ranges, shard by shard."""
        ix = self.index
        names = [p.name for p in ix.paths]
        return array_fingerprint([names, ix.sizes, ix.keys, ix.labels, ix.starts, ix.stops])

    def key_of(self, i: int) -> str:
        return self.index.keys[i]

    def _file(self, shard: int) -> Any:
        if self._pid != os.getpid():  # a forked copy: its own handles
            self._files, self._pid = {}, os.getpid()
        if shard not in self._files:
            if len(self._files) >= OPEN_SHARDS:  # a worker moves on through its shards
                self._files.pop(next(iter(self._files))).close()
            self._files[shard] = open(self.index.paths[shard], "rb")  # noqa: SIM115
        return self._files[shard]

    def read(self, shard: int, lo: int, hi: int) -> tuple[int, bytes]:
        """The bytes of global samples ``lo..hi`` (one shard) in one read, and where they
        begin in the file."""
        ix = self.index
        begin, end = int(ix.starts[lo]), int(ix.stops[hi])
        handle = self._file(shard)
        handle.seek(begin)
        return begin, handle.read(end - begin)

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
        """The samples ``indices`` in order, one read per run of one shard's block."""
        ix, block = self.samples.index, self.samples.shuffle_block
        shard = np.searchsorted(ix.offsets, indices, side="right") - 1
        group = shard * (1 << 40) + (indices - ix.offsets[shard]) // block
        cuts = np.flatnonzero(np.diff(group)) + 1
        for run in np.split(indices, cuts):
            if not len(run):
                continue
            base, buffer = self.samples.read(
                ix.shard_of(int(run[0])), int(run.min()), int(run.max())
            )
            for i in run.tolist():
                yield self._augmented(self.samples.item(i, base, buffer))


def sharded_source(dataset: Any) -> tuple[ShardSamples, Augment | None] | None:
    """The shard samples a training split streams from and the augmentation on top of them
    (``transforms``: a wrapper with ``base`` and ``augment(x, index)``), or None: map-style."""
    if isinstance(dataset, ShardSamples):
        return dataset, None
    base, augment = getattr(dataset, "base", None), getattr(dataset, "augment", None)
    if isinstance(base, ShardSamples) and callable(augment):
        return base, augment
    return None
