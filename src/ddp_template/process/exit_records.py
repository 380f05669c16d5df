"""How each rank ended, and which rank caused a failed run.

A rank that raises writes ``rank<r>/error.json``; a rank killed outright (the OOM killer,
``kill -9``, a node watchdog) writes nothing, and its peers' next collective fails ("Connection
closed by peer"), so the rank a launcher sees exit first is often a peer, not the cause. Each
rank therefore also keeps ``rank<r>/process.json``: its pid, host and attempt from its start,
and its exit code once it leaves through ``train``. A rank whose collective failed because a
peer went away checks the peers on its host (:func:`quiet_peers`), and :func:`cause` decides
from every rank's exit code and records which rank to report.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import resource
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from ddp_template import fencing

log = logging.getLogger("ddp_template")

# What a collective says when a peer's process is gone (gloo's TCP pairs, NCCL).
PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "ncclRemoteError",
    "remote process exited",
)
SETTLE_S = 5.0  # how long a failing rank waits for its peers to end or record their failure


def peer_gone(message: str) -> str | None:
    """The words in ``message`` saying that a collective failed because a peer left, or None."""
    return next((words for words in PEER_GONE if words in message), None)


@dataclass(frozen=True, kw_only=True)
class Failure:
    """A Python exception one rank recorded (``rank<r>/error.json``)."""

    time: float
    attempt: int
    traceback: str
    peer_gone: str | None = None  # a collective failed because a peer left: its words


@dataclass(frozen=True, kw_only=True)
class Process:
    """One rank's process (``rank<r>/process.json``): its start, and its exit through ``train``."""

    pid: int
    host: str
    attempt: int
    created: float  # the OS's start time of the pid: a reused pid is another process
    address: str | None = None  # the address its collectives use (a multi-node gloo rank)
    exit: int | None = None
    peak_rss_mib: float | None = None  # the process's peak resident memory, at its exit


@dataclass(frozen=True, kw_only=True)
class Verdict:
    rank: int  # the rank that caused the failure
    exitcode: int  # the launcher's exit code
    report: str  # what the launcher prints


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _write(path: Path, record: dict[str, Any]) -> None:
    """Atomically (a peer may read it at any moment), and never raising: a record must not
    replace the exception or exit it describes."""
    fencing.token(f"the record {path.name}")  # fault_tolerance=live: still a member
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)


def _read(path: Path) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    return None


def record_start(run_dir: Path, rank: int, address: str | None = None) -> None:
    """This rank's pid, host, attempt and collective address, for a peer that outlives it
    (:func:`quiet_peers`, :func:`remote_peers`)."""
    me = psutil.Process()
    record = {"pid": me.pid, "host": socket.gethostname(), "attempt": _attempt()}
    record |= {"created": me.create_time(), "address": address}
    _write(run_dir / f"rank{rank}" / "process.json", record)


def record_exit(run_dir: Path, rank: int, code: int) -> None:
    """This rank left through ``train`` with ``code`` (an exception, a config error, a stop...)."""
    path = run_dir / f"rank{rank}" / "process.json"
    record = _read(path)
    if record is not None and record.get("pid") == os.getpid():
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        _write(path, {**record, "exit": code, "peak_rss_mib": round(peak, 1)})


def _process(run_dir: Path, rank: int) -> Process | None:
    record = _read(run_dir / f"rank{rank}" / "process.json")
    with contextlib.suppress(TypeError, KeyError):
        return Process(**record)  # type: ignore[arg-type]
    return None


def _failure(run_dir: Path, rank: int) -> Failure | None:
    record = _read(run_dir / f"rank{rank}" / "error.json")
    with contextlib.suppress(TypeError, KeyError):
        return Failure(**record)  # type: ignore[arg-type]
    return None


def record_failure(run_dir: Path, rank: int, exc: BaseException) -> None:
    """This rank's traceback and when it raised, in ``rank<r>/error.json``.

    When the exception is a collective failing because a peer left, the peers on this host that
    ended without a Python exception are named in the record and in a note on ``exc`` (its
    traceback then says so, under torchrun too, where the agent is not the template's).
    """
    gone = peer_gone(str(exc))
    path = run_dir / f"rank{rank}" / "error.json"
    record = {"time": time.time(), "attempt": _attempt(), "peer_gone": gone}
    _write(path, {**record, "traceback": "".join(traceback.format_exception(exc))})
    if gone is None:
        return
    quiet = quiet_peers(run_dir, rank)
    remote = remote_peers(run_dir, rank, str(exc))
    if quiet or remote:
        notes = [
            f"rank {r} (pid {pid}) exited without a Python exception — killed by a signal?"
            for r, pid in quiet
        ]
        if remote:
            host, ranks = remote
            notes.append(
                f"host {host} ({said_ranks(ranks)}) closed its connections: its processes are "
                f"gone (the host lost, or killed together)"
            )
        note = "; ".join(notes)
        log.error("rank %d's collective failed (%s): %s", rank, gone, note)
        if sys.version_info >= (3, 11):  # add_note is 3.11's; on 3.10 the log line says it
            exc.add_note(note)
        _write(path, {**record, "traceback": "".join(traceback.format_exception(exc))})


def _ended(proc: Process) -> bool:
    """Gone, or a zombie (its parent has not reaped it yet)."""
    try:
        found = psutil.Process(proc.pid)
        if abs(found.create_time() - proc.created) > 0.01:
            return True  # the pid was reused: that rank is gone
        return found.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def _wait_for_any_exit(pids: Iterable[int], timeout: float) -> None:
    """Until one of ``pids`` exits, at most ``timeout`` s (a pidfd is readable from its exit)."""
    fds, poller = [], select.poll()
    for pid in pids:
        with contextlib.suppress(AttributeError, OSError):
            fds.append(os.pidfd_open(pid))
            poller.register(fds[-1], select.POLLIN)
    try:
        if fds:
            poller.poll(timeout * 1000)
        else:  # no pidfd (not Linux >= 5.3): check again after the slice
            time.sleep(timeout)
    finally:
        for fd in fds:
            os.close(fd)


def quiet_peers(run_dir: Path, rank: int, *, settle_s: float = SETTLE_S) -> list[tuple[int, int]]:
    """(rank, pid) of the peers of this attempt on this host that ended without a Python
    exception and without leaving through ``train``: killed by a signal, most likely.

    A peer is judged once its state has settled: ended (gone or a zombie), or alive but with a
    failure recorded (it failed too, it is not the cause); at most ``settle_s`` s is spent
    waiting for that, and a peer still running then is left out.
    """
    me = _process(run_dir, rank)
    if me is None:
        return []
    peers: dict[int, Process] = {}
    for path in run_dir.glob("rank*/process.json"):
        r = int(path.parent.name.removeprefix("rank"))
        proc = _process(run_dir, r)
        if r != rank and proc and (proc.host, proc.attempt) == (me.host, me.attempt):
            peers[r] = proc

    def raised(r: int) -> bool:
        failure = _failure(run_dir, r)
        return failure is not None and failure.time >= peers[r].created

    deadline = time.monotonic() + settle_s
    while True:
        unsettled = [p.pid for r, p in peers.items() if not _ended(p) and not raised(r)]
        left = deadline - time.monotonic()
        if not unsettled or left <= 0:
            break
        _wait_for_any_exit(unsettled, min(left, 0.1))  # re-check for new records each 0.1 s
    quiet = []
    for r, proc in sorted(peers.items()):
        now = _process(run_dir, r)
        left_through_train = now is not None and now.pid == proc.pid and now.exit is not None
        if _ended(proc) and not raised(r) and not left_through_train:
            quiet.append((r, proc.pid))
    return quiet


PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")  # gloo: "… by peer [a]:p", "error [a]:p"


def remote_peers(run_dir: Path, rank: int, message: str) -> tuple[str, list[int]] | None:
    """The host and ranks of this attempt at the peer address ``message`` names (gloo's
    "Connection closed by peer [10.0.0.2]:…", "Read error [10.0.0.2]:…: Connection reset by
    peer"), when that is another host, or None."""
    found = PEER_ADDRESS.search(message)
    me = _process(run_dir, rank)
    if found is None or me is None:
        return None
    at = []
    for path in run_dir.glob("rank*/process.json"):
        r = int(path.parent.name.removeprefix("rank"))
        proc = _process(run_dir, r)
        if proc and proc.attempt == me.attempt and proc.address == found.group(1):
            at.append((r, proc.host))
    hosts = {host for _, host in at}
    if len(hosts) != 1 or me.host in hosts:
        return None
    return hosts.pop(), sorted(r for r, _ in at)


def read_failures(run_dir: Path, since: float) -> dict[int, Failure]:
    """rank -> the failure it recorded since ``since`` (the start of the attempt that failed)."""
    found = {}
    for path in run_dir.glob("rank*/error.json"):
        rank = int(path.parent.name.removeprefix("rank"))
        failure = _failure(run_dir, rank)
        if failure is not None and failure.time >= since:
            found[rank] = failure
    return found


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _killed(rank: int, code: int) -> str:
    name = _signal_name(code)
    why = (
        "the OOM killer, kill -9 or a node watchdog?"
        if name == "SIGKILL"
        else "a crash in native code or a signal from outside?"
    )
    return f"rank {rank} was killed by {name} (no Python exception: {why})"


def said_ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def cause(*, exits: Mapping[int, int], failures: Mapping[int, Failure], seen: int) -> Verdict:
    """Which rank caused a failed attempt, and the report: a pure function of every rank's exit
    code (``exits``; negative: killed by that signal), the Python exceptions the ranks recorded
    in that attempt (``failures``) and the rank the launcher saw exit first (``seen``).

    In order: the earliest exception that is not a collective failing for a gone peer; a rank
    killed by a signal with no exception recorded (``seen`` if it is one: every other rank was
    still running when it was seen, and the launcher then stopped them, so prefer a signal
    other than its SIGTERM); a rank that exited non-zero with none; the earliest collective
    failure. The ranks whose collectives then failed get one line; so do those then killed.
    """

    def code_of(rank: int) -> int:
        code = exits.get(rank, 1)
        return code if code > 0 else 1

    raised = [r for r, f in failures.items() if f.peer_gone is None]
    killed = [r for r, code in exits.items() if code < 0 and r not in failures]
    exited = [r for r, code in exits.items() if code > 0 and r not in failures]
    if raised:
        rank = min(raised, key=lambda r: failures[r].time)
        report = f"rank {rank} failed (exit code {code_of(rank)}):\n{failures[rank].traceback}"
    elif killed:
        rank = min(killed, key=lambda r: (r != seen, exits[r] == -signal.SIGTERM, r))
        report = _killed(rank, exits[rank])
    elif exited:
        rank = min(exited, key=lambda r: (r != seen, r))
        report = f"rank {rank} exited with code {exits[rank]} without a Python exception"
    else:
        rank = min(failures, key=lambda r: failures[r].time)
        report = f"rank {rank} failed (exit code {code_of(rank)}):\n{failures[rank].traceback}"
    lines = [report.rstrip()]
    collective = sorted(r for r, f in failures.items() if f.peer_gone and r != rank)
    if collective:
        words = sorted({str(failures[r].peer_gone) for r in collective})
        lines.append(f"{said_ranks(collective)} then failed in a collective ({'; '.join(words)})")
    stopped = sorted(r for r in killed if r != rank)
    if stopped:
        signals = sorted({_signal_name(exits[r]) for r in stopped})
        lines.append(f"{said_ranks(stopped)} then ended by {', '.join(signals)}")
    return Verdict(rank=rank, exitcode=code_of(rank), report="\n".join(lines))
