"""Preemption and Ctrl-C: a signal on any rank stops every rank at the same step boundary.

The scheduler signals one or all ranks; each rank only sets a flag in its handler, and the ranks
agree on the flag through a (mostly asynchronous) all-reduce, so all of them checkpoint after the
same optimizer step and exit with ``EXIT_PREEMPTED`` for a requeue.
"""

from __future__ import annotations

import logging
import shlex
import signal
import sys
import time
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ddp_template.distributed import DistInfo
from ddp_template.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED

log = logging.getLogger("ddp_template")


PREEMPT, INTERRUPT = 1, 2  # flag values; the agreement keeps the largest
REPEAT_S = 1.0  # a SIGINT this soon after the first is the same Ctrl-C (a launcher forwarding it)


class Preemption:
    """SIGTERM/SIGUSR1 (preemption) and SIGINT (Ctrl-C) set a flag; all ranks agree to stop at
    the same step boundary, checkpoint, and exit 75 (requeue) or 130 (interrupted).

    Every ``every`` steps the flag is all-reduced asynchronously and the previous reduce is
    read: no step waits on it, and every rank sees the same answer at the same step, so a signal
    stops the run within 2 x ``every`` steps (and at the latest at the epoch end, where
    :meth:`sync` reads it with a blocking reduce). Not every step: on gloo one extra collective
    per step cost ~10 % of a small model's throughput (benchmarks/overhead_results.md).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, *, info: DistInfo, every: int, run_id: str) -> None:
        self.info, self.every, self.run_id = info, max(1, every), run_id
        # A CPU-side gloo group even under nccl: reading the flag then never syncs the GPU.
        self.group: dist.ProcessGroup | None = None
        if info.backend == "nccl":
            group = dist.new_group(backend="gloo")
            assert isinstance(group, dist.ProcessGroup)  # every rank is a member
            self.group = group
        self.flag = torch.zeros(1, dtype=torch.int32)
        self.agreed = 0  # the flag every rank agreed on at the last check
        self._interrupted_at: float | None = None
        self._pending: Any = None
        self._buf = torch.zeros(1, dtype=torch.int32)
        self._installed: dict[int, Any] = {}
        for sig in self.SIGNALS:
            self._installed[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if signum != signal.SIGINT:
            log.warning(
                "received %s: checkpointing at the next check (every %d steps) or epoch end",
                signal.Signals(signum).name,
                self.every,
            )
            self.flag.fill_(max(PREEMPT, int(self.flag.item())))
            return
        now = time.monotonic()
        if self._interrupted_at is None:
            self._interrupted_at = now
            log.info("interrupted: all ranks stop at the next step boundary (Ctrl-C again: now)")
        elif now - self._interrupted_at > REPEAT_S:
            raise KeyboardInterrupt  # a second Ctrl-C: stop at once
        self.flag.fill_(INTERRUPT)

    def requested(self, step: int) -> bool:
        """Called after every step on every rank; collective only every ``every`` steps."""
        if not self.info.distributed:
            self.agreed = int(self.flag.item())
            return bool(self.agreed)
        if step % self.every:
            return False
        stop = self._read()
        self._buf.copy_(self.flag)
        self._pending = dist.all_reduce(
            self._buf, op=dist.ReduceOp.MAX, group=self.group, async_op=True
        )
        return stop

    def _read(self) -> bool:
        if self._pending is None:
            return False
        self._pending.wait()
        self._pending = None
        self.agreed = int(self._buf.item())
        return bool(self.agreed)

    def sync(self) -> bool:
        """A blocking agreement (epoch ends): did any rank get a signal by now?"""
        if not self.info.distributed:
            self.agreed = int(self.flag.item())
            return bool(self.agreed)
        self._read()
        self._buf.copy_(self.flag)
        dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self.group)
        self.agreed = int(self._buf.item())
        return bool(self.agreed)

    def stop(self, step: int, checkpoint: str | None) -> NoReturn:
        """Leave after the agreed step: one line on rank 0 saying how to continue."""
        interrupted = self.agreed == INTERRUPT
        if self.info.is_main:
            saved = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (disabled)"
            command = shlex.join(["python", *sys.argv])
            log.warning(
                "%s at step %d, %s; resume with: RUN_ID=%s %s",
                "interrupted" if interrupted else "preempted",
                step,
                saved,
                self.run_id,
                command,
            )
        raise SystemExit(EXIT_INTERRUPTED if interrupted else EXIT_PREEMPTED)

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        self.close(broken=isinstance(exc, Exception))  # a failed collective: not waited for

    def close(self, *, broken: bool = False) -> None:
        """Restore the signal handlers; after a clean loop read the agreement still in flight.
        After a failed collective (``broken``) it is dropped unread: its peers may be gone or in
        another collective, and a wait on it could last the whole gloo timeout."""
        if broken:
            self._pending = None
        self._read()  # no collective left in flight
        for sig, old in self._installed.items():
            signal.signal(sig, old)
