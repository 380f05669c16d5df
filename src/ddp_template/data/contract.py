"""The ``(x, y, index)`` contract every dataset here keeps, and the batched fetch.

``__getitem__(i)`` returns the input ``x``, the target ``y`` (a class index, a value, a mask:
the task's; either may be a tensor or a nested tuple/dict of tensors) and ``i`` itself. The index
travels with the batch to the training loop, which is how every rank can log exactly which
samples it saw (count, fingerprint, first/last index) whatever sampler, loader or worker count
produced the batch. A data factory (the ``_target_`` of a ``data`` YAML) returns
:class:`Splits`: the training and test datasets plus the :class:`DataInfo` that the model
factory receives. In-memory data also hands over a whole :class:`Batch` at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.data import Dataset, default_collate


@dataclass(frozen=True)
class DataInfo:
    """What the model factory and the task are told about the data's shapes: each field that
    is set goes to the model factory's argument of the same name (``models.build_model``)."""

    num_classes: int | None = None  # classes (classification) or per-pixel classes (segmentation)
    in_channels: int | None = None  # images: channels
    image_size: int | None = None  # images: height = width
    in_features: int | None = None  # flat features (regression, tabular data)
    out_features: int | None = None  # regression targets per sample
    extra: Mapping[str, int] = field(default_factory=dict)  # sizes of your own (vocab_size, ...)

    def given(self) -> dict[str, int]:
        """The sizes the data set, by name (``extra``'s too)."""
        named = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**{k: v for k, v in named.items() if v}, **self.extra}


class Sampler(Protocol):
    """A training sampler as the core reads it, whatever deals the data (a planned kind's
    ``ShareSampler``, a stream's ``StreamPosition``): its lengths (the epoch's steps), its epoch,
    its state at a position (the checkpoint) and what a position holds (padding, the loader
    worker of the next batch: the ledger). ``DataKind.sampler`` returns one."""

    @property
    def dataset_size(self) -> int: ...
    @property
    def epoch_length(self) -> int: ...
    @property
    def rank_lengths(self) -> tuple[int, ...]: ...
    def set_epoch(self, epoch: int, /) -> None: ...
    def state_dict(self, position: int, /) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any], /) -> None: ...
    def padding_in_prefix(self, position: int, /) -> int: ...
    def worker_lanes(self, position: int, /) -> tuple[int, int]: ...


@dataclass
class DataRecord:
    """``DataInfo`` as a checkpoint part, for the record: what the data told the model, so the
    checkpoint alone rebuilds its model (``python -m ddp_template.optional.gpt.sample``) without
    the data. A resume restores nothing from it (the model's weights refuse other sizes)."""

    info: DataInfo

    def state_dict(self) -> dict[str, Any]:
        named = {f.name: getattr(self.info, f.name) for f in fields(self.info) if f.name != "extra"}
        return {**named, "extra": dict(self.info.extra)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Nothing to restore."""

    @staticmethod
    def read(state: Mapping[str, Any]) -> DataInfo:
        """The ``DataInfo`` a checkpoint's record holds."""
        known = {f.name for f in fields(DataInfo)}
        return DataInfo(**{k: v for k, v in state.items() if k in known})


class MapData(Protocol):
    """A map-style dataset as the samplers and loaders read it: its length and item ``i``
    (``(x, y, i)``). torch's ``Dataset`` declares no ``__len__`` (an ``IterableDataset`` is one
    too), so code that reads map-style data says so with this type."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> Any: ...


@dataclass
class Splits:
    train: Dataset
    test: Dataset
    info: DataInfo
    val: Dataset | None = None  # carved from the training data with data.val_fraction
    # The data kind that reads the training split (ddp_template.kind.DataKind): None is
    # map-style data; a factory of another kind names its own (e.g. a stream's).
    kind: Any = None

    def split(self, name: str) -> Dataset:
        """The split named ``test``, ``val`` or ``train`` (the latter without augmentation)."""
        if name == "val" and self.val is not None:
            return self.val
        if name == "train":
            return getattr(self.train, "for_eval", self.train)
        if name == "test":
            return self.test
        raise ValueError(f"no split {name}")

    def set_epoch(self, epoch: int) -> None:
        """Tell the training data the epoch (its augmentation depends on it)."""
        if hasattr(self.train, "set_epoch"):
            self.train.set_epoch(epoch)


class Batch(tuple):
    """``(x, y, index)`` of a whole batch, fetched at once by a dataset's ``get_batch``:
    :func:`collate` passes it through as it is."""


def to_device(obj: Any, device: torch.device) -> Any:
    """A batch part (a tensor, or tuples, lists and dicts of them) on ``device``."""

    def move(t: Any) -> Any:
        return t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t

    return tree_map(move, obj)


def batch_len(part: Any) -> int:
    """How many samples a batch part holds (its first tensor's first dimension)."""
    leaves = [t for t in tree_leaves(part) if isinstance(t, torch.Tensor)]
    return int(leaves[0].shape[0]) if leaves else 0


def empty_batch(loader: Any, like: Any) -> tuple:
    """A batch of no samples shaped like ``like`` (else like the dataset's first sample)."""
    if like is None:
        like = loader.collate_fn([loader.dataset[0]])
    return tuple(tree_map(lambda t: t[:0], part) for part in like)


def first_input(dataset: Any) -> Any:
    """The dataset's first input as a batch of one (a model's probe)."""
    x, _, _ = default_collate([next(iter(dataset))])
    return x


def collate(samples: Any) -> Any:
    """The loaders' collate: a :class:`Batch` as it is, a list of samples by torch's default."""
    return samples if isinstance(samples, Batch) else default_collate(samples)


class BatchFetch(Dataset):
    """What the template's loaders read: ``dataset`` with torch's ``__getitems__`` hook, so a
    dataset with ``get_batch(indices)`` (in-memory tensors) hands over a whole :class:`Batch`,
    and any other dataset is read one ``__getitem__`` per sample as usual. The dataset itself
    keeps torch's plain protocol: a DataLoader of your own with the default collate works."""

    def __init__(self, dataset: MapData) -> None:
        self.dataset = dataset
        self._batched = getattr(dataset, "get_batch", None)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[i]

    def __getitems__(self, indices: list[int]) -> Any:
        if self._batched is None:
            return [self.dataset[i] for i in indices]
        return self._batched(indices)


class IndexedTensors(Dataset):
    """In-memory inputs and targets; item ``i`` is ``(x[i], y[i], i)``. ``get_batch`` gathers
    a whole batch at once, with the same values as one item at a time and a default collate.
    Targets keep their dtype: class indices (int64), regression values, masks."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if len(x) != len(y):
            raise ValueError(f"inputs ({len(x)}) and labels ({len(y)}) differ in length")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Any, int]:
        return self.x[i], self.y[i], i

    def get_batch(self, indices: list[int]) -> Batch:
        index = torch.as_tensor(indices, dtype=torch.int64)
        return Batch((self.x[index], self.y[index], index))


class IndexedSubset(Dataset):
    """Items ``indices[j]`` of an ``(x, y, index)`` dataset, renumbered: item ``j`` is
    ``(x, y, j)``."""

    def __init__(self, base: Dataset, indices: np.ndarray) -> None:
        self.base, self.indices = base, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, j: int) -> tuple[Any, int, int]:
        x, y, _ = self.base[int(self.indices[j])]
        return x, y, j

    def get_batch(self, js: list[int]) -> Any:
        if not hasattr(self.base, "get_batch"):
            return [self[j] for j in js]
        x, y, _ = self.base.get_batch([int(self.indices[j]) for j in js])
        return Batch((x, y, torch.as_tensor(js, dtype=torch.int64)))


class WithIndex(Dataset):
    """Wraps a ``(x, y)`` dataset (torchvision's) so items carry their index."""

    def __init__(self, base: Any) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[Any, int, int]:
        x, y = self.base[i]
        return x, int(y), i
