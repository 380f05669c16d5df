"""Every way a user starts a run: in-process ranks, failures, concurrency, multi-node, help."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest
from helpers import (
    PY,
    ROOT,
    assert_killed_rank_reported,
    assert_one_run_dir,
    run,
    run_dirs,
    run_env,
    summary,
    torchrun,
    train_cmd,
)

from ddp_template.data.sampler_modes import SAMPLER_MODES

TINY = ["logger=none", "epochs=1", "max_steps_per_epoch=4"]


def test_two_runs_at_once_do_not_collide_one_an_optuna_sweep(tmp_path: Path) -> None:
    """Two in-process 2-rank runs (dist.nproc=2) at once, each with its own complete output: a
    plain run, and the optuna_lr preset's sweep of 2 jobs, whose best value is the best
    job's eval accuracy (without hydra-optuna-sweeper: a second plain run). A failing rank
    stopping all with its traceback: test_resume.py's chain test."""
    optuna = importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is not None
    sweep = ["-m", "hydra/sweeper=optuna_lr", "hydra.sweeper.n_trials=2"] if optuna else []
    procs = [
        subprocess.Popen(
            train_cmd(tmp_path / str(i), *(sweep if i else []), "dist.nproc=2", *TINY),
            cwd=ROOT,
            env=run_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for i, p in enumerate(procs):
        assert p.returncode == 0, outputs[i][-3000:]
    for i in range(2 - bool(sweep)):
        d = assert_one_run_dir(tmp_path / str(i), 2)
        assert summary(d)["world_size"] == 2
        assert "final test accuracy" in outputs[i]
    if sweep:
        (swept,) = run_dirs(tmp_path / "1", "multirun")
        jobs = sorted(p for p in swept.iterdir() if p.is_dir() and p.name.isdigit())
        assert len(jobs) == 2 and all(summary(j)["world_size"] == 2 for j in jobs)
        best = max(summary(j)["eval_accuracy"] for j in jobs)
        assert f"Best value: {best}" in outputs[1]


def test_multirun_under_torchrun_is_refused(tmp_path: Path) -> None:
    proc = run(train_cmd(tmp_path, "-m", "seed=0,1", *TINY, launcher=torchrun(1)), check=False)
    assert proc.returncode != 0
    assert "dist.nproc=N" in proc.stdout + proc.stderr


def test_help_lists_groups_and_launch_commands() -> None:
    proc = run([PY, str(ROOT / "train.py"), "--help"], timeout=60)
    for line in (
        f"sampler     {', '.join(sorted(SAMPLER_MODES))}",
        "amp         bf16, fp16, off",
        "torchrun --standalone --nproc-per-node=2 train.py",
        "dist.nproc=2",
        "hydra/launcher=slurm",
        "multinode.sbatch",
    ):
        assert line in proc.stdout
    assert "_schema" not in proc.stdout


@pytest.mark.parametrize("env_key", ["TORCHELASTIC_RUN_ID", "RUN_ID"])
def test_run_id_sources(env_key: str) -> None:
    from ddp_template.run_identity import compute_run_id

    assert compute_run_id({env_key: "abc"}) == "abc"
    multi = {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    from ddp_template.errors import ConfigError

    with pytest.raises(ConfigError, match="--rdzv-id"):
        compute_run_id(multi)


def test_a_sigkilled_rank_is_named_not_the_collective_failure_it_caused(tmp_path: Path) -> None:
    """Rank 1 SIGKILLed at step 2 (the OOM killer's way: no exception, no record); rank 0's
    next collective then fails. Whichever rank the agent sees exit first, the report names
    rank 1 and SIGKILL, rank 0 only as what followed, and nothing is left running. The
    decision for either order is tests/test_failures.py's."""
    kill = ["fault.crash_at_step=2", "fault.rank=1", "fault.signal=SIGKILL"]
    proc = run(train_cmd(tmp_path, "dist.nproc=2", *TINY, *kill), check=False, leftovers=10)
    assert_killed_rank_reported(proc, rank=1, sig="SIGKILL")
