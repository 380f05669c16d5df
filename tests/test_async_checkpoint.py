"""checkpoint.async_save: the state of step S written while training goes on, nothing later
leaking in, published atomically, and a kill inside the write costs only that checkpoint.

- in one process: ``save`` returns while the writer is held inside the write (last.pt still the
  previous checkpoint), the model changes after it, and the file published holds step S's state;
- the default job on 2 ranks: rank 0 SIGKILLed inside the background write of step 15's
  checkpoint (``fault.phase=write``: its temporary file written, not published; decided by the
  write's state, not by time); the run resumes from the previous complete checkpoint (step 12,
  epoch 0's end) and ends bit-identical to the uninterrupted run with async off; the interrupted
  write's ``last.pt.tmp`` is never read;
- experiment=lm_bytes (small; 2 micro-batches a step, the EMA on) with async on and off: the
  same final weights, optimizer state and average;
- the deferred copy of the optimizer's tensors (weights, state): held until step S+1's forward
  and backward have changed the buffers, the optimizer step waits for it, and the file holds
  step S's weights, buffers and optimizer state exactly; ``close`` (the run's last step, no
  optimizer step after it) and an exception before the next optimizer step finish it.
(Under FSDP2 with DCP slices: tests/optional/fsdp2/test_fsdp2_runs.py.)
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from helpers import assert_killed_rank_reported, cpu_rank, run, run_env, train_cmd

from ddp_template.checkpoint import Checkpointer, load, wait_in_flight
from ddp_template.config.schema import CheckpointConfig


class Held:
    """A plain state_dict part."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict:
        return self.module.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state)


def test_save_returns_during_the_write_and_nothing_later_leaks_in(tmp_path: Path) -> None:
    model = torch.nn.Linear(64, 64)
    inside, release = threading.Event(), threading.Event()
    held = {"on": False}

    def hold(payload: dict) -> None:
        if held["on"]:
            inside.set()
            assert release.wait(30)

    ckpt = Checkpointer(
        directory=tmp_path,
        cfg=CheckpointConfig(async_save=True),
        parts={"model": Held(model)},
        config_yaml="",
        info=cpu_rank(),
        before_publish=hold,
    )
    ckpt.save()  # step "1"
    ckpt.wait()  # published
    first = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    second = {k: v.clone() for k, v in model.state_dict().items()}
    held["on"] = True
    ckpt.save()  # waits for the first, stages the second, returns with the writer held
    assert inside.wait(30)
    assert (tmp_path / "last.pt.tmp").is_file()  # written, not published
    assert torch.equal(load(tmp_path / "last.pt")["model"]["weight"], first["weight"])
    with torch.no_grad():  # the next step, while the write runs
        model.weight.mul_(3.0)
    release.set()
    ckpt.close()
    saved = load(tmp_path / "last.pt")["model"]
    assert all(torch.equal(saved[k], second[k]) for k in second)
    assert not (tmp_path / "last.pt.tmp").exists()
    wait_in_flight()


BASE = ["dist.nproc=2", "epochs=2", "checkpoint.every_steps=5", "data.val_fraction=0.5"]
# digits, half of the training split validated: 719 / 2 ranks / batch 32 = 12 steps an epoch.
KILL = [
    "fault.crash_at_step=15",
    "fault.rank=0",
    "fault.signal=SIGKILL",
    "fault.phase=write",
]


def final(run_dir: Path) -> dict[str, torch.Tensor]:
    payload = load(run_dir / "checkpoints/last.pt")
    return {**payload["model"], **{f"opt{k}": v for k, v in flat(payload["optimizer"])}}


def flat(state: dict, prefix: str = ""):
    for k, v in state.items():
        if isinstance(v, dict):
            yield from flat(v, f"{prefix}{k}.")
        elif isinstance(v, torch.Tensor):
            yield f"{prefix}{k}", v


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_a_kill_inside_the_background_write_resumes_from_the_previous_one(tmp_path: Path) -> None:
    def launch(run_id: str, *overrides: str, check: bool = True):
        cmd = train_cmd(tmp_path, *BASE, *overrides)
        return run(cmd, env=run_env(RUN_ID=run_id), check=check)

    launch("off")
    proc = launch("cut", "checkpoint.async_save=true", *KILL, check=False)
    assert_killed_rank_reported(proc, rank=0, sig="SIGKILL")
    ckpts = tmp_path / "outputs/cut/checkpoints"
    assert (ckpts / "last.pt.tmp").is_file()  # the write the kill landed in
    assert load(ckpts / "last.pt")["progress"]["step"] == 12  # the previous one (epoch 0 end)
    proc = launch("cut", "checkpoint.async_save=true")
    assert "resumed from" in proc.stdout + proc.stderr
    assert "at epoch 1, step 12" in (tmp_path / "outputs/cut/train.log").read_text()
    assert "cannot be read" not in proc.stdout + proc.stderr
    equal(final(tmp_path / "outputs/off"), final(tmp_path / "outputs/cut"))


LM = [
    "experiment=lm_bytes",
    "logger=none",
    "data.size=60000",
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "data.block_size=32",
    "loader.batch_size=8",
    "epochs=1",
    "max_steps_per_epoch=12",
    "checkpoint.every_steps=4",
    "optim.warmup_steps=2",
]


@pytest.mark.needs("tokens", "gpt")  # experiment=lm_bytes
def test_async_on_and_off_end_on_the_same_weights_on_lm_bytes(tmp_path: Path) -> None:
    """With 2 micro-batches a step (the weights' copy beside both forwards and backwards) and
    the EMA switch (its average copied at the step boundary): the same weights, optimizer state
    and average, whether the checkpoints are taken asynchronously or not."""
    for run_id, flag in (("off", "false"), ("on", "true")):
        cmd = train_cmd(
            tmp_path,
            *LM,
            "optim.accumulate=2",
            "ema.decay=0.9",
            f"checkpoint.async_save={flag}",
            "paths.data_root=" + str(tmp_path),
        )
        run(cmd, env=run_env(RUN_ID=run_id))
    equal(final(tmp_path / "outputs/off"), final(tmp_path / "outputs/on"))
    averages = [load(tmp_path / f"outputs/{r}/checkpoints/last.pt")["ema"] for r in ("off", "on")]
    equal(*(dict(flat(a["model"])) for a in averages))


class Net(torch.nn.Module):
    """Weights the optimizer changes, buffers the forward changes (BatchNorm), a tied weight."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.norm = torch.nn.BatchNorm1d(32)
        self.out = torch.nn.Linear(32, 32)
        self.tied = self.out  # the same parameters under two names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tied(self.norm(self.inp(x)).relu())


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    return state | {f"opt{k}": v.clone() for k, v in flat(opt.state_dict()["state"])}


def saved(path: Path) -> dict[str, torch.Tensor]:
    payload = load(path)
    state = {f"model.{k}": v for k, v in payload["model"].items()}
    return state | {f"opt{k}": v for k, v in flat(payload["optimizer"]["state"])}


def train_step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


def test_the_deferred_copy_holds_step_s_while_step_s1_runs_and_its_optimizer_step_waits(
    tmp_path: Path, monkeypatch
) -> None:
    """The optimizer's tensors are copied by the writer thread after ``save`` returns: held
    there until step S+1's forward and backward have run (the BatchNorm buffers moved, the
    gradients made), its optimizer step waits for the copy, and the checkpoint holds step S's
    weights, buffers and optimizer state exactly; a save at the run's last step, with no next
    optimizer step, is finished by ``close``."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    inside, release = threading.Event(), threading.Event()
    copy_later = Checkpointer._copy_later

    def held_copy(self, later, staged):
        stage = copy_later(self, later, staged)
        assert later  # the weights and the optimizer's state are deferred

        def held() -> None:
            inside.set()
            assert release.wait(30)
            stage()

        return held

    monkeypatch.setattr(Checkpointer, "_copy_later", held_copy)
    ckpt = Checkpointer(
        directory=tmp_path,
        cfg=CheckpointConfig(async_save=True),
        parts={"model": Held(model), "optimizer": opt},
        config_yaml="",
        info=cpu_rank(),
    )
    with ckpt:
        for _ in range(2):  # step S-1, step S (the optimizer's state exists)
            train_step(model, x)
            opt.step()
            opt.zero_grad()
        step_s = snapshot(model, opt)
        ckpt.save()  # returns with the copy held
        assert inside.wait(30)
        train_step(model, x)  # step S+1's forward and backward, beside the held copy
        assert not torch.equal(model.norm.running_mean, step_s["model.norm.running_mean"])
        stepped = threading.Thread(target=opt.step)
        stepped.start()
        stepped.join(0.5)
        assert stepped.is_alive()  # the optimizer step waits for the copy
        assert torch.equal(model.inp.weight, step_s["model.inp.weight"])
        release.set()
        stepped.join(30)
        assert not stepped.is_alive()
        assert not torch.equal(model.inp.weight, step_s["model.inp.weight"])
        opt.zero_grad()
    equal(saved(tmp_path / "last.pt"), step_s)
    # the last step's save: no optimizer step follows, close finishes the copy and the write
    inside.clear()
    ckpt = Checkpointer(
        directory=tmp_path,
        cfg=CheckpointConfig(async_save=True),
        parts={"model": Held(model), "optimizer": opt},
        config_yaml="",
        info=cpu_rank(),
    )
    last = snapshot(model, opt)
    ckpt.save()
    threading.Timer(0.3, release.set).start()
    ckpt.close()
    equal(saved(tmp_path / "last.pt"), last)
    assert not opt._optimizer_step_pre_hooks  # close removed the checkpointers' hooks


def test_an_exception_before_the_next_optimizer_step_still_publishes_step_s(
    tmp_path: Path,
) -> None:
    """A crash in step S+1's forward (before its optimizer step): the context's close finishes
    the deferred copy and the write of step S's checkpoint."""
    torch.manual_seed(1)
    model, x = Net(), torch.randn(8, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_step(model, x)
    opt.step()
    step_s = snapshot(model, opt)
    try:
        with Checkpointer(
            directory=tmp_path,
            cfg=CheckpointConfig(async_save=True),
            parts={"model": Held(model), "optimizer": opt},
            config_yaml="",
            info=cpu_rank(),
        ) as ckpt:
            ckpt.save()
            raise RuntimeError("step S+1 failed")
    except RuntimeError:
        pass
    equal(saved(tmp_path / "last.pt"), step_s)
    wait_in_flight()
