"""End-to-end DDP runs of train.py: torchrun and in-process, one run dir, exact evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import jsonl, run, run_dirs, summary, torchrun, train_cmd

TINY = ["logger=none", "epochs=1", "max_steps_per_epoch=4"]


def _assert_one_run_dir(out: Path, world: int) -> Path:
    dirs = run_dirs(out)
    assert len(dirs) == 1, dirs
    d = dirs[0]
    assert (d / ".hydra" / "config.yaml").is_file()
    assert (d / "train.log").is_file()
    for r in range(world):
        rows = jsonl(d / f"rank{r}" / "metrics.jsonl")
        assert any("data/samples" in row for row in rows), f"rank {r} logged no epoch"
    for r in range(1, world):
        assert (d / f"rank{r}.log").is_file()
    return d


def test_torchrun_standalone_two_ranks_learns(tmp_path: Path) -> None:
    run(train_cmd(tmp_path, "logger=none", "epochs=4", launcher=torchrun(2)))
    d = _assert_one_run_dir(tmp_path, 2)
    s = summary(d)
    assert s["world_size"] == 2 and s["eval_count"] == 359
    assert s["eval_accuracy"] >= 0.9, s


def test_plain_torchrun_leaves_one_run_dir(tmp_path: Path) -> None:
    run(train_cmd(tmp_path, *TINY, launcher=torchrun(2, standalone=False)))
    d = _assert_one_run_dir(tmp_path, 2)
    assert summary(d)["world_size"] == 2


def test_in_process_two_ranks(tmp_path: Path) -> None:
    proc = run(train_cmd(tmp_path, *TINY, "dist.nproc=2"))
    d = _assert_one_run_dir(tmp_path, 2)
    assert summary(d)["world_size"] == 2
    assert "final test accuracy" in proc.stdout


@pytest.mark.parametrize(
    "data",
    [
        ["data=digits"],  # 359 eval samples: shards of 120, 120, 119
        ["data=synthetic", "data.size=50", "data.eval_size=7"],  # 3, 2, 2 ... and N < W per rank
    ],
)
def test_three_ranks_evaluate_exactly_like_one(tmp_path: Path, data: list[str]) -> None:
    one, three = tmp_path / "one", tmp_path / "three"
    run(train_cmd(one, "epochs=0", "logger=none", *data))
    run(train_cmd(three, "epochs=0", "logger=none", *data, launcher=torchrun(3)))
    s1, s3 = summary(run_dirs(one)[0]), summary(run_dirs(three)[0])
    assert s3["world_size"] == 3 and s1["world_size"] == 1
    assert s3["eval_count"] == s1["eval_count"]
    assert s3["eval_correct"] == s1["eval_correct"]
    # Logits are float32 and batch shapes differ per rank: the loss agrees to float precision.
    assert s3["eval_loss"] == pytest.approx(s1["eval_loss"], rel=1e-5)
