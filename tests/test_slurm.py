"""SLURM end to end on a real cluster: the submitit launcher preset and the sbatch recipe.

Needs SLURM installed and running on this machine: `bash .ci/slurm_up.sh` installs (Debian
packages) and starts a single-node cluster. These tests never install anything: without the
binaries they skip; with them, the session fixture starts the cluster if it is down.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from helpers import CPU, PY, ROOT, jsonl, run, run_env, summary

pytestmark = pytest.mark.slow

TINY = [
    CPU,
    "epochs=1",
    "max_steps_per_epoch=3",
    "logger=none",
    "data=synthetic",
    "data.size=64",
    "data.test_size=32",
    "data.image_size=8",
]
BINARIES = ("sinfo", "sbatch", "squeue", "scancel", "srun", "slurmctld", "slurmd", "munged")


@pytest.fixture(scope="session")
def slurm() -> None:
    """A running cluster, started with .ci/slurm_up.sh if needed; skip (never install) if not."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        pytest.skip(f"SLURM not installed: run .ci/slurm_up.sh (missing {', '.join(missing)})")
    proc = subprocess.run(
        ["bash", str(ROOT / ".ci" / "slurm_up.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SLURM_UP_NO_INSTALL": "1"},
    )
    if proc.returncode != 0:
        pytest.skip(f"SLURM cluster is not up: {(proc.stderr or proc.stdout).strip()[-400:]}")


def wait_gone(job_id: str, timeout: float, log: Path) -> None:
    """Poll squeue until the job left the queue (sbatch --wait polls too rarely)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True)
        if out.returncode == 0 and not out.stdout.strip():
            return
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], check=False)
    tail = log.read_text()[-4000:] if log.exists() else "(no log)"
    raise AssertionError(f"SLURM job {job_id} still queued after {timeout:.0f} s\n{tail}")


def assert_both_ranks_trained(run_dir: Path) -> dict:
    """rank0/ and rank1/ logged their data; rank 0 wrote the final summary of 2 ranks."""
    for rank in (0, 1):
        rows = jsonl(run_dir / f"rank{rank}" / "metrics.jsonl")
        assert [r["data/samples"] for r in rows if "data/samples" in r] == [32], (rank, rows)
    result = summary(run_dir)
    assert result["world_size"] == 2 and result["eval_count"] == 32, result
    return result


def test_submitit_launcher_preset_runs_two_ranks_in_one_job(slurm: None, tmp_path: Path) -> None:
    out = tmp_path / "multirun"
    run(
        [
            PY,
            str(ROOT / "train.py"),
            "-m",
            "hydra/launcher=slurm",
            "dist.nproc=2",
            *TINY,
            f"paths.multirun_root={out}",
            f"paths.output_root={tmp_path / 'outputs'}",
        ],
        timeout=150,
    )
    [sweep] = [p for p in out.iterdir() if p.is_dir()]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == [".submitit", "0"]
    # It ran as a SLURM job, on this venv's python, and wrote into its Hydra job dir.
    [script] = sweep.glob(".submitit/*/*_submission.sh")
    assert "srun --unbuffered" in script.read_text() and PY in script.read_text()
    result = assert_both_ranks_trained(sweep / "0")
    assert result["run_id"] == f"{sweep.name}-0"  # run id agrees with the job dir
    assert (sweep / "0" / ".hydra" / "config.yaml").exists()


def test_sbatch_recipe_runs_two_ranks_in_a_run_dir_named_after_the_job(
    slurm: None, tmp_path: Path
) -> None:
    proc = run(
        [
            "sbatch",
            "--parsable",
            "--nodes=1",
            "--cpus-per-task=2",
            f"--output={tmp_path / 'slurm-%j.out'}",
            str(ROOT / "scripts" / "slurm" / "multinode.sbatch"),
            *TINY,
            f"paths.output_root={tmp_path / 'outputs'}",
        ],
        timeout=30,
        env=run_env(NPROC="2", PYTHON=PY),
        leftovers=None,
    )
    job_id = proc.stdout.strip().split(";")[0]
    log = tmp_path / f"slurm-{job_id}.out"
    wait_gone(job_id, timeout=120, log=log)
    runs = (
        [p.name for p in (tmp_path / "outputs").iterdir()]
        if (tmp_path / "outputs").exists()
        else []
    )
    assert runs == [job_id], (runs, log.read_text()[-4000:] if log.exists() else "")
    result = assert_both_ranks_trained(tmp_path / "outputs" / job_id)
    assert result["run_id"] == job_id


def assert_one_job_of_two_ranks(run_dir: Path, launcher: str) -> None:
    """Both ranks' samples make up the training set exactly once: disjoint shards, one job."""
    assert_both_ranks_trained(run_dir)
    fingerprints = [
        [
            r["data/fingerprint"]
            for r in jsonl(run_dir / f"rank{k}" / "metrics.jsonl")
            if "data/fingerprint" in r
        ]
        for k in (0, 1)
    ]
    assert fingerprints[0] != fingerprints[1], fingerprints
    shards = [r for r in jsonl(run_dir / "rank0" / "metrics.jsonl") if "shares/coverage" in r]
    assert [(r["shares/coverage"], r["shares/overlap"]) for r in shards] == [(1.0, 0)]
    assert f"launcher {launcher}: world size 2" in (run_dir / "train.log").read_text()


def test_srun_tasks_join_one_job(slurm: None, tmp_path: Path) -> None:
    """`srun -n 2 python train.py`: two tasks, one DDP job (not two copies of world size 1)."""
    out = tmp_path / "outputs"
    cmd = ["srun", "-n", "2", PY, str(ROOT / "train.py"), *TINY, f"paths.output_root={out}"]
    run(cmd, timeout=120)
    [run_dir] = list(out.iterdir())
    assert run_dir.name.startswith("slurm-") and run_dir.name.endswith("-s0"), run_dir.name
    assert_one_job_of_two_ranks(run_dir, "slurm")


def test_sbatch_script_calling_srun_runs_one_job(slurm: None, tmp_path: Path) -> None:
    out = tmp_path / "outputs"
    script = tmp_path / "job.sbatch"
    overrides = " ".join([*TINY, f"paths.output_root={out}"])
    script.write_text(f"#!/bin/bash\nsrun {PY} {ROOT / 'train.py'} {overrides}\n")
    log = tmp_path / "job.out"
    proc = run(
        ["sbatch", "--parsable", "--ntasks=2", f"--output={log}", str(script)],
        timeout=30,
        leftovers=None,
    )
    job_id = proc.stdout.strip().split(";")[0]
    wait_gone(job_id, timeout=120, log=log)
    runs = [p.name for p in out.iterdir()] if out.exists() else []
    assert runs == [f"slurm-{job_id}-s0"], (runs, log.read_text()[-4000:])
    assert_one_job_of_two_ranks(out / runs[0], "slurm")
