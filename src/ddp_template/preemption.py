"""Preemption: SIGTERM/SIGUSR1 on any rank stop every rank at the same step boundary.

The scheduler signals one or all ranks; each rank only sets a flag in its handler, and the ranks
agree on the flag through a (mostly asynchronous) all-reduce, so all of them checkpoint after the
same optimizer step and exit with ``EXIT_PREEMPTED`` for a requeue.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import torch
import torch.distributed as dist

from ddp_template.distributed import DistInfo

log = logging.getLogger("ddp_template")


class Preemption:
    """SIGTERM/SIGUSR1 set a flag; all ranks agree to stop at the same step boundary.

    Every ``every`` steps the flag is all-reduced asynchronously and the previous reduce is
    read: no step waits on it, and every rank sees the same answer at the same step, so a signal
    stops the run within 2 x ``every`` steps (and at the latest at the epoch end, where
    :meth:`sync` reads it with a blocking reduce). Not every step: on gloo one extra collective
    per step cost ~10 % of a small model's throughput (benchmarks/overhead_results.md).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, info: DistInfo, every: int = 10) -> None:
        self.info, self.every = info, max(1, every)
        # A CPU-side gloo group even under nccl: reading the flag then never syncs the GPU.
        self.group = None
        if info.backend == "nccl":
            self.group = dist.new_group(backend="gloo")
        self.flag = torch.zeros(1, dtype=torch.int32)
        self._pending: Any = None
        self._buf = torch.zeros(1, dtype=torch.int32)
        self._installed: dict[int, Any] = {}
        for sig in self.SIGNALS:
            self._installed[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        log.warning(
            "received %s: checkpointing at the next check (every %d steps) or epoch end",
            signal.Signals(signum).name,
            self.every,
        )
        self.flag.fill_(1)

    def requested(self, step: int) -> bool:
        """Called after every step on every rank; collective only every ``every`` steps."""
        if not self.info.distributed:
            return bool(self.flag.item())
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
        return bool(self._buf.item())

    def sync(self) -> bool:
        """A blocking agreement (epoch ends): did any rank get a signal by now?"""
        if not self.info.distributed:
            return bool(self.flag.item())
        self._read()
        self._buf.copy_(self.flag)
        dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self._buf.item())

    def close(self) -> None:
        self._read()  # no collective left in flight
        for sig, old in self._installed.items():
            signal.signal(sig, old)
