"""The data's identity: its length and a content fingerprint cheap enough for large data, which
the provenance chain keeps in every checkpoint so a resume can tell that the data under the run
is the data it started with.

A dataset may say its own (``fingerprint() -> str``: the token files' and the tar shards' do);
in-memory tensors are hashed whole (memory speed: a gigabyte a second); any other map-style
dataset is probed: ``PROBES`` samples spread over it, hashed with its length. A probe misses a
change to a sample it did not read; give your dataset a ``fingerprint()`` where that matters.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any, TypedDict, cast

import numpy as np
import torch
from torch.utils._pytree import tree_leaves
from torch.utils.data import IterableDataset

from ddp_template.data.contract import IndexedSubset, IndexedTensors, MapData, Splits

PROBES = 64  # samples hashed of a dataset that has no fingerprint of its own
FILE_WHOLE = 64 << 20  # files up to this size are hashed whole; larger ones by blocks
FILE_BLOCK = 1 << 20  # bytes of each of the PROBES blocks read from a larger file


class DataIdentity(TypedDict):
    """What the chain records of the data: the training split's length, one fingerprint of
    every split (train, validation, test), and how it was taken."""

    length: int
    fingerprint: str
    how: str


def _hasher() -> Any:
    return hashlib.blake2b(digest_size=8)


def _feed(h: Any, leaf: Any) -> None:
    if isinstance(leaf, torch.Tensor):
        leaf = leaf.detach().cpu().contiguous().numpy()
    if isinstance(leaf, np.ndarray):
        h.update(str((leaf.dtype, leaf.shape)).encode())
        h.update(np.ascontiguousarray(leaf).view(np.uint8).data)
    else:
        h.update(repr(leaf).encode())


def file_fingerprint(size: int, name: str, read: Callable[[str, int, int], bytes]) -> str:
    """A file's bytes (whole up to ``FILE_WHOLE``; else ``PROBES`` blocks spread over it, and
    its size); ``read(name, begin, end)`` gives its bytes ``begin..end``."""
    h = _hasher()
    h.update(str(size).encode())
    if size <= FILE_WHOLE:
        starts = np.arange(0, size, FILE_BLOCK)
    else:
        starts = np.linspace(0, size - FILE_BLOCK, PROBES).astype(np.int64)
    for start in starts.tolist():
        h.update(read(name, start, min(size, start + FILE_BLOCK)))
    return h.hexdigest()


def array_fingerprint(arrays: Iterable[Any]) -> str:
    """Arrays or tensors, whole (their dtypes and shapes too)."""
    h = _hasher()
    for a in arrays:
        _feed(h, a)
    return h.hexdigest()


def fingerprint(dataset: Any) -> tuple[str, str]:
    """``(fingerprint, how)`` of one split."""
    own = getattr(dataset, "fingerprint", None)
    if callable(own):
        return str(own()), "its own fingerprint()"
    if isinstance(dataset, IndexedTensors):
        return array_fingerprint([dataset.x, dataset.y]), "every tensor hashed"
    if isinstance(dataset, IndexedSubset):
        base, how = fingerprint(dataset.base)
        return array_fingerprint([base, np.asarray(dataset.indices)]), how
    if isinstance(dataset, IterableDataset):
        return "", "a stream without fingerprint(): its content is not checked"
    n = len(dataset)
    h = _hasher()
    h.update(str(n).encode())
    for i in np.unique(np.linspace(0, n - 1, min(PROBES, n)).astype(np.int64)):
        for leaf in tree_leaves(dataset[int(i)]):
            _feed(h, leaf)
    return h.hexdigest(), f"{min(PROBES, n)} of {n} samples probed"


def identify(splits: Splits) -> DataIdentity:
    """The identity of the run's data: every split's fingerprint in one, the training split's
    length (a stream's: -1)."""
    prints, hows = [], []
    for split in (splits.train, splits.val, splits.test):
        if split is not None:
            value, how = fingerprint(split)
            prints.append(value)
            hows.append(how)
    train = splits.train
    length = -1 if isinstance(train, IterableDataset) else len(cast(MapData, train))
    return DataIdentity(length=length, fingerprint=array_fingerprint(prints), how=hows[0])
