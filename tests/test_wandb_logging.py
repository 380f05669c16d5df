"""W&B runs read back from the offline files: who saw what, per sampler mode and W&B runs choice.

The expected per-rank samples and fingerprints are recomputed here from torch's own
DistributedSampler (padded, drop_last) and from the definition in docs/ARCHITECTURE.md
(sequential), so a template that shards wrongly, forgets set_epoch or logs the wrong rank fails
these tests. The sampler-mode runs use the default logger.runs (per_rank for 2 ranks); the one-run
runs choice gets one short run (shared offline, which falls back to main).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import jsonl, run, run_dirs, run_env, train_cmd
from torch.utils.data.distributed import DistributedSampler
from wandb_reader import OfflineRun, find_runs

from ddp_template.ledger.tally import fingerprint

N, W, EPOCHS = 11, 2, 2  # 11 samples on 2 ranks: 12 slots when padded


def expected_lists(mode: str, epoch: int) -> list[list[int]]:
    if mode == "sequential":
        per = -(-N // W)
        return [[(r * per + j) % N for j in range(per)] for r in range(W)]
    out = []
    for r in range(W):
        s = DistributedSampler(
            range(N), num_replicas=W, rank=r, shuffle=True, seed=0, drop_last=mode == "drop_last"
        )
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def rows_with(run: OfflineRun, key: str) -> list[dict]:
    return [row for row in run.history if key in row]


@pytest.fixture(scope="module", params=["padded", "drop_last", "sequential"])
def mode_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp(request.param)
    run(
        train_cmd(
            out,
            f"sampler={request.param}",
            "dist.nproc=2",
            f"epochs={EPOCHS}",
            "data=synthetic",
            f"data.size={N}",
            "data.test_size=5",
            "data.image_size=8",
            "loader.batch_size=4",
            "log_every=1",
            "logger.log_checkpoints=last",
            "share_picture=true",
        ),
        env=run_env(WANDB_DATA_DIR=str(out / "wandb-data")),  # W&B's artifact staging copies
    )
    (run_dir,) = run_dirs(out)
    runs = sorted(find_runs(run_dir), key=lambda r: r.config["rank"])
    return request.param, run_dir, runs


def test_one_run_per_rank_in_one_group(mode_run) -> None:
    mode, run_dir, runs = mode_run
    assert [r.config["rank"] for r in runs] == [0, 1]
    assert len({r.group for r in runs}) == 1 and runs[0].group == run_dir.name
    assert [r.job_type for r in runs] == ["main", "worker"]
    assert [r.name for r in runs] == [f"{run_dir.name}-rank0", f"{run_dir.name}-rank1"]
    for r, wb in enumerate(runs):
        assert wb.path.is_relative_to(run_dir / f"rank{r}" / "wandb")
        assert wb.config["world_size"] == 2 and wb.config["backend"] == "gloo"
        assert wb.config["sampler"] == mode and wb.config["data"]["size"] == N
        assert wb.exit_code in (None, 0)


def test_per_epoch_data_matches_the_mode(mode_run) -> None:
    mode, run_dir, runs = mode_run
    for epoch in range(EPOCHS):
        want = expected_lists(mode, epoch)
        for r, wb in enumerate(runs):
            (row,) = [x for x in rows_with(wb, "data/samples") if x["epoch"] == epoch]
            assert row["data/samples"] == len(want[r])
            assert row["data/fingerprint"] == fingerprint(np.array(want[r]))
            assert row["data/first_index"] == want[r][0]
            assert row["data/last_index"] == want[r][-1]
            assert row["data/batches"] == -(-len(want[r]) // 4)
    if mode != "sequential":  # set_epoch really reshuffles
        fps = [x["data/fingerprint"] for x in rows_with(runs[0], "data/samples")]
        assert len(set(fps)) == EPOCHS


def test_duplicates_coverage_and_overlap(mode_run) -> None:
    mode, _, runs = mode_run
    expect = {
        "padded": (1.0, 1, [0, 1]),
        "drop_last": (10 / 11, 0, [0, 0]),
        "sequential": (1.0, 1, [0, 1]),
    }[mode]
    coverage, overlap, dups = expect
    report = rows_with(runs[0], "shares/coverage")
    assert len(report) == EPOCHS
    for row in report:
        assert row["shares/coverage"] == pytest.approx(coverage)
        assert row["shares/overlap"] == overlap
        assert row["shares/verdict_ok"] == 1
    assert not rows_with(runs[1], "shares/coverage")  # the report is rank 0's
    for r, wb in enumerate(runs):
        assert {x["data/duplicates"] for x in rows_with(wb, "data/samples")} == {dups[r]}


def test_interval_rows_share_one_step_axis(mode_run) -> None:
    _, run_dir, runs = mode_run
    for r, wb in enumerate(runs):
        steps = [x["step"] for x in rows_with(wb, "train/loss")]
        assert steps == sorted(steps) and steps[0] == 1
        assert all("train/lr" in x and "train/grad_norm" in x for x in rows_with(wb, "train/loss"))
        # The JSONL carries the same keys as W&B.
        lines = jsonl(run_dir / f"rank{r}" / "metrics.jsonl")
        assert [x["data/fingerprint"] for x in lines if "data/fingerprint" in x] == [
            x["data/fingerprint"] for x in rows_with(wb, "data/fingerprint")
        ]


def test_per_rank_runs_system_metrics_and_checkpoints(mode_run) -> None:
    """auto picks per_rank for 2 ranks; stats on local rank 0 only; last.pt as an artifact."""
    _, run_dir, runs = mode_run
    log = (run_dir / "train.log").read_text()
    assert "W&B runs per_rank (auto: 2 ranks <= logger.per_rank_max=8)" in log
    assert [(wb.config["wandb_runs"], wb.config["system_metrics"]) for wb in runs] == [
        ("per_rank", True),
        ("per_rank", False),
    ]
    assert runs[0].labels == {"rank0"} and not runs[1].stats
    evals = [x for x in jsonl(run_dir / "rank0" / "metrics.jsonl") if "test/accuracy" in x]
    models = [[a for a in wb.artifacts if a["type"] == "model"] for wb in runs]
    assert len(models[0]) == EPOCHS and not models[1]
    for epoch, (artifact, ev) in enumerate(zip(models[0], evals, strict=True)):
        assert artifact["name"] == f"checkpoint-{run_dir.name}" and artifact["type"] == "model"
        assert artifact["files"] == ["last.pt"] and {"last", f"epoch-{epoch}"} <= set(
            artifact["aliases"]
        )
        meta = artifact["metadata"]
        assert (meta["kind"], meta["epoch"], meta["step"]) == ("last", epoch, ev["step"])
        assert (meta["test/accuracy"], meta["test/loss"]) == (ev["test/accuracy"], ev["test/loss"])


def test_rank0_logs_eval_and_picture(mode_run) -> None:
    _, run_dir, runs = mode_run
    assert len(rows_with(runs[0], "test/accuracy")) == EPOCHS
    (sizes,) = rows_with(runs[0], "data/train_size")
    assert (sizes["data/train_size"], sizes["data/test_size"]) == (N, 5)
    assert (run_dir / "shares.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_logger_none_writes_jsonl_only(tmp_path: Path) -> None:
    run(train_cmd(tmp_path, "logger=none", "dist.nproc=2", "epochs=1", "max_steps_per_epoch=2"))
    (run_dir,) = run_dirs(tmp_path)
    assert not list(run_dir.rglob("wandb"))
    assert not (run_dir / "shares.png").exists()  # share_picture=false (tests' default)
    for r in range(2):
        assert any("data/samples" in x for x in jsonl(run_dir / f"rank{r}" / "metrics.jsonl"))


def test_a_sweep_whose_wandb_cannot_go_online_runs_offline_one_group_per_job(
    tmp_path: Path,
) -> None:
    """A 2-job sweep with no API key and a closed local port as the server: nothing leaves this
    machine. Each rank of each job says once that W&B failed to start and trains on, and each
    job's ranks write offline runs in one group of their own."""
    env = run_env(
        WANDB_BASE_URL="http://127.0.0.1:9",
        HOME=str(tmp_path / "home"),
        WANDB_CONFIG_DIR=str(tmp_path / "home"),
    )
    env.pop("WANDB_MODE")
    env.pop("WANDB_API_KEY", None)
    overrides = ["logger.mode=online", "dist.nproc=2", "seed=0,1", "epochs=1"]
    proc = run(train_cmd(tmp_path, "-m", *overrides, "max_steps_per_epoch=2"), env=env)
    out = proc.stdout + proc.stderr
    for rank in (0, 1):
        assert out.count(f"failed to start on rank {rank}") == 2  # once a job
    (sweep,) = run_dirs(tmp_path, "multirun")
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert [j.name for j in jobs] == ["0", "1"]
    groups = []
    for job in jobs:
        runs = find_runs(job)
        assert sorted(r.config["rank"] for r in runs) == [0, 1]  # offline files
        assert len({r.group for r in runs}) == 1
        groups.append(runs[0].group)
        assert (job / "summary.json").is_file()
    assert len(set(groups)) == 2
    assert not run_dirs(tmp_path, "outputs")  # no stray run directories


def test_one_run_holds_every_rank(tmp_path: Path) -> None:
    """2 ranks, 1 epoch, shared offline, so: main, one W&B run with every rank's rows. (auto's
    choice of main past logger.per_rank_max, and its reason, are test_wandb_layout's.)"""
    proc = run(
        train_cmd(
            tmp_path,
            "logger.runs=shared",
            "dist.nproc=2",
            "epochs=1",
            "data=synthetic",
            f"data.size={N}",
            "data.test_size=5",
            "data.image_size=8",
            "loader.batch_size=4",
            "checkpoint.enabled=false",
        )
    )
    (run_dir,) = run_dirs(tmp_path)
    out = proc.stdout + proc.stderr
    assert "W&B runs main (logger.runs=shared, fallen back" in out
    warning = "logger.runs=shared falls back to main: W&B's shared mode needs logger.mode=online"
    assert out.count(warning) == 1
    (wb,) = find_runs(run_dir)  # rank 1 starts no W&B run
    assert wb.path.is_relative_to(run_dir / "rank0" / "wandb")
    assert (wb.group, wb.name, wb.job_type) == (run_dir.name, run_dir.name, "main")
    assert (wb.config["wandb_runs"], wb.config["world_size"]) == ("main", 2)
    assert wb.labels == {"rank0"}  # system metrics: local rank 0
    (row,) = rows_with(wb, "data/samples/rank1")
    want = expected_lists("padded", 0)
    for r in range(W):
        (mine,) = [x for x in jsonl(run_dir / f"rank{r}" / "metrics.jsonl") if "data/samples" in x]
        assert row[f"data/samples/rank{r}"] == mine["data/samples"] == len(want[r])
        fp = fingerprint(np.array(want[r]))
        assert row[f"data/fingerprint/rank{r}"] == mine["data/fingerprint"] == fp
        assert row[f"perf/step_s/rank{r}"] == mine["perf/step_s"]
    (path,) = [x["shares/report.path"] for x in rows_with(wb, "shares/report.path")]
    table = json.loads((wb.path.parent / "files" / path).read_text())
    rows = [dict(zip(table["columns"], values, strict=True)) for values in table["data"]]
    assert [(x["rank"], x["data/fingerprint"], x["matches"]) for x in rows] == [
        (r, fingerprint(np.array(want[r])), True) for r in range(W)
    ]
    assert all("perf/samples_per_s" in x for x in rows)
