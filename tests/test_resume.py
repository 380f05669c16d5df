"""Kill it anywhere, get the same model: crash, SIGTERM and elastic restarts vs. no stop.

Every run here uses 2 ranks, shuffling and 2 loader workers (but torchrun's restart and the
world-size refusal, where workers are not the point); the reference is the same config run
without interruption. "Identical" means torch.equal on every tensor of the final model.

Each multi-process run here proves its own claim; what varies only a parameter of a claim
(the preemption check interval, the restart count) is checked on forked gloo ranks instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_killed_rank_reported,
    cpu_rank,
    jsonl,
    run,
    run_env,
    torchrun,
    train_cmd,
)
from wandb_reader import find_runs

from ddp_template import checkpoint
from ddp_template.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, ConfigError

BASE = [
    "data=synthetic",
    "data.size=60",
    "data.test_size=20",
    "data.image_size=8",
    "loader.batch_size=4",
    "epochs=2",
    "loader.num_workers=2",
    "checkpoint.every_steps=1",
]
# 60 samples / 2 ranks / batch 4 = 8 steps per epoch; step 11 is mid-way through epoch 1.
CRASH = ["fault.crash_at_step=11", "fault.rank=1"]


def launch(
    out: Path,
    run_id: str,
    *overrides: str,
    nproc_flag: bool = True,
    check: bool = True,
    launcher: list[str] | None = None,
    new_session: bool = False,
    leftovers: float = 60,
) -> subprocess.CompletedProcess:
    extra = ["dist.nproc=2"] if nproc_flag else []
    cmd = train_cmd(out, *BASE, *extra, *overrides, launcher=launcher)
    return run(
        cmd, env=run_env(RUN_ID=run_id), check=check, new_session=new_session, leftovers=leftovers
    )


def final_model(out: Path, run_id: str) -> dict[str, torch.Tensor]:
    payload = torch.load(out / "outputs" / run_id / "checkpoints" / "last.pt", weights_only=True)
    assert payload["progress"]["step"] == 16 and payload["progress"]["epoch"] == 2
    return payload["model"]


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ after resume: {different}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """Uninterrupted runs, fp32 and bf16; the fp32 one also keeps its epoch checkpoints."""
    out = tmp_path_factory.mktemp("ref")
    launch(out, "ref", "logger=none", "checkpoint.keep=2")
    launch(out, "ref-bf16", "logger=none", "amp=bf16")
    models = {"off": final_model(out, "ref"), "bf16": final_model(out, "ref-bf16")}
    return {**models, "checkpoints": out / "outputs" / "ref" / "checkpoints"}


def test_stopping_early_matters(reference) -> None:
    """Guard: the model one epoch earlier differs, so "identical to the reference" means the
    resumed run really trained to the end. (That an uninterrupted run is deterministic needs no
    run of its own: every resume below is bit-identical to the reference, which a
    nondeterministic run could not be.)"""
    short = torch.load(reference["checkpoints"] / "epoch_1.pt", weights_only=True)
    assert short["progress"]["epoch"] == 1 and short["progress"]["step"] == 8
    assert any(not torch.equal(short["model"][k], reference["off"][k]) for k in short["model"])


def test_sigkill_crash_and_ctrl_c_in_turn_each_resume_to_the_identical_model(
    reference, tmp_path: Path
) -> None:
    """One run stopped three ways in turn, each time resumed by launching it again; then it
    must end bit-identical to the reference. (One chain, not three runs each with its own
    resume: every stop is checked on its own launch's output.)"""
    ckpt = tmp_path / "outputs/chain/checkpoints/last.pt"

    # 1. The OOM killer's way: no exception, no handler. The run fails naming rank 1 and
    # SIGKILL, and no process it started (under forkserver the killed rank's loader workers
    # used to outlive the whole run) is left 10 s after the launcher exits: ``run`` fails on any.
    kill = ["fault.crash_at_step=2", "fault.rank=1", "fault.signal=SIGKILL"]
    proc = launch(tmp_path, "chain", "logger=none", *kill, check=False, leftovers=10)
    assert_killed_rank_reported(proc, rank=1, sig="SIGKILL")

    # 2. Resumed, then a rank raises mid-epoch: every rank stops promptly with its traceback,
    # nothing left behind 10 s later (torchrun semantics), and the step-10 checkpoint records
    # its place in the epoch.
    proc = launch(tmp_path, "chain", "logger=none", *CRASH, check=False, leftovers=10)
    out = proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout, out[-3000:]
    assert proc.returncode != 0
    assert "rank 1 failed" in out and "Traceback" in out, out[-3000:]
    assert "RuntimeError: fault injected: rank 1 crashes after step 11" in out, out[-3000:]
    stopped = torch.load(ckpt, weights_only=True)
    assert (
        stopped["progress"]["step"] == 10
        and stopped["progress"]["epoch"] == 1
        and stopped["progress"]["position"] == 8
    )

    # 3. Resumed, then Ctrl-C: SIGINT to the whole process group mid-epoch, as a terminal's:
    # the launcher and both ranks get it (and the launcher forwards it again); every rank stops
    # at one step boundary, one line, exit 130, no traceback.
    ctrl_c = [
        "checkpoint.preempt_check_every=1",
        "fault.crash_at_step=13",
        "fault.rank=1",
        "fault.signal=SIGINT",
        "fault.scope=process_group",
    ]
    proc = launch(tmp_path, "chain", "logger=none", *ctrl_c, check=False, new_session=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_INTERRUPTED, output[-3000:]
    assert "resumed from" in proc.stdout, output[-3000:]
    said = [line for line in output.splitlines() if "interrupted at step" in line]
    assert len(said) == 1 and "resume with: RUN_ID=chain python" in said[0], output[-3000:]
    assert "Traceback" not in output and "SignalException" not in output, output[-3000:]
    interrupted = torch.load(ckpt, weights_only=True)
    assert (
        14 <= interrupted["progress"]["step"] <= 15
        and f"step {interrupted['progress']['step']}" in said[0]
    )

    # 4. The command that line gives (the same command: its fault lies behind the checkpoint).
    launch(tmp_path, "chain", "logger=none", *ctrl_c, new_session=True)
    assert_identical(reference["off"], final_model(tmp_path, "chain"))
    # No sample skipped or repeated: in epoch 1 the crashed launch logged nothing, the
    # interrupted one its part from the crash's checkpoint to its own, the last one the rest.
    rows = jsonl(tmp_path / "outputs/chain/rank0/metrics.jsonl")
    epoch1 = [r["data/samples"] for r in rows if r.get("epoch") == 1 and "data/samples" in r]
    assert epoch1 == [
        interrupted["progress"]["position"] - 8,
        30 - interrupted["progress"]["position"],
    ]


def test_sigterm_checkpoints_exits_75_then_resumes(reference, tmp_path: Path) -> None:
    """SIGTERM to rank 1 alone at step 3, checked every 10 steps: the epoch end (step 8) comes
    first, where both ranks agree to stop. The stop at the next step boundary when checked every
    step is the Ctrl-C stop above; the agreement itself is test_preemption_agreement_*."""
    check = "checkpoint.preempt_check_every=10"
    term = ["fault.crash_at_step=3", "fault.rank=1", "fault.signal=SIGTERM"]
    proc = launch(tmp_path, "term", "logger=wandb", *term, check, check=False)
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr[-3000:]
    assert "received SIGTERM" in proc.stdout + proc.stderr
    stopped = torch.load(tmp_path / "outputs/term/checkpoints/last.pt", weights_only=True)
    assert stopped["progress"]["step"] == 8
    launch(tmp_path, "term", "logger=wandb", check)
    assert_identical(reference["off"], final_model(tmp_path, "term"))
    # The resumed run continued the same W&B runs (same ids), one file per start.
    runs = find_runs(tmp_path / "outputs/term")
    for rank in (0, 1):
        mine = [r for r in runs if r.config["rank"] == rank]
        assert len(mine) == 2 and len({r.run_id for r in mine}) == 1
    said = [r.summary["resume"] for r in runs if "resume" in r.summary]  # rank 0's second start
    assert said == [
        "resume: continues run term, link 0 → 1 at step 8: 0 samples skipped, 0 repeated"
    ]


def _preempt_rank(rank: int, port: int, every: int, signal_at: int, out) -> None:
    """One of 2 forked gloo ranks: an 8-step epoch; rank 1 alone gets SIGTERM after step
    ``signal_at``. Reports the step at which this rank stopped (8: at the epoch end)."""
    import torch.distributed as dist

    from ddp_template.preemption import Preemption

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    info = cpu_rank(rank, 2, backend="gloo")
    pre = Preemption(info=info, every=every, run_id="unit")
    stopped = None
    for step in range(1, 9):
        if rank == 1 and step == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if pre.requested(step):
            stopped = step
            break
    else:
        stopped = 8 if pre.sync() else None
    pre.close()
    dist.destroy_process_group()
    out.put((rank, stopped, pre.agreed))


@pytest.mark.parametrize(
    "every,signal_at,want",
    [
        (1, 3, 4),  # checked every step: read one step after the reduce that carried it
        (10, 3, 8),  # checked every 10 steps: the epoch end's blocking agreement comes first
        (10, 99, None),  # no signal: nobody stops
    ],
)
def test_preemption_agreement_one_signalled_rank_stops_both_at_one_step(
    every: int, signal_at: int, want: int | None
) -> None:
    """The claim of the former per-interval SIGTERM runs, on two gloo ranks from a forkserver
    (torch imported once, no train.py): a signal on one rank stops every rank after the same
    step. Not plain fork: this test process has thread pools a forked child can deadlock on."""
    import multiprocessing

    from helpers import free_port

    ctx = multiprocessing.get_context("forkserver")
    out, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=_preempt_rank, args=(r, port, every, signal_at, out)) for r in (0, 1)
    ]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert [(r, s) for r, s, _ in results] == [(0, want), (1, want)]
    assert all(agreed == (1 if want else 0) for _, _, agreed in results)  # PREEMPT, not INTERRUPT


def test_torchrun_max_restarts_recovers_identically(reference, tmp_path: Path) -> None:
    """torchrun's own restart (loader workers off: they are the SIGKILL tests' point, and the
    reference, which had them, must not depend on them)."""
    launcher = [*torchrun(2), "--max-restarts=1"]
    overrides = ["logger=none", "loader.num_workers=0", *CRASH]
    launch(tmp_path, "elastic", *overrides, nproc_flag=False, launcher=launcher)
    assert_identical(reference["off"], final_model(tmp_path, "elastic"))


def test_in_process_max_restarts_after_sigkill_recovers_identically(
    reference, tmp_path: Path
) -> None:
    """``dist.max_restarts=1``: the in-process launcher restarts the group after a SIGKILLed
    rank (nothing left behind either), and it resumes to the reference model, here under
    bf16, so a bf16 resume is bit-identical too."""
    proc = launch(
        tmp_path,
        "oom",
        "logger=none",
        "amp=bf16",
        "dist.max_restarts=1",
        *CRASH,
        "fault.signal=SIGKILL",
    )
    assert "resumed from" in proc.stdout, proc.stdout[-2000:]
    assert_identical(reference["bf16"], final_model(tmp_path, "oom"))


def test_other_world_size_is_refused_clearly(reference, tmp_path: Path) -> None:
    """A 2-rank checkpoint on a 3-rank run: ``restore`` refuses it before putting anything back,
    one sentence naming both sizes, and the file is left alone. In-process (a 3-rank launch
    only added that a rank's ConfigError ends the run with its sentence:
    test_config.py::test_meaningless_values_get_one_sentence's drop_last case)."""
    ckpt = tmp_path / "ws2.pt"  # a 2-rank checkpoint
    ckpt.write_bytes((reference["checkpoints"] / "last.pt").read_bytes())
    before = ckpt.read_bytes()
    found = checkpoint.find_resume(str(ckpt), tmp_path)
    assert found is not None and found.payload["world_size"] == 2
    three = cpu_rank(2, 3, backend="gloo")
    with pytest.raises(ConfigError, match="world size 2 but this run has 3 ranks"):
        checkpoint.restore(found, parts=None, rank_parts=None, info=three)  # nothing touched first
    assert ckpt.read_bytes() == before  # nothing written over


def _payload(step: int) -> dict:
    return {"format": checkpoint.FORMAT_VERSION, "step": step, "w": torch.full((3,), step)}


def test_truncated_last_falls_back_to_older_checkpoint(tmp_path: Path, caplog) -> None:
    d = tmp_path / "checkpoints"
    checkpoint.save_atomic(_payload(8), d / "epoch_1.pt")
    checkpoint.save_atomic(_payload(16), d / "last.pt")
    data = (d / "last.pt").read_bytes()
    (d / "last.pt").write_bytes(data[: len(data) // 2])
    found = checkpoint.find_resume("auto", d)
    assert found is not None and Path(found[0]).name == "epoch_1.pt" and found[1]["step"] == 8
    assert "last.pt cannot be read" in caplog.text
    assert sorted(p.name for p in d.iterdir()) == ["epoch_1.pt", "last.pt"]  # nothing deleted
    with pytest.raises(checkpoint.ConfigError, match="last.pt cannot be read"):
        checkpoint.find_resume(str(d / "last.pt"), d)


def _save_killed_before_rename(path: Path) -> None:
    checkpoint.os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # this child only
    checkpoint.save_atomic({"format": 1, "step": 2, "w": torch.ones(10**6)}, path)


def test_write_killed_before_rename_keeps_previous(tmp_path: Path) -> None:
    import multiprocessing

    path = tmp_path / "last.pt"
    checkpoint.save_atomic(_payload(1), path)
    # A child SIGKILLed where it would rename. From the forkserver, not a fork of this process:
    # its torch thread pools deadlock a forked child's torch.save (seen in CI).
    child = multiprocessing.get_context("forkserver").Process(
        target=_save_killed_before_rename, args=(path,)
    )
    child.start()
    child.join(timeout=60)
    assert child.exitcode == -9
    assert (tmp_path / "last.pt.tmp").stat().st_size > 4 * 10**6  # the new data was written
    assert checkpoint.load(path)["step"] == 1  # ... but never replaced the good file


def test_weights_only_load_refuses_code(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    path = tmp_path / "evil.pt"
    torch.save({"format": 1, "x": Evil()}, path)
    with pytest.raises(checkpoint.ConfigError, match="cannot be read"):
        checkpoint.load(path)
