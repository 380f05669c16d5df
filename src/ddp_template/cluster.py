"""Who started this process: one typed description of its rank, world and rendezvous.

``detect`` checks launchers in a fixed order, first match wins: torchrun (RANK and WORLD_SIZE),
a SLURM srun step (SLURM_PROCID and SLURM_STEP_NUM_TASKS; a batch script or salloc shell has no
step variables and is one plain process), Open MPI, MPICH/Intel MPI (Hydra), horovodrun, LSF
jsrun, else "none". Other launchers than torchrun take MASTER_ADDR/MASTER_PORT from the user when
set; else the address is SLURM's first step host, 127.0.0.1 on one node, LSF's first compute host
or rank 0's hostname over mpi4py, and the port derives from the job id so concurrent jobs on a
node do not collide. Contradicting values, or a rank/size missing from a multi-process launch,
raise ConfigError: a launch must never degrade into silent independent copies.
"""

from __future__ import annotations

import os
import re
import socket
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from ddp_template.errors import ConfigError

Env = Mapping[str, str]
LOOPBACK, DEFAULT_PORT = "127.0.0.1", 29500
TORCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_MISSING: Any = object()
_SINGLE = dict(rank=0, local_rank=0, world_size=1, local_world_size=1)


@dataclass(frozen=True, kw_only=True)
class ClusterEnv:
    """This process's place in its launch; ``master_*`` is None only for torchrun and none."""

    launcher: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    job_id: str | None

    @property
    def multi_process(self) -> bool:
        return self.world_size > 1


class _Spec(NamedTuple):
    launcher: str
    rank: str
    size: str
    local_rank: str
    local_size: str


def _std(launcher: str, prefix: str) -> _Spec:
    return _Spec(launcher, *(prefix + v for v in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE")))


_TORCHRUN = _Spec("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_SLURM = _Spec(
    "slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"
)
_MPI_SPECS = (
    _std("openmpi", "OMPI_COMM_WORLD_"),
    _Spec("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    _std("horovod", "HOROVOD_"),
    _std("lsf", "JSM_NAMESPACE_"),
)
_JOB_VARS = {
    "openmpi": ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"),
    "mpich": ("PMI_KVS_NAME", "PMI_JOBID"),
    "lsf": ("LSB_JOBID",),
}
_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


def detect(env: Env | None = None) -> ClusterEnv:
    """Describe this process from ``env`` (default ``os.environ``); see the module docstring."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return _torchrun(env)
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env and not _inner_mpi(env):
        return _slurm(env)
    for spec in _MPI_SPECS:
        if spec.rank in env or spec.size in env:
            return _mpi(env, spec)
    return ClusterEnv(launcher="none", **_SINGLE, master_addr=None, master_port=None, job_id=None)


def torch_env(cluster: ClusterEnv) -> dict[str, str]:
    """torchrun's variables for ``cluster``; {} where torchrun set them already or none apply."""
    if cluster.launcher in ("torchrun", "none"):
        return {}
    c = cluster
    values = (c.rank, c.local_rank, c.world_size, c.local_world_size, c.master_addr, c.master_port)
    return dict(zip(TORCH_VARS, map(str, values), strict=True))


def _inner_mpi(env: Env) -> bool:
    """mpirun/mpiexec inside an srun step start their daemons with srun, so their ranks also see
    the daemon step's SLURM_* (one task per node): the inner launcher's table must win. srun never
    sets OMPI_COMM_WORLD_* or HOROVOD_*, so their presence decides; PMI_SIZE is also set by
    ``srun --mpi=pmi2`` itself, so it wins only when it differs from SLURM_STEP_NUM_TASKS."""
    inner = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "HOROVOD_SIZE", "HOROVOD_RANK")
    pmi_size = _read(env, "PMI_SIZE", "mpich", None)
    return any(v in env for v in inner) or pmi_size not in (None, _read(env, _SLURM.size, "slurm"))


def _torchrun(env: Env) -> ClusterEnv:
    counts = _counts(env, _TORCHRUN)
    run_id = env.get("TORCHELASTIC_RUN_ID", "").strip()
    addr, port = env.get("MASTER_ADDR") or None, _user_port(env, "torchrun")
    job = run_id if run_id not in ("", "none") else None
    return ClusterEnv(launcher="torchrun", **counts, master_addr=addr, master_port=port, job_id=job)


def _slurm(env: Env) -> ClusterEnv:
    counts = _counts(env, _SLURM)
    job, step = _read(env, "SLURM_JOB_ID", "slurm", None), _read(env, "SLURM_STEP_ID", "slurm", 0)
    task = env.get("SLURM_ARRAY_TASK_ID")
    base = f"{env.get('SLURM_ARRAY_JOB_ID') or job}_{task}" if task else job
    job_id = f"slurm-{base}-s{step}" if job is not None else None
    addr = _master_addr(env, _SLURM, counts)
    # Distinct for the steps of one job and for jobs whose ids differ mod 20000 (131 is prime to
    # 20000), so concurrent jobs and steps sharing a node do not collide.
    derived = 20000 + (job * 131 + step) % 20000 if job is not None else DEFAULT_PORT
    port = _user_port(env, "slurm") or derived
    return ClusterEnv(launcher="slurm", **counts, master_addr=addr, master_port=port, job_id=job_id)


def _slurm_local_world(env: Env, world: int) -> int:
    name = next((v for v in (_SLURM.local_size, "SLURM_TASKS_PER_NODE") if env.get(v)), None)
    if name is None:
        return _read(env, _SLURM.local_size, "slurm", 1 if world == 1 else _MISSING)
    try:
        counts = parse_tasks_per_node(env[name])
    except ValueError:
        raise ConfigError(
            f"{name}={env[name]!r} is not SLURM's tasks-per-node form like '2(x3),1'; launch "
            "with srun so SLURM sets it, or unset it."
        ) from None
    node = _read(env, "SLURM_NODEID", "slurm", 0 if len(counts) == 1 else _MISSING)
    if not 0 <= node < len(counts):
        raise ConfigError(
            f"SLURM_NODEID={node} is outside the {len(counts)} nodes of {name}={env[name]!r}; "
            "launch with srun so SLURM sets both consistently."
        )
    return counts[node]


def _mpi(env: Env, spec: _Spec) -> ClusterEnv:
    name, counts = spec.launcher, _counts(env, spec)
    job = next((env[v].strip() for v in _JOB_VARS.get(name, ()) if env.get(v, "").strip()), None)
    if name == "lsf" and job and env.get("LSB_JOBINDEX", "0") not in ("", "0"):
        job += f"_{env['LSB_JOBINDEX']}"  # an element of an LSF job array
    job_id = f"{name}-{job}" if job else None
    addr = _master_addr(env, spec, counts)
    derived = 20000 + zlib.crc32(job_id.encode()) % 20000 if job_id else DEFAULT_PORT
    port = _user_port(env, name) or derived  # every rank derives the same port from the job id
    return ClusterEnv(launcher=name, **counts, master_addr=addr, master_port=port, job_id=job_id)


def _master_addr(env: Env, spec: _Spec, counts: dict[str, int]) -> str:
    """User's MASTER_ADDR, else the launcher's host hint, else loopback on one node, else mpi4py."""
    world, local = counts["world_size"], counts["local_world_size"]
    addr = env.get("MASTER_ADDR") or _host_hint(env, spec.launcher, local < world)
    addr = addr or (LOOPBACK if local == world else None) or _share_rank0_host()
    if addr:
        return addr
    raise ConfigError(
        f"MASTER_ADDR is not set and the {spec.launcher} launch spans several nodes "
        f"({spec.local_size}={local} of {spec.size}={world}), so export "
        "MASTER_ADDR=<rank 0's host> (and MASTER_PORT) to every rank, e.g. mpirun -x "
        "MASTER_ADDR=..., or pip install mpi4py."
    )


def _host_hint(env: Env, launcher: str, several_nodes: bool) -> str | None:
    """SLURM: the first host of the step's node list. LSF on several nodes: the first compute
    host of LSB_MCPU_HOSTS ("batch 1 host1 4 host2 4"; the first pair is the launch node, which
    runs no ranks when more pairs follow)."""
    if launcher == "lsf" and several_nodes:
        hosts = env.get("LSB_MCPU_HOSTS", "").split()[0::2]
        return hosts[1] if len(hosts) > 1 else next(iter(hosts), None)
    name = next((v for v in _NODELISTS if env.get(v)), None) if launcher == "slurm" else None
    if name is None:
        return None
    try:
        return parse_hostlist(env[name])[0]
    except ValueError:
        raise ConfigError(
            f"{name}={env[name]!r} is not a SLURM host list; export MASTER_ADDR=<first node>."
        ) from None


def _share_rank0_host() -> str | None:
    """Rank 0's hostname broadcast over MPI (importing mpi4py initialises MPI); None without it."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD.bcast(socket.gethostname(), root=0)


def _user_port(env: Env, launcher: str) -> int | None:
    port = _read(env, "MASTER_PORT", launcher, None)
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"MASTER_PORT={port} is not a TCP port; set it to 1..65535 or unset it.")
    return port


def _read(env: Env, name: str, launcher: str, default: Any = _MISSING) -> Any:
    """``env[name]`` as an int; ``default`` when unset (ConfigError if there is none)."""
    raw = env.get(name, "").strip()
    if not raw:
        if default is _MISSING:
            raise ConfigError(
                f"{name} is missing from this multi-process {launcher} launch; start every rank "
                f"with the launcher's own command (it sets {name}) or export {name} to every rank."
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"{name}={env[name]!r} is not an integer; unset it or set it to a whole number "
            f"before starting this {launcher} launch."
        ) from None


def _counts(env: Env, spec: _Spec) -> dict[str, int]:
    """Rank and sizes as ClusterEnv fields; refuses values that contradict each other (they would
    start silent independent copies). Local values may be missing only for torchrun or 1 rank."""
    name = spec.launcher
    world, rank = _read(env, spec.size, name), _read(env, spec.rank, name)
    lenient = world == 1 or spec is _TORCHRUN
    local_rank = _read(env, spec.local_rank, name, 0 if lenient else _MISSING)
    if spec is _SLURM:
        local_world = _slurm_local_world(env, world)
    else:
        local_world = _read(env, spec.local_size, name, world if lenient else _MISSING)
    problems = (
        (not 0 <= rank < world, spec.rank, rank, f"in 0..{world - 1} for {spec.size}={world}"),
        (not 1 <= local_world <= world, spec.local_size, local_world, f"in 1..{world}"),
        (not 0 <= local_rank < local_world, spec.local_rank, local_rank, f"below {local_world}"),
    )
    for bad, var, value, want in problems:
        if bad:
            raise ConfigError(f"{var}={value} from {name} must be {want}; let the launcher set it.")
    return dict(rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world)


def parse_tasks_per_node(text: str) -> list[int]:
    """SLURM's compressed task counts per node: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.strip().split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip(), re.ASCII)
        if match is None:
            raise ValueError(f"bad tasks-per-node entry {part!r} in {text!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def parse_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list: ``"gpu[01-03,7],cpu-a"`` -> gpu01 gpu02 gpu03 gpu7 cpu-a."""
    hosts, depth, start = [], 0, 0
    for i, char in enumerate(text + ","):
        depth += (char == "[") - (char == "]")
        if not 0 <= depth <= 1:
            raise ValueError(f"unbalanced or nested '[' ']' in host list {text!r}")
        if char == "," and depth == 0:
            hosts += _expand(text[start:i].strip(), text)
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in host list {text!r}")
    return hosts


def _expand(pattern: str, text: str) -> list[str]:
    if not pattern:
        raise ValueError(f"empty host name in host list {text!r}")
    head, bracket, rest = pattern.partition("[")
    if not bracket:
        return [pattern]
    body, _, tail = rest.partition("]")
    items = []
    for piece in body.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", piece, re.ASCII)
        if match is None or (match[2] and int(match[2]) < int(match[1])):
            raise ValueError(f"bad range {piece!r} in host list {text!r}")
        width, low = len(match[1]), int(match[1])
        items += [str(n).zfill(width) for n in range(low, int(match[2] or low) + 1)]
    tails = _expand(tail, text) if tail else [""]
    return [head + item + end for item in items for end in tails]
