"""Run identity: the run id and run directory every rank agrees on, Hydra's resolvers, --help.

Run id: an explicit ``RUN_ID``; else torchrun's rendezvous id (``TORCHELASTIC_RUN_ID`` unless it
is ``none``); else, on a single node, the launching agent's identity (its start time and pid,
which all its workers share and elastic restarts keep); else, for a plain process, a timestamp.
Ranks on several nodes with no shared id cannot agree, so that launch is refused with the fix.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
from omegaconf import OmegaConf

from ddp_template.distributed import env_rank, launched_by_torchrun
from ddp_template.errors import ConfigError

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
    resolvers: dict[str, Callable[..., str | None]] = {
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
