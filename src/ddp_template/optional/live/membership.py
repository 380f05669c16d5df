"""``fault_tolerance=live``, a rank's side: its heartbeat, the membership it regroups into.

Every rank joins torch's reconfigurable gloo process group (``enable_reconfigure=True``; a
process-unique rank so that a replacement's handle never collides with a dead rank's) and
talks to the membership coordinator through the store it hosts (``live.coordinator``, in node
0's launcher). The coordinator publishes each membership as a generation ``g`` (``members/<g>``:
the member ids); the members of ``g`` post their reconfigure handle and the step their weights
stand at (``arrive/<g>/<id>``) and, once all have, reconfigure the group with the handles in one
order every member computes alike: the survivors furthest on first (the new rank 0 is the one
every other takes its state from), then by slot, replacements last. A generation that loses a
member before it forms is superseded by the next one the coordinator publishes.

A heartbeat thread beats every ``heartbeat_s`` and whenever the rank's step progress moves, and
reads the newest membership: one that drops this rank ends it; one that names hosts gone silent
has their connections shut down (``connections.sever``). The rank's writes ask ``gate`` first
(``fencing``): a token while the rank is a member and its lease stands, else it stops without
writing; a watchdog stops it too once no beat has landed for ``dead_after_s`` (cut off).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ddp_template import distributed, fencing, network
from ddp_template.checkpoint import Found
from ddp_template.config.schema import BackendConfig, FaultToleranceConfig
from ddp_template.distributed import DistInfo
from ddp_template.optional.live import keys
from ddp_template.optional.live.connections import sever
from ddp_template.optional.live.coordinator import silence_s
from ddp_template.optional.live.handover import handover
from ddp_template.reach import stop_fenced
from ddp_template.tolerance import MEMBERSHIP_VAR, Begin, Held, M, Start

log = logging.getLogger(__name__)

PROCESS_RANKS = 1 << 20  # the group's nominal size at init: every process's rank is its own
LOOK_S = 0.05  # how often the heartbeat thread looks for the next membership


class Regroup(Exception):  # noqa: N818  (not an error: the members regroup at a boundary)
    """A replacement waits: every member leaves the loop at the same step boundary."""


class Lost(SystemExit):
    """This rank was counted lost (too slow to answer): it leaves; the others went on."""


class Live:
    """This rank's membership of a live group."""

    def __init__(self, cfg: FaultToleranceConfig, backend: BackendConfig) -> None:
        self.cfg, self.backend = cfg, backend
        self.slot, self.incarnation = int(os.environ["RANK"]), keys.incarnation()
        self.id = keys.member_id(self.slot, self.incarnation)
        self.store = keys.connect(timedelta(seconds=cfg.regroup_timeout_s))
        self.gen, self.target = -1, 0
        self.seen = -1  # the newest membership the heartbeat thread saw published
        self.dropped = ""  # why the newest membership it saw leaves this member out
        self.landed: float | None = None  # when the last heartbeat that reached the store left
        # A write must land while the coordinator cannot have dropped this member for silence.
        self.lease_s = silence_s(cfg, broke=True) / 2
        self.regrouped = False  # the first step after a regroup: rank 0 records its commit
        self._agreeing: Any = None  # the admission check in flight (an async all-reduce)
        self._flag = torch.zeros(1, dtype=torch.int32)
        self.info: DistInfo | None = None
        self.state: Any = None  # the membership's engine.TrainState: its step progress
        self.keep_port = int(os.environ["MASTER_PORT"])
        fencing.install(self.gate)
        for target in (self._beat, self._watchdog):
            threading.Thread(target=target, name=f"live-{target.__name__}", daemon=True).start()

    def _progress(self) -> tuple[int, int, int]:
        """(membership, optimizer step, micro-batches of the next step read)."""
        state = self.state
        if state is None:
            return self.gen, -1, 0
        return self.gen, int(state.step), len(state.held)

    def _beat(self) -> None:
        """Own store client: the main thread's may be blocked in a long wait on the store.
        A beat goes out every ``heartbeat_s`` and whenever the progress moved; every look
        reads the newest membership, so the step boundary never waits on the store."""
        timeout = timedelta(seconds=self.cfg.heartbeat_s * 2)
        store: dist.Store | None = None
        n, beat_at, sent = 0, 0.0, (-2, -2, -2)
        while True:
            try:
                store = store or keys.connect(timeout)
                progress, now = self._progress(), time.monotonic()
                if now - beat_at >= self.cfg.heartbeat_s or progress != sent:
                    n, beat_at, sent = n + 1, now, progress
                    store.set(keys.heartbeat(self.id), str(keys.Beat(n, *progress)))
                    self.landed = now
                if store.check([keys.LATEST]):
                    self._look(store, keys.latest(store))
            except (RuntimeError, dist.DistStoreError):  # unanswered: a new client next look
                store = None
            time.sleep(LOOK_S)

    def _look(self, store: dist.Store, latest: int) -> None:
        """The newest membership: dropped from it, or a host in it to sever."""
        if latest <= self.seen:
            return
        published = keys.read_members(store, latest)
        if self.id in published.members:
            mine = self.info.address if self.info is not None else None
            sever(set(published.sever) - {mine}, self.keep_port)
            self.dropped = ""
        elif self.gen >= 0:
            self.dropped = f"membership {latest} left it out ({published.reason})"
        self.seen = latest

    def _watchdog(self) -> None:
        """Cut off for ``dead_after_s`` (the coordinator has dropped it), or dropped: this
        process stops here without another write."""
        while True:
            time.sleep(LOOK_S)
            landed = self.landed
            silent = 0.0 if landed is None else time.monotonic() - landed
            if silent > self.cfg.dead_after_s:
                self._fence(
                    f"none of its heartbeats reached the membership coordinator "
                    f"({os.environ['MASTER_ADDR']}:{self.keep_port}) for {silent:.0f} s "
                    f"(fault_tolerance.dead_after_s={self.cfg.dead_after_s})"
                )
            if self.dropped and self.seen > self.gen:
                self._fence(self.dropped)

    def _fence(self, why: str) -> NoReturn:
        stop_fenced(
            f"rank slot {self.slot} (member {self.id}) on {socket.gethostname()} is out of the "
            f"run: {why}; it stops here and writes nothing more into the run, which the "
            f"members that the coordinator still hears own."
        )

    def gate(self, what: str) -> fencing.Token:
        """``fencing``'s gate: this member's token, while its membership is not over and its
        lease stands (a heartbeat landed within ``lease_s``); else it stops without writing."""
        landed = self.landed
        if self.dropped and self.seen > self.gen:
            self._fence(f"{self.dropped}, and {what} was refused")
        if landed is None or time.monotonic() - landed > self.lease_s:
            self._fence(
                f"its lease on the run lapsed (no heartbeat reached the coordinator for "
                f"{self.lease_s:.1f} s), and {what} was refused"
            )
        return fencing.Token(self.id, self.gen)

    def setup(self) -> Start:
        base = distributed.setup_local(self.backend)  # device, threads, launcher: no group yet
        world = int(os.environ["WORLD_SIZE"])
        if base.local_world_size < world:  # across hosts: gloo on the interface that reaches them
            interface = network.bind_gloo(
                os.environ["MASTER_ADDR"],
                self.slot,
                world,
                dist.PrefixStore("net", keys.connect(timedelta(seconds=60))),
                timedelta(seconds=self.cfg.regroup_timeout_s),
            )
            base = replace(base, interface=interface)
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("pg", keys.connect(timedelta(seconds=60))),
            rank=self.incarnation * world + self.slot,
            world_size=PROCESS_RANKS,
            enable_reconfigure=True,
            timeout=timedelta(seconds=self.backend.timeout_s),
        )
        self.info = base
        if self.incarnation == 0:
            return Start(self._regroup(step=0, joining=False), None)
        self.store.set(keys.ready(self.id), str(os.getpid()))  # the coordinator admits it
        info = self._regroup(step=-1, joining=True)
        return Start(info, handover(None, info, self.target))

    def run(self, begin: Begin[M], info: DistInfo, found: Found | None, regroup: bool) -> M:
        """One membership after another until one fits to the end: where a rank is lost (or a
        replacement waits), the members regroup, the one furthest on hands its state to the
        others, and the next membership begins from it."""
        while True:
            membership = begin(info, found, regroup)
            self.state = membership.held().state
            try:
                membership.fit()
                return membership
            except Exception as exc:  # a lost rank (or a replacement) regroups the ranks
                held = membership.held()
                regrouped = self.recover(exc, held.state.step)
                if regrouped is None:
                    raise
                found = self.handover(held, regrouped)
                info, regroup = regrouped, True

    def boundary(self, step: int) -> None:
        """Every ``admit_every`` steps: is a replacement waiting? Each rank's heartbeat thread
        has looked; an all-reduce started here and read ``admit_every`` steps later (no step
        waits on it) tells every rank the same answer at the same step, so all leave the loop
        there."""
        assert self.info is not None
        if self.regrouped and self.info.is_main:
            keys.record(os.environ[keys.RECORD_VAR], event="committed", gen=self.gen, step=step)
        self.regrouped = False
        if step % self.cfg.admit_every:
            return
        if self._agreeing is not None:
            self._agreeing.wait()
            self._agreeing = None
            if self._flag.item():
                raise Regroup(f"a new membership waits at step {step}")
        self._flag.fill_(int(self.seen > self.gen))
        self._agreeing = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)

    def recover(self, exc: BaseException, step: int) -> DistInfo | None:
        """After a failed collective whose cause the launcher confirms (a new membership
        published within the time it takes to find a silent rank), or a regroup at a boundary:
        this rank's place in the new group, its weights standing at ``step``."""
        self.state = None
        if not isinstance(exc, Regroup):
            self.store.add(keys.broken(self.gen), 1)  # a member is gone: it is judged sooner
            wait = self.cfg.dead_after_s + 4 * self.cfg.heartbeat_s + 2.0
            try:
                self.store.wait([keys.members(self.gen + 1)], timedelta(seconds=wait))
            except (RuntimeError, dist.DistStoreError):
                return None  # no member was lost: the failure is the run's own
            log.warning("regrouping after: %s", str(exc).strip().splitlines()[0][:200])
        self._agreeing = None  # in the old group: never read
        _release(exc)
        self._leave()
        return self._regroup(step=step, joining=False)

    def _leave(self) -> None:
        """Close this rank's connections to the old group (a group of itself alone): a survivor
        still waiting in a collective on this one fails at once, instead of at gloo's
        timeout, and comes to the regroup too."""
        solo = (self.gen + 1) * PROCESS_RANKS + self.incarnation * 1024 + self.slot + 1
        dist._reconfigure(uuid=solo, handles=[dist._get_reconfigure_handle()]).wait()

    def handover(self, held: Held, info: DistInfo) -> Found:
        return handover(held, info, self.target)

    def _regroup(self, *, step: int, joining: bool) -> DistInfo:
        """Into the newest membership: post this rank's handle and step, wait for every member,
        reconfigure. Returns this rank's place in the new group."""
        deadline = time.monotonic() + self.cfg.regroup_timeout_s
        self._await(self.gen + 1, deadline)
        gen = keys.latest(self.store)
        while True:
            members = keys.read_members(self.store, gen).members
            if self.id not in members:
                if not joining:
                    raise Lost(f"rank {self.id} was counted lost in membership {gen}; it leaves")
                self._await(gen + 1, deadline)
                gen = keys.latest(self.store)
                continue
            arrival = {"handle": dist._get_reconfigure_handle(), "step": step, "joining": joining}
            self.store.set(keys.arrival(gen, self.id), json.dumps(arrival))
            arrived = [keys.arrival(gen, m) for m in members]
            while not self.store.check(arrived):
                if self.store.check([keys.members(gen + 1)]):
                    break
                self._check(deadline, gen)
                time.sleep(0.005)
            else:
                posts = {m: json.loads(self.store.get(keys.arrival(gen, m))) for m in members}
                order = sorted(members, key=lambda m: _place(m, posts[m]))
                try:
                    dist._reconfigure(
                        uuid=gen + 1,
                        handles=[posts[m]["handle"] for m in order],
                        timeout=timedelta(seconds=self.cfg.regroup_timeout_s),
                    ).wait()
                except RuntimeError:  # a member died while the group formed: the next one
                    self._await(gen + 1, deadline)
                    gen = keys.latest(self.store)
                    continue
                self.gen, self.target = gen, posts[order[0]]["step"]
                os.environ[MEMBERSHIP_VAR] = str(gen)  # fault injection's attempt
                self.regrouped = gen > 0
                return self._placed(order.index(self.id), len(order))
            gen = keys.latest(self.store)

    def _await(self, gen: int, deadline: float) -> None:
        """Until membership ``gen`` is published (a replacement: unless the run finished)."""
        while not self.store.check([keys.members(gen)]):
            self._check(deadline, gen)
            time.sleep(0.005)

    def _check(self, deadline: float, gen: int) -> None:
        if self.incarnation and self.store.check([keys.CLOSED]):
            log.warning("the run finished before this replacement was admitted; it leaves")
            raise SystemExit(0)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"membership {gen}: its members did not all arrive within "
                f"fault_tolerance.regroup_timeout_s={self.cfg.regroup_timeout_s} s"
            )

    def _placed(self, rank: int, world: int) -> DistInfo:
        assert self.info is not None
        one_host = self.info.local_world_size == self.info.world_size
        self.info = replace(
            self.info,
            rank=rank,
            local_rank=rank if one_host else self.info.local_rank,
            world_size=world,
            local_world_size=world if one_host else self.info.local_world_size,
            backend="gloo",
        )
        return self.info


def _release(exc: BaseException | None) -> None:
    """Drop the failure's frames: a collective's work they hold keeps the old group's
    connections open (gloo closes them with the last reference), and a survivor waiting on
    this rank would wait for gloo's timeout instead of failing now."""
    while exc is not None:
        exc.__traceback__ = None
        exc = exc.__context__
    gc.collect()


def _place(member: str, post: dict[str, Any]) -> tuple[int, int, int]:
    """Survivors furthest on first (the state's source), then by slot; replacements last."""
    slot, _ = keys.parse(member)
    return (int(post["joining"]), -int(post["step"]), slot)


def build_live(cfg: FaultToleranceConfig, backend: BackendConfig) -> Live:
    """The ``fault_tolerance=live`` builder (``tolerance.TOLERANCE``)."""
    return Live(cfg, backend)
