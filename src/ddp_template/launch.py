"""In-process launch of N workers, and the run id / run directory every rank agrees on.

Run id (DESIGN.md §5): an explicit ``RUN_ID``; else torchrun's rendezvous id
(``TORCHELASTIC_RUN_ID`` unless it is ``none``); else, on a single node, the launching agent's
identity (its start time and pid, which all its workers share and elastic restarts keep); else,
for a plain process, a timestamp. Ranks on several nodes with no shared id cannot agree, so
that launch is refused with the fix.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from omegaconf import DictConfig, OmegaConf

from ddp_template.config import validate
from ddp_template.distributed import env_rank, launched_by_torchrun
from ddp_template.errors import EXIT_CONFIG_ERROR, EXIT_PREEMPTED, ConfigError

_RUN_ID: str | None = None


def _stamp(seconds: float) -> str:
    return time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(seconds))


def compute_run_id(env: dict[str, str] | None = None) -> str:
    env = dict(os.environ if env is None else env)
    if env.get("RUN_ID"):
        return env["RUN_ID"]
    rdzv = env.get("TORCHELASTIC_RUN_ID", "")
    if rdzv and rdzv != "none":
        return rdzv
    if "WORLD_SIZE" in env:
        world, local = int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
        if world != local:
            raise ConfigError(
                "this multi-node launch has no run id that all nodes share "
                "(TORCHELASTIC_RUN_ID=none); pass --rdzv-id=<id> to torchrun on every node "
                "(or set RUN_ID), or use --standalone on a single node."
            )
        agent = psutil.Process(os.getppid())  # every worker of one torchrun agent shares it
        return f"{_stamp(agent.create_time())}-a{agent.pid}"
    return f"{_stamp(time.time())}-p{os.getpid()}"


def run_id() -> str:
    """This process's run id, computed once: every resolution must give the same answer."""
    global _RUN_ID
    if _RUN_ID is None:
        _RUN_ID = compute_run_id()
    return _RUN_ID


SKIP_GROUPS = ("hydra", "local")


def config_groups(conf_dir: str) -> str:
    """``--help``'s list of config groups and options, read from the YAML files on disk.

    Hydra's own ``$APP_CONFIG_GROUPS`` would also list the schemas registered in ConfigStore.
    """
    root = Path(conf_dir)
    lines = []
    for group in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in SKIP_GROUPS):
        options = sorted(f.stem for f in group.glob("*.yaml"))
        lines.append(f"  {group.name:<11} {', '.join(options)}")
    return "\n".join(lines)


def register_resolvers() -> None:
    """Resolvers used by conf/config.yaml's ``hydra:`` section; call before ``@hydra.main``."""
    resolvers = {
        "run_id": run_id,
        "config_groups": config_groups,
        # Only rank 0 writes .hydra/ and train.log; other ranks of a torchrun job log to
        # rank<r>.log in the same directory.
        "hydra_subdir": lambda: ".hydra" if env_rank() == 0 else None,
        "log_file": lambda: "train.log" if env_rank() == 0 else f"rank{env_rank()}.log",
    }
    for name, fn in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


@dataclass(frozen=True)
class RunInfo:
    run_id: str  # the W&B group: one per run (per job in a multirun)
    run_dir: Path


def current_run() -> RunInfo:
    """The run id and directory of the current Hydra job (run or multirun)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    rid = run_id()
    if hc.mode == RunMode.MULTIRUN:
        if launched_by_torchrun():
            raise ConfigError(
                "multirun (-m) under torchrun would run every sweep job on every rank; drop "
                "torchrun and run `python train.py -m dist.nproc=N ...`, which starts N ranks "
                "per job."
            )
        rid = f"{rid}-{hc.job.num}"
    return RunInfo(rid, run_dir)


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


def launch(fn: Any, cfg: DictConfig, run: RunInfo) -> Any:
    """Run ``fn(cfg, run)`` on ``dist.nproc`` local ranks, or directly when already a rank.

    The workers get the composed config and the run directory from this process (they do not
    compose Hydra again) and rendezvous on a free localhost port, so concurrent runs never
    collide. A failing worker stops all of them, like torchrun; with ``dist.max_restarts`` the
    whole group restarts and resumes from the last checkpoint.
    """
    validate(cfg)
    if launched_by_torchrun() or cfg.dist.nproc == 1:
        return fn(cfg, run)
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
        start_method=cfg.dist.start_method,
    )
    os.environ["RUN_ID"] = run.run_id  # workers inherit it: one id, also after restarts
    # The agent logs its own internal traceback for every failed worker; the worker's own
    # message (or traceback, printed below) is the one a user needs.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        results = elastic_launch(config, _importable(fn))(cfg, run)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode in (EXIT_CONFIG_ERROR, EXIT_PREEMPTED):  # the rank said why
            raise SystemExit(failure.exitcode) from None
        message = failure.message
        if isinstance(message, dict):
            message = message.get("extraInfo", {}).get("py_callstack") or message.get("message")
        print(f"rank {rank} failed (exit code {failure.exitcode}):\n{message}", file=sys.stderr)
        raise SystemExit(failure.exitcode if failure.exitcode > 0 else 1) from None
    return results[0]
