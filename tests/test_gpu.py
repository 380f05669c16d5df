"""CUDA-only checks: torch's SyncBatchNorm over nccl (fp32 and autocast), fp16/bf16 training
steps without host syncs, bit-identical resume with deterministic=true, nccl and auto runs.

Skipped as a whole without CUDA; a test that needs more GPUs than the machine has (marker
``gpu(n)``) is skipped with the reason. Run them on a GPU machine with ``pytest -m gpu`` (or
``benchmarks/gpu_check.sh``). The SyncBN oracle is the one tests/test_syncbn.py uses on CPU:
a global batch split across ranks and trained with synchronised BN must give the statistics
and gradients of plain BN on the whole batch in one process. On one rank torch's SyncBN is
plain BN, so only the 2-rank case proves anything; it needs 2 GPUs.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA: torch.cuda.is_available() is False", allow_module_level=True)

import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port, run, run_env, step_trainer, summary, torchrun, train_cmd
from test_resume import BASE, assert_identical, final_model
from test_syncbn import (
    combined_grads,
    local_slice,
    make_batch,
    make_model,
    model_step,
)
from torch import nn

from ddp_template.amp import autocast, build_scaler, check_amp
from ddp_template.config.schema import AmpConfig, AmpMode, OptimConfig
from ddp_template.engine import _step
from ddp_template.errors import ConfigError
from ddp_template.models import convert_syncbn, small_cnn
from ddp_template.optim import build_optimizer
from ddp_template.sync_batchnorm import convert_sync_batchnorm

pytestmark = pytest.mark.gpu

TOL = {"rtol": 1e-4, "atol": 1e-5}
AMP_TOL = {"rtol": 2e-2, "atol": 2e-2}  # half-precision convolutions on 8 vs 1-7 samples
# Per-rank batch sizes of 2 ranks (they add up to GLOBAL_BATCH) and the loss reduction.
SYNC_CASES: dict[str, tuple[tuple[int, ...], str]] = {
    "even_mean": ((4, 4), "mean"),
    "uneven_5_3": ((5, 3), "sum"),
    "uneven_1_7": ((1, 7), "sum"),
    "empty_0_8": ((0, 8), "sum"),  # sampler=exact: a rank whose list has ended counts nothing
}


def native_bf16() -> bool:
    return torch.cuda.get_device_capability() >= (8, 0)


def half() -> str:
    """The autocast mode this GPU runs natively."""
    return "bf16" if native_bf16() else "fp16"


def exact_math() -> None:
    """No TF32: the comparison with plain BN is at fp32 tolerance."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True


def to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    return obj


def syncbn_worker(rank: int, world: int, port: int, out_dir: str, amp: str) -> None:
    """One rank: every case with synced BN; rank 0 also computes plain BN on the whole batch."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    exact_math()
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
        device_id=device,
    )
    try:
        x, y = (t.to(device) for t in make_batch())
        results: dict[str, Any] = {}
        for name, (sizes, loss) in SYNC_CASES.items():
            model = convert_sync_batchnorm(make_model(), device_type=device.type).to(device)
            xs, ys = local_slice(x, sizes, rank), local_slice(y, sizes, rank)
            with autocast(amp, device):
                results[name] = to_cpu(model_step(model, xs, ys, loss))
        results["synced_types"] = [
            type(m) is nn.SyncBatchNorm
            for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
        ]
        if rank == 0:
            with autocast(amp, device):
                results["reference"] = to_cpu(model_step(make_model().to(device), x, y, "sum"))
        dist.barrier()
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_syncbn(out_dir: Path, amp: str) -> list[dict[str, Any]]:
    world = 2
    mp.spawn(syncbn_worker, args=(world, free_port(), str(out_dir), amp), nprocs=world, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def assert_syncbn_matches_plain(per_rank: list[dict[str, Any]], tol: dict[str, float]) -> None:
    ref = per_rank[0]["reference"]
    for name, (_, loss) in SYNC_CASES.items():
        got = [r[name] for r in per_rank]
        for r in got:  # running stats come from the global batch: the same on every rank
            torch.testing.assert_close(r["bufs"], ref["bufs"], **tol)
        torch.testing.assert_close(combined_grads(got, loss), ref["grads"], **tol)
        out = torch.cat([r["out"] for r in got]).float()
        torch.testing.assert_close(out, ref["out"].float(), **tol)
        if loss == "sum":
            x_grad = torch.cat([r["x_grad"] for r in got])
            torch.testing.assert_close(x_grad, ref["x_grad"], **tol)


@pytest.mark.gpu(2)
@pytest.mark.parametrize("amp", ["off", "half"])
def test_torch_syncbn_over_nccl_matches_plain_bn(amp: str, tmp_path: Path) -> None:
    amp = half() if amp == "half" else amp
    per_rank = run_syncbn(tmp_path, amp)
    assert all(per_rank[0]["synced_types"])  # torch's own module, not the CPU fallback
    assert_syncbn_matches_plain(per_rank, TOL if amp == "off" else AMP_TOL)


def test_convert_syncbn_on_cuda_gives_torch_syncbatchnorm() -> None:
    device = torch.device("cuda")
    model = convert_syncbn(small_cnn(num_classes=10, in_channels=3, image_size=32), device)
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert bns and all(type(m) is nn.SyncBatchNorm for m in bns)
    with torch.no_grad():  # eval mode runs no collective: no process group needed
        out = model.to(device).eval()(torch.randn(4, 3, 32, 32, device=device))
    assert out.shape == (4, 10) and torch.isfinite(out).all()


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_amp_trains_a_few_steps_on_cuda(mode: str) -> None:
    if mode == "bf16" and not native_bf16():
        pytest.skip("this GPU has no native bf16 (compute capability < 8.0)")
    device = torch.device("cuda")
    check_amp(mode, device)
    torch.manual_seed(0)
    model = small_cnn(num_classes=4, in_channels=3, image_size=16).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cfg = AmpConfig(mode=AmpMode(mode), init_scale=2.0**16, growth_interval=2000)
    scaler = build_scaler(cfg, device)
    assert scaler.is_enabled() is (mode == "fp16")
    tr = step_trainer(
        model=model, optimizer=opt, scaler=scaler, device=device, amp_mode=mode, grad_clip=5.0
    )
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(32, 3, 16, 16, generator=g).to(device)
    y = (x.mean(dim=(1, 2, 3)) > 0).long() + 2 * (x[:, 0].mean(dim=(1, 2)) > 0).long()
    losses = [float(_step(tr, x, y, want_norm=True)[0]) for _ in range(30)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0]
    if mode == "fp16":
        assert scaler.get_scale() > 0 and "scale" in scaler.state_dict()


def test_torchrun_one_rank_nccl_syncbn_run_finishes(tmp_path: Path) -> None:
    cmd = train_cmd(
        tmp_path, "backend=nccl", "syncbn=on", "epochs=1", "logger=none", launcher=torchrun(1)
    )
    run(cmd, timeout=240)
    (run_dir,) = (tmp_path / "outputs").iterdir()
    result = summary(run_dir)
    assert result["world_size"] == 1 and result["eval_accuracy"] > 0.5, result


def test_bf16_on_this_gpu_is_accepted_only_with_native_support() -> None:
    device = torch.device("cuda", 0)
    if native_bf16():
        check_amp("bf16", device)
    else:  # V100, T4: torch.cuda.is_bf16_supported() may say yes (emulation); the check says no
        with pytest.raises(ConfigError, match="needs a GPU with native bf16"):
            check_amp("bf16", device)


def fp16_trainer(fused: bool):
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = small_cnn(num_classes=4, in_channels=3, image_size=16).to(device)
    optimizer = build_optimizer(OptimConfig(fused=None if fused else False), model)
    assert bool(optimizer.defaults["fused"]) is fused  # unset: fused on CUDA
    scaler = build_scaler(AmpConfig(mode=AmpMode.fp16), device)
    return step_trainer(
        model=model, optimizer=optimizer, scaler=scaler, device=device, amp_mode="fp16",
        grad_clip=None,
    )  # fmt: skip


@pytest.mark.parametrize("fused", [True, False])
def test_fp16_steps_wait_for_the_gpu_only_without_a_fused_optimizer(fused: bool) -> None:
    tr = fp16_trainer(fused)
    x = torch.randn(16, 3, 16, 16, device="cuda")
    y = torch.randint(0, 4, (16,), device="cuda")
    _step(tr, x, y, want_norm=False)  # the first step allocates state: not what is measured
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        if fused:
            for _ in range(3):
                _step(tr, x, y, want_norm=False)
        else:  # GradScaler.step reads found_inf with .item()
            with pytest.raises(RuntimeError, match="synchroniz"):
                _step(tr, x, y, want_norm=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)


RESUME = [
    *(o for o in BASE if not o.startswith("data.size=")),
    "numerics.deterministic=true",
    "logger=none",
]


@pytest.mark.parametrize(
    "world,amp",
    [
        pytest.param(1, "fp16", marks=pytest.mark.gpu(1)),
        pytest.param(2, "off", marks=pytest.mark.gpu(2)),
    ],
)
def test_crash_then_resume_on_cuda_is_bit_identical_with_deterministic(
    tmp_path: Path, world: int, amp: str
) -> None:
    """As tests/test_resume.py on CPU: 8 steps per epoch, a crash at step 11, resume, and every
    tensor of the final model equal to an uninterrupted run's."""
    overrides = [
        *RESUME, "backend=nccl", f"dist.nproc={world}", f"data.size={32 * world}", f"amp={amp}",
    ]  # fmt: skip

    def launch(run_id: str, *extra: str, check: bool = True):
        cmd = train_cmd(tmp_path, *overrides, *extra)
        return run(cmd, env=run_env(RUN_ID=run_id), check=check, timeout=300)

    launch("ref")
    proc = launch("crash", "fault.crash_at_step=11", f"fault.rank={world - 1}", check=False)
    assert proc.returncode != 0
    assert "resumed from" in launch("crash").stdout
    assert_identical(final_model(tmp_path, "ref"), final_model(tmp_path, "crash"))


def test_two_ranks_with_backend_auto_run_on_what_this_node_can_host(tmp_path: Path) -> None:
    """`make train` on this machine: nccl with 2+ GPUs, gloo (and the reason) with one."""
    gpus = torch.cuda.device_count()
    cmd = train_cmd(
        tmp_path, "backend=auto", "dist.nproc=2", "epochs=1", "max_steps_per_epoch=4",
        "logger=none",
    )  # fmt: skip
    run(cmd, timeout=240)
    (run_dir,) = (tmp_path / "outputs").iterdir()
    log = (run_dir / "train.log").read_text()
    if gpus >= 2:
        assert "backend nccl, device cuda:0 (auto: " in log, log
    else:
        assert "backend gloo, device cpu (auto: 1 visible GPU for 2 local ranks" in log, log
    assert summary(run_dir)["world_size"] == 2
