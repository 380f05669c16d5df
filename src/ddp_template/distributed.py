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
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ddp_template import cluster, network
from ddp_template.config.schema import BackendConfig
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
    why: str = ""  # what decided the backend and device (BackendChoice.why)
    interface: network.Interface | None = None  # a multi-node gloo job's network interface

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def address(self) -> str | None:
        """The address this rank's collectives use, where the template chose it."""
        return self.interface.address if self.interface else None

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    def describe(self) -> str:
        """Rank 0's first log line: who started the ranks, how many, where they meet, and which
        backend and device they use and why."""
        where = f", master {self.master}" if self.master else ""
        why = f" ({self.why})" if self.why else ""
        nic = self.interface
        via = f"; gloo on {nic.name} ({nic.why})" if nic else ""
        return (
            f"launcher {self.launcher}: world size {self.world_size}{where}, backend "
            f"{self.backend}, device {self.device}{why}{via}"
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


def env_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


class BackendChoice(NamedTuple):
    name: str  # gloo or nccl
    why: str  # one clause for the log: what decided it


def cuda_devices() -> int:
    """GPUs visible to this process (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def node_ranks(nproc: int) -> tuple[int, bool]:
    """(ranks on this node, whether the launcher told each rank its local rank): the outer
    launcher's when one started this process, else the ``dist.nproc`` ranks about to start."""
    if not launched_by_torchrun():
        return nproc, True
    ranks = cluster.detect()
    return ranks.local_world_size, "LOCAL_RANK" in os.environ or ranks.world_size == 1


def choose_backend(
    name: str, local_world_size: int, *, local_rank_given: bool = True
) -> BackendChoice:
    """Resolve ``auto`` for this node and refuse ``nccl`` where it cannot run, before any process
    group: NCCL needs one GPU per local rank (two ranks cannot share a GPU, and
    ``set_device(local_rank)`` fails past the last one) and the local rank to pick it by."""
    name, gpus = str(name), cuda_devices()
    seen = f"{gpus} visible GPU{'s' if gpus != 1 else ''} for {local_world_size} local rank"
    seen += "s" if local_world_size != 1 else ""
    if name == "gloo":
        return BackendChoice("gloo", "backend=gloo")
    if name == "auto":
        if not local_rank_given:
            return BackendChoice("gloo", "auto: the launcher gave no LOCAL_RANK to pick a GPU by")
        if gpus == 0:
            return BackendChoice("gloo", "auto: no GPU visible")
        if gpus < local_world_size:
            return BackendChoice("gloo", f"auto: {seen}, nccl needs one GPU per rank")
        return BackendChoice("nccl", f"auto: {seen}")
    if gpus < local_world_size:
        raise ConfigError(
            f"backend.name=nccl needs one GPU per local rank but this node has {seen}; use "
            f"backend=auto (gloo here), fewer ranks per node, or more GPUs (CUDA_VISIBLE_DEVICES)."
        )
    if not local_rank_given:
        raise ConfigError(
            "backend.name=nccl needs LOCAL_RANK to pick this rank's GPU but the launcher set "
            "RANK and WORLD_SIZE without it; start the ranks with torchrun (or also export "
            "LOCAL_RANK and LOCAL_WORLD_SIZE), or use backend=gloo."
        )
    return BackendChoice("nccl", f"backend=nccl: {seen}")


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


def store_client(namespace: str, world: int, timeout: timedelta) -> dist.Store:
    """A new client of the rendezvous store (MASTER_ADDR:MASTER_PORT), its keys under
    ``namespace`` and this restart attempt.

    Under torchrun (and the in-process launcher) workers share the agent's TCPStore, which
    outlives a restart; torch 2.14 does not prefix its keys per attempt, so a restarted rank can
    read a dead peer's address and fail with "Connection refused" (reproduced here with a bare
    init_process_group script). A prefix per attempt makes every restart start clean.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"ddp_template/attempt_{attempt}/{namespace}", store)


def _restart_safe_store(world: int, timeout: timedelta) -> dict[str, Any]:
    """The process group's store: the agent's, namespaced by the attempt (``store_client``)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    return {"store": store_client("group", world, timeout)}


def setup_local(cfg: BackendConfig) -> DistInfo:
    """This launched rank's device, threads and info, without joining a process group
    (``fault_tolerance=live`` joins its own, reconfigurable one)."""
    ranks = cluster.detect()
    local_world, local_rank_given = node_ranks(1)
    choice = choose_backend(cfg.name, local_world, local_rank_given=local_rank_given)
    _share_cpu_threads(ranks.local_world_size)
    return DistInfo(
        rank=ranks.rank,
        local_rank=ranks.local_rank,
        world_size=ranks.world_size,
        local_world_size=ranks.local_world_size,
        backend=choice.name,
        device=choose_device(choice.name, ranks.local_rank),
        host=socket.gethostname(),
        launcher=os.environ.get(LAUNCHER_VAR, "none"),
        master=f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
        why=choice.why,
    )


def setup(cfg: BackendConfig) -> DistInfo:
    """The ``backend`` group's builder: join the process group the environment describes (a
    plain process joins none), on the device this rank owns."""
    host = socket.gethostname()
    launcher = os.environ.get(LAUNCHER_VAR, "none")
    if not launched_by_torchrun():
        choice = choose_backend(cfg.name, 1)
        device = choose_device(choice.name, 0)
        return DistInfo(
            rank=0,
            local_rank=0,
            world_size=1,
            local_world_size=1,
            backend=None,
            device=device,
            host=host,
            launcher=launcher,
            why=choice.why,
        )
    ranks = cluster.detect()  # torchrun's variables, set by torchrun or by adopt_launcher
    local_world, local_rank_given = node_ranks(1)
    choice = choose_backend(cfg.name, local_world, local_rank_given=local_rank_given)
    backend = choice.name
    device = choose_device(backend, ranks.local_rank)
    _share_cpu_threads(ranks.local_world_size)
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=cfg.timeout_s)}
    kwargs.update(_restart_safe_store(ranks.world_size, kwargs["timeout"]))
    interface = None
    if backend == "gloo" and ranks.local_world_size < ranks.world_size:
        addr = os.environ["MASTER_ADDR"]
        interface = network.bind_gloo(
            addr, ranks.rank, ranks.world_size, kwargs.get("store"), kwargs["timeout"]
        )
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
        why=choice.why,
        interface=interface,
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


def all_reduce_max(value: int, info: DistInfo) -> int:
    """The largest of the ranks' ``value``."""
    if not info.distributed:
        return value
    t = torch.tensor([value], device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


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
