"""The names the coordinator, the agents and the ranks share in the coordinator's store
(under ``live/``), and the run's live record."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed as dist

from ddp_template import fencing
from ddp_template.tolerance import INCARNATION_VAR


def connect(timeout: timedelta) -> dist.Store:
    """A client of the coordinator's store (MASTER_ADDR:MASTER_PORT), its live/ keys."""
    return at(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout)


def at(host: str, port: int, timeout: timedelta) -> dist.Store:
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return dist.PrefixStore("live", store)


RECORD = "live.jsonl"  # in the run dir: every membership, loss, regroup and first commit
RECORD_VAR = "DDP_TEMPLATE_LIVE_RECORD"  # its path, for the ranks


def record(path: Path | str, **row: Any) -> None:
    """One row of the run's live record (appends of one line: the coordinator and rank 0 both
    write, each row whole; a rank's row carries its fencing token)."""
    row = fencing.stamped({"time": time.time(), **row}, "a live record row")
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


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


def started(member: str) -> str:
    """Its agent's word that the process runs: ``{"pid", "host", "node"}``."""
    return f"started/{member}"


def exited(member: str) -> str:
    """Its agent's word that the process ended: its exit code (negative: a signal's)."""
    return f"exit/{member}"


def kill(member: str) -> str:
    """The coordinator's word to the member's agent: kill it (silent, or stuck)."""
    return f"kill/{member}"


def broken(gen: int) -> str:
    """A counter the members of ``gen`` add to when a collective of theirs broke."""
    return f"broken/{gen}"


def incarnations(slot: int) -> str:
    """A counter: the processes ever started in ``slot`` (the next one's incarnation)."""
    return f"incarnation/{slot}"


LATEST = "latest"
RESULT = "result"
CLOSED = "closed"  # a rank finished the run: a replacement not yet admitted has nothing to join
ABORT = "abort"  # the coordinator ends the run: {"code", "why"}; every agent ends its ranks
REPLACED = "replaced"  # a counter: the replacements started, against fault_tolerance.replacements


def latest(store: dist.Store) -> int:
    return int(store.get(LATEST))


class Published(NamedTuple):
    """Membership ``gen`` as the coordinator published it."""

    members: list[str]
    reason: str
    sever: list[str]  # the addresses of hosts gone silent: connections to them are shut down


def read_members(store: dist.Store, gen: int) -> Published:
    body = json.loads(store.get(members(gen)))
    return Published(list(body["members"]), body["reason"], list(body.get("sever", [])))


def publish(store: dist.Store, gen: int, ids: list[str], reason: str, sever: list[str]) -> None:
    """Membership ``gen`` (its record first, then ``latest``: a reader of one finds the other)."""
    store.set(members(gen), json.dumps({"members": ids, "reason": reason, "sever": sever}))
    store.set(LATEST, str(gen))


class Beat(NamedTuple):
    """A heartbeat's value: its number, and where the member's training stands (its
    membership, its optimizer step and the micro-batches of the next step it has read)."""

    n: int
    gen: int
    step: int
    held: int

    def __str__(self) -> str:
        return f"{self.n} {self.gen} {self.step} {self.held}"

    @classmethod
    def parse(cls, text: str) -> Beat:
        n, gen, step, held = (int(v) for v in text.split())
        return cls(n, gen, step, held)
