"""Mixed precision on CPU: bf16/fp16 runs learn, the fp16 GradScaler scales, and survives resume.

The end-to-end tests run ``train.py`` for real (2 gloo ranks, digits, W&B off) and read what the
run wrote: ``summary.json``, ``rank<r>/metrics.jsonl`` and ``checkpoints/last.pt``. The
GradScaler's rules (halve and skip on inf/nan, double after ``growth_interval`` clean steps) are
checked on a tiny model, and torch's own GradScaler replaying the run's clean steps is the oracle
for the scale a checkpoint must hold.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import jsonl, run, run_dirs, run_env, step_trainer, summary, train_cmd
from omegaconf import OmegaConf
from torch import nn

from ddp_template.amp import build_scaler, check_amp
from ddp_template.config.schema import AmpConfig, AmpMode
from ddp_template.engine import _step
from ddp_template.errors import ConfigError

CPU = torch.device("cpu")
# Small scaler settings so a short run shows growth: 46 clean steps -> 1 * 2**4 = 16.
FP16_SCALER = {"init_scale": 1.0, "growth_interval": 10}
FP16_OVERRIDES = (
    "amp=fp16",
    f"amp.init_scale={FP16_SCALER['init_scale']}",
    f"amp.growth_interval={FP16_SCALER['growth_interval']}",
    "optim.grad_clip=1.0",
)
DIGITS_STEPS_PER_EPOCH = 23  # ceil(1438 / 2 ranks / batch 32)


# ---------------------------------------------------------------- end-to-end helpers
def train(out: Path, run_id: str, *overrides: str) -> Path:
    """One 2-rank CPU run in ``out/outputs/<run_id>``; a second call with the same id resumes it.

    ``backend=gloo`` pins the CPU path: ``auto`` would pick nccl on a GPU machine, and a machine
    with one GPU cannot hold two nccl ranks.
    """
    cmd = train_cmd(out, "backend=gloo", "dist.nproc=2", "logger=none", *overrides)
    run(cmd, env=run_env(RUN_ID=run_id))
    return out / "outputs" / run_id


def snapshot(run_dir: Path) -> dict[str, Any]:
    """What a run left behind, read now: a later resume in the same dir overwrites it."""
    return {
        "summary": summary(run_dir),
        "metrics": [jsonl(run_dir / f"rank{r}" / "metrics.jsonl") for r in range(2)],
        "checkpoint": torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True),
        "log": (run_dir / "train.log").read_text(),
        "config": OmegaConf.load(run_dir / ".hydra" / "config.yaml"),
    }


def clean_scaler_state(steps: int, init_scale: float, growth_interval: int) -> dict[str, Any]:
    """The state torch's GradScaler reaches after ``steps`` overflow-free steps."""
    param = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([param], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    for _ in range(steps):
        scaler.scale(param.sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler.state_dict()


def assert_learned(snap: dict[str, Any], min_accuracy: float = 0.8) -> None:
    assert snap["summary"]["eval_accuracy"] >= min_accuracy, snap["summary"]
    losses = [row["train/loss"] for row in snap["metrics"][0] if "train/loss" in row]
    assert len(losses) >= 4 and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0]
    for rows in snap["metrics"]:  # every rank's epoch loss, not only rank 0's intervals
        local = [row["train/loss_local"] for row in rows if "train/loss_local" in row]
        assert local and all(math.isfinite(x) for x in local), local


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """bf16 with SyncBatchNorm: one run for both the bf16 and the SyncBN+bf16 claims (bf16
    without SyncBN runs in test_resume.py, bit-identical across a restart)."""
    out = tmp_path_factory.mktemp("bf16")
    return snapshot(train(out, "bf16", "syncbn=on", "amp=bf16", "epochs=3"))


@pytest.fixture(scope="module")
def fp16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fp16")


@pytest.fixture(scope="module")
def fp16_run(fp16_dir: Path) -> dict[str, Any]:
    return snapshot(train(fp16_dir, "fp16", *FP16_OVERRIDES, "epochs=2"))


@pytest.fixture(scope="module")
def fp16_resumed(fp16_dir: Path, fp16_run: dict[str, Any]) -> dict[str, Any]:
    """The fp16 run continued in the same run dir (``resume=auto``) for one more epoch."""
    return snapshot(train(fp16_dir, "fp16", *FP16_OVERRIDES, "epochs=3", "resume=auto"))


# ---------------------------------------------------------------- bf16 / fp16 runs learn
def test_bf16_run_learns_with_finite_loss(bf16_run: dict[str, Any]) -> None:
    assert_learned(bf16_run)
    assert bf16_run["checkpoint"]["scaler"] == {}  # bf16 needs no loss scaling: scaler is off


@pytest.mark.slow
def test_fp16_run_learns_with_finite_loss(fp16_run: dict[str, Any]) -> None:
    assert_learned(fp16_run)


@pytest.mark.slow
def test_fp16_checkpoint_holds_the_grown_scale(fp16_run: dict[str, Any]) -> None:
    ckpt = fp16_run["checkpoint"]
    steps = 2 * DIGITS_STEPS_PER_EPOCH
    assert ckpt["progress"]["step"] == fp16_run["summary"]["steps"] == steps
    scale = ckpt["scaler"]["scale"]
    assert isinstance(scale, float) and scale > FP16_SCALER["init_scale"]
    assert ckpt["scaler"] == clean_scaler_state(steps, **FP16_SCALER)  # scale 16, tracker 6


@pytest.mark.slow
def test_fp16_resume_continues_the_scaler(fp16_resumed: dict[str, Any]) -> None:
    assert "resumed from" in fp16_resumed["log"]
    steps = 3 * DIGITS_STEPS_PER_EPOCH
    assert fp16_resumed["summary"]["steps"] == steps
    # Restored: the scale keeps growing from 16 (64 after 69 steps, tracker 9). A fresh scaler
    # would have restarted at init_scale and reached only 4 in the resumed epoch's 23 steps.
    expected = clean_scaler_state(steps, **FP16_SCALER)
    assert fp16_resumed["checkpoint"]["scaler"] == expected
    fresh = clean_scaler_state(DIGITS_STEPS_PER_EPOCH, **FP16_SCALER)
    assert expected["scale"] != fresh["scale"]
    assert fp16_resumed["summary"]["eval_accuracy"] >= 0.8


# ---------------------------------------------------------------- SyncBN + bf16 on CPU
@pytest.mark.slow
def test_syncbn_bf16_matches_plain_fp32_accuracy(
    bf16_run: dict[str, Any], digits_fp32_run: Path
) -> None:
    assert bf16_run["config"].syncbn.enabled and bf16_run["config"].amp.mode == "bf16"
    synced = bf16_run["summary"]
    (plain_dir,) = run_dirs(digits_fp32_run)  # conftest.py: the same 3 epochs, fp32, no SyncBN
    plain = summary(plain_dir)
    plain_cfg = OmegaConf.load(plain_dir / ".hydra" / "config.yaml")
    assert not plain_cfg.syncbn.enabled and plain_cfg.amp.mode == "off" and plain_cfg.epochs == 3
    assert synced["eval_accuracy"] >= 0.9 and plain["eval_accuracy"] >= 0.9, (synced, plain)
    assert abs(synced["eval_accuracy"] - plain["eval_accuracy"]) <= 0.05


# ---------------------------------------------------------------- GradScaler rules
def tiny_setup(scale: float = 1024.0, growth_interval: int = 3):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cfg = AmpConfig(mode=AmpMode.fp16, init_scale=scale, growth_interval=growth_interval)
    return model, opt, build_scaler(cfg, CPU), torch.randn(8, 4)


def scaler_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    x: torch.Tensor,
    factor: float = 1.0,
) -> None:
    loss = model(x).square().mean() * factor
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("mode,enabled", [("fp16", True), ("bf16", False), ("off", False)])
def test_build_scaler_is_active_only_for_fp16(mode: str, enabled: bool) -> None:
    cfg = AmpConfig(mode=AmpMode(mode), init_scale=8.0, growth_interval=5)
    scaler = build_scaler(cfg, CPU)
    assert scaler.is_enabled() is enabled
    if enabled:
        assert scaler.get_scale() == 8.0 and scaler.get_growth_interval() == 5


def test_overflow_halves_the_scale_and_skips_the_step() -> None:
    model, opt, scaler, x = tiny_setup()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scaler_step(model, opt, scaler, x, factor=1e38)  # finite loss, inf once scaled by 1024
    assert scaler.get_scale() == 512.0
    assert scaler.state_dict()["_growth_tracker"] == 0
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)
    assert not opt.state  # the optimizer never ran: no momentum buffers either


def test_growth_interval_clean_steps_double_the_scale() -> None:
    model, opt, scaler, x = tiny_setup(growth_interval=3)
    scaler_step(model, opt, scaler, x, factor=float("inf"))  # resets the tracker: 512
    weight = model.weight.detach().clone()
    for expected in (512.0, 512.0, 1024.0, 1024.0, 1024.0, 2048.0):
        scaler_step(model, opt, scaler, x)
        assert scaler.get_scale() == expected
    assert not torch.equal(model.weight, weight)  # clean steps do update the weights


def test_gradients_are_unscaled_before_clipping() -> None:
    """``_step`` with a scale of 2**10 must clip and report the TRUE gradient norm."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    reference = [p.detach().clone() for p in model.parameters()]
    nn.functional.cross_entropy(model(x), y).backward()
    true_norm = float(nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    model.zero_grad(set_to_none=True)

    clip = true_norm / 4  # clipping must bite
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    cfg = AmpConfig(mode=AmpMode.fp16, init_scale=2.0**10, growth_interval=2000)
    tr = step_trainer(
        model=model,
        optimizer=opt,
        scaler=build_scaler(cfg, CPU),
        device=CPU,
        amp_mode="fp16",
        grad_clip=clip,
    )
    _, norm = _step(tr, x, y, want_norm=True)
    # fp16 autocast changes the forward slightly; a scaled norm would be 1024x off.
    assert float(norm) == pytest.approx(true_norm, rel=0.02)
    update = torch.cat(
        [(p.detach() - r).flatten() for p, r in zip(model.parameters(), reference, strict=True)]
    )
    assert float(update.norm()) == pytest.approx(clip, rel=1e-3)  # lr 1: step = clipped grads


# ---------------------------------------------------------------- unsupported modes
@pytest.mark.parametrize("mode", ["off", "bf16", "fp16"])
def test_check_amp_accepts_every_mode_on_cpu(mode: str) -> None:
    check_amp(mode, CPU)


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_check_amp_rejects_a_device_that_cannot_autocast(mode: str) -> None:
    # torch.autocast refuses device_type 'meta' for real: no monkeypatching needed.
    with pytest.raises(ConfigError) as err:
        check_amp(mode, torch.device("meta"))
    message = str(err.value)
    assert f"amp.mode={mode}" in message and "meta" in message and "amp=off" in message
    assert "unsupported autocast device_type" in message  # torch's reason is passed on
    assert err.value.__cause__ is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA autocast works on this machine")
@pytest.mark.filterwarnings("ignore:.*CUDA is not available.*:UserWarning")
def test_check_amp_rejects_cuda_without_a_gpu() -> None:
    with pytest.raises(ConfigError, match=r"amp.mode=fp16 is not supported on cuda"):
        check_amp("fp16", torch.device("cuda"))


def test_unknown_amp_mode_fails_at_startup(tmp_path: Path) -> None:
    proc = run(train_cmd(tmp_path, "amp.mode=fp8", "logger=none"), check=False, timeout=120)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "amp.mode" in out and "fp8" in out and "off, bf16, fp16" in out
    assert not (tmp_path / "outputs").exists()  # rejected before any run dir
