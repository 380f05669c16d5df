"""EMA on real gloo ranks: the same averaged weights on every rank, evaluated exactly at 1, 2
and 3 ranks. (Resume with EMA on is bit-identical: test_accumulation's kill-and-resume.)"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import classification, free_port, join_gloo, save_gathered, step_trainer

from ddp_template.config.schema import DDPConfig, EmaConfig, LoaderConfig
from ddp_template.data.builtin import synthetic
from ddp_template.data.loader import build_eval_loader
from ddp_template.distributed import DistInfo
from ddp_template.engine import _step
from ddp_template.evaluation import evaluate
from ddp_template.models import small_cnn
from ddp_template.parallel import build_ddp
from ddp_template.switches.ema import EMA, build_ema

EVAL = LoaderConfig(eval_batch_size=7, num_workers=0)  # 40 samples: ragged shards


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return small_cnn(num_classes=10, in_channels=3, image_size=8)  # BatchNorm: buffers


def eval_set():
    return synthetic(size=8, test_size=40, image_size=8).test


def rank_info(rank: int, world: int) -> DistInfo:
    return DistInfo(
        rank=rank,
        local_rank=rank,
        world_size=world,
        local_world_size=world,
        backend="gloo" if world > 1 else None,
        device=torch.device("cpu"),
        host=socket.gethostname(),
    )


def train_with_ema(info: DistInfo) -> tuple[EMA, torch.nn.Module]:
    """Three DDP steps on this rank's own random batch, the EMA updated after each."""
    model = make_model()
    ema = build_ema(EmaConfig(decay=0.5, every=1, warmup=1), model, info)
    tr = step_trainer(
        model=build_ddp(DDPConfig(), model, info),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        device=info.device,
    )
    gen = torch.Generator().manual_seed(100 + info.rank)
    for step in (1, 2, 3):
        x, y = torch.randn(6, 3, 8, 8, generator=gen), torch.randint(0, 10, (6,), generator=gen)
        _step(tr, x, y, want_norm=False)
        ema.update(model, step)
    return ema, model


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def worker(rank: int, world: int, port: int, ema_state: dict, out: str) -> None:
    torch.set_num_threads(1)
    join_gloo(rank, world, port, timeout_s=60)
    try:
        info = rank_info(rank, world)
        trained, model = train_with_ema(info)
        mine = {
            "ema": flat(trained.module.state_dict().values()),
            "updates": trained.updates,
            "model_buffers": flat(model.buffers()),
        }
        fixed = build_ema(EmaConfig(decay=0.9), make_model(), info)
        fixed.load_state_dict(ema_state)
        loader = build_eval_loader(eval_set(), EVAL, info)
        mine["eval"] = evaluate(fixed.module, loader, info, "off", classification(10))
        save_gathered(mine, world, Path(out) / f"world{world}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ema_state() -> dict:
    """An EMA of a model trained for three single-process steps (BN stats moved)."""
    return train_with_ema(rank_info(0, 1))[0].state_dict()


def test_ema_identical_on_every_rank_and_exact_eval_at_1_2_3_ranks(
    ema_state: dict, tmp_path: Path
) -> None:
    single = build_ema(EmaConfig(decay=0.9), make_model(), rank_info(0, 1))
    single.load_state_dict(ema_state)
    alone = rank_info(0, 1)
    one = evaluate(
        single.module, build_eval_loader(eval_set(), EVAL, alone), alone, "off", classification(10)
    )
    data = eval_set()
    x, y, _ = zip(*(data[i] for i in range(len(data))), strict=True)
    logits = single.module.eval()(torch.stack(x))
    labels = torch.tensor(y)
    assert one.count == 40 and one.values["correct"] == int((logits.argmax(1) == labels).sum())
    for world in (2, 3):
        mp.spawn(worker, args=(world, free_port(), ema_state, str(tmp_path)), nprocs=world)
        ranks = torch.load(tmp_path / f"world{world}.pt", weights_only=False)
        for r in ranks[1:]:
            assert torch.equal(r["ema"], ranks[0]["ema"]), f"EMA differs across {world} ranks"
            assert r["updates"] == 3
        # The models' own BN statistics differ (own batches): the EMA's are rank 0's, broadcast.
        assert not torch.equal(ranks[0]["model_buffers"], ranks[1]["model_buffers"])
        counts = [(r["eval"].values["correct"], r["eval"].count) for r in ranks]
        assert counts == [(one.values["correct"], 40)] * world
        assert ranks[0]["eval"].values["loss"] == pytest.approx(one.values["loss"], rel=1e-5)
