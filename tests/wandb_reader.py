"""Read W&B offline run files (``run-<id>.wandb``) back into plain Python values.

wandb >= 0.30 ships no public reader for offline files, yet the tests must check what each rank
logged without a network. The format, verified against files written by wandb-core 0.31:

* a 7-byte file header ``<4sHB``: ident ``b":W&B"``, magic ``0xBEE1``, version ``0``;
* then a LevelDB-style log in 32 KiB blocks counted from file offset 0 (the header sits inside
  the first block). Each fragment has a 7-byte header ``<IHB``: checksum, length, type
  (1 FULL, 2 FIRST, 3 MIDDLE, 4 LAST). Unlike LevelDB the checksum is plain, unmasked CRC-32
  (zlib/IEEE, not CRC-32C) over the type byte followed by the data. A block tail shorter than a
  fragment header is zero padding;
* each joined payload is a serialized ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

FILE_HEADER = struct.Struct("<4sHB")  # ident, magic, version
FRAGMENT_HEADER = struct.Struct("<IHB")  # crc32, length, type
IDENT, MAGIC, VERSION = b":W&B", 0xBEE1, 0
BLOCK_LEN = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    """What one rank's offline run file says, decoded to plain values."""

    path: Path
    run_id: str = ""
    name: str = ""
    group: str = ""
    job_type: str = ""
    project: str = ""
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    exit_code: int | None = None
    stats: list[dict] = field(default_factory=list)  # system-metric samples, key -> value
    alerts: list[dict] = field(default_factory=list)  # title, text, level
    artifacts: list[dict] = field(default_factory=list)  # name, type, aliases, metadata, files

    @property
    def labels(self) -> set[str]:
        """The process labels (``x_label``) its system metrics carry: ``cpu/l:rank0`` → rank0."""
        return {key.rpartition("/l:")[2] for row in self.stats for key in row if "/l:" in key}


def _check_file_header(data: bytes) -> None:
    """Refuse anything that is not a version-0 W&B log, rather than decode garbage."""
    if len(data) < FILE_HEADER.size:
        raise ValueError(f"not a W&B offline file: only {len(data)} bytes")
    ident, magic, version = FILE_HEADER.unpack_from(data)
    if (ident, magic, version) != (IDENT, MAGIC, VERSION):
        raise ValueError(f"not a W&B offline file: header {ident!r} {magic:#x} v{version}")


def iter_payloads(data: bytes) -> Iterator[bytes]:
    """Yield each record's bytes, joining fragments that were split at 32 KiB block edges.

    A torn last fragment (a run still writing, or killed mid-write) ends the stream quietly;
    a checksum mismatch or an impossible fragment order raises ValueError.
    """
    _check_file_header(data)
    offset, parts = FILE_HEADER.size, []
    while offset + FRAGMENT_HEADER.size <= len(data):
        left_in_block = BLOCK_LEN - offset % BLOCK_LEN
        if left_in_block < FRAGMENT_HEADER.size:
            offset += left_in_block  # zero trailer: no fragment header fits here
            continue
        crc, length, kind = FRAGMENT_HEADER.unpack_from(data, offset)
        start = offset + FRAGMENT_HEADER.size
        chunk = data[start : start + length]
        if kind == 0 or len(chunk) < length:
            break  # preallocated zeros or a torn tail
        if zlib.crc32(bytes([kind]) + chunk) != crc:
            raise ValueError(f"CRC mismatch in fragment at byte {offset}")
        if (kind in (FULL, FIRST)) == bool(parts) or kind not in (FULL, FIRST, MIDDLE, LAST):
            raise ValueError(f"fragment of type {kind} out of order at byte {offset}")
        parts.append(chunk)
        offset = start + length
        if kind in (FULL, LAST):
            yield b"".join(parts)
            parts = []


def _path(item: Any) -> list[str]:
    """An item names its key either flat (``key``) or as a path (``nested_key``)."""
    return list(item.nested_key) or [item.key]


def _set(target: dict, path: list[str], value: Any) -> None:
    for part in path[:-1]:
        target = target.setdefault(part, {})
    target[path[-1]] = value


def _remove(target: dict, path: list[str]) -> None:
    for part in path[:-1]:
        target = target.get(part, {})
    target.pop(path[-1], None)


def _merge(target: dict, updates: Any, removals: Any) -> None:
    """Config and summary arrive as many partial records; later ones win."""
    for item in updates:
        _set(target, _path(item), json.loads(item.value_json))
    for item in removals:
        _remove(target, _path(item))


def _apply_run(run: OfflineRun, rec: Any) -> None:
    """The run record carries identity; a later one (e.g. a rename) overrides non-empty fields."""
    for attr, value in (
        ("run_id", rec.run_id),
        ("name", rec.display_name),
        ("group", rec.run_group),
        ("job_type", rec.job_type),
        ("project", rec.project),
    ):
        if value:
            setattr(run, attr, value)
    _merge(run.config, rec.config.update, rec.config.remove)
    _merge(run.summary, rec.summary.update, rec.summary.remove)


def _apply(run: OfflineRun, record: Any, config_records: list) -> None:
    kind = record.WhichOneof("record_type")
    if kind == "run":
        _apply_run(run, record.run)
    elif kind == "config":  # applied after every run record's config (read_run)
        config_records.append(record.config)
    elif kind == "summary":
        _merge(run.summary, record.summary.update, record.summary.remove)
    elif kind == "history":
        # a logged nested dict {"a": {"b": 1}} arrives as path [a, b]; W&B shows it as "a.b"
        row = {".".join(_path(i)): json.loads(i.value_json) for i in record.history.item}
        run.history.append(row)
    elif kind == "exit":
        run.exit_code = record.exit.exit_code
    elif kind == "stats":
        run.stats.append({i.key: json.loads(i.value_json) for i in record.stats.item})
    elif kind == "alert":
        a = record.alert
        run.alerts.append({"title": a.title, "text": a.text, "level": a.level})
    elif kind == "artifact":
        a = record.artifact
        run.artifacts.append(
            {
                "name": a.name,
                "type": a.type,
                "aliases": list(a.aliases),
                "metadata": json.loads(a.metadata) if a.metadata else {},
                "files": [c.path for c in a.manifest.contents],
            }
        )


def read_run(wandb_file: Path) -> OfflineRun:
    """Decode one ``run-<id>.wandb`` file; ``config`` omits wandb's internal ``_wandb`` key."""
    path = Path(wandb_file)
    run = OfflineRun(path=path)
    config_records: list = []
    for payload in iter_payloads(path.read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        _apply(run, record, config_records)
    # A run record carries the config as of init; under load W&B can write it after a later
    # config.update's record, so the updates go over it in their own order.
    for config in config_records:
        _merge(run.config, config.update, config.remove)
    run.config.pop("_wandb", None)
    return run


def find_runs(root: Path) -> list[OfflineRun]:
    """Every offline run file below ``root`` (one per rank, one more per resume), by path."""
    return [read_run(p) for p in sorted(Path(root).rglob("run-*.wandb"))]
