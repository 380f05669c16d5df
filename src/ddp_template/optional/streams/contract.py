"""Streams the template cannot plan: your own ``IterableDataset`` (Hugging Face ``datasets``
streaming, a WebDataset pipeline, a generator) as the training split.

A stream's items are ``(x, y, key)``: the key is an int index or a string (WebDataset's
``__key__``, an ``id`` column), hashed into the fingerprints. The template does not split a
stream (your stack does); it reads it as it comes, tags every item in the process that reads
it with its key's hash and the loader worker's id (:class:`Tagged`), and audits what each
(rank, worker) read (``streams.verify``). What the epoch should hold, when known, is
:class:`Expected`: the dataset's ``expected_keys`` (keys, or a file of one key a line), else
its ``num_rows`` or length (a count).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ddp_template.errors import ConfigError, Misfit
from ddp_template.ledger.tally import fingerprint_sum

_KEY_MASK = 2**63 - 1  # hashes stay non-negative int64 (a tensor's dtype)
KeySpec = int | str | Callable[[Any], Any]  # a tuple position, a dict field, or a function


def is_stream(dataset: Any) -> bool:
    return isinstance(dataset, IterableDataset)


def key_hash(key: Any) -> int:
    """An int key as it is; a string's (or bytes') stable 63-bit blake2b hash."""
    if isinstance(key, torch.Tensor) and key.numel() == 1:
        key = key.item()
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool) and key >= 0:
        return int(key)
    if isinstance(key, (str, bytes)):
        raw = key.encode() if isinstance(key, str) else key
        return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") & _KEY_MASK
    raise TypeError(f"{key!r} ({type(key).__name__})")


def pick(item: Any, key: KeySpec) -> Any:
    """The sample key of ``item``: ``key`` is a position, a field name or a function."""
    if callable(key):
        return key(item)
    return item[key]


class Tagged(IterableDataset):
    """``dataset``'s items as ``(item, key hash, worker, key name)``, tagged in the process
    that reads them: the worker is ``get_worker_info().id`` (0 in the rank itself)."""

    def __init__(self, dataset: Any, key: KeySpec) -> None:
        self.dataset, self.key = dataset, key

    def __iter__(self) -> Iterator[tuple[Any, int, int, str]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        for item in self.dataset:
            k = pick(item, self.key)
            yield item, key_hash(k), worker, str(k)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


@dataclass(frozen=True)
class TagCollate:
    """A batch of tagged items: ``(collate(items), key hashes, worker, key names)``. A batch of
    an iterable dataset comes whole from one worker."""

    collate: Callable[[list], Any]

    def __call__(self, tagged: list) -> tuple[Any, torch.Tensor, int, list[str]]:
        items, hashes, workers, names = zip(*tagged, strict=True)
        return self.collate(list(items)), torch.tensor(hashes), workers[0], list(names)


@dataclass(frozen=True)
class Expected:
    """What one epoch should read: a count, and the keys' hashes (sorted) where known."""

    count: int
    hashes: np.ndarray | None = None

    @property
    def fingerprint(self) -> int | None:
        return None if self.hashes is None else fingerprint_sum(self.hashes)

    @classmethod
    def of(cls, source: Any) -> Expected | None:
        """From a count, keys, a key-list file, or a dataset's ``expected_keys`` (keys or a
        file), ``num_rows`` or ``len()``; None when nothing is known."""
        if source is None:
            return None
        if isinstance(source, int):
            return cls(source)
        if isinstance(source, (str, Path)):
            return cls.of(Path(source).read_text().split())
        if isinstance(source, (Sequence, np.ndarray)):
            ints = isinstance(source, range) or np.asarray(source).dtype.kind in "iu"
            keys = source if ints else [key_hash(k) for k in source]
            hashes = np.unique(np.asarray(keys, dtype=np.int64))
            return cls(len(hashes), hashes)
        for attr in ("expected_keys", "num_rows"):
            if getattr(source, attr, None) is not None:
                return cls.of(getattr(source, attr))
        try:
            return cls(len(source))
        except TypeError:
            return None


def check_stream(train: Any) -> None:
    """Refuse a training stream that gives nothing to account with, from its first item."""
    what = type(train).__name__
    try:
        item = next(iter(train))
    except StopIteration:
        raise ConfigError(
            f"the training stream ({what}) yields no item; check its files."
        ) from None
    fix = (
        "an IterableDataset for training must yield (x, y, key), the key an int index or a "
        "string id (WebDataset's __key__, an id column), so each rank's samples can be counted"
    )
    if not isinstance(item, (tuple, list)) or len(item) != 3:
        shape = f"a {len(item)}-tuple" if isinstance(item, (tuple, list)) else type(item).__name__
        raise ConfigError(f"the training stream ({what}) yields {shape}; {fix}.")
    try:
        key_hash(item[2])
    except TypeError as exc:
        raise ConfigError(f"the training stream ({what}) yields the key {exc}; {fix}.") from None


def check_run(cfg: Any, splits: Any) -> None:
    """The run's options a training stream cannot honour, each refused in one sentence."""
    for name in ("test", "val"):
        if is_stream(getattr(splits, name)):
            raise ConfigError(
                f"the {name} split is an IterableDataset; evaluation is exact only over a "
                f"map-style dataset (len and __getitem__): return one for {name}."
            )
    s, default = cfg.sampler, type(cfg.sampler)()
    for key in ("mode", "shuffle", "seed", "permutation", "drop_last_batch"):
        if getattr(s, key) != getattr(default, key):
            raise ConfigError(
                f"sampler.{key}={getattr(s, key)} has no effect on a training stream (the "
                f"template reads an IterableDataset as it comes, it does not sample it); drop "
                f"it and shuffle or split in the stream itself."
            )
    t = cfg.transforms
    refusals = [
        (
            f"transforms={t.name} (mean={t.mean})",
            str(t.name) != "none" or t.mean is not None,
            "augment and normalise in the stream itself (transforms=none); the template's "
            "transforms read map-style data",
        ),
        (
            f"eval_split={cfg.eval_split}",
            str(cfg.eval_split) == "train",
            "a stream cannot be evaluated exactly; use eval_split=test",
        ),
        (
            f"checkpoint.every_steps={cfg.checkpoint.every_steps}",
            cfg.checkpoint.every_steps > 0,
            "a stream cannot resume mid-epoch; use checkpoint.every_steps=0 (epoch ends)",
        ),
    ]
    for setting, refused, fix in refusals:
        if refused:
            raise ConfigError(f"{setting} does not work with a training stream: {fix}.")
    check_horizon(cfg, splits.train)


def check_horizon(cfg: Any, train: Any) -> None:
    """Refuse an LR schedule that needs the run's length when the stream does not declare its size:
    ``StreamPosition.epoch_length`` would be one batch per loader worker past the first (none
    without workers), so the cosine would reach 0 within the run's first steps."""
    if str(cfg.optim.schedule) == "cosine" and Expected.of(train) is None:
        raise ConfigError(
            f"optim.schedule=cosine needs the run's length to decay the LR over and the "
            f"training stream ({type(train).__name__}) does not declare its size; give it a "
            f"__len__, a num_rows or an expected_keys attribute, or set optim.schedule=none."
        )


@dataclass(kw_only=True)
class StreamPosition:
    """A stream in the sampler's place: the template deals nothing, so this holds only what
    the loop, the step arithmetic and the logs ask a sampler for."""

    expected: Expected | None
    world_size: int
    batch_size: int
    workers: int
    epoch: int = 0
    mode: str = "stream"
    rank_lengths: tuple[int, ...] = ()

    @property
    def dataset_size(self) -> int:
        return self.expected.count if self.expected is not None else 0

    @property
    def epoch_length(self) -> int:
        """An estimate of one rank's samples per epoch (the LR schedule's length): N / W, plus
        a short batch per worker."""
        per_rank = -(-self.dataset_size // self.world_size)
        return per_rank + self.batch_size * max(self.workers - 1, 0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def padding_in_prefix(self, position: int) -> int:
        return 0

    def worker_lanes(self, position: int) -> tuple[int, int]:
        return max(self.workers, 1), 0

    def state_dict(self, position: int) -> dict[str, Any]:
        return {"stream_epoch": self.epoch, "position": position}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if "stream_epoch" not in saved:
            raise Misfit("it holds a sampler's state but this run trains on a stream.")
        if saved["position"]:
            raise Misfit(
                f"it stands mid-epoch (epoch {saved['stream_epoch']}, position "
                f"{saved['position']}) of a stream, which cannot be positioned there (an "
                f"IterableDataset has no position to restore); resume from an epoch end's "
                f"checkpoint (checkpoints/epoch_<k>.pt with checkpoint.keep > 0)."
            )
