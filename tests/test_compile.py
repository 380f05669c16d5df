"""compile=true: torch.compile (Inductor, CPU) of the DDP model learns like the eager one, and
its checkpoints hold the plain module: a compiled run resumes uncompiled and back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import run, run_env, summary, train_cmd

TWO_RANKS = ["logger=none", "dist.nproc=2"]


def launch(out: Path, *overrides: str):
    return run(train_cmd(out, *TWO_RANKS, *overrides), env=run_env(RUN_ID="c"), timeout=480)


@pytest.mark.slow
def test_compiled_run_learns_and_resumes_uncompiled_and_back(tmp_path: Path) -> None:
    launch(tmp_path, "compile=true", "epochs=4")
    run_dir = tmp_path / "outputs" / "c"
    s = summary(run_dir)
    assert s["eval_accuracy"] >= 0.9, s  # test_train's band for the eager default, 4 epochs
    payload = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert not any("_orig_mod" in k or k.startswith("module.") for k in payload["model"])

    proc = launch(tmp_path, "compile=false", "epochs=5")  # the compiled run's checkpoint
    assert "resumed from" in proc.stdout and "at epoch 4" in proc.stdout
    proc = launch(tmp_path, "compile=true", "epochs=6")  # ... and the eager run's
    assert "resumed from" in proc.stdout and "at epoch 5" in proc.stdout
    assert summary(run_dir)["eval_accuracy"] >= 0.9


def test_compile_without_a_compiler_is_refused_at_startup(tmp_path: Path) -> None:
    cmd = train_cmd(tmp_path, "logger=none", "compile=true", "epochs=1")
    proc = run(cmd, env=run_env(CXX="/nonexistent/g++"), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-2000:]
    assert "compile=true on CPU needs a C++ compiler" in out and "compile=false" in out
    assert "Traceback" not in out
