"""mpirun's ranks join one DDP job: Open MPI's own variables read, one run directory.

Needs Open MPI's `mpirun` (Debian's openmpi-bin; `.ci/run` installs it); skips without it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import PY, ROOT, run, run_env
from test_slurm import TINY, assert_one_job_of_two_ranks

pytestmark = pytest.mark.slow


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun: apt-get install openmpi-bin")
def test_mpirun_ranks_join_one_job(tmp_path: Path) -> None:
    out = tmp_path / "outputs"
    cmd = ["mpirun", "--oversubscribe", "-np", "2", PY, str(ROOT / "train.py"), *TINY]
    env = run_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    run([*cmd, f"paths.output_root={out}"], env=env, timeout=120)
    [run_dir] = list(out.iterdir())
    assert run_dir.name.startswith("openmpi-"), run_dir.name
    assert_one_job_of_two_ranks(run_dir, "openmpi")
