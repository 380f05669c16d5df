"""``fault_tolerance=live``, the launcher's side: one launcher per host.

Node 0's launcher runs the membership coordinator (``coordinator``: the store and the
memberships) beside its host's agent (``agent``: its ranks); every other host's launcher runs
its agent only, a client of the coordinator at ``fault_tolerance.coordinator``. On one host
(``dist.nnodes=1``) the coordinator listens on a free loopback port. Every membership goes to
``<run_dir>/live.jsonl``.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

from ddp_template.config.schema import Config
from ddp_template.distributed import LAUNCHER_VAR
from ddp_template.errors import EXIT_INTERRUPTED
from ddp_template.optional.live import keys
from ddp_template.optional.live.agent import Agent
from ddp_template.optional.live.coordinator import Coordinator, Ended
from ddp_template.process import server_start
from ddp_template.process.preload import loaded_modules
from ddp_template.run_identity import RunInfo

POLL_S = 0.02
REQUEST_S = 5.0  # an agent's request to the coordinator: longer, and the coordinator is unreached


def supervise(fn: Any, cfg: Config, run: RunInfo) -> Any:
    """Run ``fn(cfg, run)`` on this host's ``dist.nproc`` ranks, which survive each other's
    deaths and other hosts' (node 0: also the coordinator). Returns the sweep's objective."""
    os.environ["RUN_ID"] = run.run_id
    os.environ[LAUNCHER_VAR] = "dist.nproc"
    if cfg.dist.start_method == "forkserver":
        server_start.start(preload=loaded_modules("torch", "torch._dynamo"))
    ft = cfg.fault_tolerance
    host, _, port = ft.coordinator.rpartition(":") if ft.coordinator else ("127.0.0.1", "", "0")
    coordinator = None
    run.run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.dist.node_rank == 0:
        world = cfg.dist.nproc * cfg.dist.nnodes
        coordinator = Coordinator(ft, world, run.run_dir / keys.RECORD, int(port))
        live, port = coordinator.live, str(coordinator.port)
        agent = Agent(fn, cfg, run, lambda: live, f"{host}:{port}")
    else:
        first = keys.at(host, int(port), timedelta(seconds=ft.regroup_timeout_s))  # node 0 starts
        first.set_timeout(timedelta(seconds=REQUEST_S))
        clients = iter([first])
        agent = Agent(
            fn,
            cfg,
            run,
            lambda: next(clients, None) or keys.at(host, int(port), timedelta(seconds=REQUEST_S)),
            f"{host}:{port}",
        )
    agent.start()
    if coordinator is not None:
        coordinator.start()
    try:
        while True:
            if coordinator is not None:
                coordinator.watch()
            if not agent.watch() and (coordinator is None or coordinator.done):
                break
            time.sleep(POLL_S)
    except Ended as ended:
        agent.end(ended.sig)
        raise SystemExit(ended.code) from None
    except KeyboardInterrupt:
        agent.end(signal.SIGINT)
        raise SystemExit(EXIT_INTERRUPTED) from None
    if agent.code:
        raise SystemExit(agent.code)
    return coordinator.result() if coordinator is not None else None
