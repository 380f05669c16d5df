"""Helpers for end-to-end tests: run train.py for real (gloo, W&B offline, tmp run root)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC",
                                "RUN_ID"))}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", PYTHONUNBUFFERED="1",
               HYDRA_FULL_ERROR="0")
    env.update(extra)
    return env


def train_cmd(out: Path, *overrides: str, launcher: list[str] | None = None) -> list[str]:
    """A train.py command writing under ``out`` (outputs/, multirun/)."""
    paths = [f"paths.output_root={out / 'outputs'}", f"paths.multirun_root={out / 'multirun'}"]
    flags = [o for o in overrides if o.startswith("-")]  # -m / --multirun go before overrides
    rest = [o for o in overrides if not o.startswith("-")]
    return [*(launcher or [PY]), str(ROOT / "train.py"), *flags, *paths, *rest]


def _kill_tree(pid: int) -> None:
    """Kill a process and every descendant; torchrun puts ranks in sessions of their own."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)


def run(cmd: list[str], timeout: float = 240, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    # On a timeout the whole tree (agent, ranks, loader workers) dies, not just the agent.
    with subprocess.Popen(cmd, cwd=ROOT, env=env or run_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(p.pid)
            out, err = p.communicate()
            raise AssertionError(
                f"timed out after {timeout} s\n{out[-3000:]}\n{err[-3000:]}") from None
    proc = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def torchrun(nproc: int, standalone: bool = True) -> list[str]:
    if standalone:
        return [*TORCHRUN, "--standalone", f"--nproc-per-node={nproc}"]
    return [*TORCHRUN, f"--nproc-per-node={nproc}", f"--master-port={free_port()}"]


def run_dirs(out: Path, kind: str = "outputs") -> list[Path]:
    base = out / kind
    return sorted(p for p in base.iterdir() if p.is_dir()) if base.exists() else []


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
