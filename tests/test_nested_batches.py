"""The batch contract generalised: ``x`` and ``y`` may be nested tuples/dicts of tensors.
One process, the real engine loop and evaluation, a task whose model reads a dict and whose
target is a tuple; the index stays the ledger's key."""

from __future__ import annotations

from typing import Any

import torch
from helpers import cpu_rank, step_trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from ddp_template.config.schema import LoaderConfig
from ddp_template.data.contract import batch_len, collate, empty_batch, to_device
from ddp_template.data.epoch_steps import EpochSteps
from ddp_template.data.loader import build_eval_loader
from ddp_template.engine import TrainState, train_one_epoch
from ddp_template.evaluation import evaluate
from ddp_template.task import EvalResult, Task


class Pairs(Dataset):
    """Item i: ({"a": a_i, "b": b_i}, (t_i, w_i), i)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.a, self.b = torch.randn(n, 3, generator=g), torch.randn(n, 2, generator=g)
        self.t = self.a.sum(1, keepdim=True) - self.b[:, :1]
        self.w = torch.rand(n, generator=g) + 0.5

    def __len__(self) -> int:
        return len(self.w)

    def __getitem__(self, i: int) -> tuple[dict[str, Tensor], tuple[Tensor, Tensor], int]:
        return {"a": self.a[i], "b": self.b[i]}, (self.t[i], self.w[i]), i


class Both(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(5, 1)

    def forward(self, x: dict[str, Tensor]) -> Tensor:
        return self.head(torch.cat([x["a"], x["b"]], dim=1))


class Weighted(Task):
    """A weighted squared error: the target is (value, weight)."""

    directions = {"wse": "min"}
    monitor = "wse"

    def loss(self, output: Tensor, y: Any, reduction: str) -> Tensor:
        t, w = y
        per = w * (output - t).square().squeeze(1)
        return per.mean() if reduction == "mean" else per.sum()

    def sums(self, device: torch.device) -> Tensor:
        return torch.zeros(2, dtype=torch.float64, device=device)

    def update(self, sums: Tensor, output: Tensor, y: Any) -> None:
        t, w = y
        sums[0] += (w * (output - t).square().squeeze(1)).sum().double()
        sums[1] += batch_len(y)

    def result(self, sums: Tensor) -> EvalResult:
        n = int(sums[1])
        return EvalResult(values={"wse": float(sums[0]) / n}, count=n)


def test_nested_parts_collate_move_and_empty() -> None:
    data = Pairs(5)
    x, y, index = collate([data[i] for i in range(3)])
    assert x["a"].shape == (3, 3) and y[1].shape == (3,) and index.tolist() == [0, 1, 2]
    assert batch_len(x) == batch_len(y) == 3
    moved = to_device((x, y), torch.device("cpu"))
    assert torch.equal(moved[0]["b"], x["b"]) and torch.equal(moved[1][0], y[0])
    loader = DataLoader(data, batch_size=2, collate_fn=collate)
    ex, ey, ei = empty_batch(loader, None)
    assert ex["a"].shape == (0, 3) and ey[0].shape == (0, 1) and ei.shape == (0,)
    assert batch_len(ey) == 0


def test_the_engine_trains_and_evaluates_nested_batches() -> None:
    torch.manual_seed(0)
    data, model, task = Pairs(20), Both(), Weighted()
    info = cpu_rank()
    before = evaluate(
        model, build_eval_loader(data, LoaderConfig(eval_batch_size=6), info), info, "off", task
    )
    tr = step_trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), task=task)
    tr.loader = DataLoader(data, batch_size=4, collate_fn=collate)
    tr.steps = EpochSteps(length=20, batch_size=4, epochs=1)

    class One:  # a sampler of one rank that deals no worker ranges
        def worker_lanes(self, position: int) -> tuple[int, int]:
            return 1, 0

    tr.sampler = One()
    state = TrainState()
    stats = train_one_epoch(tr, state, lambda s: False, lambda row, step: None)
    assert stats.steps == 5 and stats.tally.samples == 20  # the index is still the ledger's key
    after = evaluate(
        model, build_eval_loader(data, LoaderConfig(eval_batch_size=6), info), info, "off", task
    )
    assert after.count == before.count == 20
    assert after.values["wse"] < before.values["wse"]  # it learned from the nested targets
