"""A rank's DataLoader workers: how they start (a fork server, its preload), how they are
seeded, and how they end with their rank.

Worker RNGs are seeded from (seed, rank, epoch), never from wall-clock entropy, so two runs
with the same config load the same data. Workers persist across epochs and take batches in
turn, so a mid-epoch resume hands batches to different workers: a random augmentation that
must survive a resume exactly should seed itself from the sample index and epoch.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import random
import select
import signal
import threading
import time
from multiprocessing import forkserver
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from ddp_template.config.schema import LoaderConfig
from ddp_template.data.contract import collate
from ddp_template.process.preload import loaded_modules, modules_of


def init_worker(worker_id: int, rank_pid: int) -> None:
    """Seed numpy's and Python's RNGs from the loader's per-worker torch seed; die with the rank."""
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
    # Ctrl-C reaches the whole process group; the rank decides when to stop, and its workers
    # go with it (the watchdog below), not mid-batch.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(
        target=_exit_when_gone, args=(rank_pid,), name="rank-watchdog", daemon=True
    ).start()


def _exit_when_gone(pid: int) -> None:
    """End this worker as soon as process ``pid`` (the rank that owns the loader) is gone.

    Under forkserver a worker's parent is the fork server, not the rank, and the server stays up
    while any of its children do, so torch's own check (has my parent changed?) never fires: a
    rank killed with SIGKILL (OOM killer, a launcher's grace period running out) left its workers,
    the server and the resource tracker running for good, holding memory and the rank's stdout.
    """
    try:
        fd = os.pidfd_open(pid)  # Linux >= 5.3: readable once the process has exited
    except (AttributeError, OSError):
        while _alive(pid):
            time.sleep(1.0)
    else:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.poll()
    os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        pass
    return True


def _worker_start_method(dataset: object) -> str:
    """forkserver, not fork: a rank has gloo/NCCL, OpenMP and loader threads running, and
    forking a threaded process can deadlock the child inside ``fork()`` (seen here: an eval
    loader's worker hung at epoch 0 while the train loader's feeder threads ran)."""
    global _server_started
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    if not _server_started:  # the preload reaches only the server's first start
        # The server imports these once; each worker is then a fork of it instead of a fresh
        # interpreter importing torch (~1.5 s per worker, 8 workers for 2 ranks' two loaders).
        mp.set_forkserver_preload(loaded_modules("torch", "numpy", *modules_of(dataset)))
    # Started now, the server's imports overlap building the model, DDP and W&B instead of
    # delaying the first batch.
    forkserver.ensure_running()
    _server_started = True
    return "forkserver"


_server_started = False  # by _worker_start_method, in this process


def loader_kwargs(cfg: LoaderConfig, device: torch.device, dataset: object) -> dict[str, Any]:
    pin = cfg.pin_memory and device.type == "cuda"
    kwargs: dict[str, Any] = {
        "num_workers": cfg.num_workers,
        "pin_memory": pin,
        "collate_fn": collate,
    }
    if cfg.num_workers > 0:
        kwargs.update(
            worker_init_fn=functools.partial(init_worker, rank_pid=os.getpid()),
            persistent_workers=cfg.persistent_workers,  # one start per loader and run
            prefetch_factor=4,
            multiprocessing_context=_worker_start_method(dataset),
        )
    return kwargs


def seeded_generator(seed: int, rank: int) -> torch.Generator:
    """The generator a training loader draws its workers' seeds from (epoch 0's)."""
    generator = torch.Generator()
    generator.manual_seed(worker_seed(seed, rank, 0))
    return generator


def worker_seed(seed: int, rank: int, epoch: int) -> int:
    """A distinct, reproducible base seed per (seed, rank, epoch)."""
    return (seed * 1_000_003 + rank * 10_007 + epoch) % 2**63


def reseed_for_epoch(loader: DataLoader, seed: int, rank: int, epoch: int) -> None:
    """Called before each epoch's iterator: workers get seeds that resume reproduces."""
    if loader.generator is not None:
        loader.generator.manual_seed(worker_seed(seed, rank, epoch))
