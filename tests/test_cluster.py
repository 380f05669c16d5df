"""Launcher detection: each launcher's real variables, the precedence, rendezvous and refusals."""

from __future__ import annotations

import dataclasses
import socket
import sys
import types

import pytest

from ddp_template import cluster
from ddp_template.cluster import ClusterEnv, detect, parse_hostlist, parse_tasks_per_node, torch_env
from ddp_template.errors import ConfigError


def env_of(text: str, **extra: str) -> dict[str, str]:
    """``env``-style ``NAME=value`` words (values without spaces) as a dict, plus ``extra``."""
    return {**dict(word.split("=", 1) for word in text.split()), **extra}


# What torchrun's elastic agent gives local rank 1 on its second node.
TORCHRUN = env_of("""
    RANK=3 LOCAL_RANK=1 WORLD_SIZE=4 LOCAL_WORLD_SIZE=2 GROUP_RANK=1 GROUP_WORLD_SIZE=2
    ROLE_RANK=3 ROLE_WORLD_SIZE=4 ROLE_NAME=default MASTER_ADDR=gpu01 MASTER_PORT=29400
    TORCHELASTIC_RUN_ID=job42 TORCHELASTIC_RESTART_COUNT=0 TORCHELASTIC_MAX_RESTARTS=0
    OMP_NUM_THREADS=1
""")
# Set for the whole allocation: the batch script and an salloc shell see these too.
SLURM_JOB = env_of("""
    SLURM_JOB_ID=123456 SLURM_JOBID=123456 SLURM_JOB_NAME=train SLURM_JOB_NODELIST=gpu[01-02]
    SLURM_NODELIST=gpu[01-02] SLURM_JOB_NUM_NODES=2 SLURM_NNODES=2 SLURM_NTASKS=4 SLURM_NPROCS=4
    SLURM_TASKS_PER_NODE=2(x2) SLURM_JOB_CPUS_PER_NODE=8(x2) SLURM_SUBMIT_DIR=/home/u/run
    SLURM_SUBMIT_HOST=login1
""")
# `srun -N2 -n4 python train.py`: task 3, the second task on the second node.
SLURM_TASK = {
    **SLURM_JOB,
    **env_of("""
    SLURM_STEP_ID=0 SLURM_STEPID=0 SLURM_STEP_NODELIST=gpu[01-02] SLURM_STEP_NUM_NODES=2
    SLURM_STEP_NUM_TASKS=4 SLURM_STEP_TASKS_PER_NODE=2(x2) SLURM_STEP_LAUNCHER_PORT=41231
    SLURM_SRUN_COMM_HOST=10.0.0.1 SLURM_PROCID=3 SLURM_LOCALID=1 SLURM_NODEID=1 SLURM_GTIDS=2,3
    SLURMD_NODENAME=gpu02 SLURM_TOPOLOGY_ADDR=gpu02 SLURM_DISTRIBUTION=block
"""),
}
# The batch script of `sbatch --ntasks=2`: one process despite SLURM_NTASKS=2.
SLURM_BATCH = {
    **SLURM_JOB,
    **env_of("""
    SLURM_NTASKS=2 SLURM_TASKS_PER_NODE=2 SLURM_JOB_NODELIST=gpu01 SLURM_NODELIST=gpu01
    SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0 SLURM_GTIDS=0 SLURM_TASK_PID=4242
    ENVIRONMENT=BATCH
"""),
}
# submitit's `srun python -m submitit...`: a one-task step.
SLURM_ONE_TASK = {
    **SLURM_JOB,
    **env_of("""
    SLURM_JOB_ID=777 SLURM_JOB_NODELIST=gpu05 SLURM_NTASKS=1 SLURM_TASKS_PER_NODE=1
    SLURM_STEP_ID=0 SLURM_STEP_NODELIST=gpu05 SLURM_STEP_NUM_TASKS=1 SLURM_STEP_TASKS_PER_NODE=1
    SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0
"""),
}
# The srun step mpirun starts its remote daemons in: one task per node.
ORTED_STEP = {
    **SLURM_JOB,
    **env_of("""
    SLURM_STEP_ID=0 SLURM_STEP_NODELIST=gpu02 SLURM_STEP_NUM_TASKS=1 SLURM_STEP_TASKS_PER_NODE=1
    SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0
"""),
}


def ompi(rank: int, local_rank: int, size: int = 2, local_size: int = 2) -> dict[str, str]:
    """Open MPI 4.1.4's variables as `mpirun -np 2 env` showed them here (the same job id)."""
    return env_of(f"""
        OMPI_COMM_WORLD_RANK={rank} OMPI_COMM_WORLD_SIZE={size} PMIX_RANK={rank}
        OMPI_COMM_WORLD_LOCAL_RANK={local_rank} OMPI_COMM_WORLD_LOCAL_SIZE={local_size}
        OMPI_COMM_WORLD_NODE_RANK={local_rank} OMPI_MCA_ess_base_jobid=1737752577
        OMPI_MCA_orte_ess_num_procs={size} OMPI_MCA_orte_num_nodes={size // local_size}
        PMIX_NAMESPACE=1737752577
    """)


# MPICH / Intel MPI mpiexec (Hydra): rank 5 of 8, 4 per node.
HYDRA = env_of("PMI_RANK=5 PMI_SIZE=8 PMI_FD=6 MPI_LOCALRANKID=1 MPI_LOCALNRANKS=4")
# horovodrun -np 2 (gloo) on one host.
HOROVOD = env_of("""
    HOROVOD_RANK=1 HOROVOD_SIZE=2 HOROVOD_LOCAL_RANK=1 HOROVOD_LOCAL_SIZE=2 HOROVOD_CROSS_RANK=0
    HOROVOD_CROSS_SIZE=1 HOROVOD_HOSTNAME=localhost HOROVOD_CONTROLLER=gloo
    HOROVOD_CPU_OPERATIONS=gloo HOROVOD_GLOO_RENDEZVOUS_ADDR=10.0.0.9
    HOROVOD_GLOO_RENDEZVOUS_PORT=41000
""")
# LSF jsrun: rank 5 of 8 on two compute hosts behind the batch host.
JSRUN = env_of(
    """
    JSM_NAMESPACE_RANK=5 JSM_NAMESPACE_SIZE=8 JSM_NAMESPACE_LOCAL_RANK=1 JSM_NAMESPACE_LOCAL_SIZE=4
    LSB_JOBID=98765 LSB_JOBINDEX=0
    """,
    LSB_MCPU_HOSTS="batch3 1 h41n01 42 h41n02 42",
    LSB_HOSTS="batch3 h41n01 h41n02",
)


def fields(c: ClusterEnv) -> tuple:
    return (c.launcher, c.rank, c.local_rank, c.world_size, c.local_world_size)


@pytest.mark.parametrize(
    ("env", "expected", "master", "job_id"),
    [
        (TORCHRUN, ("torchrun", 3, 1, 4, 2), ("gpu01", 29400), "job42"),
        # the template's in-process launcher: no LOCAL_* and no run id
        ({"RANK": "1", "WORLD_SIZE": "2"}, ("torchrun", 1, 0, 2, 2), (None, None), None),
        # `srun ... torchrun`: torchrun's own table wins over the SLURM step's
        (
            {**SLURM_TASK, **TORCHRUN, "TORCHELASTIC_RUN_ID": "none"},
            ("torchrun", 3, 1, 4, 2),
            ("gpu01", 29400),
            None,
        ),
    ],
)
def test_torchrun(env: dict, expected: tuple, master: tuple, job_id: str | None) -> None:
    c = detect(env)
    assert fields(c) == expected
    assert (c.master_addr, c.master_port, c.job_id) == (*master, job_id)


@pytest.mark.parametrize(
    ("env", "expected", "master", "job_id"),
    [
        (SLURM_TASK, ("slurm", 3, 1, 4, 2), "gpu01", "slurm-123456-s0"),
        # 3 nodes of 2 tasks and 1 of 1: the last node's only task
        (
            {
                **SLURM_TASK,
                "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
                "SLURM_STEP_NUM_TASKS": "7",
                "SLURM_STEP_NODELIST": "n[001-004]",
                "SLURM_PROCID": "6",
                "SLURM_LOCALID": "0",
                "SLURM_NODEID": "3",
                "SLURM_STEP_ID": "2",
            },
            ("slurm", 6, 0, 7, 1),
            "n001",
            "slurm-123456-s2",
        ),
        # an array task: the id a user sees in squeue (ARRAY_JOB_ID_TASK_ID)
        (
            {
                **SLURM_TASK,
                "SLURM_JOB_ID": "123460",
                "SLURM_ARRAY_JOB_ID": "123450",
                "SLURM_ARRAY_TASK_ID": "7",
            },
            ("slurm", 3, 1, 4, 2),
            "gpu01",
            "slurm-123450_7-s0",
        ),
        (SLURM_ONE_TASK, ("slurm", 0, 0, 1, 1), "gpu05", "slurm-777-s0"),
    ],
)
def test_slurm_step(env: dict, expected: tuple, master: str, job_id: str) -> None:
    c = detect(env)
    assert fields(c) == expected
    assert (c.master_addr, c.job_id) == (master, job_id)
    assert c.multi_process is (expected[3] > 1)


def test_slurm_step_falls_back_to_job_level_lists() -> None:
    env = {
        k: v
        for k, v in SLURM_TASK.items()
        if k not in ("SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE")
    }
    env["SLURM_JOB_NODELIST"] = "big[07-08]"
    c = detect(env)
    assert (c.local_world_size, c.master_addr) == (2, "big07")


@pytest.mark.parametrize(
    "env",
    [
        SLURM_BATCH,
        {**SLURM_JOB, "SLURM_NTASKS": "2"},  # an salloc shell
        {},
        {"HOME": "/root", "PATH": "/usr/bin", "LOCAL_RANK": "0"},
    ],
)
def test_single_processes_are_none(env: dict) -> None:
    c = detect(env)
    assert fields(c) == ("none", 0, 0, 1, 1)
    assert (c.master_addr, c.master_port, c.job_id, c.multi_process) == (None, None, None, False)
    assert torch_env(c) == {}


def test_real_open_mpi_ranks_share_one_job() -> None:
    first, second = detect(ompi(0, 0)), detect(ompi(1, 1))
    assert fields(first) == ("openmpi", 0, 0, 2, 2)
    assert fields(second) == ("openmpi", 1, 1, 2, 2)
    assert first.job_id == second.job_id == "openmpi-1737752577"
    assert first.master_addr == second.master_addr == "127.0.0.1"
    assert first.master_port == second.master_port == 30664  # 20000 + crc32(id) % 20000


def test_open_mpi_five_job_id_from_pmix_namespace() -> None:
    env = {**ompi(0, 0), "PMIX_NAMESPACE": "prterun-host-1234@1"}
    del env["OMPI_MCA_ess_base_jobid"]
    assert detect(env).job_id == "openmpi-prterun-host-1234@1"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({**ORTED_STEP, **ompi(2, 0, 4, 2)}, ("openmpi", 2, 0, 4, 2)),
        # `mpirun -np 2 --map-by node` on 3 nodes: the step's task count equals the MPI size,
        # yet SLURM_PROCID=0 is the daemon's rank, not this rank's: Open MPI must still win
        (
            {
                **ORTED_STEP,
                "SLURM_STEP_NUM_TASKS": "2",
                "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
                **ompi(1, 0, 2, 1),
            },
            ("openmpi", 1, 0, 2, 1),
        ),
        ({**ORTED_STEP, "SLURM_STEP_NUM_TASKS": "2", **HYDRA}, ("mpich", 5, 1, 8, 4)),
        ({**ORTED_STEP, **HOROVOD}, ("horovod", 1, 1, 2, 2)),
        # `srun --mpi=pmi2`: srun itself sets PMI_RANK/PMI_SIZE, equal to its own table
        (
            {**SLURM_TASK, "PMI_RANK": "3", "PMI_SIZE": "4", "PMI_JOBID": "123456.0"},
            ("slurm", 3, 1, 4, 2),
        ),
    ],
)
def test_inner_launcher_inside_slurm_allocation(env: dict, expected: tuple) -> None:
    c = detect({**env, "MASTER_ADDR": "gpu01"})
    assert fields(c) == expected
    assert c.master_addr == "gpu01"


def test_mpich_hydra() -> None:
    c = detect({**HYDRA, "MASTER_ADDR": "n01", "PMI_KVS_NAME": "kvs_4242_0"})
    assert fields(c) == ("mpich", 5, 1, 8, 4)
    assert c.job_id == "mpich-kvs_4242_0"
    assert detect({**HYDRA, "MASTER_ADDR": "n01"}).master_port == 29500  # no job id


def test_horovodrun_on_one_host() -> None:
    c = detect(HOROVOD)
    assert fields(c) == ("horovod", 1, 1, 2, 2)
    assert (c.master_addr, c.master_port, c.job_id) == ("127.0.0.1", 29500, None)


# An element of an LSF job array with all four ranks on one node.
JSRUN_ONE_NODE = {**JSRUN, **env_of("JSM_NAMESPACE_RANK=1 JSM_NAMESPACE_SIZE=4 LSB_JOBINDEX=3")}


@pytest.mark.parametrize(
    ("env", "expected", "master", "job_id"),
    [
        (JSRUN, ("lsf", 5, 1, 8, 4), "h41n01", "lsf-98765"),  # the batch host runs no ranks
        ({**JSRUN, "LSB_MCPU_HOSTS": "h41n07 4"}, ("lsf", 5, 1, 8, 4), "h41n07", "lsf-98765"),
        (JSRUN_ONE_NODE, ("lsf", 1, 1, 4, 4), "127.0.0.1", "lsf-98765_3"),
    ],
)
def test_lsf_jsrun(env: dict, expected: tuple, master: str, job_id: str) -> None:
    c = detect(env)
    assert fields(c) == expected
    assert (c.master_addr, c.job_id) == (master, job_id)


@pytest.mark.parametrize("env", [SLURM_TASK, ompi(5, 1, 8, 4), JSRUN, HYDRA])
def test_user_master_addr_and_port_win(env: dict) -> None:
    c = detect({**env, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "1234"})
    assert (c.master_addr, c.master_port) == ("10.1.2.3", 1234)


def test_slurm_port_differs_between_jobs_and_steps() -> None:
    port = detect(SLURM_TASK).master_port
    assert port == 20000 + (123456 * 131 + 0) % 20000 == 32736
    assert detect({**SLURM_TASK, "SLURM_JOB_ID": "123457"}).master_port not in (port, None)
    other_step = detect({**SLURM_TASK, "SLURM_STEP_ID": "1"})
    assert other_step.master_port not in (port, None)
    assert other_step.job_id == "slurm-123456-s1"


def test_mpi_port_differs_between_job_ids() -> None:
    first = detect(ompi(0, 0)).master_port
    other = detect({**ompi(0, 0), "OMPI_MCA_ess_base_jobid": "1737752578"}).master_port
    assert first != other
    assert all(20000 <= p < 40000 for p in (first, other))


def test_multi_node_mpi_without_master_addr_or_mpi4py_is_refused(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # `import mpi4py` raises ImportError
    with pytest.raises(ConfigError, match="MASTER_ADDR") as err:
        detect(ompi(5, 1, 8, 4))
    assert "openmpi" in str(err.value)
    assert "mpi4py" in str(err.value)


def test_multi_node_mpi_asks_mpi4py_for_rank0_host(monkeypatch) -> None:
    sent = []

    class Comm:
        @staticmethod
        def bcast(value: str, root: int) -> str:
            sent.append((value, root))
            return "gpu07"

    fake = types.ModuleType("mpi4py")
    fake.MPI = types.SimpleNamespace(COMM_WORLD=Comm)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mpi4py", fake)
    assert detect(ompi(5, 1, 8, 4)).master_addr == "gpu07"
    assert sent == [(socket.gethostname(), 0)]
    monkeypatch.setattr(cluster, "_share_rank0_host", lambda: "node-b")
    assert detect(HYDRA).master_addr == "node-b"


@pytest.mark.parametrize(
    ("env", "words"),
    [
        (ompi(2, 0), ["OMPI_COMM_WORLD_RANK=2", "0..1"]),
        (
            {**ompi(1, 0), "OMPI_COMM_WORLD_LOCAL_SIZE": "3"},
            ["OMPI_COMM_WORLD_LOCAL_SIZE=3", "in 1..2"],
        ),
        (
            {k: v for k, v in ompi(1, 1).items() if k != "OMPI_COMM_WORLD_LOCAL_RANK"},
            ["OMPI_COMM_WORLD_LOCAL_RANK is missing", "openmpi"],
        ),
        (
            {k: v for k, v in HYDRA.items() if k != "MPI_LOCALNRANKS"},
            ["MPI_LOCALNRANKS is missing", "mpich"],
        ),
        ({**SLURM_TASK, "SLURM_NODEID": "2"}, ["SLURM_NODEID=2", "2(x2)"]),
        (
            {k: v for k, v in SLURM_TASK.items() if "TASKS_PER_NODE" not in k},
            ["SLURM_STEP_TASKS_PER_NODE is missing"],
        ),
        ({**SLURM_TASK, "SLURM_STEP_TASKS_PER_NODE": "2x2"}, ["SLURM_STEP_TASKS_PER_NODE='2x2'"]),
        ({**SLURM_TASK, "SLURM_STEP_NODELIST": "gpu[01-02"}, ["SLURM_STEP_NODELIST='gpu[01-02'"]),
        ({**TORCHRUN, "RANK": "4"}, ["RANK=4", "WORLD_SIZE=4"]),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, ["MASTER_PORT=70000"]),
        ({**HOROVOD, "HOROVOD_SIZE": "two"}, ["HOROVOD_SIZE='two' is not an integer"]),
    ],
)
def test_inconsistent_launches_are_refused(env: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        detect(env)
    message = str(err.value)
    assert all(w in message for w in words), message
    assert "\n" not in message and message.endswith(".")


def test_bad_integer_names_the_variable_and_value() -> None:
    with pytest.raises(ConfigError, match=r"^SLURM_PROCID='x' is not an integer; "):
        detect({**SLURM_TASK, "SLURM_PROCID": "x"})


def test_detect_reads_os_environ_by_default(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert fields(detect()) == ("torchrun", 1, 1, 3, 3)


def test_torch_env_exports_torchruns_variables() -> None:
    assert torch_env(detect(SLURM_TASK)) == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu01",
        "MASTER_PORT": "32736",
    }
    assert torch_env(detect(TORCHRUN)) == {}


def test_cluster_env_is_frozen_and_keyword_only() -> None:
    c = detect(HOROVOD)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.rank = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        ClusterEnv("none", 0, 0, 1, 1, None, None, None)  # type: ignore[misc]
    assert c.multi_process and not dataclasses.replace(c, world_size=1).multi_process


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("gpu[01-03,7],cpu-a", ["gpu01", "gpu02", "gpu03", "gpu7", "cpu-a"]),
        ("n[001-003]", ["n001", "n002", "n003"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("a[1,3],b", ["a1", "a3", "b"]),
    ],
)
def test_parse_hostlist(text: str, hosts: list[str]) -> None:
    assert parse_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["gpu[01-03", "gpu01-03]", "n[3-1]", "n[]", "n[a-b]", "a,,b", ""])
def test_parse_hostlist_rejects_malformed(text: str) -> None:
    with pytest.raises(ValueError):
        parse_hostlist(text)


@pytest.mark.parametrize(
    ("text", "counts"),
    [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,3(x2)", [1, 3, 3])],
)
def test_parse_tasks_per_node(text: str, counts: list[int]) -> None:
    assert parse_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["2(3)", "x", "", "2(x3),", "-1"])
def test_parse_tasks_per_node_rejects_malformed(text: str) -> None:
    with pytest.raises(ValueError):
        parse_tasks_per_node(text)


# --------------------------------------------------------------------- adopting a launch
def test_adopt_launcher_gives_srun_tasks_torchruns_contract_and_the_jobs_run_id() -> None:
    from ddp_template.distributed import LAUNCHER_VAR, adopt_launcher

    env = dict(SLURM_TASK)
    found = adopt_launcher(env)
    assert (found.launcher, found.rank, found.world_size) == ("slurm", 3, 4)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")} == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
    }
    assert env["MASTER_ADDR"] == "gpu01" and env["RUN_ID"] == "slurm-123456-s0"
    assert env[LAUNCHER_VAR] == "slurm"
    assert detect(env).launcher == "torchrun"  # from now on one contract: torchrun's
    chosen = dict(SLURM_TASK, RUN_ID="mine")
    adopt_launcher(chosen)
    assert chosen["RUN_ID"] == "mine"  # the user's RUN_ID wins


@pytest.mark.parametrize("env", [SLURM_BATCH, SLURM_ONE_TASK, {}])
def test_adopt_launcher_leaves_a_single_process_alone(env: dict[str, str]) -> None:
    from ddp_template.distributed import adopt_launcher

    env = dict(env)
    adopt_launcher(env)
    assert not {"RANK", "WORLD_SIZE", "RUN_ID"} & set(env)


@pytest.mark.parametrize(("nproc", "refused"), [(1, False), (2, False), (4, True)])
def test_dist_nproc_inside_a_launch_is_refused_unless_it_matches(
    monkeypatch: pytest.MonkeyPatch, nproc: int, refused: bool
) -> None:
    """`srun -n 2 python train.py dist.nproc=4` must not start ranks inside ranks."""
    from ddp_template.checks import _check_launch
    from ddp_template.config.schema import Config

    for key, value in env_of("RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DDP_TEMPLATE_LAUNCHER", "slurm")
    cfg = Config()
    cfg.dist.nproc = nproc
    if refused:
        with pytest.raises(ConfigError, match=r"dist.nproc=4 .* that slurm already started"):
            _check_launch(cfg)
    else:
        _check_launch(cfg)
