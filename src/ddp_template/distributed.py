"""Process-group setup and teardown, rank information, device and backend choice.

Everything here reads torchrun's environment contract (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). torchrun and the in-process launcher set it;
``adopt_launcher`` translates srun's, mpirun's, horovodrun's and jsrun's own variables into it
(``cluster.py`` reads them), so one code path serves every way of starting a run.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddp_template import cluster
from ddp_template.config import BackendConfig
from ddp_template.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    backend: str | None  # None: no process group (a single plain process)
    device: torch.device
    host: str
    launcher: str = "none"  # who started the ranks: torchrun, dist.nproc, slurm, openmpi, ...
    master: str | None = None  # the rendezvous address:port

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    def describe(self) -> str:
        """Rank 0's first log line: who started the ranks, how many, and where they meet."""
        where = f", master {self.master}" if self.master else ""
        return (
            f"launcher {self.launcher}: world size {self.world_size}{where}, backend {self.backend}"
        )


LAUNCHER_VAR = "DDP_TEMPLATE_LAUNCHER"  # the launcher as first detected, inherited by ranks


def adopt_launcher(env: MutableMapping[str, str] | None = None) -> cluster.ClusterEnv:
    """Call once per process, before Hydra composes: ranks started by srun, mpirun, horovodrun
    or jsrun get torchrun's variables, so every later step (Hydra's run dir included) reads one
    contract, and the launcher's job id as ``RUN_ID``: one run dir, found again after a requeue.
    """
    env = os.environ if env is None else env
    found = cluster.detect(env)
    env.setdefault(LAUNCHER_VAR, found.launcher)
    if found.multi_process and found.launcher != "torchrun":
        env.update(cluster.torch_env(found))
        if found.job_id:
            env.setdefault("RUN_ID", found.job_id)
    return found


def launched_by_torchrun() -> bool:
    """True inside a worker started by torchrun, the in-process launcher or an srun recipe."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def choose_backend(name: str) -> str:
    """Resolve ``auto`` and refuse ``nccl`` where it cannot run, before any process group."""
    name = str(name)
    cuda = torch.cuda.is_available()
    if name == "auto":
        return "nccl" if cuda else "gloo"
    if name == "nccl" and not cuda:
        raise ConfigError(
            "backend.name=nccl needs CUDA but no GPU is visible here; "
            "use backend=gloo (or backend=auto) on CPU."
        )
    return name


def choose_device(backend: str, local_rank: int) -> torch.device:
    """nccl ranks own one GPU each (by LOCAL_RANK); gloo runs on the CPU."""
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _share_cpu_threads(local_world: int) -> None:
    """Split the cores among this node's ranks unless the user chose (OMP_NUM_THREADS).

    torchrun sets OMP_NUM_THREADS=1 for multi-rank jobs; the in-process launcher does not, and
    N ranks each using every core thrash a small machine (measured: 5x slower steps on 2 cores).
    """
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


def _restart_safe_store(world: int, timeout: timedelta) -> dict[str, Any]:
    """A store namespaced by the elastic restart attempt.

    Under torchrun (and the in-process launcher) workers share the agent's TCPStore, which
    outlives a restart; torch 2.14 does not prefix its keys per attempt, so a restarted rank can
    read a dead peer's address and fail with "Connection refused" (reproduced here with a bare
    init_process_group script). A prefix per attempt makes every restart start clean.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timeout,
    )
    return {"store": dist.PrefixStore(f"ddp_template/attempt_{attempt}", store)}


def setup(cfg: BackendConfig) -> DistInfo:
    """The ``backend`` group's builder: join the process group the environment describes (a
    plain process joins none), on the device this rank owns."""
    host = socket.gethostname()
    launcher = os.environ.get(LAUNCHER_VAR, "none")
    if not launched_by_torchrun():
        device = choose_device(choose_backend(cfg.name), 0)
        single = dict(rank=0, local_rank=0, world_size=1, local_world_size=1, backend=None)
        return DistInfo(**single, device=device, host=host, launcher=launcher)
    ranks = cluster.detect()  # torchrun's variables, set by torchrun or by adopt_launcher
    backend = choose_backend(cfg.name)
    device = choose_device(backend, ranks.local_rank)
    _share_cpu_threads(ranks.local_world_size)
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=cfg.timeout_s)}
    kwargs.update(_restart_safe_store(ranks.world_size, kwargs["timeout"]))
    if device.type == "cuda":
        kwargs["device_id"] = device  # binds NCCL to this GPU and avoids a lazy guess
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=ranks.rank, world_size=ranks.world_size, **kwargs)
    return DistInfo(
        rank=ranks.rank,
        local_rank=ranks.local_rank,
        world_size=ranks.world_size,
        local_world_size=ranks.local_world_size,
        backend=backend,
        device=device,
        host=host,
        launcher=launcher,
        master=f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
    )


def teardown() -> None:
    """Destroy the process group; safe to call on every exit path, errors included."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``obj`` on every rank (small Python objects: stats, index arrays)."""
    if not info.distributed:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not info.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
