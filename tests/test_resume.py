"""Kill it anywhere, get the same model: crash, SIGTERM and elastic restarts vs. no stop.

Every run here uses 2 ranks, shuffling and 2 loader workers; the reference is the same config
run without interruption. "Identical" means torch.equal on every tensor of the final model.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import PY, ROOT, TORCHRUN, jsonl, run, run_env, torchrun, train_cmd
from wandb_reader import find_runs

from ddp_template import checkpoint
from ddp_template.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED

BASE = [
    "data=synthetic",
    "data.size=60",
    "data.eval_size=20",
    "data.image_size=8",
    "batch_size=4",
    "epochs=2",
    "num_workers=2",
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
) -> subprocess.CompletedProcess:
    extra = ["dist.nproc=2"] if nproc_flag else []
    cmd = train_cmd(out, *BASE, *extra, *overrides, launcher=launcher)
    return run(cmd, env=run_env(RUN_ID=run_id), check=check, new_session=new_session)


def final_model(out: Path, run_id: str) -> dict[str, torch.Tensor]:
    payload = torch.load(out / "outputs" / run_id / "checkpoints" / "last.pt", weights_only=True)
    assert payload["step"] == 16 and payload["epoch"] == 2
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


def test_reference_is_deterministic_and_stop_matters(reference, tmp_path: Path) -> None:
    """Guard: a second uninterrupted run is identical, the model one epoch earlier is not."""
    launch(tmp_path, "again", "logger=none")
    assert_identical(reference["off"], final_model(tmp_path, "again"))
    short = torch.load(reference["checkpoints"] / "epoch_1.pt", weights_only=True)
    assert short["epoch"] == 1 and short["step"] == 8
    assert any(not torch.equal(short["model"][k], reference["off"][k]) for k in short["model"])


@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_crash_mid_epoch_then_resume_is_bit_identical(reference, tmp_path: Path, amp: str) -> None:
    proc = launch(tmp_path, "crash", "logger=none", f"amp={amp}", *CRASH, check=False)
    assert proc.returncode != 0
    assert "fault injected: rank 1" in proc.stderr
    stopped = torch.load(tmp_path / "outputs/crash/checkpoints/last.pt", weights_only=True)
    assert stopped["step"] == 10 and stopped["epoch"] == 1 and stopped["position"] == 8
    proc = launch(tmp_path, "crash", "logger=none", f"amp={amp}")
    assert "resumed from" in proc.stdout
    assert_identical(reference[amp], final_model(tmp_path, "crash"))
    # No sample skipped or repeated: epoch 1 of the resumed run saw the rest of the shard.
    rows = jsonl(tmp_path / "outputs/crash/rank0/metrics.jsonl")
    epoch1 = [r for r in rows if r.get("epoch") == 1 and "data/samples" in r]
    assert [r["data/samples"] for r in epoch1] == [30 - 8]  # crash run logged no epoch 1


@pytest.mark.parametrize(
    "at,every,stopped_at",
    [
        (11, 1, (12, 13)),  # checked every step: all ranks stop at the next step boundary
        (3, 10, (8, 8)),  # checked every 10 steps: the epoch end (step 8) comes first
    ],
)
def test_sigterm_checkpoints_exits_75_then_resumes(
    reference, tmp_path: Path, at: int, every: int, stopped_at: tuple
) -> None:
    check = f"checkpoint.preempt_check_every={every}"
    proc = launch(
        tmp_path,
        "term",
        f"fault.crash_at_step={at}",
        "fault.rank=1",
        "fault.signal=SIGTERM",
        check,
        check=False,
    )
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr[-3000:]
    assert "received SIGTERM" in proc.stdout + proc.stderr
    stopped = torch.load(tmp_path / "outputs/term/checkpoints/last.pt", weights_only=True)
    assert stopped_at[0] <= stopped["step"] <= stopped_at[1]
    launch(tmp_path, "term", check)
    assert_identical(reference["off"], final_model(tmp_path, "term"))
    # The resumed run continued the same W&B runs (same ids), one file per start.
    runs = find_runs(tmp_path / "outputs/term")
    for rank in (0, 1):
        mine = [r for r in runs if r.config["rank"] == rank]
        assert len(mine) == 2 and len({r.run_id for r in mine}) == 1


def test_ctrl_c_stops_every_rank_at_one_step_exits_130_and_resumes(
    reference, tmp_path: Path
) -> None:
    """SIGINT to the whole process group mid-epoch, as a terminal's Ctrl-C: the launcher and
    both ranks get it (and the launcher forwards it again); one line, exit 130, nothing left."""
    ctrl_c = [
        "checkpoint.preempt_check_every=1",
        "fault.crash_at_step=11",
        "fault.rank=1",
        "fault.signal=SIGINT",
        "fault.process_group=true",
    ]
    proc = launch(tmp_path, "ctrlc", "logger=none", *ctrl_c, check=False, new_session=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_INTERRUPTED, output[-3000:]
    said = [line for line in output.splitlines() if "interrupted at step" in line]
    assert len(said) == 1 and "resume with: RUN_ID=ctrlc python" in said[0], output[-3000:]
    assert "Traceback" not in output and "SignalException" not in output, output[-3000:]
    stopped = torch.load(tmp_path / "outputs/ctrlc/checkpoints/last.pt", weights_only=True)
    assert 12 <= stopped["step"] <= 13 and f"step {stopped['step']}" in said[0]
    launch(tmp_path, "ctrlc", "logger=none", *ctrl_c, new_session=True)  # the same command
    assert_identical(reference["off"], final_model(tmp_path, "ctrlc"))


def test_torchrun_max_restarts_recovers_identically(reference, tmp_path: Path) -> None:
    launcher = [*torchrun(2), "--max-restarts=1"]
    launch(tmp_path, "elastic", "logger=none", *CRASH, nproc_flag=False, launcher=launcher)
    assert_identical(reference["off"], final_model(tmp_path, "elastic"))


def test_in_process_max_restarts_recovers_identically(reference, tmp_path: Path) -> None:
    launch(tmp_path, "elastic2", "logger=none", "dist.max_restarts=1", *CRASH)
    assert_identical(reference["off"], final_model(tmp_path, "elastic2"))


@pytest.mark.parametrize("restarts", [0, 1])
def test_sigkilled_rank_takes_its_loader_workers_along(
    reference, tmp_path: Path, restarts: int
) -> None:
    """The OOM killer's way: no exception, no handler. ``run`` fails on any process left behind
    (under forkserver the killed rank's workers used to outlive the whole run)."""
    proc = launch(
        tmp_path,
        "oom",
        "logger=none",
        f"dist.max_restarts={restarts}",
        *CRASH,
        "fault.signal=SIGKILL",
        check=restarts > 0,
    )
    if restarts:
        assert_identical(reference["off"], final_model(tmp_path, "oom"))
    else:
        assert proc.returncode != 0 and "SIGKILL" in proc.stderr, proc.stderr[-2000:]


def test_other_world_size_is_refused_clearly(reference, tmp_path: Path) -> None:
    ckpt = tmp_path / "ws2.pt"  # a 2-rank checkpoint
    ckpt.write_bytes((reference["checkpoints"] / "last.pt").read_bytes())
    before = ckpt.read_bytes()
    cmd = train_cmd(
        tmp_path,
        *BASE,
        "logger=none",
        f"resume={ckpt}",
        launcher=[*TORCHRUN, "--standalone", "--nproc-per-node=3"],
    )
    proc = run(cmd, env=run_env(RUN_ID="ws3"), check=False)
    assert proc.returncode != 0
    assert "world size 2 but this run has 3 ranks" in proc.stdout + proc.stderr
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
    assert found is not None and found[0].name == "epoch_1.pt" and found[1]["step"] == 8
    assert "last.pt cannot be read" in caplog.text
    assert sorted(p.name for p in d.iterdir()) == ["epoch_1.pt", "last.pt"]  # nothing deleted
    with pytest.raises(checkpoint.ConfigError, match="last.pt cannot be read"):
        checkpoint.find_resume(str(d / "last.pt"), d)


def test_write_killed_before_rename_keeps_previous(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    checkpoint.save_atomic(_payload(1), path)
    script = (
        "import os, signal, sys, torch\n"
        "from pathlib import Path\n"
        "from ddp_template import checkpoint\n"
        "checkpoint.os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"checkpoint.save_atomic({{'format': 1, 'step': 2, 'w': torch.ones(10**6)}},"
        f" Path({str(path)!r}))\n"
    )
    proc = subprocess.run([PY, "-c", script], cwd=ROOT, capture_output=True)
    assert proc.returncode == -9
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
