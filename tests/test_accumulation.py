"""Gradient accumulation: K micro-batches make one optimizer step of K x the batch.

Two ranks, 100 samples each: batch_size=16 with optim.accumulate=2 is 7 micro-batches (the last
of 4 samples) in 4 optimizer steps per epoch, the last a single micro-batch, exactly the 4 steps
(32, 32, 32, 4) of batch_size=32. GroupNorm (``model.norm=group``) has no batch dependence, so
the two runs must end with the same weights up to float rounding. The same runs carry an EMA
(``ema.decay``) so that one kill-and-resume checks accumulation and EMA resume together.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import cpu_rank, jsonl, run, run_env, train_cmd
from test_resume import assert_identical

from ddp_template.checkpoint import Found, restore
from ddp_template.checkpoint_parts import Progress
from ddp_template.data.epoch_steps import EpochSteps
from ddp_template.engine import TrainState
from ddp_template.errors import ConfigError
from ddp_template.models import small_cnn
from ddp_template.replay import load_run, step_rows

BASE = [
    "data=synthetic",
    "data.size=200",
    "data.test_size=40",
    "data.image_size=8",
    "epochs=2",
    "logger=none",
    "model.norm=group",
    "ema.decay=0.9",
    "checkpoint.every_steps=1",
    "dist.nproc=2",
]
ACCUMULATE = ["loader.batch_size=16", "optim.accumulate=2"]


def launch(out: Path, run_id: str, *overrides: str, check: bool = True):
    cmd = train_cmd(out, *BASE, *overrides)
    return run(cmd, env=run_env(RUN_ID=run_id), check=check)


def last(out: Path, run_id: str) -> dict:
    return torch.load(out / "outputs" / run_id / "checkpoints" / "last.pt", weights_only=True)


def test_schedule_groups_micro_batches_into_steps() -> None:
    s = EpochSteps(length=100, batch_size=16, epochs=2, accumulate=2)
    assert (s.micro_batches, s.steps_per_epoch, s.total_steps) == (7, 4, 8)
    assert [s.span(k) for k in range(4)] == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert tuple(s.batch(8)) == (8, 1, 96, 100)
    dropped = EpochSteps(length=100, batch_size=16, epochs=1, accumulate=4, drop_last_batch=True)
    assert (dropped.steps_per_epoch, dropped.span(1), dropped.consumed_per_epoch) == (
        2,
        (64, 96),
        96,
    )
    capped = EpochSteps(length=100, batch_size=16, epochs=1, accumulate=3, max_steps_per_epoch=2)
    assert capped.consumed_per_epoch == 96 and capped.span(1) == (48, 96)


def test_default_norm_is_todays_network() -> None:
    """model.norm=batch (the default) builds the same modules, names and initial weights."""
    torch.manual_seed(0)
    default = small_cnn(num_classes=10, in_channels=1, image_size=8)
    torch.manual_seed(0)
    batch = small_cnn(num_classes=10, in_channels=1, image_size=8, norm="batch")
    assert [type(m).__name__ for m in default] == [
        *("Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d", "Conv2d", "BatchNorm2d", "ReLU"),
        *("AdaptiveAvgPool2d", "Flatten", "Dropout", "Linear"),
    ]
    assert_identical(default.state_dict(), batch.state_dict())
    x = torch.randn(4, 1, 8, 8)
    assert torch.equal(default(x), batch(x))


@pytest.mark.slow
def test_accumulation_equals_the_big_batch_and_resumes_bit_identically(tmp_path: Path) -> None:
    launch(tmp_path, "acc", *ACCUMULATE)
    launch(tmp_path, "big", "loader.batch_size=32")
    acc, big = last(tmp_path, "acc"), last(tmp_path, "big")
    assert acc["progress"]["step"] == big["progress"]["step"] == 8
    for a, b in ((acc["model"], big["model"]), (acc["ema"]["model"], big["ema"]["model"])):
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert worst < 1e-6, f"accumulated and big-batch weights differ by {worst}"  # 6e-8 seen
    assert any(not torch.equal(acc["model"][k], big["model"][k]) for k in acc["model"])

    # Replay: a step's batch is its micro-batches together, the big run's batch.
    runs = [load_run(tmp_path / "outputs" / name) for name in ("acc", "big")]
    for step in (1, 4, 8):
        assert step_rows(runs[0], step) == step_rows(runs[1], step)
    assert [len(r["indices"]) for r in step_rows(runs[0], 4)] == [4, 4]

    rows = jsonl(tmp_path / "outputs/acc/rank0/metrics.jsonl")
    assert {k: v for r in rows for k, v in r.items() if k == "train/global_batch"} == {
        "train/global_batch": 64
    }
    ema_eval = [r for r in rows if "test/ema_accuracy" in r]
    assert len(ema_eval) == 2 and all(0 <= r["test/ema_accuracy"] <= 1 for r in ema_eval)
    assert [r["data/batches"] for r in rows if "data/batches" in r] == [7, 7]

    # Rank 1 dies after step 6 (rank 0 is already in step 7's first, unsynced micro-batch).
    crash = ["fault.crash_at_step=6", "fault.rank=1"]
    proc = launch(tmp_path, "crash", *ACCUMULATE, *crash, check=False)
    assert proc.returncode != 0 and "fault injected: rank 1" in proc.stderr
    stopped = last(tmp_path, "crash")
    assert (
        stopped["progress"]["step"],
        stopped["progress"]["epoch"],
        stopped["progress"]["position"],
    ) == (5, 1, 32)
    assert stopped["ema"]["updates"] == 5
    launch(tmp_path, "crash", *ACCUMULATE)
    resumed = last(tmp_path, "crash")
    assert_identical(acc["model"], resumed["model"])
    assert_identical(acc["ema"]["model"], resumed["ema"]["model"])
    assert resumed["ema"]["updates"] == acc["ema"]["updates"] == 8
    assert_identical(acc["optimizer"]["state"][0], resumed["optimizer"]["state"][0])


def test_resume_with_another_accumulate_is_refused(tmp_path: Path) -> None:
    """A mid-epoch position of K=2 need not be a step boundary of K=3: one sentence, no load."""
    path = tmp_path / "last.pt"

    def progress(state: TrainState, accumulate: int) -> Progress:
        schedule = EpochSteps(length=100, batch_size=16, epochs=2, accumulate=accumulate)
        return Progress(state=state, trainer=SimpleNamespace(steps=schedule))

    saved = progress(TrainState(epoch=1, step=5, position=32), accumulate=2)
    found = Found(path, {"world_size": 1, "progress": saved.state_dict(), "ranks": [{}]})
    mine = {"progress": progress(TrainState(), accumulate=3)}
    alone = cpu_rank(0, 1, backend=None)
    with pytest.raises(ConfigError, match=r"accumulate=2 but this run has optim.accumulate=3"):
        restore(found, parts=mine, rank_parts={}, info=alone)
    assert mine["progress"].state == TrainState()  # nothing loaded


def test_last_micro_batch_is_the_one_the_epoch_ends_with() -> None:
    """What the batch-of-one probe checks: 100 positions in batches of 16 end with 4."""
    assert EpochSteps(length=100, batch_size=16, epochs=1).last_micro_batch == 4
    assert EpochSteps(length=100, batch_size=16, epochs=1, accumulate=3).last_micro_batch == 4
    capped = EpochSteps(length=100, batch_size=16, epochs=1, accumulate=2, max_steps_per_epoch=2)
    assert capped.last_micro_batch == 16  # the cap ends the epoch on a full micro-batch
    dropped = EpochSteps(length=100, batch_size=16, epochs=1, drop_last_batch=True)
    assert dropped.last_micro_batch == 16
    assert EpochSteps(length=100, batch_size=16, epochs=0).last_micro_batch == 0
