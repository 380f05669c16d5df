"""``fault_tolerance=live``: the membership coordinator, in node 0's launcher process.

It hosts the ranks' TCPStore (``live/`` keys: ``keys``), so the store outlives every rank; it
is not a rank's process, and across hosts it is the one place the membership is decided. It
publishes membership 0 (every slot's first process) and then judges each member:

- its process ended (its agent's word, ``exit/<id>``): finished (0), the run's own failure (a
  positive code other than ``EXIT_FENCED``: the run ends, as the restart path would), or lost
  (a signal, or fenced: cut off and stopped);
- its heartbeat silent for ``dead_after_s`` (a stopped process, a cut link, a lost host), or
  for ``SHORT_BEATS`` heartbeats once a member of its membership reported a broken collective
  (a host whose processes all died closes their connections: the survivors say so at once):
  lost, and its agent told to kill it where the agent is still reachable;
- its heartbeat alive but its step progress stopped for ``dead_after_s`` while another member
  is past it (stuck outside any collective: the others wait for it in the next one): its
  agent kills it, and its exit makes it lost.

Each loss publishes the next membership without it; where members went silent, the new
membership names their addresses, and the survivors shut their connections to those hosts
down, so a collective waiting on a host that is cut off fails at once. A replacement that an
agent started (or a host's agent started again) is published as a member of the next
membership once it is ready. Fewer than ``min_members`` left ends the run in one sentence.

Its loss (node 0's launcher, or node 0) ends the run: the other hosts' ranks find their
heartbeats unanswered, stop without writing (fenced), and their agents end after
``regroup_timeout_s``; the same commands resume from the last checkpoint.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddp_template.config.schema import FaultToleranceConfig
from ddp_template.errors import EXIT_FENCED
from ddp_template.optional.live import keys

SHORT_BEATS = 4  # heartbeats of silence that lose a member once its membership broke
LOOK_S = 0.1  # how often the heartbeats and the waiting replacements are read


def silence_s(ft: FaultToleranceConfig, broke: bool) -> float:
    """How long a member may be silent before it is lost (and the shortest, which a member's
    lease on writing stays inside: ``membership.Live``)."""
    return min(ft.dead_after_s, SHORT_BEATS * ft.heartbeat_s) if broke else ft.dead_after_s


@dataclass
class Member:
    id: str
    since: float = field(default_factory=time.monotonic)
    beat: keys.Beat | None = None
    beat_at: float = field(default_factory=time.monotonic)
    progress_at: float = field(default_factory=time.monotonic)
    killing: str = ""  # why its agent was told to kill it

    @property
    def slot(self) -> int:
        return keys.parse(self.id)[0]

    @property
    def incarnation(self) -> int:
        return keys.parse(self.id)[1]


class Ended(Exception):  # noqa: N818  (the run's end: its exit code, the ranks' signal)
    def __init__(self, code: int, sig: signal.Signals) -> None:
        super().__init__(code)
        self.code, self.sig = code, sig


class Coordinator:
    def __init__(self, ft: FaultToleranceConfig, world: int, record: Path, port: int) -> None:
        self.ft, self.world, self.record = ft, world, record
        self.store = dist.TCPStore(
            "0.0.0.0" if port else "127.0.0.1",
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=60),
        )
        self.live = dist.PrefixStore("live", self.store)
        self.members: list[Member] = []
        self.gen, self.started = -1, time.monotonic()
        self.finished = 0
        self.looked = 0.0
        self.said: dict[str, dict[str, Any]] = {}  # member -> its agent's started/<id>
        self.recorded: set[str] = set()  # the processes whose start is in the record
        self.departed: set[str] = set()  # the members lost
        self.lost: list[tuple[Member, str]] = []  # this look's losses, not yet published
        # addresses where members went silent, severed while no member is there (a single
        # silent rank's agent kills it: its connections close)
        self.sever: set[str] = set()

    @property
    def port(self) -> int:
        return int(self.store.port)

    def write(self, **row: Any) -> None:
        keys.record(self.record, since_start_s=time.monotonic() - self.started, **row)

    def start(self) -> None:
        """Membership 0 once every slot's first process has started (its pid for the record)."""
        firsts = [keys.member_id(slot, 0) for slot in range(self.world)]
        deadline = time.monotonic() + self.ft.regroup_timeout_s
        while not self.live.check([keys.started(m) for m in firsts]):
            if time.monotonic() > deadline:
                missing = [m for m in firsts if not self.live.check([keys.started(m)])]
                self.end(
                    1,
                    f"the ranks of slots {', '.join(m.split('.')[0] for m in missing)} did "
                    f"not start within fault_tolerance.regroup_timeout_s="
                    f"{self.ft.regroup_timeout_s} s: start the launcher of every host "
                    f"(dist.node_rank=0..dist.nnodes-1) with the same fault_tolerance.coordinator.",
                    signal.SIGTERM,
                    say=True,
                )
            time.sleep(LOOK_S)
        for member in firsts:
            self._record_start(member)
        self.members = [Member(m) for m in firsts]
        self._publish("start")

    def _record_start(self, member: str) -> None:
        """A process its agent started, into the record (once), at the time the agent said."""
        if member in self.recorded:
            return
        self.recorded.add(member)
        said = self._started(member)
        slot, incarnation = keys.parse(member)
        self.write(
            event="started",
            slot=slot,
            incarnation=incarnation,
            pid=said.get("pid"),
            host=said.get("host"),
            time=said.get("time"),
        )

    def _publish(self, reason: str) -> None:
        self.gen += 1
        ids = [m.id for m in self.members]
        here = {self._started(i).get("address") for i in ids}
        keys.publish(self.live, self.gen, ids, reason, sorted(self.sever - here))
        now = time.monotonic()
        for m in self.members:
            m.progress_at = now
        pids = {i: self._started(i).get("pid") for i in ids}
        self.write(event="membership", gen=self.gen, members=ids, pids=pids, reason=reason)

    def _started(self, member: str) -> dict[str, Any]:
        """Its agent's word on the process (written once): read from the store once."""
        if member not in self.said:
            key = keys.started(member)
            if not self.live.check([key]):
                return {}
            self.said[member] = json.loads(self.live.get(key))
        return self.said[member]

    @property
    def done(self) -> bool:
        return not self.members

    def watch(self) -> None:
        """One look at every member; raises :class:`Ended` where the run ends."""
        for member in list(self.members):
            key = keys.exited(member.id)
            if self.live.check([key]):
                self._exited(member, int(self.live.get(key)))
        self._settle()
        self._admit()
        now = time.monotonic()
        if now - self.looked < LOOK_S:
            return
        self.looked = now
        broke = int(self.live.add(keys.broken(self.gen), 0)) > 0
        for member in list(self.members):
            self._listen(member, now, broke)
        self._settle()
        self._judge_progress(now)

    def _exited(self, member: Member, code: int) -> None:
        if code == 0:
            self.live.set(keys.CLOSED, str(member.slot))
            self.members.remove(member)
            self.finished += 1
            self.write(event="finished", slot=member.slot, incarnation=member.incarnation)
            return
        if 0 < code != EXIT_FENCED:  # the rank's own failure: the run ends (a restart resumes)
            self.write(event="failed", slot=member.slot, exit=code)
            self.end(code, f"rank slot {member.slot} failed (exit {code})", signal.SIGTERM)
        if member.killing:
            why = member.killing
        elif code == EXIT_FENCED:
            why = "cut off: it stopped without writing (fenced)"
        else:
            why = f"killed by {signal.Signals(-code).name}"
        self._lose(member, why)

    def _listen(self, member: Member, now: float, broke: bool) -> None:
        """A member's heartbeat: a new one (its progress), or silence too long (lost)."""
        key = keys.heartbeat(member.id)
        beat = keys.Beat.parse(self.live.get(key).decode()) if self.live.check([key]) else None
        if beat is not None and beat != member.beat:
            moved = member.beat is None or beat[1:] != member.beat[1:]
            member.beat, member.beat_at = beat, now
            if moved:
                member.progress_at = now
            return
        silent = now - member.beat_at
        # never beaten yet: a process still starting, which a regroup waits for as long
        limit = silence_s(self.ft, broke) if member.beat else self.ft.regroup_timeout_s
        if silent > limit and not member.killing:
            member.killing = f"silent for {silent:.1f} s"
            self.live.set(keys.kill(member.id), member.killing)  # its agent, if it can hear
            address = self._started(member.id).get("address")
            if address:
                self.sever.add(address)
            self._lose(member, member.killing)

    def _judge_progress(self, now: float) -> None:
        """A member stuck outside any collective: its heartbeat alive, its step progress
        stopped for ``dead_after_s`` while another member of its membership is past it."""
        beats = [m.beat for m in self.members]
        if not beats or any(b is None or b.gen != self.gen or b.step < 0 for b in beats):
            return  # a regroup or a build under way (or a member not beating yet): no one judged
        furthest = max((b.step, b.held) for b in beats if b is not None)
        for member in self.members:
            beat = member.beat
            assert beat is not None
            still = now - member.progress_at
            behind = (beat.step, beat.held) < furthest
            if member.killing or still <= self.ft.dead_after_s or not behind:
                continue
            member.killing = (
                f"stuck: no step progress for {still:.1f} s (at step {beat.step}, "
                f"{beat.held} micro-batches read) while others were past it, killed"
            )
            self.live.set(keys.kill(member.id), member.killing)
            self.write(event="stuck", slot=member.slot, incarnation=member.incarnation, still=still)

    def _admit(self) -> None:
        """Each slot's newest process, ready while the slot has no member: members of the next
        membership (those ready at one look, together: a host's ranks rejoin at once)."""
        if not self.members or self.finished:
            return
        taken = {m.slot for m in self.members}
        ready, starting = [], set()  # starting: hosts with a process not ready yet
        for slot in range(self.world):
            if slot in taken:
                continue
            newest = int(self.live.add(keys.incarnations(slot), 0)) - 1
            member = keys.member_id(slot, newest)
            if newest < 1 or member in self.departed:
                continue
            if not self.live.check([keys.started(member)]):
                continue
            self._record_start(member)
            if self.live.check([keys.exited(member)]):  # failed before it was ready
                continue
            if self.live.check([keys.ready(member)]):
                ready.append(member)
            else:
                starting.add(self._started(member).get("node"))
        said = [self._started(m) for m in ready]
        ready = [m for m, s in zip(ready, said, strict=True) if s.get("node") not in starting]
        said = [s for s in said if s.get("node") not in starting]
        if not ready:
            return
        self.members += [Member(m) for m in ready]
        slots = ", ".join(str(keys.parse(m)[0]) for m in ready)
        pids = ", ".join(str(s.get("pid")) for s in said)
        verb = "rejoin" if len(ready) > 1 else "rejoins"
        self._publish(f"slot{'s' if len(ready) > 1 else ''} {slots} {verb} (process {pids})")

    def _lose(self, member: Member, why: str) -> None:
        """``member`` is lost; the losses of one look go into one membership (``_settle``):
        a host's ranks, lost together, leave together."""
        self.members.remove(member)
        self.departed.add(member.id)  # never admitted again: a new process takes its slot
        self.lost.append((member, why))
        self.write(event="lost", slot=member.slot, incarnation=member.incarnation, why=why)

    def _settle(self) -> None:
        if not self.lost:
            return
        why, more = self.lost[0][1], len(self.lost) - 1
        slots = ", ".join(str(m.slot) for m, _ in self.lost)
        self.lost.clear()
        if len(self.members) < self.ft.min_members:
            self.end(
                1,
                f"rank slot{'s' if more else ''} {slots} {'were' if more else 'was'} lost "
                f"({why}) and {len(self.members)} of "
                f"{self.world} ranks are left, fewer than fault_tolerance.min_members="
                f"{self.ft.min_members}; the run ends here: run the same command again and it "
                f"resumes from its last checkpoint (resume=auto).",
                signal.SIGKILL,
                say=True,
            )
        self._publish(f"slot{'s' if more else ''} {slots} lost: {why}")

    def end(self, code: int, why: str, sig: signal.Signals, *, say: bool = False) -> None:
        """The run ends: every agent ends its ranks with ``sig`` (``ABORT``); ``say``: the
        coordinator says why (a rank's own failure it said itself)."""
        self.live.set(keys.ABORT, json.dumps({"code": code, "why": why, "signal": sig.name}))
        if say:
            print(f"error: {why}", file=sys.stderr)
        raise Ended(code, sig)

    def result(self) -> Any:
        if self.live.check([keys.RESULT]):
            return json.loads(self.live.get(keys.RESULT))
        return None
