"""Helpers for end-to-end tests: run train.py for real (gloo, W&B offline, tmp run root)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC", "RUN_ID"))
    }
    env.update(
        WANDB_MODE="offline", WANDB_SILENT="true", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0"
    )
    # One compute thread per rank: make test runs three tests at once on two cores, where a
    # rank's spare OpenMP threads only spin against the other tests' ranks.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


# The CPU tests' backend, also on a GPU host: backend=auto would put their ranks on the GPUs
# (and a 3-rank test on a 1-GPU host would then run on gloo, but a 2-rank one on nccl).
CPU = "backend=gloo"


# W&B costs each rank seconds of CPU to import and start: a run logs to it only where its test
# reads what W&B got (tests/test_wandb_*.py, the resumed W&B runs, the artifacts). Likewise
# shares.png (a second of rank 0's CPU): drawn only where its test reads it.
QUIET = "logger=none"
CHOOSES_LOGGER = ("logger", "debug=", "experiment=", "+experiment=")
NO_PICTURE = "share_picture=false"


def train_cmd(out: Path, *overrides: str, launcher: list[str] | None = None) -> list[str]:
    """A train.py command writing under ``out`` (outputs/, multirun/), on gloo unless an
    override chooses the backend, without W&B unless an override chooses the logger (or a
    ``debug``/``experiment`` preset does), and without shares.png unless one asks for it."""
    paths = [f"paths.output_root={out / 'outputs'}", f"paths.multirun_root={out / 'multirun'}"]
    flags = [o for o in overrides if o.startswith("-")]  # -m / --multirun go before overrides
    rest = [o for o in overrides if not o.startswith("-")]
    if not any(o.startswith(("backend=", "backend.name=")) for o in rest):
        rest.insert(0, CPU)
    if not any(o.startswith(CHOOSES_LOGGER) for o in rest):
        rest.insert(0, QUIET)
    if not any(o.startswith("share_picture=") for o in rest):
        rest.insert(0, NO_PICTURE)
    return [*(launcher or [PY]), str(ROOT / "train.py"), *flags, *paths, *rest]


RUN_TOKEN = "DDP_TEMPLATE_TEST_RUN"  # every process a test starts inherits it, orphans too


def _processes_with(token: str) -> list:
    import psutil

    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(RUN_TOKEN) == token:
                found.append(proc)
    return found


def _reap(token: str, grace: float) -> list[str]:
    """Wait up to ``grace`` s for every process carrying ``token`` to end; kill and name the rest.

    Parent-child links are no use here: a loader worker whose rank died is re-parented to init.
    """
    import psutil

    deadline = time.monotonic() + grace
    while (left := _processes_with(token)) and (wait := deadline - time.monotonic()) > 0:
        psutil.wait_procs(left, timeout=min(wait, 0.5))  # back once they end (a zombie: 0.5 s)
    named = []
    for proc in left:
        with contextlib.suppress(psutil.Error):
            named.append(f"pid {proc.pid}: {' '.join(proc.cmdline())[:160]}")
            proc.kill()
    return named


@dataclass
class Started:
    """A command running in the background (see :func:`start`); :meth:`wait` ends it as
    :func:`run` does."""

    cmd: list[str]
    popen: subprocess.Popen
    token: str
    out: Any
    err: Any

    def wait(
        self, *, timeout: float = 240, check: bool = True, leftovers: float | None = 60
    ) -> subprocess.CompletedProcess:
        p = self.popen
        try:
            p.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        grace = 0 if timed_out else leftovers
        left = [] if grace is None else _reap(self.token, grace)
        p.wait()
        with self.out, self.err:
            self.out.seek(0)
            self.err.seek(0)
            proc = subprocess.CompletedProcess(
                self.cmd, p.returncode, self.out.read(), self.err.read()
            )
        if timed_out:
            raise AssertionError(
                f"timed out after {timeout} s\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        if left:
            raise AssertionError(
                f"still running {leftovers} s after the run ended (killed now):\n"
                + "\n".join(left)
                + f"\n{proc.stderr[-3000:]}"
            )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
            )
        return proc


def wait_for(path: Path, *started: Started, timeout_s: float = 180) -> None:
    """Until ``path`` exists while every command in ``started`` still runs, or fail with the
    first one's output."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if any(s.popen.poll() is not None for s in started) or time.monotonic() > deadline:
            raise AssertionError(f"{path} never appeared:\n{started[0].wait(check=False).stderr}")
        time.sleep(0.2)


def start(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
    new_session: bool = False,
) -> Started:
    """Start ``cmd`` in the background, its output to files, so a stray process cannot hang
    us. ``new_session`` gives the command its own process group, as a shell does, for signals
    sent to the group."""
    token = uuid.uuid4().hex
    env = {**(env or run_env()), RUN_TOKEN: token}
    # closed by Started.wait, which reads them
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # noqa: SIM115
    popen = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True, start_new_session=new_session
    )
    return Started(cmd=cmd, popen=popen, token=token, out=out, err=err)


def run(
    cmd: list[str],
    *,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    check: bool = True,
    leftovers: float | None = 60,
    cwd: Path = ROOT,
    new_session: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` to the end.

    Afterwards no process it started may still run ``leftovers`` s later (a leak: orphaned loader
    workers hold memory and the terminal); ``leftovers=None`` for commands that hand work to
    others on purpose (sbatch). On a timeout everything it started is killed.
    """
    started = start(cmd, env=env, cwd=cwd, new_session=new_session)
    return started.wait(timeout=timeout, check=check, leftovers=leftovers)


def assert_killed_rank_reported(proc: subprocess.CompletedProcess, rank: int, sig: str) -> None:
    """A launch whose rank ``rank`` was killed by ``sig``: a non-zero exit, that rank named as
    the cause, and every other rank only as what followed (``rank 0 then failed in a
    collective (Connection closed by peer)``), never as a rank that failed."""
    err = proc.stderr
    assert proc.returncode != 0, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith(("rank ", "ranks "))]
    assert said and said[0].startswith(f"rank {rank} was killed by {sig} (no Python"), err[-3000:]
    assert all(" then " in line for line in said[1:]), err[-3000:]
    assert all("Connection" not in line or " then " in line for line in err.splitlines()), err


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


def classification(num_classes: int):
    """The classification task, told ``num_classes`` (set up on the CPU)."""
    import torch

    from ddp_template.data.contract import DataInfo
    from ddp_template.tasks.classification import Classification

    task = Classification()
    task.setup(DataInfo(num_classes=num_classes), torch.device("cpu"))
    return task


def step_trainer(
    *, model, optimizer, scaler=None, device=None, amp_mode: str = "off", grad_clip=None, task=None
):
    """A one-process Trainer with a constant learning rate, for tests of a single step (on the
    CPU, fp32, no clipping unless told)."""
    import torch

    device = torch.device("cpu") if device is None else device
    scaler = torch.amp.GradScaler("cpu", enabled=False) if scaler is None else scaler

    from ddp_template.config.loop import DDPConfig
    from ddp_template.distributed import DistInfo
    from ddp_template.engine import Trainer
    from ddp_template.parallel import Replicated
    from ddp_template.tasks.classification import Classification

    single = dict(rank=0, local_rank=0, world_size=1, local_world_size=1, backend=None)
    info = DistInfo(**single, device=device, host="localhost")
    return Trainer(
        model=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
        scaler=scaler,
        loader=None,
        sampler=None,
        steps=None,  # train_step alone reads no step arithmetic
        info=info,
        amp_mode=amp_mode,
        grad_clip=grad_clip,
        task=task if task is not None else Classification(),  # the loss needs no setup
        parallel=Replicated(cfg=DDPConfig(), info=info),
    )


def assert_one_run_dir(out: Path, world: int) -> Path:
    """The only run dir under ``out``: its config, log, every rank's metrics and log files."""
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


def join_gloo(rank: int, world: int, port: int, timeout_s: float = 60) -> None:
    """A test's own rank joins a gloo group on localhost (torch imported, no train.py)."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def save_gathered(mine: Any, world: int, path: Path) -> None:
    """Every rank's ``mine`` gathered; rank 0 saves the list at ``path`` (a spawned test rank's
    result, read back by the test)."""
    import torch
    import torch.distributed as dist

    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        torch.save(everyone, path)


def cpu_rank(rank: int = 0, world_size: int = 1, backend: str | None = None):
    """The DistInfo of a CPU rank on localhost, as distributed.setup would describe it."""
    import torch

    from ddp_template.distributed import DistInfo

    return DistInfo(
        rank=rank,
        local_rank=rank,
        world_size=world_size,
        local_world_size=world_size,
        backend=backend,
        device=torch.device("cpu"),
        host="localhost",
    )


def last_checkpoint(out: Path, run_id: str) -> dict:
    """The ``last.pt`` of run ``run_id`` under ``out``, loaded on the CPU."""
    import torch

    return torch.load(out / "outputs" / run_id / "checkpoints" / "last.pt", weights_only=True)


def live_rows(run_dir: Path) -> list[dict]:
    """fault_tolerance=live's record of the run: memberships, losses, regroups, commits."""
    return jsonl(run_dir / "live.jsonl")


def events(rows: list[dict], event: str) -> list[dict]:
    return [r for r in rows if r["event"] == event]


def verdicts(run_dir: Path) -> dict[int, tuple[int, int]]:
    """Each epoch's verdict and its total samples, by the epoch's last step, from every
    process's metrics (under fault_tolerance=live rank 0 moves when it dies)."""
    found = {}
    for path in run_dir.glob("rank*/metrics.jsonl"):
        for row in jsonl(path):
            if "shares/verdict_ok" in row:
                found[row["step"]] = (row["shares/verdict_ok"], row["shares/total_samples"])
    return found
