"""``fault_tolerance=live``, the launcher's side: the store, the heartbeats, the memberships.

The launcher process hosts the ranks' TCPStore, so the store outlives every rank (a store in
rank 0 dies with it, and so would every survivor's next call). It starts ``dist.nproc`` ranks
(slot 0..N-1), publishes the first membership, and then watches: a rank killed by a signal, or
silent for ``fault_tolerance.dead_after_s`` (a stopped or hung process: killed, so it cannot
come back into a group that went on without it), is lost. Each loss publishes the next
membership without it and, while ``fault_tolerance.replacements`` last, starts a new process
in its slot; the replacement, once ready, is published as a member of the next membership and
joins at the survivors' next admission check. Fewer than ``fault_tolerance.min_members``
alive ends the run with one sentence (its last checkpoint resumes it). A rank's own failure
(a Python exception, a config error, a preemption: a non-zero exit code) ends the run as the
restart path would. Every membership goes to ``<run_dir>/live.jsonl``.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddp_template.config.schema import Config
from ddp_template.distributed import LAUNCHER_VAR
from ddp_template.errors import EXIT_INTERRUPTED
from ddp_template.optional.live import keys
from ddp_template.process import server_start
from ddp_template.process.preload import loaded_modules
from ddp_template.run_identity import RunInfo
from ddp_template.tolerance import INCARNATION_VAR, LIVE_VAR

POLL_S = 0.02


@dataclass
class Member:
    slot: int
    incarnation: int
    process: Any  # multiprocessing.Process
    beat: str = ""  # the last heartbeat value seen
    beat_at: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> str:
        return keys.member_id(self.slot, self.incarnation)


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


class Supervisor:
    def __init__(self, fn: Any, cfg: Config, run: RunInfo) -> None:
        self.fn, self.cfg, self.run = fn, cfg, run
        self.ft = cfg.fault_tolerance
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self.live = dist.PrefixStore("live", self.store)
        self.nproc = cfg.dist.nproc
        self.context: Any = multiprocessing.get_context(str(cfg.dist.start_method))
        self.members: list[Member] = []
        self.waiting: list[Member] = []  # replacements not yet admitted
        self.done: list[Member] = []
        self.gen, self.started, self.replaced = -1, time.monotonic(), 0
        self.beats_read = self.started
        self.record = run.run_dir / keys.RECORD

    def _env(self, slot: int, incarnation: int) -> dict[str, str]:
        return {
            "RANK": str(slot),
            "LOCAL_RANK": str(slot),
            "WORLD_SIZE": str(self.nproc),
            "LOCAL_WORLD_SIZE": str(self.nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.store.port),
            "RUN_ID": self.run.run_id,
            LAUNCHER_VAR: "dist.nproc",
            LIVE_VAR: "1",
            INCARNATION_VAR: str(incarnation),
            keys.RECORD_VAR: str(self.record),
        }

    def _start(self, slot: int, incarnation: int) -> Member:
        process = self.context.Process(
            target=_rank_main,
            args=(self.fn, self.cfg, self.run, self._env(slot, incarnation)),
            name=f"rank-slot{slot}",
        )
        process.start()
        member = Member(slot, incarnation, process)
        self._write(event="started", slot=slot, incarnation=incarnation, pid=process.pid)
        return member

    def _write(self, **row: Any) -> None:
        keys.record(self.record, since_start_s=time.monotonic() - self.started, **row)

    def _publish(self, reason: str) -> None:
        self.gen += 1
        ids = [m.id for m in self.members]
        keys.publish(self.live, self.gen, ids, reason)
        pids = {m.id: m.process.pid for m in self.members}
        self._write(event="membership", gen=self.gen, members=ids, pids=pids, reason=reason)

    def run_all(self) -> Any:
        self.run.run_dir.mkdir(parents=True, exist_ok=True)
        self.members = [self._start(slot, 0) for slot in range(self.nproc)]
        self._publish("start")  # membership 0
        try:
            while self.members or self.waiting:
                self._watch()
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            self._end(signal.SIGINT)
            raise SystemExit(EXIT_INTERRUPTED) from None
        if self.live.check([keys.RESULT]):
            return json.loads(self.live.get(keys.RESULT))
        return None

    def _watch(self) -> None:
        now = time.monotonic()
        read_beats = now - self.beats_read >= self.ft.heartbeat_s  # as often as they are sent
        if read_beats:
            self.beats_read = now
        for member in list(self.members):
            code = member.process.exitcode
            if code is not None:
                self._exited(member, code)
            elif read_beats:
                self._listen(member, now)
        self._admit()

    def _listen(self, member: Member, now: float) -> None:
        """A running member's heartbeat: a new one, or silence too long (killed, lost)."""
        beat = self._beat(member)
        if beat != member.beat:
            member.beat, member.beat_at = beat, now
        elif beat and now - member.beat_at > self.ft.dead_after_s:
            member.process.kill()  # a stopped or hung rank: it must not come back
            member.process.join()
            self._lose(member, f"silent for {now - member.beat_at:.1f} s, killed")

    def _exited(self, member: Member, code: int) -> None:
        """A member's exit: finished, its own failure (the run ends), or killed (lost)."""
        if code == 0:
            self.live.set(keys.CLOSED, str(member.slot))
            self.members.remove(member)
            self.done.append(member)
            self._write(event="finished", slot=member.slot, incarnation=member.incarnation)
            return
        if code > 0:  # the rank's own failure: the run ends (a restart resumes it)
            self._write(event="failed", slot=member.slot, exit=code)
            self._end(signal.SIGTERM)
            raise SystemExit(code)
        self._lose(member, f"killed by {signal.Signals(-code).name}")

    def _admit(self) -> None:
        """The waiting replacements: failed, or ready to join (a new membership)."""
        for member in list(self.waiting):
            if member.process.exitcode is not None:
                self.waiting.remove(member)
                self._write(
                    event="replacement_failed", slot=member.slot, exit=member.process.exitcode
                )
            elif self.live.check([keys.ready(member.id)]) and self.members and not self.done:
                self.waiting.remove(member)
                self.members.append(member)
                self._publish(f"slot {member.slot} rejoins (process {member.process.pid})")

    def _beat(self, member: Member) -> str:
        key = keys.heartbeat(member.id)
        return self.live.get(key).decode() if self.live.check([key]) else ""

    def _lose(self, member: Member, why: str) -> None:
        self.members.remove(member)
        self._write(event="lost", slot=member.slot, incarnation=member.incarnation, why=why)
        if len(self.members) < self.ft.min_members:
            print(
                f"error: rank slot {member.slot} was lost ({why}) and {len(self.members)} of "
                f"{self.nproc} ranks are left, fewer than fault_tolerance.min_members="
                f"{self.ft.min_members}; the run ends here: run the same command again and it "
                f"resumes from its last checkpoint (resume=auto).",
                file=sys.stderr,
            )
            self._end(signal.SIGKILL)
            raise SystemExit(1)
        self._publish(f"slot {member.slot} lost: {why}")
        if self.replaced < self.ft.replacements and not self.done:
            self.replaced += 1
            self.waiting.append(self._start(member.slot, member.incarnation + 1))

    def _end(self, sig: signal.Signals) -> None:
        for member in self.members + self.waiting:
            with contextlib.suppress(ProcessLookupError, AttributeError):
                os.kill(member.process.pid, sig)
        for member in self.members + self.waiting:
            member.process.join(timeout=30)
            if member.process.exitcode is None:
                member.process.kill()


def supervise(fn: Any, cfg: Config, run: RunInfo) -> Any:
    """Run ``fn(cfg, run)`` on ``dist.nproc`` ranks that survive each other's deaths."""
    os.environ["RUN_ID"] = run.run_id
    os.environ[LAUNCHER_VAR] = "dist.nproc"
    if cfg.dist.start_method == "forkserver":
        server_start.start(preload=loaded_modules("torch", "torch._dynamo"))
    return Supervisor(fn, cfg, run).run_all()
