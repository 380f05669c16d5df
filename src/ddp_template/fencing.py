"""Whether this process may still write into the run: its fencing token.

Under ``fault_tolerance=live`` a rank that the membership dropped (cut off, stopped, stuck) must
never write into the run again: the survivors own it from that membership on. So every write
the template promises (a checkpoint, the ledger inside it, a metrics row, the summary, the live
record, the stretches) first asks :func:`token`: the writer's id and the membership it writes
in, stamped into what it writes. A rank whose membership is over (or that cannot prove it is
not, its lease on the coordinator lapsed) does not return from :func:`token`: it stops without
writing (``EXIT_FENCED``), saying why on its stderr only. Without a live membership there is no
token and every write goes through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


class Token(NamedTuple):
    writer: str  # the member id: slot.incarnation
    membership: int  # the membership (generation) the write is made in

    def stamp(self) -> dict[str, Any]:
        """The keys a row or a file carries."""
        return {"fence/writer": self.writer, "fence/membership": self.membership}


Gate = Callable[[str], Token]  # raises or exits where ``what`` may not be written

_gate: Gate | None = None


def install(gate: Gate | None) -> None:
    """The live membership's gate (None: writes are free, no token)."""
    global _gate
    _gate = gate


def token(what: str) -> Token | None:
    """Before writing ``what`` into the run: this process's token, or None without one."""
    return _gate(what) if _gate is not None else None


def stamped(row: dict[str, Any], what: str) -> dict[str, Any]:
    """``row`` with this process's token (unchanged without one), once it may be written."""
    held = token(what)
    return row if held is None else {**row, **held.stamp()}
