"""The shard index: which samples each WebDataset tar shard holds, and where in the file.

Shards are given as WebDataset gives them (``/data/train-{000000..000127}.tar``, brace
notation), as local paths or ``s3://`` URLs: either is read through ``storage``. A sample is
WebDataset's: the tar members sharing a key (``<key>.png|jpg|jpeg|npy`` and ``<key>.cls``).
Each shard's index (its keys, labels and the byte range of every sample and of its input
member) is built once with one pass over the tar and cached beside it as ``<shard>.idx.json``
(a file, or an object in the bucket); a shard whose tag changed (its size and modification
time; an object's ETag) is indexed again. Every sample then has a global index: the shards'
samples counted in url order, ``(shard, offset)`` ↔ ``offsets[shard] + offset``.
"""

from __future__ import annotations

import contextlib
import io
import json
import tarfile
from dataclasses import dataclass
from typing import IO

import numpy as np

from ddp_template import storage
from ddp_template.errors import ConfigError
from ddp_template.storage import RangeFile, Storage, said_for

INPUT_EXTS = ("png", "jpg", "jpeg", "npy")
INDEX_VERSION = 2  # 2: stamped with the storage's tag (size and mtime, or the ETag)
INDEX_SUFFIX = ".idx.json"
SCAN_BYTES = 8 << 20  # bytes per read while a shard is scanned


@dataclass(frozen=True)
class Shard:
    """One tar shard: its name in the storage of its folder (a local one, or a bucket's)."""

    storage: Storage
    name: str

    @property
    def where(self) -> str:
        return self.storage.where(self.name)


def expand_urls(key: str, pattern: str | None) -> list[Shard]:
    """The shards of ``data.<key>`` (brace notation; paths or ``s3://`` URLs), each checked to
    exist (one listing per folder)."""
    from braceexpand import braceexpand

    example = f"data.{key}=/data/{key.split('_')[0]}-{{000000..000127}}.tar"
    if not pattern or not str(pattern).strip():
        raise ConfigError(
            f"data.{key}={pattern!r} names no shards; give them in WebDataset's brace "
            f"notation, e.g. {example}."
        )
    pattern = str(pattern).removeprefix("file://").removeprefix("file:")
    folders: dict[str, tuple[Storage, set[str]]] = {}
    shards = []
    with said_for(f"data.{key}", pattern):
        for location in braceexpand(pattern):
            where, name = storage.parent(location, key=f"data.{key}")
            if where.root not in folders:
                folders[where.root] = (where, set(where.names()))
            where, held = folders[where.root]
            if name not in held:
                raise ConfigError(
                    f"data.{key}={pattern} names {where.where(name)}, which does not exist; fix "
                    f"the pattern or write the shards (python -m "
                    f"ddp_template.optional.webdataset.writer write --out DIR)."
                )
            shards.append(Shard(where, name))
    return shards


def _key_and_ext(name: str) -> tuple[str, str] | None:
    """WebDataset's split of a member name: the key (all before the basename's first dot) and
    the extension (all after it)."""
    head, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot or not stem:
        return None
    return (f"{head}/{stem}" if head else stem), ext.lower()


def scan_shard(shard: Shard, key: str) -> dict:
    """One pass over a tar, read front to back once (``SCAN_BYTES`` per read): each sample's
    key, label, byte range and input member."""
    samples: list[list] = []
    current: dict | None = None
    path = shard.where
    raw = io.BufferedReader(RangeFile(shard.storage, shard.name), SCAN_BYTES)
    with raw, tarfile.open(fileobj=raw, mode="r:") as tar:
        for member in tar:
            split = _key_and_ext(member.name) if member.isfile() else None
            if split is None:
                continue
            sample_key, ext = split
            if current is None or current["key"] != sample_key:
                _close(current, samples, path, key)
                current = {
                    "key": sample_key,
                    "label": None,
                    "input": None,
                    "exts": [],
                    "start": member.offset,
                }
            current["exts"].append(ext)
            current["stop"] = member.offset_data + member.size
            if ext == "cls":
                current["label"] = _label(tar, member, f"{sample_key}.cls in {path}", key)
            elif ext in INPUT_EXTS and current["input"] is None:
                current["input"] = (ext, member.offset_data, member.size)
        _close(current, samples, path, key)
    return {"samples": samples}


def _label(tar: tarfile.TarFile, member: tarfile.TarInfo, name: str, key: str) -> int:
    """A ``.cls`` member's integer label."""
    handle = tar.extractfile(member)
    assert handle is not None  # a regular file's member (the scan keeps only those)
    raw = handle.read().decode().strip()
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"data.{key}: {name} holds {raw[:20]!r}, not an "
            f"integer label; write the class index as text, e.g. 3."
        ) from None


def _close(sample: dict | None, samples: list[list], path: str, key: str) -> None:
    """A sample whose members have all been read: its row, once it has a label and an input."""
    if sample is None:
        return
    name = f"{sample['key']!r} in {path}"
    if sample["label"] is None:
        raise ConfigError(
            f"data.{key}: sample {name} has no .cls member (it has "
            f".{', .'.join(sample['exts'])}); every sample needs <key>.cls holding its "
            f"integer label: write the shards with "
            f"python -m ddp_template.optional.webdataset.writer write."
        )
    if sample["input"] is None:
        raise ConfigError(
            f"data.{key}: sample {name} has no input member (it has "
            f".{', .'.join(sample['exts'])}); give each sample one of "
            f".{', .'.join(INPUT_EXTS)}."
        )
    ext, offset, size = sample["input"]
    samples.append(
        [sample["key"], sample["label"], sample["start"], sample["stop"], ext, offset, size]
    )


def shard_entries(shard: Shard, key: str) -> list[list]:
    """The shard's samples from its cached index (``<shard>.idx.json`` beside it, stamped with
    the shard's size and modification time, or its ETag), built and cached (atomically) if
    missing or stale; a folder or bucket that cannot be written keeps the index in memory."""
    where, cache = shard.storage, shard.name + INDEX_SUFFIX
    stamp = {"version": INDEX_VERSION, "tag": where.tag(shard.name)}
    if where.exists(cache):
        try:
            saved = json.loads(where.read(cache))
            if all(saved.get(k) == v for k, v in stamp.items()):
                return saved["samples"]
        except (OSError, ValueError, KeyError):
            pass  # unreadable or half-written by an older version: index again
    entries = scan_shard(shard, key)["samples"]
    body = json.dumps({**stamp, "samples": entries}).encode()

    def fill(f: IO[bytes]) -> None:
        f.write(body)

    with contextlib.suppress(ConfigError, OSError):  # refused (read-only), failed: not cached
        where.publish(cache, fill)
    return entries


@dataclass(frozen=True)
class ShardIndex:
    """Every shard's samples in url order; global index = ``offsets[shard] + offset``."""

    shards: tuple[Shard, ...]
    sizes: np.ndarray  # samples per shard
    offsets: np.ndarray  # global index of each shard's first sample (len(shards) + 1 entries)
    keys: tuple[str, ...]  # __key__ of every sample, by global index
    labels: np.ndarray  # int64 label of every sample, by global index
    starts: np.ndarray  # byte offset of each sample's first member header
    stops: np.ndarray  # byte offset just past each sample's last member
    input_ext: tuple[str, ...]
    input_offset: np.ndarray
    input_size: np.ndarray

    @classmethod
    def of(cls, key: str, pattern: str) -> ShardIndex:
        """The index of ``data.<key>``'s shards (ConfigError: a missing shard, a bad sample)."""
        shards = expand_urls(key, pattern)
        with said_for(f"data.{key}", pattern):
            per_shard = [shard_entries(s, key) for s in shards]
        sizes = np.array([len(e) for e in per_shard], dtype=np.int64)
        if sizes.sum() == 0:
            raise ConfigError(
                f"data.{key}={pattern} holds no samples ({len(shards)} shards, all empty); "
                f"write samples <key>.png|jpg|npy + <key>.cls into them."
            )
        rows = [row for entries in per_shard for row in entries]
        col = list(zip(*rows, strict=True))
        return cls(
            shards=tuple(shards),
            sizes=sizes,
            offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            keys=tuple(col[0]),
            labels=np.array(col[1], dtype=np.int64),
            starts=np.array(col[2], dtype=np.int64),
            stops=np.array(col[3], dtype=np.int64),
            input_ext=tuple(col[4]),
            input_offset=np.array(col[5], dtype=np.int64),
            input_size=np.array(col[6], dtype=np.int64),
        )

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def shard_of(self, index: int) -> int:
        return int(np.searchsorted(self.offsets, index, side="right") - 1)
