"""The shard index: which samples each WebDataset tar shard holds, and where in the file.

Shards are given as WebDataset gives them (``/data/train-{000000..000127}.tar``, brace
notation, local paths). A sample is WebDataset's: the tar members sharing a key
(``<key>.png|jpg|jpeg|npy`` and ``<key>.cls``). Each shard's index (its keys, labels and the
byte range of every sample and of its input member) is built once with one pass over the tar
and cached beside it as ``<shard>.idx.json``; a shard whose size or modification time changed
is indexed again. Every sample then has a global index: the shards' samples counted in url
order, ``(shard, offset)`` ↔ ``offsets[shard] + offset``.
"""

from __future__ import annotations

import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddp_template.errors import ConfigError

INPUT_EXTS = ("png", "jpg", "jpeg", "npy")
INDEX_VERSION = 1
INDEX_SUFFIX = ".idx.json"


def expand_urls(key: str, pattern: str | None) -> list[Path]:
    """The shard paths of ``data.<key>`` (brace notation), each checked to exist."""
    from braceexpand import braceexpand

    example = f"data.{key}=/data/{key.split('_')[0]}-{{000000..000127}}.tar"
    if not pattern or not str(pattern).strip():
        raise ConfigError(
            f"data.{key}={pattern!r} names no shards; give them in WebDataset's brace "
            f"notation, e.g. {example}."
        )
    pattern = str(pattern).removeprefix("file://").removeprefix("file:")
    scheme = pattern.split(":", 1)[0] if ":" in pattern.split("/", 1)[0] else None
    if scheme is not None:
        raise ConfigError(
            f"data.{key}={pattern} is a {scheme}: URL; sharded data is read from local files "
            f"(each worker seeks to its range by the shard index), so copy or mount the shards "
            f"and give their paths, e.g. {example}."
        )
    paths = [Path(p) for p in braceexpand(pattern)]
    for path in paths:
        if not path.is_file():
            raise ConfigError(
                f"data.{key}={pattern} names {path}, which does not exist; fix the pattern "
                f"or write the shards (python -m ddp_template.optional.webdataset.writer write "
                f"--out DIR)."
            )
    return paths


def _key_and_ext(name: str) -> tuple[str, str] | None:
    """WebDataset's split of a member name: the key (all before the basename's first dot) and
    the extension (all after it)."""
    head, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot or not stem:
        return None
    return (f"{head}/{stem}" if head else stem), ext.lower()


def scan_shard(path: Path, key: str) -> dict:
    """One pass over a tar: each sample's key, label, byte range and input member."""
    samples: list[list] = []
    current: dict | None = None
    with tarfile.open(path, "r:") as tar:
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


def _close(sample: dict | None, samples: list[list], path: Path, key: str) -> None:
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


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"version": INDEX_VERSION, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def shard_entries(path: Path, key: str) -> list[list]:
    """The shard's samples from its cached index, built (and cached, atomically) if missing
    or stale; a shard folder that cannot be written keeps the index in memory only."""
    cache = path.with_name(path.name + INDEX_SUFFIX)
    stamp = _stamp(path)
    if cache.is_file():
        try:
            saved = json.loads(cache.read_text())
            if all(saved.get(k) == v for k, v in stamp.items()):
                return saved["samples"]
        except (OSError, ValueError, KeyError):
            pass  # unreadable or half-written by an older version: index again
    entries = scan_shard(path, key)["samples"]
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({**stamp, "samples": entries}))
        os.replace(tmp, cache)
    except OSError:
        tmp.unlink(missing_ok=True)
    return entries


@dataclass(frozen=True)
class ShardIndex:
    """Every shard's samples in url order; global index = ``offsets[shard] + offset``."""

    paths: tuple[Path, ...]
    sizes: np.ndarray  # samples per shard
    offsets: np.ndarray  # global index of each shard's first sample (len(paths) + 1 entries)
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
        paths = expand_urls(key, pattern)
        per_shard = [shard_entries(p, key) for p in paths]
        sizes = np.array([len(e) for e in per_shard], dtype=np.int64)
        if sizes.sum() == 0:
            raise ConfigError(
                f"data.{key}={pattern} holds no samples ({len(paths)} shards, all empty); "
                f"write samples <key>.png|jpg|npy + <key>.cls into them."
            )
        rows = [row for entries in per_shard for row in entries]
        col = list(zip(*rows, strict=True))
        return cls(
            paths=tuple(paths),
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
