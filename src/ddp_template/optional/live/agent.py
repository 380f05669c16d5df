"""``fault_tolerance=live``: a host's agent, in each host's launcher process.

It starts this host's ranks (``dist.nproc`` slots: ``node_rank * nproc + i``), tells the
coordinator when one ends (``exit/<id>``) and kills the ones the coordinator gives up on
(``kill/<id>``: silent or stuck, so they cannot come back into a group that went on without
them). A rank of its own that was lost (killed by a signal, or cut off and fenced) is started
again in its slot, while ``fault_tolerance.replacements`` last: the new process joins the
survivors at a step boundary. An agent started again on a host that was lost (the same
command) finds the run under way and starts its slots as such replacements: the host rejoins.

An agent cut off from the coordinator keeps its ranks' exits until it reaches it again, then
reports them and starts its slots anew (they rejoin), or says why not; after
``regroup_timeout_s`` without an answer it ends its ranks and says so.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddp_template import network
from ddp_template.config.schema import Config
from ddp_template.distributed import LAUNCHER_VAR
from ddp_template.errors import EXIT_FENCED
from ddp_template.optional.live import keys
from ddp_template.run_identity import RunInfo
from ddp_template.tolerance import INCARNATION_VAR, LIVE_VAR


def _rank_main(fn: Any, cfg: Config, run: RunInfo, env: dict[str, str]) -> None:
    """A rank's process: its environment, then ``fn``; exits without the interpreter's
    teardown of a live gloo group."""
    os.environ.update(env)
    code = 1
    try:
        result = fn(cfg, run)
        code = 0
        if result is not None:  # the sweep's objective, the same on every rank
            with contextlib.suppress(Exception):
                keys.connect(timedelta(seconds=10)).set(keys.RESULT, json.dumps(float(result)))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def reached_from(host: str) -> str | None:
    """This host's address toward the coordinator's ``host`` (None on the loopback: one
    machine), the address its ranks' collectives use."""
    source = network.route_source(socket.gethostbyname(host))
    return None if source.startswith("127.") else source


class Agent:
    def __init__(
        self, fn: Any, cfg: Config, run: RunInfo, connect: Callable[[], dist.Store], master: str
    ) -> None:
        """``connect``: a client of the coordinator's store (again after one went unanswered)."""
        self.fn, self.cfg, self.run, self.connect = fn, cfg, run, connect
        self.store: dist.Store | None = connect()
        self.ft, self.nproc = cfg.fault_tolerance, cfg.dist.nproc
        self.node, self.world = cfg.dist.node_rank, cfg.dist.nproc * cfg.dist.nnodes
        self.master = master  # host:port of the coordinator's store
        self.address = reached_from(master.rpartition(":")[0])
        self.context: Any = multiprocessing.get_context(str(cfg.dist.start_method))
        self.running: dict[str, Any] = {}  # member id -> multiprocessing.Process
        self.unsaid: dict[str, int] = {}  # exits not yet told to the coordinator
        self.unreached: float | None = None  # since when the coordinator has not answered
        self.code = 0

    def start(self) -> None:
        assert self.store is not None
        for local in range(self.nproc):
            self._start(self.store, self.node * self.nproc + local)

    def _env(self, slot: int, incarnation: int) -> dict[str, str]:
        host, _, port = self.master.rpartition(":")
        return {
            "RANK": str(slot),
            "LOCAL_RANK": str(slot - self.node * self.nproc),
            "WORLD_SIZE": str(self.world),
            "LOCAL_WORLD_SIZE": str(self.nproc),
            "GROUP_RANK": str(self.node),
            "MASTER_ADDR": host,
            "MASTER_PORT": port,
            "RUN_ID": self.run.run_id,
            LAUNCHER_VAR: "dist.nproc",
            LIVE_VAR: "1",
            INCARNATION_VAR: str(incarnation),
            keys.RECORD_VAR: str(self.run.run_dir / keys.RECORD),
        }

    def _start(self, store: dist.Store, slot: int) -> None:
        """A process in ``slot``: its first, or a replacement (within the budget)."""
        incarnation = int(store.add(keys.incarnations(slot), 1)) - 1
        if incarnation > 0 and int(store.add(keys.REPLACED, 1)) > self.ft.replacements:
            self._say(
                f"slot {slot} is not started again: fault_tolerance.replacements="
                f"{self.ft.replacements} are used up; the run goes on without it"
            )
            return
        process = self.context.Process(
            target=_rank_main,
            args=(self.fn, self.cfg, self.run, self._env(slot, incarnation)),
            name=f"rank-slot{slot}",
        )
        process.start()
        member = keys.member_id(slot, incarnation)
        host = socket.gethostname()
        said = {"pid": process.pid, "host": host, "node": self.node, "address": self.address}
        said["time"] = time.time()
        store.set(keys.started(member), json.dumps(said))
        self.running[member] = process
        if incarnation:
            self._say(f"slot {slot} started again (process {process.pid}); it joins the others")

    def _say(self, line: str) -> None:
        print(f"live agent on {socket.gethostname()} (node {self.node}): {line}", file=sys.stderr)

    def watch(self) -> bool:
        """One look at this host's ranks and the coordinator's word; False once the agent is
        done (its ranks finished, or ended: ``code``)."""
        for member, process in list(self.running.items()):
            if process.exitcode is not None:
                del self.running[member]
                self.unsaid[member] = process.exitcode
        try:
            self.store = self.store or self.connect()
            self._tell(self.store)
        except (RuntimeError, dist.DistStoreError):  # cut off, or the coordinator is gone
            self.store = None  # its connection may be half-read: a new one next look
            now = time.monotonic()
            self.unreached = self.unreached or now
            if now - self.unreached > self.ft.regroup_timeout_s:
                self._say(
                    f"the membership coordinator at {self.master} has not answered for "
                    f"{now - self.unreached:.0f} s (fault_tolerance.regroup_timeout_s); this "
                    f"host's ranks end here. Start every host's command again and the run "
                    f"resumes from its last checkpoint."
                )
                self.end(signal.SIGKILL)
                self.code = 1
                return False
            return True
        self.unreached = None
        return bool(self.running)

    def _tell(self, store: dist.Store) -> None:
        """The exits to the coordinator (lost slots started again), its word back."""
        if store.check([keys.ABORT]):
            ended = json.loads(store.get(keys.ABORT))
            self.code = int(ended["code"])
            self.end(signal.Signals[ended["signal"]])
            return
        for member, code in list(self.unsaid.items()):
            store.set(keys.exited(member), str(code))
            del self.unsaid[member]
            if code < 0 or code == EXIT_FENCED:
                self._restart(store, keys.parse(member)[0])
        for member, process in self.running.items():
            if store.check([keys.kill(member)]):
                with contextlib.suppress(ProcessLookupError):
                    process.kill()  # silent or stuck: it must not come back

    def _restart(self, store: dist.Store, slot: int) -> None:
        if store.check([keys.CLOSED]):
            self._say(f"the run finished while slot {slot} was lost; it does not rejoin")
            return
        self._start(store, slot)

    def end(self, sig: signal.Signals) -> None:
        """This host's ranks get ``sig``; any still there after 30 s, SIGKILL."""
        for process in self.running.values():
            with contextlib.suppress(ProcessLookupError, AttributeError):
                os.kill(process.pid, sig)
        for process in self.running.values():
            process.join(timeout=30)
            if process.exitcode is None:
                process.kill()
        self.running.clear()
