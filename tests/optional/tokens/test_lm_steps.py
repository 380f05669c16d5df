"""A run's length and evaluation cadence in optimizer steps (``max_steps``, ``eval_every_steps``)
and rank 0's step lines (``logger.step_lines``), on ``experiment=lm_bytes`` made small.

168 windows of 33 tokens, 2 ranks x batch 8: 11 steps an epoch. ``max_steps=15`` ends the run
4 steps into epoch 1, whose verdict covers what it read (32 windows a rank); the LR schedule
reaches zero at step 15; ``eval_every_steps=5`` evaluates at steps 5 and 10 (step 15 ends an
epoch, whose end evaluates) and checkpoints there; killed at step 8 and resumed from step 5's
checkpoint, the run ends at step 15 on the uninterrupted run's weights, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_killed_rank_reported, jsonl, run, run_env, summary, train_cmd
from test_resume import assert_identical

from ddp_template.data.epoch_steps import EpochSteps
from ddp_template.errors import ConfigError
from ddp_template.replay import load_run

pytestmark = pytest.mark.needs("gpt")  # experiment=lm_bytes trains model=gpt

SMALL = [
    "experiment=lm_bytes",
    "logger=none",
    "data.size=6000",  # 5,400 train tokens: 168 windows of 33
    "data.block_size=32",
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "loader.batch_size=8",
    "optim.warmup_steps=2",
    "max_steps=15",
    "eval_every_steps=5",
    "log_every=5",
    "logger.step_lines=true",
]


def launch(out: Path, run_id: str, *overrides: str, check: bool = True):
    cmd = train_cmd(out, *SMALL, f"paths.data_root={out / 'data'}", *overrides)
    return run(cmd, env=run_env(RUN_ID=run_id), check=check)


def test_max_steps_ends_the_epoch_it_falls_in_and_sets_the_horizon() -> None:
    """11 steps an epoch, max_steps=15: epoch 0 whole, epoch 1's first 4, none after; the run's
    steps (the LR horizon) 15; step numbering (replay's) unchanged; past the epochs refused."""
    steps = EpochSteps(length=84, batch_size=8, epochs=3, max_steps=15)
    assert steps.steps_per_epoch == 11 and steps.total_steps == 15
    assert [steps.from_step(11 * e, 0).steps_in_epoch for e in range(3)] == [11, 4, 0]
    resumed = steps.from_step(13, 16)  # epoch 1 resumed after its 2nd step
    assert resumed.steps_left(16) == 2 and resumed.cap == 4
    assert steps.batch(15).epoch == 1 and steps.batch(15).stop == 32
    assert resumed.horizon(13, 16, later=11) == 15
    assert not steps.ended(15, 32) and steps.ended(15, 0)
    with pytest.raises(ConfigError, match=r"max_steps=40 .* set epochs=4"):
        EpochSteps(length=84, batch_size=8, epochs=3, max_steps=40).check_reach()


@pytest.fixture(scope="module")
def steps_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("lmsteps")
    proc = launch(out, "whole")
    return out, proc.stdout


def test_a_run_of_max_steps_verifies_its_partial_epoch_and_evaluates_every_n_steps(
    steps_run,
) -> None:
    out, console = steps_run
    run_dir = out / "outputs" / "whole"
    assert "epoch 0 shares (exact, N=168): verdict ok" in console
    assert "epoch 1 shares (exact, N=168): verdict ok" in console
    assert console.count("rank 0: 84 samples") == 1 and console.count("rank 0: 32 samples") == 1
    assert "epoch 2 shares" not in console  # max_steps: no epoch after
    rows = jsonl(run_dir / "rank0" / "metrics.jsonl")
    assert [r["step"] for r in rows if "test/loss" in r] == [5, 10, 11, 15]
    assert [r["shares/total_samples"] for r in rows if "shares/verdict_ok" in r] == [168, 64]
    assert "step 5: test loss" in console and "step 10: test loss" in console
    lines = [line for line in console.splitlines() if "ms/step" in line]
    assert [line.split("] - ")[1].split(":")[0] for line in lines] == [
        "step 5",
        "step 10",
        "step 15",
    ]
    assert "lr 0.000e+00" in lines[-1]  # the schedule's horizon is max_steps
    assert summary(run_dir)["steps"] == 15
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert (last["progress"]["step"], last["progress"]["epoch"]) == (15, 2)
    assert load_run(run_dir).total_steps == 15  # replay knows where the run ended


def test_killed_mid_run_and_resumed_it_ends_at_max_steps_bit_identical(
    steps_run, tmp_path: Path
) -> None:
    """SIGKILL to rank 1 at step 8: the checkpoint eval_every_steps wrote at step 5 resumed, the
    run stops at step 15 on the uninterrupted run's weights and optimizer state."""
    out, _ = steps_run
    kill = ["fault.crash_at_step=8", "fault.rank=1", "fault.signal=SIGKILL"]
    proc = launch(tmp_path, "cut", *kill, check=False)
    assert_killed_rank_reported(proc, rank=1, sig="SIGKILL")
    cut = tmp_path / "outputs" / "cut" / "checkpoints" / "last.pt"
    assert torch.load(cut, weights_only=True)["progress"]["step"] == 5
    proc = launch(tmp_path, "cut")
    assert "at epoch 0, step 5" in proc.stdout
    assert proc.stdout.count("verdict ok") == 2, proc.stdout[-3000:]
    ref = torch.load(out / "outputs/whole/checkpoints/last.pt", weights_only=True)
    resumed = torch.load(cut, weights_only=True)
    assert ref["progress"]["step"] == resumed["progress"]["step"] == 15
    assert_identical(ref["model"], resumed["model"])
    assert_identical(ref["optimizer"]["state"][0], resumed["optimizer"]["state"][0])
