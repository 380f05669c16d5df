"""The names the launcher and the ranks share in the launcher's store (under ``live/``)."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddp_template.tolerance import INCARNATION_VAR


def connect(timeout: timedelta) -> dist.Store:
    """A client of the launcher's store (MASTER_ADDR:MASTER_PORT), its live/ keys."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore("live", store)


RECORD = "live.jsonl"  # in the run dir: every membership, loss, regroup and first commit
RECORD_VAR = "DDP_TEMPLATE_LIVE_RECORD"  # its path, for the ranks


def record(path: Path | str, **row: Any) -> None:
    """One row of the run's live record (appends of one line: the launcher and rank 0 both
    write, each row whole)."""
    with open(path, "a") as f:
        f.write(json.dumps({"time": time.time(), **row}) + "\n")


def incarnation() -> int:
    return int(os.environ.get(INCARNATION_VAR, "0"))


def member_id(slot: int, incarnation: int) -> str:
    return f"{slot}.{incarnation}"


def parse(member: str) -> tuple[int, int]:
    slot, inc = member.split(".")
    return int(slot), int(inc)


def members(gen: int) -> str:
    return f"members/{gen}"


def arrival(gen: int, member: str) -> str:
    return f"arrive/{gen}/{member}"


def heartbeat(member: str) -> str:
    return f"heartbeat/{member}"


def ready(member: str) -> str:
    return f"ready/{member}"


LATEST = "latest"
RESULT = "result"
CLOSED = "closed"  # a rank finished the run: a replacement not yet admitted has nothing to join


def latest(store: dist.Store) -> int:
    return int(store.get(LATEST))


def read_members(store: dist.Store, gen: int) -> list[str]:
    return list(json.loads(store.get(members(gen)))["members"])


def publish(store: dist.Store, gen: int, ids: list[str], reason: str) -> None:
    """Membership ``gen`` (its record first, then ``latest``: a reader of one finds the other)."""
    store.set(members(gen), json.dumps({"members": ids, "reason": reason}))
    store.set(LATEST, str(gen))
