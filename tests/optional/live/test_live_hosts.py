"""fault_tolerance=live across hosts: 2 hosts x 2 ranks made of network namespaces
(``tests/hosts.py``), the template's launcher on each host, the membership coordinator in
host0's.

- host1's processes all SIGKILLed at once mid-epoch: the survivors' next step commits within
  5 s, in the same processes to the end; host1's launcher started again rejoins; every epoch's
  verdict ok and replay lists every sample of the interrupted epoch exactly once.
- host1's link cut mid-epoch and healed 10 s later: the survivors go on; host1's ranks stop on
  their own and nothing in the run (metrics rows, live record, checkpoints, summary) was
  written by them in or after the membership that dropped them; once healed, host1's agent
  starts its slots again and they rejoin.

Needs root (``make test-hosts``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers import (
    Started,
    events,
    jsonl,
    live_rows,
    run_env,
    start,
    summary,
    train_cmd,
    verdicts,
)
from hosts import Hosts, unavailable
from test_elastic import replayed_epoch

pytestmark = [
    pytest.mark.hosts,
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
]

RUN = "livehosts"
N_DIGITS = 1438
# batch 3 x 4 ranks: 120 steps an epoch, a global batch of 12 that 3, 2 and 1 ranks keep too.
LIVE = [
    "dist.nproc=2",
    "dist.nnodes=2",
    "fault_tolerance=live",
    "fault_tolerance.coordinator=host0:29400",
    "model=mlp",
    "model.in_features=64",
    "model.out_features=10",
    "loader.batch_size=3",
    "sampler=exact",  # nothing padded or dropped: replay lists every sample exactly once
    "log_every=1",
]


def _launch(hosts: Hosts, out: Path, node: int, *overrides: str) -> Started:
    cmd = train_cmd(out, *LIVE, *overrides, f"dist.node_rank={node}")
    return start(hosts.command(node, cmd), env=run_env(RUN_ID=RUN))


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "rank0" / "metrics.jsonl"
    return sum(1 for r in jsonl(path) if "train/loss" in r) if path.exists() else 0


def _wait_steps(run_dir: Path, steps: int, *agents: Started) -> None:
    """Until rank 0 has logged ``steps`` steps (mid-epoch 0: 120 steps long)."""
    deadline = time.monotonic() + 180
    while _steps_logged(run_dir) < steps:
        if any(a.popen.poll() is not None for a in agents) or time.monotonic() > deadline:
            raise AssertionError(agents[0].wait(check=False).stderr[-3000:])
        time.sleep(0.05)


def _pids(rows: list[dict], members: list[str]) -> set[tuple[int, ...]]:
    """The processes of ``members`` in every membership they are in."""
    return {
        tuple(m["pids"][i] for i in members)
        for m in events(rows, "membership")
        if set(members) <= set(m["members"])
    }


def test_a_host_killed_mid_epoch_is_survived_and_rejoins(tmp_path: Path) -> None:
    run_dir = tmp_path / "outputs" / RUN
    with Hosts(2) as hosts:
        agents = [_launch(hosts, tmp_path, node, "epochs=3") for node in (0, 1)]
        _wait_steps(run_dir, 30, *agents)
        killed = time.time()
        assert len(hosts.kill(1)) >= 3  # the launcher and its two ranks, all at once
        agents[1].wait(check=False)
        again = _launch(hosts, tmp_path, 1, "epochs=3")  # host1 comes back: the same command
        again.wait(timeout=300)
        agents[0].wait(timeout=300)
    rows = live_rows(run_dir)
    lost = events(rows, "lost")
    assert sorted(r["slot"] for r in lost) == [2, 3], rows
    first = events(rows, "regrouped")[0]
    assert (first["epoch"], first["world_from"], first["world_to"]) == (0, 4, 2), first
    assert first["position"] > 0 and first["derived_ranks"] == [2, 3], first
    committed = events(rows, "committed")[0]
    assert committed["step"] == first["step"] + 1
    assert committed["time"] - killed < 5.0, (committed, killed)
    assert len(_pids(rows, ["0.0", "1.0"])) == 1, rows  # the survivors' processes, to the end
    memberships = [m["members"] for m in events(rows, "membership")]
    assert memberships[-1] == ["0.0", "1.0", "2.1", "3.1"], memberships  # host1 rejoined
    finished = {(r["slot"], r["incarnation"]) for r in events(rows, "finished")}
    assert finished == {(0, 0), (1, 0), (2, 1), (3, 1)}, rows
    assert [ok for ok, _ in verdicts(run_dir).values()] == [1, 1, 1]
    seen = replayed_epoch(run_dir)
    assert set(seen) == set(range(N_DIGITS)), "replay misses training samples"
    assert set(seen.values()) == {1}, seen.most_common(3)


def _written(run_dir: Path) -> list[tuple[str, str, int]]:
    """(file, writer, membership) of every row and file a rank wrote into the run: metrics and
    spike rows, the live record's rank rows, the checkpoints, the summary. Each must carry its
    writer's token."""
    found = []
    for path in [*run_dir.glob("rank*/metrics.jsonl"), *run_dir.glob("rank*/spikes.jsonl")]:
        found += [(str(path), r["fence/writer"], r["fence/membership"]) for r in jsonl(path)]
    ranks = [r for r in live_rows(run_dir) if "since_start_s" not in r]  # not the coordinator's
    found += [("live.jsonl", r["fence/writer"], r["fence/membership"]) for r in ranks]
    for path in (run_dir / "checkpoints").glob("*.pt"):
        fence = torch.load(path, weights_only=False, map_location="cpu")["fence"]
        found.append((str(path), fence["writer"], fence["membership"]))
    body = summary(run_dir)
    found.append(("summary.json", body["fence/writer"], body["fence/membership"]))
    return found


def test_a_cut_host_is_fenced_and_rejoins_once_healed(tmp_path: Path) -> None:
    run_dir = tmp_path / "outputs" / RUN
    with Hosts(2) as hosts:
        agents = [_launch(hosts, tmp_path, node, "epochs=40") for node in (0, 1)]
        _wait_steps(run_dir, 30, *agents)
        hosts.cut(1)
        cut_at = time.monotonic()
        rows: list[dict] = []
        while not any(r["members"] == ["0.0", "1.0"] for r in events(rows, "membership")):
            assert time.monotonic() - cut_at < 60, rows
            time.sleep(0.2)
            rows = live_rows(run_dir)
        time.sleep(max(0.0, 10 - (time.monotonic() - cut_at)))
        hosts.heal(1)
        second = agents[1].wait(timeout=300)
        agents[0].wait(timeout=300)
    rows = live_rows(run_dir)
    dropped = next(m for m in events(rows, "membership") if m["members"] == ["0.0", "1.0"])
    assert [r["why"][:10] for r in events(rows, "lost")] == ["silent for"] * 2, rows
    assert len(_pids(rows, ["0.0", "1.0"])) == 1, rows
    assert events(rows, "membership")[-1]["members"] == ["0.0", "1.0", "2.1", "3.1"], rows
    # each cut rank stops on its own: its watchdog (no beat landed) or a write its lapsed lease
    # refused, whichever comes first
    said = [line for line in second.stderr.splitlines() if "is out of the run" in line]
    assert len(said) == 2 and all("writes nothing more into the run" in s for s in said), said
    written = _written(run_dir)
    cut = [w for w in written if w[1] in ("2.0", "3.0")]
    assert cut and all(gen < dropped["gen"] for _, _, gen in cut), cut
    assert all(ok == 1 for ok, _ in verdicts(run_dir).values())
