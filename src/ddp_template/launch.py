"""The in-process launcher: ``dist.nproc`` local ranks on torch's elastic agent, like torchrun.

The workers get the composed config and the run directory from this process (they do not
compose Hydra again) and rendezvous on a free localhost port, so concurrent runs never collide.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import multiprocessing
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import psutil

from ddp_template.config import Config
from ddp_template.distributed import LAUNCHER_VAR, launched_by_torchrun
from ddp_template.errors import EXIT_CONFIG_ERROR, EXIT_INTERRUPTED, EXIT_PREEMPTED
from ddp_template.run_identity import RunInfo


def _importable(fn: Any) -> Any:
    """``fn`` in a form that spawned workers can unpickle.

    Spawned workers import ``fn`` by module and name. ``train.train`` lives in ``__main__``,
    which is importable only while train.py *is* ``__main__``; under hydra-submitit-launcher
    (``hydra/launcher=slurm``) ``__main__`` is submitit's runner and the function arrived by
    value (cloudpickle), so it is sent to the workers by value too.
    """
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) != "__main__" or getattr(main, fn.__name__, None) is fn:
        return fn
    import cloudpickle  # installed with submitit, the only way to get here

    call = functools.partial(_call_pickled, cloudpickle.dumps(fn))
    call.__name__ = call.__qualname__ = fn.__name__  # type: ignore[attr-defined]  # for the agent
    return call


def _call_pickled(blob: bytes, *args: Any) -> Any:
    import cloudpickle

    return cloudpickle.loads(blob)(*args)


def launch(fn: Any, cfg: Config, run: RunInfo) -> Any:
    """Run ``fn(cfg, run)`` on ``dist.nproc`` local ranks, or directly when already a rank.

    The workers get the composed config and the run directory from this process (they do not
    compose Hydra again) and rendezvous on a free localhost port, so concurrent runs never
    collide. A failing worker stops all of them, like torchrun; with ``dist.max_restarts`` the
    whole group restarts and resumes from the last checkpoint.
    """
    if launched_by_torchrun() or cfg.dist.nproc == 1:
        return fn(cfg, run)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.dist.nproc,
        run_id=run.run_id,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=cfg.dist.max_restarts,
        monitor_interval=0.1,
        start_method=str(cfg.dist.start_method),
    )
    if cfg.dist.start_method == "forkserver":
        # Each rank is then a fork of one server that has imported torch and this script once,
        # instead of a fresh interpreter importing them (seconds per rank on a small machine).
        multiprocessing.set_forkserver_preload(["torch", "__main__"])
    started = time.time()
    os.environ["RUN_ID"] = run.run_id  # workers inherit it: one id, also after restarts
    os.environ[LAUNCHER_VAR] = "dist.nproc"
    _quiet_agent()
    try:
        results = elastic_launch(config, _importable(fn))(cfg, run)
    except SignalException as exc:  # Ctrl-C or SIGTERM reached this process too
        _kill_workers()  # they have checkpointed and left, unless a second Ctrl-C came first
        interrupted = exc.sigval == signal.SIGINT
        raise SystemExit(EXIT_INTERRUPTED if interrupted else EXIT_PREEMPTED) from None
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode in (EXIT_CONFIG_ERROR, EXIT_PREEMPTED, EXIT_INTERRUPTED):
            raise SystemExit(failure.exitcode) from None  # the rank said why
        message = failure.message
        if isinstance(message, dict):
            message = message.get("extraInfo", {}).get("py_callstack") or message.get("message")
        records = _recorded_failures(run.run_dir, started)
        if rank in records:  # the rank the agent saw raised too: did another rank raise first?
            rank = min(records, key=records.__getitem__)
            message = records[rank][2]
        print(f"rank {rank} failed (exit code {failure.exitcode}):\n{message}", file=sys.stderr)
        raise SystemExit(failure.exitcode if failure.exitcode > 0 else 1) from None
    return results[0]


def record_failure(run_dir: Path, rank: int) -> None:
    """A failing rank's traceback and the moment it raised, in ``rank<r>/error.json``.

    The agent reports the first rank it sees exit; when rank 1 crashes, rank 0's collective
    fails at once ("Connection closed by peer") and may exit first, and the agent then stops
    rank 1 and never shows its traceback. The times recorded here name the rank that failed
    first.
    """
    record = {
        "time": time.time(),
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "traceback": traceback.format_exc(),
    }
    path = run_dir / f"rank{rank}" / "error.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))


def _recorded_failures(run_dir: Path, since: float) -> dict[int, tuple[int, float, str]]:
    """rank -> (-attempt, time, traceback) of the failures recorded since this launch began:
    ``min`` over the values is the earliest failure of the last elastic attempt."""
    found = {}
    for path in run_dir.glob("rank*/error.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            record = json.loads(path.read_text())
            if record["time"] >= since:
                rank = int(path.parent.name.removeprefix("rank"))
                found[rank] = (-record["attempt"], record["time"], record["traceback"])
    return found


class _DropSignalNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "death signal" not in str(record.msg)


def _quiet_agent() -> None:
    """The agent logs its own traceback for every failed worker and a notice for every signal;
    the worker's own message (or traceback, printed by ``launch``) is the one a user needs."""
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    agent_log = logging.getLogger("torch.distributed.elastic.agent.server.api")
    if not any(isinstance(f, _DropSignalNotice) for f in agent_log.filters):
        agent_log.addFilter(_DropSignalNotice())


def _kill_workers() -> None:
    """Kill the ranks still running (not multiprocessing's resource tracker: this process
    still needs it to clean up at exit)."""
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if "resource_tracker" not in " ".join(child.cmdline()):
                child.kill()
