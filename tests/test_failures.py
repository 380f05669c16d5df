"""Which rank caused a failed run: the decision over exit codes and records, both orders, and a
rank's own check of the peers on its host (what the template can know under torchrun)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import PY, ROOT, run_env

from ddp_template.process import exit_records
from ddp_template.process.exit_records import Failure, cause

CLOSED = "Connection closed by peer"
KILLED_1 = (
    "rank 1 was killed by SIGKILL (no Python exception: the OOM killer, kill -9 or a node "
    "watchdog?)"
)


def collective(t: float) -> Failure:
    """What rank 0 records when its peer's process is gone: gloo's error, in a collective."""
    tb = f"Traceback (most recent call last):\nRuntimeError: [pair.cc:545] Read error: {CLOSED}"
    return Failure(time=t, attempt=0, traceback=tb, peer_gone=CLOSED)


def raised(t: float, what: str) -> Failure:
    return Failure(time=t, attempt=0, traceback=f"Traceback (most recent call last):\n{what}")


def orders(exits: dict[int, int]) -> list[dict[int, int]]:
    """The same exit codes in both orders (the order the launcher collected them)."""
    return [dict(exits.items()), dict(reversed(exits.items()))]


@pytest.mark.parametrize("seen", [0, 1])
@pytest.mark.parametrize("order", [0, 1])
def test_a_killed_rank_is_the_cause_whichever_rank_the_launcher_saw_first(
    seen: int, order: int
) -> None:
    """Rank 1 SIGKILLed, rank 0's next collective failed for it: rank 1 is named, rank 0's
    failure is one line after it. Also when rank 0 was seen first (both gone by the poll)."""
    exits = orders({0: 1, 1: -9})[order]
    verdict = cause(exits=exits, failures={0: collective(10.0)}, seen=seen)
    assert verdict.rank == 1 and verdict.exitcode == 1
    assert verdict.report.splitlines() == [
        KILLED_1,
        f"rank 0 then failed in a collective ({CLOSED})",
    ]


@pytest.mark.parametrize("order", [0, 1])
def test_a_killed_rank_seen_first_is_the_cause_not_the_rank_the_launcher_then_stopped(
    order: int,
) -> None:
    """Seen first, rank 1 (SIGKILL); the launcher then stopped rank 0 (SIGTERM, no record)."""
    verdict = cause(exits=orders({0: -15, 1: -9})[order], failures={}, seen=1)
    assert verdict.rank == 1
    assert verdict.report.splitlines() == [KILLED_1, "rank 0 then ended by SIGTERM"]


def test_an_unseen_killed_rank_beats_the_launchers_sigterm() -> None:
    """Three ranks: rank 2 seen first with a collective failure; rank 1 killed with SIGKILL
    before, rank 0 stopped with SIGTERM by the launcher: rank 1 is the cause."""
    exits = {0: -15, 1: -9, 2: 1}
    verdict = cause(exits=exits, failures={2: collective(5.0)}, seen=2)
    assert verdict.rank == 1
    assert verdict.report.splitlines()[0] == KILLED_1


@pytest.mark.parametrize("seen", [0, 1])
@pytest.mark.parametrize("first", ["exception", "collective"])
def test_a_real_exception_wins_over_the_collective_failures_it_caused(
    seen: int, first: str
) -> None:
    """Rank 1 raised, rank 0's collective failed for it: rank 1's traceback is the report,
    whichever rank the launcher saw and even when rank 0's record is the earlier (clocks)."""
    t_collective = 9.0 if first == "collective" else 11.0
    found = {0: collective(t_collective), 1: raised(10.0, "RuntimeError: a bug on rank 1")}
    verdict = cause(exits={0: 1, 1: 1}, failures=found, seen=seen)
    assert verdict.rank == 1
    lines = verdict.report.splitlines()
    assert lines[0] == "rank 1 failed (exit code 1):" and "a bug on rank 1" in lines[-2]
    assert lines[-1] == f"rank 0 then failed in a collective ({CLOSED})"


def test_the_earliest_real_exception_wins() -> None:
    found = {0: raised(12.0, "ValueError: late"), 1: raised(11.0, "KeyError: early")}
    verdict = cause(exits={0: 1, 1: 1}, failures=found, seen=0)
    assert verdict.rank == 1 and "KeyError: early" in verdict.report


def test_without_a_known_cause_the_earliest_collective_failure_is_reported() -> None:
    """Nothing on this node explains it (a peer on another node, say): today's report."""
    found = {0: collective(3.0), 1: collective(2.0)}
    verdict = cause(exits={0: 1, 1: 1}, failures=found, seen=0)
    assert verdict.rank == 1 and verdict.report.startswith("rank 1 failed (exit code 1):\n")
    assert verdict.report.splitlines()[-1] == f"rank 0 then failed in a collective ({CLOSED})"


def test_an_exit_code_without_an_exception_and_a_native_crash_are_named() -> None:
    verdict = cause(exits={0: 1, 1: 3}, failures={0: collective(1.0)}, seen=0)
    assert verdict.rank == 1 and verdict.exitcode == 3
    assert verdict.report.splitlines()[0] == "rank 1 exited with code 3 without a Python exception"
    verdict = cause(exits={0: 1, 1: -11}, failures={0: collective(1.0)}, seen=0)
    assert verdict.report.splitlines()[0] == (
        "rank 1 was killed by SIGSEGV (no Python exception: a crash in native code or a signal "
        "from outside?)"
    )


def test_records_of_an_earlier_attempt_are_ignored(tmp_path: Path) -> None:
    """Under dist.max_restarts only the failed attempt's records count (from its start)."""
    for rank, t in ((0, 50.0), (1, 120.0)):
        (tmp_path / f"rank{rank}").mkdir()
        record = {"time": t, "attempt": 0, "traceback": f"tb {rank}", "peer_gone": None}
        (tmp_path / f"rank{rank}" / "error.json").write_text(json.dumps(record))
    assert sorted(exit_records.read_failures(tmp_path, since=100.0)) == [1]


# A peer rank on this host: records its start, then ends the way the test asks.
PEER = """
import sys
from pathlib import Path
from ddp_template.process import exit_records
run_dir, how = Path(sys.argv[1]), sys.argv[2]
exit_records.record_start(run_dir, 1)
if how == "raises":
    try:
        raise ValueError("a bug on rank 1")
    except ValueError as exc:
        exit_records.record_failure(run_dir, 1, exc)
elif how == "config_error":
    exit_records.record_exit(run_dir, 1, 2)
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize(
    "how,quiet",
    [("killed", True), ("raises", False), ("config_error", False), ("running", False)],
)
def test_a_rank_whose_collective_failed_names_a_peer_killed_without_exception(
    tmp_path: Path, how: str, quiet: bool
) -> None:
    """Rank 0 (this process) fails in a collective; its peer on this host was SIGKILLed (a
    zombie until reaped), raised, left with a config error, or still runs: only the first
    is named, in rank 0's record and as a note on its exception."""
    env = {k: v for k, v in run_env().items() if k != "TORCHELASTIC_RESTART_COUNT"}
    peer = subprocess.Popen(
        [PY, "-c", PEER, str(tmp_path), how],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdout.readline() == "ready\n"  # its records are written
        if how == "killed":
            peer.kill()
        elif how != "running":
            peer.stdin.close()  # it exits normally
        exit_records.record_start(tmp_path, 0)
        exc = RuntimeError(f"[pair.cc:545] Read error [127.0.0.1]:1234: {CLOSED}")
        if how == "running":  # a peer still running is left out once the wait is over
            assert exit_records.quiet_peers(tmp_path, 0, settle_s=0.2) == []
            assert peer.poll() is None
            return
        exit_records.record_failure(tmp_path, 0, exc)
    finally:
        peer.kill()
        peer.wait()
    note = f"rank 1 (pid {peer.pid}) exited without a Python exception — killed by a signal?"
    record = json.loads((tmp_path / "rank0" / "error.json").read_text())
    assert record["peer_gone"] == CLOSED
    assert (note in record["traceback"]) == quiet
    assert getattr(exc, "__notes__", []) == ([note] if quiet else [])


def test_exit_codes_fail_soft_when_torchs_agent_changes() -> None:
    """The one place that reads torch internals gives nothing rather than raise."""
    from ddp_template.launch import _exit_codes

    assert _exit_codes(object(), object()) == {}


def _process(run_dir: Path, rank: int, host: str, address: str, attempt: int = 0) -> None:
    record = {"pid": 1, "host": host, "attempt": attempt, "created": 0.0, "address": address}
    (run_dir / f"rank{rank}").mkdir()
    (run_dir / f"rank{rank}" / "process.json").write_text(json.dumps(record))


@pytest.mark.parametrize(
    "message",
    [
        "[pair.cc:561] Connection closed by peer [10.0.0.2]:30929. This is typically caused by",
        "[pair.cc:545] Read error [10.0.0.2]:8891: Connection reset by peer. This is typically",
    ],
)
def test_a_collective_failure_names_the_host_at_the_peer_address(
    tmp_path: Path, message: str
) -> None:
    """gloo's two words for a peer gone, with its address: the host and ranks at that address
    in this attempt's records (not an earlier attempt's, never this rank's own host)."""
    for rank, (host, address) in enumerate(
        [("node0", "10.0.0.1"), ("node0", "10.0.0.1"), ("node1", "10.0.0.2"), ("node1", "10.0.0.2")]
    ):
        _process(tmp_path, rank, host, address)
    _process(tmp_path, 4, "node2", "10.0.0.2", attempt=1)
    assert exit_records.remote_peers(tmp_path, 0, message) == ("node1", [2, 3])
    assert exit_records.remote_peers(tmp_path, 2, message) is None  # its own host
    assert exit_records.remote_peers(tmp_path, 0, "Connection closed by peer") is None
