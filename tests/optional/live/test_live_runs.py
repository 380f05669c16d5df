"""fault_tolerance=live for real: 3 gloo ranks under the template's launcher, ranks killed and
killed mid-run, the survivors going on in the same processes and replacements rejoining.

- rank 2 SIGKILLed inside step 10's gradient all-reduce: ranks 0 and 1 keep their PIDs to the
  end, the next step commits within 10 s of the kill, the slot's replacement rejoins; every
  epoch's verdict ok, replay lists each training index of the interrupted epoch once, and the
  final weights are those of one process fed the committed global batches replay lists; also
  with checkpoint.async_save taking a checkpoint every 3 steps.
- rank 0 killed as a checkpoint starts, twice in one epoch; a rank killed between steps; rank
  0 killed as the evaluation starts; a stopped rank (SIGSTOP) found by its silent heartbeat:
  each survived, the epoch's verdict ok.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import compose_conf
from helpers import events, live_rows, run, run_env, summary, train_cmd, verdicts
from test_elastic import replayed_epoch

from ddp_template.checkpoint import load
from ddp_template.config.boundary import typed
from ddp_template.models import build_model
from ddp_template.optim import build_optimizer, build_scheduler
from ddp_template.replay import load_run, step_rows
from ddp_template.sinks.console import DERIVED

N_DIGITS = 1438
LIVE = ["dist.nproc=3", "fault_tolerance=live", "fault.signal=SIGKILL"]
# An MLP (no batch statistics, no dropout): one process fed the same global batches trains to
# the same weights; 60 steps an epoch (batch 8 x 3 ranks), so the replacement (ready about
# 0.2 s after its start here) is admitted long before the run's 120 steps end.
MLP = [
    "model=mlp",
    "model.in_features=64",
    "model.out_features=10",
    "epochs=2",
    "loader.batch_size=8",
    "log_every=1",
]


def _live_run(tmp: Path, name: str, *overrides: str) -> Path:
    """The run's directory; what the launch printed is kept beside it (``_said``)."""
    proc = run(train_cmd(tmp, *LIVE, *overrides), env=run_env(RUN_ID=name), timeout=300)
    (tmp / f"{name}.out").write_text(proc.stdout + proc.stderr)
    return tmp / "outputs" / name


def _said(run_dir: Path) -> str:
    return (run_dir.parent.parent / f"{run_dir.name}.out").read_text()


# checkpoint.async_save: step 9's checkpoint in flight (its weights copied before step 10's
# optimizer step) as step 10's all-reduce breaks; the regroup restores after the copy.
ASYNC_SAVES = ["checkpoint.every_steps=3", "checkpoint.async_save=true"]


@pytest.fixture(scope="module", params=[[], ASYNC_SAVES], ids=["sync", "async"])
def killed_in_allreduce(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Path:
    out = tmp_path_factory.mktemp("live")
    return _live_run(
        out,
        "allreduce",
        *MLP,
        "fault.rank=2",
        "fault.crash_at_step=10",
        "fault.phase=allreduce",
        *request.param,
    )


def test_a_rank_killed_in_the_allreduce_is_survived_and_its_slot_rejoins(
    killed_in_allreduce: Path,
) -> None:
    rows = live_rows(killed_in_allreduce)
    members = events(rows, "membership")
    assert [m["members"] for m in members] == [
        ["0.0", "1.0", "2.0"],
        ["0.0", "1.0"],
        ["0.0", "1.0", "2.1"],
    ], members
    for slot in ("0.0", "1.0"):  # the survivors never restarted
        assert len({m["pids"][slot] for m in members}) == 1, members
    finished = {(r["slot"], r["incarnation"]) for r in events(rows, "finished")}
    assert finished == {(0, 0), (1, 0), (2, 1)}, rows
    lost = events(rows, "lost")
    assert [(r["slot"], r["why"]) for r in lost] == [(2, "killed by SIGKILL")], lost
    regrouped = events(rows, "regrouped")
    assert [(r["world_from"], r["world_to"], r["derived_ranks"]) for r in regrouped] == [
        (3, 2, [2]),
        (2, 3, []),
    ], regrouped
    # Step 10 broke in its all-reduce: uncommitted, the survivors' 16 samples back to the rest.
    # Or rank 2's part had reached the others before it died: step 10 committed, and each
    # survivor found the loss either inside step 11 (its 8 samples uncommitted) or at the step
    # boundary before reading any (under load one survivor can be a step boundary behind).
    first = regrouped[0]
    assert (first["step"], first["uncommitted_samples"]) in {(9, 16), (10, 0), (10, 8), (10, 16)}
    committed = events(rows, "committed")[0]
    assert committed["step"] == first["step"] + 1, rows
    assert committed["time"] - lost[0]["time"] < 10.0, rows
    epochs = verdicts(killed_in_allreduce)
    assert {s: ok for s, (ok, _) in epochs.items()} == {60: 1, 120: 1}
    seen = replayed_epoch(killed_in_allreduce)
    assert set(seen) == set(range(N_DIGITS)), "replay misses training samples"
    # The padded mode's pads only, of the world size epoch 0's rest was dealt at (3 when the
    # replacement was admitted before the epoch ended, 2 when after): what the ledger counted.
    pads = epochs[60][1] - N_DIGITS
    assert pads in (0, 1, 2) and sum(seen.values()) - N_DIGITS == pads, seen.most_common(3)
    assert summary(killed_in_allreduce)["eval_count"] == 359
    said = [line for line in _said(killed_in_allreduce).splitlines() if "of 3:" in line]
    derived = [line for line in said if line.endswith(DERIVED)]  # the lost rank's, once
    assert len(said) == 3 and len(derived) == 1 and "rank 2 of 3" in derived[0], said


def test_the_weights_are_one_process_fed_the_committed_global_batches(
    killed_in_allreduce: Path,
) -> None:
    """Replay's global batch of every step (each rank's micro-batches, at the world size of
    its segment) trained by one process from the same initial weights, with the same optimizer
    and LR schedule: the live run's final weights within 2e-5 (float32 sums in another order)."""
    cfg = typed(compose_conf(*MLP, "logger=none"))
    replayed = load_run(killed_in_allreduce)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, replayed.splits.info)
    optimizer = build_optimizer(cfg.optim, model)
    scheduler = build_scheduler(cfg.optim, optimizer, replayed.total_steps)
    for step in range(1, replayed.total_steps + 1):
        indices = [i for row in step_rows(replayed, step) for i in row["indices"]]
        x = torch.stack([replayed.train[i][0] for i in indices])
        y = torch.tensor([int(replayed.train[i][1]) for i in indices])
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    live = load(killed_in_allreduce / "checkpoints" / "last.pt")["model"]
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(live[name], tensor, rtol=0, atol=2e-5, msg=name)


def test_rank0_killed_as_checkpoints_start_twice_in_one_epoch(tmp_path: Path) -> None:
    """Rank 0 SIGKILLed as step 5's checkpoint starts (the others in its gather), then the
    process that is rank 0 at step 25 killed there too: two losses in epoch 0 (60 steps of
    8 x 3), each survived whether slot 0's replacement joined between them or not."""
    run_dir = _live_run(
        tmp_path,
        "twice",
        "epochs=1",
        "loader.batch_size=8",
        "checkpoint.every_steps=5",
        "fault.rank=0",
        "fault.crash_at_step=5",
        "fault.phase=checkpoint",
        "fault.again_at_step=25",  # not a multiple of admit_every: no admission regroup there
    )
    rows = live_rows(run_dir)
    assert [r["slot"] for r in events(rows, "lost")] == [0, 1], rows
    regrouped = events(rows, "regrouped")
    assert all(r["epoch"] == 0 for r in regrouped), regrouped
    losses = [r for r in regrouped if r["derived_ranks"]]
    assert [(r["step"], r["derived_ranks"]) for r in losses] == [(5, [0]), (25, [0])], regrouped
    derived = [line for line in _said(run_dir).splitlines() if line.endswith(DERIVED)]
    assert len(derived) == 2 and all("rank 0 of" in line for line in derived), derived
    assert [ok for ok, _ in verdicts(run_dir).values()] == [1]
    seen = replayed_epoch(run_dir)
    assert set(seen) == set(range(N_DIGITS)) and max(seen.values()) <= 2, seen.most_common(3)
    assert summary(run_dir)["eval_count"] == 359


@pytest.mark.parametrize(
    ("phase", "rank", "step", "uncommitted"),
    [("step", 1, 7, 16), ("evaluation", 0, 60, 0)],
    ids=["between-steps", "rank0-at-evaluation"],
)
def test_a_rank_killed_between_steps_or_as_the_evaluation_starts(
    tmp_path: Path, phase: str, rank: int, step: int, uncommitted: int
) -> None:
    """Killed after step 7's update (the others' step 8 cannot complete without it: its 16
    samples go back to the rest), or rank 0 killed as epoch 0's evaluation starts (the other
    survivor waiting on it in the evaluation's first collective, not on the dead rank):
    survived, the verdict ok, the evaluation exact."""
    run_dir = _live_run(
        tmp_path,
        phase,
        "epochs=1",
        "loader.batch_size=8",
        f"fault.rank={rank}",
        f"fault.crash_at_step={step}",
        f"fault.phase={phase}",
    )
    rows = live_rows(run_dir)
    assert [r["slot"] for r in events(rows, "lost")] == [rank], rows
    members = events(rows, "membership")
    survivors = [m for m in members[0]["members"] if m != f"{rank}.0"]
    assert len({tuple(m["pids"][s] for s in survivors) for m in members}) == 1, members
    lost = events(rows, "regrouped")[0]
    assert (lost["step"], lost["derived_ranks"]) == (step, [rank]), lost
    assert lost["uncommitted_samples"] == uncommitted, lost
    assert [ok for ok, _ in verdicts(run_dir).values()] == [1]
    assert summary(run_dir)["eval_count"] == 359


def test_a_stopped_rank_is_found_by_its_heartbeat(tmp_path: Path) -> None:
    """SIGSTOP after step 4: no connection closes; the launcher finds the rank silent for
    dead_after_s, kills it, and the others (in step 5's all-reduce) regroup."""
    run_dir = _live_run(
        tmp_path,
        "stopped",
        "epochs=1",
        "fault.rank=1",
        "fault.crash_at_step=4",
        "fault.signal=SIGSTOP",
        "fault_tolerance.dead_after_s=2",
    )
    rows = live_rows(run_dir)
    lost = events(rows, "lost")
    assert [r["slot"] for r in lost] == [1] and lost[0]["why"].startswith("silent for"), rows
    assert [ok for ok, _ in verdicts(run_dir).values()] == [1]


def test_a_stuck_rank_is_found_by_its_step_progress(tmp_path: Path) -> None:
    """Rank 1 spins in a Python loop after step 4, its heartbeat thread beating on: the others
    wait for it in step 5's all-reduce, past it. The coordinator finds its progress stopped
    for dead_after_s (and not longer than a look past it), its agent kills it, and the others
    regroup: the verdict ok."""
    run_dir = _live_run(
        tmp_path,
        "stuck",
        "epochs=1",
        "fault.rank=1",
        "fault.crash_at_step=4",
        "fault.spin=true",
        "fault_tolerance.dead_after_s=2",
    )
    rows = live_rows(run_dir)
    stuck = events(rows, "stuck")
    assert [r["slot"] for r in stuck] == [1] and 2.0 < stuck[0]["still"] < 2.5, stuck
    lost = events(rows, "lost")
    assert [r["slot"] for r in lost] == [1], rows
    assert lost[0]["why"].startswith("stuck: no step progress for"), lost
    assert "at step 4, 0 micro-batches read" in lost[0]["why"], lost
    assert [ok for ok, _ in verdicts(run_dir).values()] == [1]


def test_below_min_members_the_run_ends_in_one_sentence_and_resumes(tmp_path: Path) -> None:
    """2 ranks, ``min_members=2``: a loss leaves too few, so the launcher ends the run in one
    sentence; the same command (the fault taken out) resumes from the last checkpoint."""
    same = ["fault_tolerance=live", "fault_tolerance.min_members=2", "dist.nproc=2", "epochs=1"]
    fault = ["fault.rank=1", "fault.crash_at_step=6", "fault.signal=SIGKILL"]
    failed = run(
        train_cmd(tmp_path, *same, "checkpoint.every_steps=4", *fault),
        env=run_env(RUN_ID="floor"),
        timeout=300,
        check=False,
    )
    assert failed.returncode == 1, failed.stderr[-2000:]
    said = [line for line in failed.stderr.splitlines() if "min_members" in line]
    assert len(said) == 1 and "fewer than fault_tolerance.min_members=2" in said[0], said
    assert "resumes from its last checkpoint" in said[0], said
    resumed = run(
        train_cmd(tmp_path, *same, "checkpoint.every_steps=4"),
        env=run_env(RUN_ID="floor"),
        timeout=300,
    )
    assert "resumed from" in resumed.stdout + resumed.stderr
    run_dir = tmp_path / "outputs" / "floor"
    assert [ok for ok, _ in verdicts(run_dir).values()] == [1]
