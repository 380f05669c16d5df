"""Whether every host of a multi-node run is still reachable: heartbeats through the store.

A host whose processes die closes their connections, so the peers' next collective fails at
once ("Connection closed by peer [10.0.0.2]:…", which ``exit_records`` turns into the host's
name). A host cut off from the network (a link, a switch port, a partition) closes nothing: its
peers would wait in a collective until gloo's timeout (``backend.timeout_s``, which must also
cover the slowest checkpoint or evaluation). So each rank of a multi-node run keeps a
:class:`Watch`: a thread adds to the rank's own counter in the rendezvous store every
``backend.heartbeat_s`` and reads everyone's, and a second one judges:

- a rank whose counter has not moved for ``backend.lost_after_s`` while this rank's own beats
  land is **lost**: this rank names the lost host and its ranks (its log, ``error.json``) and
  exits ``EXIT_HOST_LOST``; the launcher ends the rest, and the same command resumes from the
  last checkpoint (or an elastic torchrun continues on the hosts left);
- a rank whose own beats have not landed for ``backend.lost_after_s`` is the one **cut off**:
  the run goes on (or ends) on the store's side, so this rank is fenced: it writes nothing more
  into the run (no log line, checkpoint, metrics row or exit record), kills what it started
  (loader workers, the W&B service) and exits ``EXIT_FENCED``, saying why on its stderr only.

In a partition the side that still reaches the store (the rendezvous host's) is the run; the
other side stops. Each beat is two store requests (an ``add`` and one ``multi_get`` of every
rank's counter), so the store serves 2 x world size requests per heartbeat.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import psutil
import torch.distributed as dist

from ddp_template.config.schema import BackendConfig
from ddp_template.distributed import DistInfo, store_client
from ddp_template.errors import EXIT_FENCED, EXIT_HOST_LOST
from ddp_template.process import exit_records
from ddp_template.tolerance import live_launch

log = logging.getLogger("ddp_template")


class Watch:
    """This rank's heartbeats and its judgement of everyone's (see the module's doc)."""

    def __init__(self, run_dir: Path, info: DistInfo, cfg: BackendConfig) -> None:
        self.run_dir, self.info, self.cfg = run_dir, info, cfg
        timeout = timedelta(seconds=max(cfg.heartbeat_s, cfg.lost_after_s / 2))
        self.store: dist.Store = store_client("reach", info.world_size, timeout)
        self.keys = [f"beat/{r}" for r in range(info.world_size)]
        self.store.set(f"host/{info.rank}", info.host)
        for key in self.keys:  # every counter exists before the first multi_get
            self.store.add(key, 0)
        now = time.monotonic()
        self.landed = now  # this rank's last beat that reached the store
        self.counts = [-1] * info.world_size
        self.moved = [now] * info.world_size  # when each rank's counter last moved
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        for target in (self._beat, self._judge):
            threading.Thread(target=target, name=f"reach-{target.__name__}", daemon=True).start()

    def close(self) -> None:
        """This rank leaves through ``train``: its silence from here on is not a loss."""
        self.stopped.set()
        with contextlib.suppress(Exception):
            self.store.set(f"left/{self.info.rank}", "1")

    def _beat(self) -> None:
        while not self.stopped.is_set():
            try:
                self.store.add(self.keys[self.info.rank], 1)
                counts = [int(v) for v in self.store.multi_get(self.keys)]
            except Exception:  # noqa: BLE001  a cut link times the request out: judged below
                counts = None
            if counts is not None:
                now = time.monotonic()
                with self.lock:
                    self.landed = now
                    for r, count in enumerate(counts):
                        if count != self.counts[r]:
                            self.counts[r], self.moved[r] = count, now
            self.stopped.wait(self.cfg.heartbeat_s)  # a refused request too: no busy retry

    def _judge(self) -> None:
        while not self.stopped.wait(self.cfg.heartbeat_s):
            now = time.monotonic()
            with self.lock:
                cut = now - self.landed > self.cfg.lost_after_s
                # silent while this rank's own beats landed: a cut rank judges no one but itself
                lost = [
                    r for r, t in enumerate(self.moved) if self.landed - t > self.cfg.lost_after_s
                ]
            if self.stopped.is_set():
                return
            if cut:
                self._fence(now)
            lost = [r for r in lost if not self._left(r)]
            if lost:
                self._end(lost)

    def _left(self, rank: int) -> bool:
        try:
            return bool(self.store.check([f"left/{rank}"]))
        except Exception:  # noqa: BLE001  the store just answered this rank's beat: retry next
            return True

    def _fence(self, now: float) -> None:
        """Cut off: stop without another write into the run (the other side owns it now)."""
        silent = now - self.landed
        stop_fenced(
            f"rank {self.info.rank} on {self.info.host} is cut off: none of its heartbeats "
            f"reached the rendezvous store ({self.info.master}) for {silent:.0f} s "
            f"(backend.lost_after_s={self.cfg.lost_after_s}); it stops here and writes nothing "
            f"more into the run, which the hosts that still reach the store own."
        )

    def _end(self, lost: list[int]) -> None:
        """A host went silent: say which, record it for the launcher, end this rank."""
        line = f"{self._silent(lost)} went silent: no heartbeat reached the rendezvous store for "
        line += (
            f"{self.cfg.lost_after_s:.0f} s (backend.lost_after_s) while this host's did: a link "
            f"cut, a partition or a hung host. The run ends here; the same command resumes it "
            f"from the last checkpoint."
        )
        log.error("rank %d: %s", self.info.rank, line)
        exit_records.record_failure(self.run_dir, self.info.rank, HostLost(line))
        exit_records.record_exit(self.run_dir, self.info.rank, EXIT_HOST_LOST)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_HOST_LOST)

    def _silent(self, lost: list[int]) -> str:
        """``host h (ranks …)`` where every rank of a host is silent (the others half as long
        already: a cut host's ranks stop beating within a heartbeat of each other), else
        ``rank r on host h``."""
        now = time.monotonic()
        with self.lock:
            fading = {r for r, t in enumerate(self.moved) if now - t > self.cfg.lost_after_s / 2}
        hosts: dict[str, list[int]] = {}
        for r in range(self.info.world_size):
            try:
                host = self.store.get(f"host/{r}").decode()
            except Exception:  # noqa: BLE001
                host = "an unknown host"
            hosts.setdefault(host, []).append(r)
        said = []
        for host, ranks in hosts.items():
            if all(r in fading for r in ranks):
                said.append(f"host {host} ({exit_records.said_ranks(ranks)})")
            else:
                said += [f"rank {r} on host {host}" for r in ranks if r in lost]
        return "; ".join(said)


def stop_fenced(line: str) -> NoReturn:
    """This process stops without another write into the run: what it started (loader
    workers, the W&B service) killed, ``line`` on its stderr only, ``EXIT_FENCED``."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.send_signal(signal.SIGKILL)
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    os._exit(EXIT_FENCED)


class HostLost(RuntimeError):
    """A host of the run stopped beating (``Watch``)."""


def watch(run_dir: Path, info: DistInfo, cfg: BackendConfig) -> Watch | None:
    """A :class:`Watch` for a rank of a multi-node run with heartbeats on, else None (also
    under ``fault_tolerance=live``, whose coordinator judges the heartbeats)."""
    one_host = info.local_world_size >= info.world_size
    if live_launch() or not info.distributed or one_host or cfg.lost_after_s <= 0:
        return None
    return Watch(run_dir, info, cfg)
