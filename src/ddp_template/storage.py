"""Where checkpoints and data live: a local folder, or a prefix of an object store.

A location is a local path or a URL. ``at(location)`` gives its :class:`Storage`, which names
what it holds relative to itself (``last.pt``, ``slices/<id>/.metadata``): :class:`Folder` for
a path; for a URL the class ``SCHEMES`` names (``s3://``: the optional wing's ``optional/s3/``,
reached only through this string, so that folder may be deleted). What every storage promises:
``publish`` is atomic (a reader sees the old object or the whole new one, never a part), reads
of a byte range return exactly those bytes (or one sentence naming the object and the range),
and DCP writes and reads its directories through ``dcp_writer``/``dcp_reader``.
"""

from __future__ import annotations

import io
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Protocol

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from ddp_template.errors import ConfigError
from ddp_template.registry import load

SCHEMES = {"s3": "ddp_template.optional.s3.bucket:Bucket"}

Fill = Callable[[IO[bytes]], None]  # writes an object's bytes into the file it is given


class Storage(Protocol):
    """A place holding named objects (``a/b`` names one below a folder ``a``)."""

    root: str  # the location it was made for, as given

    def where(self, name: str) -> str:
        """The full location of ``name``, as the user would write it."""

    def read(self, name: str) -> bytes: ...

    def open(self, name: str) -> IO[bytes]:
        """``name`` as a seekable binary file, read as it is read (``torch.load``'s)."""

    def read_range(self, name: str, begin: int, end: int) -> bytes:
        """Bytes ``begin..end`` (end excluded) of ``name``, exactly."""

    def size(self, name: str) -> int: ...

    def tag(self, name: str) -> str:
        """A stamp of ``name``'s version: it changes whenever the object is written again."""

    def exists(self, name: str) -> bool:
        """Whether ``name`` is a file (an object), not a folder."""

    def names(self, folder: str = "") -> list[str]:
        """What ``folder`` holds, one level down (files and folders), sorted."""

    def publish(self, name: str, fill: Fill, before: Callable[[], None] | None = None) -> None:
        """``name`` written as a whole, atomically; ``before`` runs once the bytes are written
        and before they are published (a test's fault: ``fault.phase=write``)."""

    def remove(self, name: str) -> None:
        """``name`` deleted: a file, or a folder with everything in it (gone already: fine)."""

    def dcp_writer(self, name: str) -> FileSystemWriter: ...

    def dcp_reader(self, name: str) -> FileSystemReader: ...


def is_url(location: str | os.PathLike) -> bool:
    """``s3://bucket/key`` is a URL; a path (``/data/x``, ``x``, ``file:x``) is not."""
    head = str(location).split("/", 1)[0]
    return head.endswith(":") and len(head) > 2 and not str(location).startswith("file:")


def at(location: str | os.PathLike, *, key: str = "checkpoint.folder") -> Storage:
    """The storage at ``location`` (``key``: the setting that gave it, for a refusal)."""
    text = str(location)
    if not is_url(text):
        return Folder(Path(text.removeprefix("file://").removeprefix("file:")).expanduser())
    scheme = text.split(":", 1)[0]
    if scheme not in SCHEMES:
        raise ConfigError(
            f"{key}={text} is a {scheme}: URL, which this template cannot read or write; give a "
            f"local path or an {', '.join(f'{s}://' for s in SCHEMES)} URL."
        )
    kind = load(SCHEMES[scheme], key=f"{key}={text}", fix="give a local path.")
    return kind(text)


def parent(location: str | os.PathLike, *, key: str = "resume") -> tuple[Storage, str]:
    """The storage of the folder holding ``location``, and its name there."""
    text = str(location).rstrip("/")
    head, _, name = text.rpartition("/")
    if not is_url(text):
        path = Path(text).expanduser()
        return Folder(path.parent), path.name
    return at(head, key=key), name


@contextmanager
def said_for(key: str, value: str) -> Iterator[None]:
    """A storage's refusal (one sentence) said for the setting ``key=value`` that led to it."""
    try:
        yield
    except ConfigError as refused:
        if str(refused).startswith(key):  # it names the setting already
            raise
        raise ConfigError(f"{key}={value}: {refused}") from None


def name_of(location: str | os.PathLike) -> str:
    """The last part of a path or URL (``last.pt``)."""
    return str(location).rstrip("/").rpartition("/")[2]


class Folder:
    """A local directory. ``publish`` writes ``<name>.tmp``, fsyncs it, renames it over
    ``name`` (atomic on POSIX) and fsyncs the folder, so the rename itself is durable."""

    def __init__(self, path: Path) -> None:
        self.path, self.root = path, str(path)
        self._handles: dict[str, Any] = {}
        self._pid, self._lock = os.getpid(), threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # a loader worker opens its own handles
        return {**self.__dict__, "_handles": {}, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def where(self, name: str) -> str:
        return str(self.path / name)

    def read(self, name: str) -> bytes:
        return (self.path / name).read_bytes()

    def open(self, name: str) -> IO[bytes]:
        return open(self.path / name, "rb")  # noqa: SIM115 (the caller closes it)

    def read_range(self, name: str, begin: int, end: int) -> bytes:
        with self._lock:
            if self._pid != os.getpid():  # a forked copy: its own handles
                self._handles, self._pid = {}, os.getpid()
            handle = self._handles.get(name)
            if handle is None:
                if len(self._handles) >= OPEN_FILES:  # a reader moves on through its files
                    self._handles.pop(next(iter(self._handles))).close()
                handle = self._handles[name] = open(self.path / name, "rb")  # noqa: SIM115
            handle.seek(begin)
            return handle.read(end - begin)

    def size(self, name: str) -> int:
        return (self.path / name).stat().st_size

    def tag(self, name: str) -> str:
        st = (self.path / name).stat()
        return f"{st.st_size}-{st.st_mtime_ns}"

    def exists(self, name: str) -> bool:
        return (self.path / name).is_file()

    def names(self, folder: str = "") -> list[str]:
        where = self.path / folder
        return sorted(p.name for p in where.iterdir()) if where.is_dir() else []

    def publish(self, name: str, fill: Fill, before: Callable[[], None] | None = None) -> None:
        path = self.path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        if before is not None:
            before()
        os.replace(tmp, path)
        fsync_dir(path.parent)

    def remove(self, name: str) -> None:
        path = self.path / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def dcp_writer(self, name: str) -> FileSystemWriter:
        return FileSystemWriter(self.path / name)

    def dcp_reader(self, name: str) -> FileSystemReader:
        return FileSystemReader(self.path / name)


class RangeFile(io.RawIOBase):
    """An object read by byte ranges as a seekable file (DCP reads each item's slice; a tar
    shard is scanned through one, buffered)."""

    def __init__(self, storage: Storage, name: str) -> None:
        self.storage, self.name, self.at = storage, name, 0
        self.length = storage.size(name)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.at, io.SEEK_END: self.length}[whence]
        self.at = max(0, base + offset)
        return self.at

    def tell(self) -> int:
        return self.at

    def readinto(self, buffer: Any) -> int:
        end = min(self.length, self.at + len(buffer))
        data = self.storage.read_range(self.name, self.at, end)
        buffer[: len(data)] = data
        self.at += len(data)
        return len(data)


OPEN_FILES = 16  # file handles a Folder keeps for read_range (the least recently opened closed)


def fsync_dir(directory: Path) -> None:
    """A folder's entries made durable (a rename in it)."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
