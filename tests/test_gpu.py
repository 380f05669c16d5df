"""CUDA-only checks: torch's SyncBatchNorm over nccl, fp16/bf16 training steps, a torchrun run.

Skipped as a whole without CUDA; run them on a GPU machine with ``pytest -m gpu`` (or
``benchmarks/gpu_check.sh``). The SyncBN oracle is the one tests/test_syncbn.py uses on CPU:
a global batch split across ranks and trained with synchronised BN must give the statistics
and gradients of plain BN on the whole batch in one process.
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
from helpers import free_port, run, step_trainer, summary, torchrun, train_cmd
from test_syncbn import (
    GLOBAL_BATCH,
    combined_grads,
    local_slice,
    make_batch,
    make_model,
    model_step,
)
from torch import nn

from ddp_template.amp import build_scaler, check_amp
from ddp_template.config import AmpConfig, AmpMode
from ddp_template.engine import _step
from ddp_template.models import convert_syncbn, small_cnn
from ddp_template.sync_batchnorm import convert_sync_batchnorm

pytestmark = pytest.mark.gpu

TOL = {"rtol": 1e-4, "atol": 1e-5}
# Per-rank batch sizes (they add up to GLOBAL_BATCH) and the loss reduction, per world size.
# ``combined_grads`` averages ``mean`` losses over test_syncbn's 2 ranks, so 1 rank uses ``sum``.
SYNC_CASES: dict[int, dict[str, tuple[tuple[int, ...], str]]] = {
    1: {"whole": ((GLOBAL_BATCH,), "sum")},
    2: {
        "even_mean": ((4, 4), "mean"),
        "uneven_5_3": ((5, 3), "sum"),
        "uneven_1_7": ((1, 7), "sum"),
    },
}


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


def syncbn_worker(rank: int, world: int, port: int, out_dir: str, backend: str) -> None:
    """One rank: every case with synced BN; rank 0 also computes plain BN on the whole batch."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    exact_math()
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        x, y = (t.to(device) for t in make_batch())
        results: dict[str, Any] = {}
        for name, (sizes, loss) in SYNC_CASES[world].items():
            model = convert_sync_batchnorm(make_model(), device_type=device.type).to(device)
            xs, ys = local_slice(x, sizes, rank), local_slice(y, sizes, rank)
            results[name] = to_cpu(model_step(model, xs, ys, loss))
        results["synced_types"] = [
            type(m) is nn.SyncBatchNorm
            for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
        ]
        if rank == 0:
            results["reference"] = to_cpu(model_step(make_model().to(device), x, y, "sum"))
        dist.barrier()
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_syncbn(world: int, out_dir: Path, backend: str = "nccl") -> list[dict[str, Any]]:
    mp.spawn(
        syncbn_worker, args=(world, free_port(), str(out_dir), backend), nprocs=world, join=True
    )
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def assert_syncbn_matches_plain(per_rank: list[dict[str, Any]], world: int) -> None:
    ref = per_rank[0]["reference"]
    for name, (_, loss) in SYNC_CASES[world].items():
        got = [r[name] for r in per_rank]
        for r in got:  # running stats come from the global batch: the same on every rank
            torch.testing.assert_close(r["bufs"], ref["bufs"], **TOL)
        torch.testing.assert_close(combined_grads(got, loss), ref["grads"], **TOL)
        torch.testing.assert_close(torch.cat([r["out"] for r in got]), ref["out"], **TOL)
        if loss == "sum":
            torch.testing.assert_close(torch.cat([r["x_grad"] for r in got]), ref["x_grad"], **TOL)


@pytest.mark.parametrize("world", [1, 2])
def test_torch_syncbn_over_nccl_matches_plain_bn(world: int, tmp_path: Path) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    per_rank = run_syncbn(world, tmp_path)
    assert all(per_rank[0]["synced_types"])  # torch's own module, not the CPU fallback
    assert_syncbn_matches_plain(per_rank, world)


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
    if mode == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
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
