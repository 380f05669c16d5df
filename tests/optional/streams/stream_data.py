"""Training streams a forker brings: ``data`` factories returning an ``IterableDataset``
(tests/test_streams.py registers them as ``data`` options through a conf folder of its own).

* ``digits_stream``: the digits' training set as a stream that splits itself by rank and
  (``split_by_worker``) by loader worker; its keys are the indices, all expected. ``skewed``
  (2 ranks): rank 0 reads every third row, rank 1 the rest, so rank 0's stream ends halfway.
* ``no_key_stream``: the same, yielding ``(x, y)``: nothing to account with.
* ``env_split_stream``: the digits split by ``RANK``/``WORLD_SIZE`` inside ``__iter__``, as
  README says a loader worker can; no ``len()``, its ``num_rows`` declared with ``sized``.
* ``parquet_stream``: Hugging Face ``datasets`` streaming from local Parquet files (pixels,
  label, a string ``id``), split by rank with ``split_dataset_by_node`` or not.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from ddp_template.data.builtin import digits
from ddp_template.data.contract import Splits
from ddp_template.optional.streams.kind import Streamed


def _rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class DigitsStream(IterableDataset):
    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        split_by_worker: bool,
        key: bool,
        skewed: bool = False,
    ) -> None:
        self.x, self.y, self.split_by_worker, self.key = x, y, split_by_worker, key
        self.rank, self.world = _rank()  # in the rank, before its loader workers start
        self.skewed = skewed
        self.expected_keys = range(len(y))

    def _mine(self, i: int) -> bool:
        if self.skewed:
            return (i % 3 == 0) == (self.rank == 0)
        return i % self.world == self.rank

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        own = (i for i in range(len(self.y)) if self._mine(i))
        for j, i in enumerate(own):
            if self.split_by_worker and j % workers != worker:
                continue
            yield (self.x[i], int(self.y[i]), i) if self.key else (self.x[i], int(self.y[i]))


def digits_stream(
    split_by_worker: bool = True, skewed: bool = False, uneven: str = "stop"
) -> Splits:
    base = digits()
    train = DigitsStream(base.train.x, base.train.y, split_by_worker, key=True, skewed=skewed)
    return Splits(train, base.test, base.info, kind=Streamed(uneven=uneven))


def no_key_stream() -> Splits:
    base = digits()
    stream = DigitsStream(base.train.x, base.train.y, True, key=False)
    return Splits(stream, base.test, base.info, kind=Streamed())


class Rows(IterableDataset):
    """A Hugging Face streaming dataset's rows as ``(x, y, id)``."""

    def __init__(self, rows, num_rows: int) -> None:
        self.rows, self.num_rows = rows, num_rows

    def __iter__(self):
        for row in self.rows:
            yield torch.tensor(row["pixels"]).view(1, 8, 8), int(row["label"]), row["id"]

    def set_epoch(self, epoch: int) -> None:
        self.rows.set_epoch(epoch)


def parquet_stream(path: str, split_by_node: bool = True, uneven: str = "stop") -> Splits:
    import pyarrow.parquet as pq
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    files = sorted(str(p) for p in Path(path).glob("*.parquet"))
    rows = load_dataset("parquet", data_files=files, split="train", streaming=True)
    if split_by_node:
        rank, world = _rank()
        rows = split_dataset_by_node(rows, rank=rank, world_size=world)
    num_rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    base = digits()
    return Splits(Rows(rows, num_rows), base.test, base.info, kind=Streamed(uneven=uneven))


class EnvSplitDigits(IterableDataset):
    """The digits' training set, split by rank from ``RANK``/``WORLD_SIZE`` in ``__iter__`` (a
    loader worker has the rank's environment but no process group) and by loader worker; no
    ``len()``, and ``num_rows`` only when ``sized``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, sized: bool) -> None:
        self.x, self.y = x, y
        if sized:
            self.num_rows = len(y)

    def __iter__(self):
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for j, i in enumerate(range(rank, len(self.y), world)):
            if j % workers == worker:
                yield self.x[i], int(self.y[i]), i


def env_split_stream(sized: bool = False) -> Splits:
    base = digits()
    train = EnvSplitDigits(base.train.x, base.train.y, sized)
    return Splits(train, base.test, base.info, kind=Streamed())
