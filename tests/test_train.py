"""End-to-end DDP runs of train.py: torchrun and in-process, one run dir, exact evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import assert_one_run_dir, run, run_dirs, summary, train_cmd


def test_plain_torchrun_two_ranks_learns_in_one_run_dir(digits_fp32_run: Path) -> None:
    """torchrun without --standalone (a --master-port rendezvous): one run dir, and 2 ranks on
    digits learn; eval counts all 359 samples once (uneven shards of 180 and 179). The
    --standalone rendezvous is test_resume.py's torchrun restart and test_launch.py's multirun
    refusal; in-process ranks are test_three_ranks_evaluate_exactly_like_one's and
    test_launch.py::test_two_runs_at_once_do_not_collide_one_an_optuna_sweep."""
    d = assert_one_run_dir(digits_fp32_run, 2)  # conftest.py: 3 epochs, shared with test_amp
    s = summary(d)
    assert s["world_size"] == 2 and s["eval_count"] == 359
    assert s["eval_accuracy"] >= 0.9, s


def test_three_ranks_evaluate_exactly_like_one(tmp_path: Path) -> None:
    """Uneven eval shards (7 samples on 3 ranks: 3, 2, 2, in batches of 2, so rank 0 ends on a
    partial batch) give one rank's exact counts and loss: the case digits' 359 (120, 120, 119
    in batches of 32) was also run for, at 7 x the cost; its count is checked above. The 3
    ranks are in-process (dist.nproc=3: forks of one server that imported torch once, cheaper
    than torchrun's fresh interpreters; the launcher is not the point)."""
    data = ["data=synthetic", "data.size=50", "data.test_size=7", "loader.eval_batch_size=2"]
    one, three = tmp_path / "one", tmp_path / "three"
    run(train_cmd(one, "epochs=0", "logger=none", *data))
    run(train_cmd(three, "epochs=0", "logger=none", *data, "dist.nproc=3"))
    s1, s3 = summary(run_dirs(one)[0]), summary(run_dirs(three)[0])
    assert s3["world_size"] == 3 and s1["world_size"] == 1
    assert s3["eval_count"] == s1["eval_count"]
    assert s3["eval_correct"] == s1["eval_correct"]
    # Logits are float32 and batch shapes differ per rank: the loss agrees to float precision.
    assert s3["eval_loss"] == pytest.approx(s1["eval_loss"], rel=1e-5)
