"""The in-process launcher: ``dist.nproc`` local ranks on torch's elastic agent, like torchrun.

The workers get the composed config and the run directory from this process (they do not
compose Hydra again) and rendezvous on a free localhost port, so concurrent runs never collide.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from ddp_template.config.schema import Config
from ddp_template.distributed import LAUNCHER_VAR, launched_by_torchrun
from ddp_template.errors import EXIT_CONFIG_ERROR, EXIT_INTERRUPTED, EXIT_PREEMPTED
from ddp_template.process import exit_records, server_start
from ddp_template.process.preload import loaded_modules
from ddp_template.registry import load
from ddp_template.run_identity import RunInfo
from ddp_template.tolerance import SUPERVISOR, fallback_line, reconfigurable


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
    if launched_by_torchrun() or (cfg.dist.nproc == 1 and cfg.dist.nnodes == 1):
        return fn(cfg, run)
    if cfg.fault_tolerance.mode == "live":
        why = reconfigurable()
        if why is None:
            supervise = load(SUPERVISOR, key="fault_tolerance=live", fix="set fault_tolerance=off.")
            return supervise(_importable(fn), cfg, run)
        print(f"warning: {fallback_line(why)}", file=sys.stderr)
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
    os.environ["RUN_ID"] = run.run_id  # workers inherit it: one id, also after restarts
    os.environ[LAUNCHER_VAR] = "dist.nproc"
    if cfg.dist.start_method == "forkserver":
        # Each rank is then a fork of one server that has imported torch and this script once,
        # instead of a fresh interpreter importing them (seconds per rank on a small machine).
        # torch._dynamo too: every rank's optimizer imports it (2 s each). The server is itself
        # a fork of this process (after the variables above, which the ranks inherit from it).
        server_start.start(preload=loaded_modules("torch", "torch._dynamo"))
    _quiet_agent()
    exits = _Exits()
    try:
        with _agent_keeping(exits):
            results = elastic_launch(config, _importable(fn))(cfg, run)
    except SignalException as exc:  # Ctrl-C or SIGTERM reached this process too
        _kill_workers()  # they have checkpointed and left, unless a second Ctrl-C came first
        interrupted = exc.sigval == signal.SIGINT
        raise SystemExit(EXIT_INTERRUPTED if interrupted else EXIT_PREEMPTED) from None
    except ChildFailedError as exc:
        seen, failure = exc.get_first_failure()
        if failure.exitcode in (EXIT_CONFIG_ERROR, EXIT_PREEMPTED, EXIT_INTERRUPTED):
            raise SystemExit(failure.exitcode) from None  # the rank said why
        verdict = _verdict(seen, failure, exits, run.run_dir)
        print(verdict.report, file=sys.stderr)
        raise SystemExit(verdict.exitcode) from None
    return results[0]


def _verdict(seen: int, failure: Any, exits: _Exits, run_dir: Path) -> exit_records.Verdict:
    """Who caused the failure, from every worker's exit code and the ranks' own records; torch's
    own record of the rank it saw stands in for ours when that rank left none."""
    found = exit_records.read_failures(run_dir, since=exits.started)
    message = failure.message
    if seen not in found and isinstance(message, dict):  # torch's @record caught an exception
        text = message.get("extraInfo", {}).get("py_callstack") or message.get("message", "")
        found[seen] = exit_records.Failure(
            time=failure.timestamp,
            attempt=0,
            traceback=text,
            peer_gone=exit_records.peer_gone(text),
        )
    codes = exits.codes or {seen: failure.exitcode}  # empty: torch's agent changed
    return exit_records.cause(exits=codes, failures=found, seen=seen)


class _Exits:
    """What the agent saw of the last worker group: when it started (older records belong to an
    earlier attempt) and, once it failed, every worker's exit code."""

    def __init__(self) -> None:
        self.started = time.time()
        self.codes: dict[int, int] = {}


@contextlib.contextmanager
def _agent_keeping(exits: _Exits) -> Iterator[None]:
    """torch's elastic launch with its LocalElasticAgent keeping every worker's exit code.

    torch's failure result holds one worker: the first that its poll finds exited, which is rank 0
    whenever both ranks are gone by the poll, also when rank 1's death caused rank 0's. The agent's
    ``_start_workers``/``_monitor_workers`` are its documented extension points; the exit codes
    are on the ``multiprocessing.Process`` objects inside its process context (set by the join that
    found the failure), which is torch internals (2.14): read in ``_exit_codes`` only, and anything
    missing there leaves ``exits.codes`` empty, so the report falls back to torch's one failure.
    """
    import torch.distributed.launcher.api as launcher_api

    base = getattr(launcher_api, "LocalElasticAgent", None)
    if base is None:
        yield
        return

    class Agent(base):  # type: ignore[misc, valid-type]
        def _start_workers(self, worker_group: Any) -> Any:
            exits.started, exits.codes = time.time(), {}
            return super()._start_workers(worker_group)

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            if result.is_failed():
                exits.codes = _exit_codes(self, worker_group)
            return result

    # launch_agent builds its agent by this name (a patch of torch's module: no type of its own)
    launcher_api.LocalElasticAgent = Agent  # type: ignore[misc]
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = base  # type: ignore[misc]  # put back, as above


def _exit_codes(agent: Any, worker_group: Any) -> dict[int, int]:
    """global rank -> exit code of every worker of a failed group; {} if torch's own changed."""
    try:
        processes = agent._pcontext._pc.processes  # MultiprocessContext -> mp.ProcessContext
        codes = {w.global_rank: processes[w.local_rank].exitcode for w in worker_group.workers}
    except (AttributeError, IndexError, TypeError):
        return {}
    return {rank: code for rank, code in codes.items() if isinstance(code, int)}


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
