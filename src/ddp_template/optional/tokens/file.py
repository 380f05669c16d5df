"""A token file: a flat array of token ids (nanoGPT's ``.bin`` format: little-endian uint16, or
uint32 for vocabularies over 65,536) beside ``meta.json``, the directory's metadata.

``meta.json`` gives the dtype, the vocabulary size, the tokenizer (``bytes``: one token per
UTF-8 byte, what bits per byte needs) and each file's length in tokens, which the file's size
must agree with. The directory is a local path or an ``s3://`` URL (read through ``storage``).
A local file opens as a read-only memory map: nothing is read until a window is. An object up
to ``HOLD_BYTES`` is read whole on first use and held (a random window per request is bound by
the request rate: 8 KiB of windows per round trip); a larger one's windows are read by byte
ranges, overlapping or near windows in one range, a batch's ranges at once (``READERS``
threads per process).
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddp_template import storage
from ddp_template.errors import ConfigError
from ddp_template.storage import Folder, Storage, said_for

META = "meta.json"
FORMAT = "ddp_template.optional.tokens/1"
DTYPES: dict[str, np.dtype[np.unsignedinteger]] = {
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
}
BYTES = "bytes"  # the tokenizer of byte-level files: token = one UTF-8 byte, vocabulary 256
READERS = 8  # threads a process reads an object's ranges with
HOLD_BYTES = 64 << 20  # an object up to this size is read whole once and held in memory
HOLD_PART = 8 << 20  # bytes per request of such a whole read


def dtype_for(vocab_size: int) -> str:
    """The narrowest dtype that holds ids below ``vocab_size``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


@dataclass(frozen=True)
class TokenMeta:
    """A directory's ``meta.json``."""

    dtype: str
    vocab_size: int
    tokenizer: str  # "bytes", or a name of yours ("gpt2", ...): only "bytes" has bits per byte
    tokens: dict[str, int]  # file name → its length in tokens

    @classmethod
    def read(cls, where: Storage, raw: bytes | None) -> TokenMeta:
        """The ``meta.json`` of ``where``, read as ``raw`` (None: there is none)."""
        path, directory = where.where(META), where.root
        if raw is None:
            raise ConfigError(
                f"data.path={directory} has no {META} (the token files' dtype, vocabulary and "
                f"lengths); write the files with python -m "
                f"ddp_template.optional.tokens.writer write, or "
                f'add {META} as README "Token files" shows.'
            )
        try:
            body = json.loads(raw)
            meta = cls(
                dtype=str(body["dtype"]),
                vocab_size=int(body["vocab_size"]),
                tokenizer=str(body.get("tokenizer", "")),
                tokens={str(k): int(v) for k, v in body["tokens"].items()},
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(
                f"{path} is not token metadata ({type(exc).__name__}: {exc}); it needs "
                f'{{"dtype": "uint16", "vocab_size": N, "tokens": {{"train.bin": T, ...}}}}.'
            ) from None
        if meta.dtype not in DTYPES:
            raise ConfigError(
                f"{path} gives dtype {meta.dtype!r}; token files are {' or '.join(DTYPES)} "
                f"(uint32 for vocabularies over 65,536): rewrite the file in one of them."
            )
        limit = 2 ** (8 * DTYPES[meta.dtype].itemsize)
        if not 1 <= meta.vocab_size <= limit:
            raise ConfigError(
                f"{path} gives vocab_size {meta.vocab_size}, which {meta.dtype} ids cannot hold "
                f"(1..{limit}); use dtype uint32 or fix vocab_size."
            )
        return meta

    def write(self, directory: Path) -> Path:
        path = Path(directory) / META
        body = {
            "format": FORMAT,
            "dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "tokenizer": self.tokenizer,
            "tokens": self.tokens,
        }
        tmp = path.with_name(META + ".tmp")
        tmp.write_text(json.dumps(body, indent=2) + "\n")
        tmp.replace(path)
        return path


@dataclass(frozen=True)
class TokenFile:
    """One token file, checked against its metadata: a local one memory-mapped read-only
    (``ids``), an object read by ranges (``ids`` None)."""

    storage: Storage
    name: str
    meta: TokenMeta
    count: int  # tokens
    ids: np.memmap | np.ndarray | None

    @classmethod
    def open(cls, directory: str | Path, name: str, key: str) -> TokenFile:
        """``directory/name``, the file ``key`` (a config key) names."""
        where = storage.at(directory, key="data.path")
        path = where.where(name)
        with said_for("data.path", str(directory)):  # a wrong bucket, refused credentials
            held = set(where.names())
            raw = where.read(META) if META in held else None
            size = where.size(name) if name in held else 0
        if name not in held:
            raise ConfigError(
                f"{key}={name}: no token file {path}; write it with python -m "
                f"ddp_template.optional.tokens.writer write --text FILE --out {directory}, or "
                f"point data.path at the directory that holds it."
            )
        meta = TokenMeta.read(where, raw)
        dtype = DTYPES[meta.dtype]
        if size % dtype.itemsize:
            raise ConfigError(
                f"{path} is {size:,} bytes, not a whole number of {meta.dtype} tokens "
                f"({dtype.itemsize} bytes each): the file is truncated or not {meta.dtype}; "
                f"rewrite it, or fix dtype in {where.where(META)}."
            )
        count = size // dtype.itemsize
        if meta.tokens.get(name) != count:
            said = meta.tokens.get(name)
            raise ConfigError(
                f"{where.where(META)} says {name} holds {said} tokens but {path} holds {count:,} "
                f"{meta.dtype} tokens: the file was changed after its metadata was written; "
                f"rewrite both with the writer, or set tokens.{name} to {count} if the file is "
                f"right."
            )
        ids = None
        if isinstance(where, Folder):
            ids = (
                np.memmap(where.path / name, dtype=dtype, mode="r") if count else np.zeros(0, dtype)
            )
        return cls(where, name, meta, count, ids)

    @property
    def where(self) -> str:
        return self.storage.where(self.name)

    def __len__(self) -> int:
        return self.count

    def rows(self, starts: np.ndarray, span: int) -> np.ndarray:
        """The ``span`` tokens from each of ``starts``: one row each."""
        ids = self.ids if self.ids is not None else self._held()
        if ids is not None:
            return ids[starts[:, None] + np.arange(span)]
        dtype = DTYPES[self.meta.dtype]
        order = np.argsort(starts, kind="stable")
        first = starts[order]
        groups = np.split(order, np.flatnonzero(np.diff(first) > 2 * span) + 1)

        def read(group: np.ndarray) -> np.ndarray:
            lo, hi = int(starts[group].min()), int(starts[group].max()) + span
            data = self.storage.read_range(self.name, lo * dtype.itemsize, hi * dtype.itemsize)
            return np.frombuffer(data, dtype)[(starts[group] - lo)[:, None] + np.arange(span)]

        out = np.empty((len(starts), span), dtype)
        parts = [read(groups[0])] if len(groups) == 1 else list(_readers().map(read, groups))
        for group, part in zip(groups, parts, strict=True):
            out[group] = part
        return out

    def _held(self) -> np.ndarray | None:
        """An object of up to ``HOLD_BYTES``: its tokens, read whole once (``HOLD_PART`` bytes a
        request, at once) and held (by the process, and the loader workers forked after)."""
        dtype = DTYPES[self.meta.dtype]
        size = self.count * dtype.itemsize
        if size > HOLD_BYTES:
            return None
        with _pool_lock:
            ids = _held.get(self.where)
        if ids is None:
            parts = _readers().map(
                lambda at: self.storage.read_range(self.name, at, min(size, at + HOLD_PART)),
                range(0, size, HOLD_PART),
            )
            ids = np.frombuffer(b"".join(parts), dtype)
            with _pool_lock:
                _held[self.where] = ids
        return ids


_pool: dict[int, ThreadPoolExecutor] = {}
_held: dict[str, np.ndarray] = {}  # an object's tokens, by its URL
_pool_lock = threading.Lock()


def _readers() -> ThreadPoolExecutor:
    """This process's threads for range reads (a loader worker after the fork makes its own)."""
    with _pool_lock:
        if os.getpid() not in _pool:
            _pool.clear()
            _pool[os.getpid()] = ThreadPoolExecutor(READERS, thread_name_prefix="tokens")
        return _pool[os.getpid()]


def write_tokens(directory: Path, name: str, ids: np.ndarray, meta: TokenMeta) -> TokenMeta:
    """Write ``ids`` as ``directory/name`` and record its length in ``meta.json``; returns the
    metadata written. Ids at or above the vocabulary are refused before anything is written."""
    directory = Path(directory)
    ids = np.asarray(ids)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= meta.vocab_size):
        raise ConfigError(
            f"{name}: token ids span {int(ids.min())}..{int(ids.max())}, outside the "
            f"vocabulary 0..{meta.vocab_size - 1}; pass the tokenizer's vocabulary size."
        )
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (name + ".tmp")
    ids.astype(DTYPES[meta.dtype]).tofile(tmp)
    tmp.replace(directory / name)
    updated = TokenMeta(
        meta.dtype, meta.vocab_size, meta.tokenizer, {**meta.tokens, name: ids.size}
    )
    updated.write(directory)
    return updated
