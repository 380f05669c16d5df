"""CpuSyncBatchNorm against one process with plain BN on the whole batch.

One real 2-process gloo job (spawned once per module, no mocks) runs every distributed scenario
and saves each rank's results to tmp files; the tests compare them with single-process
references computed here. The oracle: a global batch split across ranks, trained with synced
BN, must give the statistics and gradients of plain BN on the unsplit batch.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers import join_gloo
from torch import Tensor, nn

from ddp_template.sync_batchnorm import CpuSyncBatchNorm, convert_sync_batchnorm

WORLD = 2
GLOBAL_BATCH = 8
TOL = {"rtol": 1e-4, "atol": 1e-5}

# Whole-model training step: per-rank batch sizes, loss reduction, whether BN is converted.
MODEL_CASES: dict[str, dict[str, Any]] = {
    "even_mean": {"sizes": (4, 4), "loss": "mean", "sync": True},
    "uneven_5_3": {"sizes": (5, 3), "loss": "sum", "sync": True},
    "uneven_1_7": {"sizes": (1, 7), "loss": "sum", "sync": True},
    "empty_0_8": {"sizes": (0, 8), "loss": "sum", "sync": True},
    "plain_even": {"sizes": (4, 4), "loss": "mean", "sync": False},
    "plain_uneven": {"sizes": (5, 3), "loss": "sum", "sync": False},
}
# Single BN layer: class, global input shape, per-rank sizes, constructor kwargs.
LAYER_CASES: dict[str, dict[str, Any]] = {
    "bn1d_nc": {"cls": nn.BatchNorm1d, "shape": (8, 3), "sizes": (5, 3), "kw": {}},
    "bn1d_ncl": {
        "cls": nn.BatchNorm1d,
        "shape": (8, 3, 5),
        "sizes": (6, 2),
        "kw": {"momentum": None},
    },
    "bn3d": {
        "cls": nn.BatchNorm3d,
        "shape": (8, 3, 2, 3, 2),
        "sizes": (3, 5),
        "kw": {"momentum": 0.3},
    },
    "bn2d_no_affine": {
        "cls": nn.BatchNorm2d,
        "shape": (8, 3, 4, 4),
        "sizes": (1, 7),
        "kw": {"affine": False},
    },
    "bn2d_untracked": {
        "cls": nn.BatchNorm2d,
        "shape": (8, 3, 4, 4),
        "sizes": (2, 6),
        "kw": {"track_running_stats": False},
    },
}


# ---------------------------------------------------------------- deterministic building blocks
def make_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 5),
    )
    nn.init.uniform_(model[1].weight, 0.5, 1.5)
    nn.init.normal_(model[1].bias)
    return model


def make_batch(n: int = GLOBAL_BATCH, seed: int = 1) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 6, 6, generator=g) * 2 + 1, torch.randint(0, 5, (n,), generator=g)


def make_layer(case: dict[str, Any]) -> nn.Module:
    layer = case["cls"](case["shape"][1], **case["kw"])
    if layer.affine:
        with torch.no_grad():
            layer.weight.copy_(torch.linspace(0.5, 1.5, layer.num_features))
            layer.bias.copy_(torch.linspace(-1.0, 1.0, layer.num_features))
    return layer


def layer_data(shape: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor]:
    """Two input batches (two training steps) and a fixed upstream gradient for the first."""
    g = torch.Generator().manual_seed(2)
    return (
        torch.randn(shape, generator=g) * 3 - 2,
        torch.randn(shape, generator=g) + 1,
        torch.randn(shape, generator=g),
    )


def local_slice(t: Tensor, sizes: tuple[int, ...], rank: int) -> Tensor:
    start = sum(sizes[:rank])
    return t[start : start + sizes[rank]]


def grads(model: nn.Module) -> dict[str, Tensor]:
    return {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for n, p in model.named_parameters()
    }


def buffers(model: nn.Module) -> dict[str, Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def model_step(model: nn.Module, x: Tensor, y: Tensor, loss: str) -> dict[str, Any]:
    """One forward/backward. ``sum`` divides by the GLOBAL batch so per-rank grads just add up."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    if loss == "mean":
        value = F.cross_entropy(out, y)
    else:
        value = F.cross_entropy(out, y, reduction="sum") / GLOBAL_BATCH
    value.backward()
    return {"out": out.detach(), "x_grad": x.grad, "grads": grads(model), "bufs": buffers(model)}


def layer_steps(layer: nn.Module, x1: Tensor, x2: Tensor, dy: Tensor) -> dict[str, Any]:
    """Forward + backward on x1 with upstream grad dy, then a second forward (running stats)."""
    x1 = x1.clone().requires_grad_(True)
    out = layer(x1)
    out.backward(dy)
    layer(x2)
    return {"out": out.detach(), "x_grad": x1.grad, "grads": grads(layer), "bufs": buffers(layer)}


# ---------------------------------------------------------------- the 2-process job
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_model_cases(rank: int) -> dict[str, Any]:
    results = {}
    x, y = make_batch()
    for name, case in MODEL_CASES.items():
        model = make_model()
        if case["sync"]:
            model = convert_sync_batchnorm(model)
        sizes = case["sizes"]
        results[name] = model_step(
            model, local_slice(x, sizes, rank), local_slice(y, sizes, rank), case["loss"]
        )
        results[name]["state"] = model.state_dict()
    return results


def run_layer_cases(rank: int) -> dict[str, Any]:
    results = {}
    for name, case in LAYER_CASES.items():
        layer = convert_sync_batchnorm(make_layer(case))
        assert isinstance(layer, CpuSyncBatchNorm)
        x1, x2, dy = (local_slice(t, case["sizes"], rank) for t in layer_data(case["shape"]))
        results[name] = layer_steps(layer, x1, x2, dy)
    return results


def run_eval_on_rank0_only(rank: int, state: dict[str, Tensor], flag: Path) -> dict[str, Any]:
    """Rank 0 evaluates while rank 1 sits outside any collective: a collective would hang."""
    if rank != 0:
        deadline = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"rank0_finished": flag.exists()}
    model = convert_sync_batchnorm(make_model())
    model.load_state_dict(state)
    model.eval()
    start = time.monotonic()
    try:
        with torch.no_grad():
            out = model(make_batch(3, seed=5)[0])
    finally:
        flag.touch()
    return {"out": out, "seconds": time.monotonic() - start}


def run_singleton_group(rank: int) -> dict[str, Any]:
    """A process group of one rank: CpuSyncBatchNorm must take plain BN's path bit for bit."""
    groups = [dist.new_group([r]) for r in range(WORLD)]  # every rank creates every group
    plain = make_layer(LAYER_CASES["bn3d"])
    synced = convert_sync_batchnorm(make_layer(LAYER_CASES["bn3d"]), process_group=groups[rank])
    x1, x2, dy = layer_data((4, 3, 2, 3, 2))
    return {"plain": layer_steps(plain, x1, x2, dy), "synced": layer_steps(synced, x1, x2, dy)}


def run_bf16(rank: int) -> dict[str, Any]:
    """bf16 autocast forward/backward vs the same synced model in fp32."""
    x, y = (local_slice(t, (5, 3), rank) for t in make_batch())
    fp32 = model_step(convert_sync_batchnorm(make_model()), x, y, "sum")
    model = convert_sync_batchnorm(make_model())
    bn_dtypes: list[torch.dtype] = []
    model[1].register_forward_hook(lambda _m, _i, out: bn_dtypes.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    (F.cross_entropy(out.float(), y, reduction="sum") / GLOBAL_BATCH).backward()
    return {
        "fp32": fp32,
        "out": out.detach(),
        "bn_dtype": bn_dtypes[0],
        "grads": grads(model),
        "bufs": buffers(model),
    }


def run_too_few_values(rank: int) -> str:
    """One value per channel in the whole group (1 + 0): every rank must raise, none hang."""
    layer = CpuSyncBatchNorm(3)
    try:
        layer(torch.randn(1 - rank, 3))
    except ValueError as err:
        return str(err)
    return "no error"


def worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    join_gloo(rank, WORLD, port, timeout_s=30)
    try:
        results = {"model": run_model_cases(rank), "layer": run_layer_cases(rank)}
        state = results["model"]["even_mean"]["state"]
        results["eval"] = run_eval_on_rank0_only(rank, state, Path(out_dir) / "eval_done")
        dist.barrier()
        results["singleton"] = run_singleton_group(rank)
        results["bf16"] = run_bf16(rank)
        results["too_few"] = run_too_few_values(rank)
        dist.barrier()
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("syncbn")
    mp.spawn(worker, args=(free_port(), str(out_dir)), nprocs=WORLD, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


# ---------------------------------------------------------------- references and comparisons
def model_reference() -> dict[str, Any]:
    return model_step(make_model(), *make_batch(), "sum")  # sum / GLOBAL_BATCH == mean


def combined_grads(per_rank: list[dict[str, Any]], loss: str) -> dict[str, Tensor]:
    """What DDP would hand the optimizer: the average over ranks of the local gradients
    (``mean`` loss); with ``sum``/global-batch the local losses add up, so the grads add up."""
    scale = 1.0 / WORLD if loss == "mean" else 1.0
    return {n: sum(r["grads"][n] for r in per_rank) * scale for n in per_rank[0]["grads"]}


def assert_matches_reference(per_rank: list[dict[str, Any]], ref: dict[str, Any], loss: str):
    for r in per_rank:
        torch.testing.assert_close(r["bufs"], ref["bufs"], **TOL)
    torch.testing.assert_close(combined_grads(per_rank, loss), ref["grads"], **TOL)
    torch.testing.assert_close(torch.cat([r["out"] for r in per_rank]), ref["out"], **TOL)
    if loss == "sum":  # the input gradient of each sample is the reference's, unscaled
        torch.testing.assert_close(torch.cat([r["x_grad"] for r in per_rank]), ref["x_grad"], **TOL)


@pytest.mark.parametrize("case", ["even_mean", "uneven_5_3", "uneven_1_7", "empty_0_8"])
def test_training_step_matches_single_process(ranks: list[dict[str, Any]], case: str) -> None:
    per_rank = [r["model"][case] for r in ranks]
    assert_matches_reference(per_rank, model_reference(), MODEL_CASES[case]["loss"])


@pytest.mark.parametrize("case", ["plain_even", "plain_uneven"])
def test_plain_batchnorm_differs_from_single_process(ranks: list[dict[str, Any]], case: str):
    """Sanity check of the oracle: without synchronisation the comparison must fail."""
    per_rank = [r["model"][case] for r in ranks]
    with pytest.raises(AssertionError):
        assert_matches_reference(per_rank, model_reference(), MODEL_CASES[case]["loss"])
    ref, loss = model_reference(), MODEL_CASES[case]["loss"]
    assert not torch.allclose(per_rank[0]["bufs"]["1.running_mean"], ref["bufs"]["1.running_mean"])
    assert not torch.allclose(combined_grads(per_rank, loss)["0.weight"], ref["grads"]["0.weight"])


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_shapes_and_options_match_single_process(ranks: list[dict[str, Any]], case: str):
    spec = LAYER_CASES[case]
    ref = layer_steps(make_layer(spec), *layer_data(spec["shape"]))
    assert_matches_reference([r["layer"][case] for r in ranks], ref, "sum")


def test_eval_runs_no_collective_and_uses_running_stats(ranks: list[dict[str, Any]]) -> None:
    assert ranks[1]["eval"]["rank0_finished"]
    assert ranks[0]["eval"]["seconds"] < 10  # a collective would have waited for the timeout
    reference = make_model()
    reference.load_state_dict(ranks[0]["model"]["even_mean"]["state"])
    with torch.no_grad():
        expected = reference.eval()(make_batch(3, seed=5)[0])
    torch.testing.assert_close(ranks[0]["eval"]["out"], expected, rtol=0, atol=0)


def test_singleton_process_group_is_plain_batchnorm(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        got, expected = r["singleton"]["synced"], r["singleton"]["plain"]
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_bf16_autocast_is_finite_and_close_to_fp32(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        res = r["bf16"]
        assert res["out"].dtype == torch.bfloat16 and res["bn_dtype"] == torch.bfloat16
        assert torch.isfinite(res["out"].float()).all()
        assert all(torch.isfinite(g).all() for g in res["grads"].values())
        torch.testing.assert_close(res["out"].float(), res["fp32"]["out"], rtol=0.05, atol=0.1)
        torch.testing.assert_close(res["bufs"], res["fp32"]["bufs"], rtol=0.02, atol=0.02)
    # Running statistics come from the global batch, so they agree across ranks exactly.
    torch.testing.assert_close(ranks[0]["bf16"]["bufs"], ranks[1]["bf16"]["bufs"], rtol=0, atol=0)


def test_one_value_per_channel_in_whole_group_raises_on_every_rank(ranks: list[dict[str, Any]]):
    for r in ranks:
        assert "more than 1 value per channel" in r["too_few"]


# ---------------------------------------------------------------- single process, no group
@pytest.mark.parametrize("case", list(LAYER_CASES))
@pytest.mark.parametrize("training", [True, False])
def test_without_process_group_equals_plain_batchnorm(case: str, training: bool) -> None:
    assert not dist.is_initialized()
    spec = LAYER_CASES[case]
    plain, synced = make_layer(spec), convert_sync_batchnorm(make_layer(spec))
    plain.train(training)
    synced.train(training)
    data = layer_data(spec["shape"])
    got, expected = layer_steps(synced, *data), layer_steps(plain, *data)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_convert_mirrors_torch_converter() -> None:
    model = nn.Sequential(
        nn.BatchNorm1d(3, eps=1e-3, momentum=None),
        nn.Sequential(nn.BatchNorm2d(4, affine=False), nn.SyncBatchNorm(2)),
        nn.BatchNorm3d(5, track_running_stats=False),
        nn.BatchNorm2d(6, bias=False),
    )
    model[0].weight.requires_grad_(False)
    model[0].running_mean.fill_(3.0)
    model[0].num_batches_tracked.fill_(7)
    model[1][0].eval()
    originals = [model[0], model[1][0], model[2], model[3]]
    converted = convert_sync_batchnorm(model)
    news = [converted[0], converted[1][0], converted[2], converted[3]]
    assert converted is model and isinstance(converted[1][1], nn.SyncBatchNorm)
    for old, new in zip(originals, news, strict=True):
        assert type(new) is CpuSyncBatchNorm
        for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
            assert getattr(new, attr) == getattr(old, attr), attr
        assert new.training == old.training
        for name, tensor in [*old.named_parameters(), *old.named_buffers()]:
            assert getattr(new, name) is tensor, name  # shared, so optimizers still see it
        assert (new.bias is None) == (old.bias is None)
    assert not converted[0].weight.requires_grad and converted[3].weight.requires_grad
    assert not converted[1][0].training
    assert type(convert_sync_batchnorm(nn.BatchNorm2d(3))) is CpuSyncBatchNorm


def test_convert_on_cuda_uses_torch_syncbatchnorm() -> None:
    converted = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)), device_type="cuda")
    assert type(converted[0]) is nn.SyncBatchNorm
