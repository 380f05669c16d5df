"""Replay without training: every mode and permutation against a real, capped DataLoader.

The oracle is a real DataLoader over the run's sampler, its micro-batches grouped into optimizer
steps and cut at the epoch's last step as ``engine.micro_batches`` groups and cuts them, with an
optional mid-epoch checkpoint and resume into a fresh sampler and loader. Replay must give the
same batch at every step (a resume never renumbers), and ``--index`` the same steps. Also: the
O(batch) cost at N = 1e9, the step arithmetic, and the refusal of an ``--index`` that would
take minutes.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from ddp_template.data.epoch_steps import EpochSteps
from ddp_template.data.feistel import FeistelPermutation
from ddp_template.data.loader import build_train_loader
from ddp_template.engine import TrainState, micro_batches
from ddp_template.errors import ConfigError
from ddp_template.replay import index_hits, load_run, step_rows


def write_run(folder: Path, cfg) -> Path:
    """A run dir holding only the composed config, as rank 0 writes it."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    return folder


def engine_epoch(loader, schedule, state: TrainState, steps: list, stop_after, rank) -> bool:
    """One epoch of ``engine.train_one_epoch``'s loop from ``state.position``; False: stopped."""
    step: list[int] = []
    for (_, _, idx), _, last in micro_batches(loader, schedule, state.position, rank):
        step += idx.tolist()
        if last:
            state.position = schedule.next_boundary(state.position)
            steps.append(step)
            step = []
            if len(steps) == stop_after:
                return False
    return True


def loader_steps(run_, stop_after: int | None = None) -> list[list[list[int]]]:
    """Per rank, each step's indices from a real DataLoader, capped as the engine caps it.

    ``stop_after``: stop after that many steps, checkpoint the sampler position and go on in a
    fresh sampler and loader (the template's resume), keeping the step count.
    """
    per_rank = []
    drop = run_.cfg.sampler.drop_last_batch
    for rank in range(run_.world_size):
        info = SimpleNamespace(rank=rank, device=torch.device("cpu"))
        sampler = run_.sampler(rank)
        loader = build_train_loader(
            run_.train, sampler, run_.cfg.loader, seed=run_.cfg.seed, drop_last=drop, info=info
        )
        steps, state = [], TrainState()
        while state.epoch < run_.cfg.epochs:
            sampler.set_epoch(state.epoch)
            if engine_epoch(loader, run_.epoch_steps, state, steps, stop_after, rank):
                state.epoch, state.position = state.epoch + 1, 0
                continue
            saved, stop_after = sampler.state_dict(state.position), None
            sampler = run_.sampler(rank)
            sampler.load_state_dict(saved)
            loader = build_train_loader(
                run_.train, sampler, run_.cfg.loader, seed=run_.cfg.seed, drop_last=drop, info=info
            )
        per_rank.append(steps)
    return per_rank


ORACLE_CASES = [  # mode, permutation, sampler.drop_last_batch, max_steps_per_epoch, accumulate
    ("padded", "randperm", False, None, 1),
    ("drop_last", "feistel", True, None, 1),
    ("sequential", "auto", False, 3, 1),
    ("padded", "feistel", True, 2, 1),
    ("drop_last", "randperm", False, 4, 1),
    ("padded", "randperm", False, None, 2),  # 3 micro-batches per epoch: steps of 2 and 1
    ("sequential", "auto", True, 1, 2),
    ("drop_last", "feistel", False, None, 3),
    ("exact", "randperm", False, None, 1),  # 23 on 3 ranks: lists of 8, 8 and 7
    ("exact", "feistel", True, None, 2),
    ("exact", "auto", False, 2, 3),
]


@pytest.mark.parametrize(("mode", "permutation", "drop_last_batch", "cap", "acc"), ORACLE_CASES)
def test_replay_is_the_capped_loader_in_every_mode(
    mode: str, permutation: str, drop_last_batch: bool, cap, acc: int, compose_cfg, tmp_path: Path
) -> None:
    overrides = [
        "data=synthetic",
        "data.size=23",
        "data.test_size=4",
        "data.image_size=4",
        "data.channels=1",
        f"sampler={mode}",
        f"sampler.permutation={permutation}",
        f"sampler.drop_last_batch={drop_last_batch}",
        "loader.batch_size=3",
        "epochs=3",
        "seed=5",
        f"max_steps_per_epoch={cap if cap else 'null'}",
        f"optim.accumulate={acc}",
    ]
    run_ = load_run(write_run(tmp_path / "run", compose_cfg(*overrides)), world_size=3)
    truth, per_epoch = loader_steps(run_), run_.epoch_steps.steps_per_epoch
    assert [len(steps) for steps in truth] == [run_.epoch_steps.total_steps] * 3
    for stop in (per_epoch, per_epoch + 1):  # a resume at an epoch's end and mid-epoch
        assert loader_steps(run_, stop_after=stop) == truth
    for step in range(1, run_.epoch_steps.total_steps + 1):
        assert [row["indices"] for row in step_rows(run_, step)] == [t[step - 1] for t in truth]
    for index in range(23):
        expected = [
            (s // per_epoch, s + 1, r)
            for s in range(run_.epoch_steps.total_steps)
            for r in range(3)
            for i in truth[r][s]
            if i == index
        ]
        got = [(h["epoch"], h["step"], h["rank"]) for h in index_hits(run_, index)]
        assert got == expected


def test_replay_at_a_billion_samples_is_o_batch(compose_cfg, tmp_path: Path) -> None:
    overrides = [
        "data=synthetic",
        "data.size=1000000000",
        "loader.batch_size=32",
        "epochs=1",
        "seed=7",
    ]
    run_ = load_run(write_run(tmp_path / "run", compose_cfg(*overrides)), world_size=8)
    step = 3_000_000  # deep in the first epoch of 3,906,250 steps
    tracemalloc.start()
    rows = step_rows(run_, step)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * 2**20
    # docs/ARCHITECTURE.md: rank r reads slot r + W*j, slot j holds perm(j), perm keyed (7, 0).
    positions = np.arange((step - 1) * 32, step * 32)
    perm = FeistelPermutation(10**9, 7, 0)
    assert [row["indices"] for row in rows] == [perm(r + positions * 8).tolist() for r in range(8)]


def test_step_schedule_counts_like_the_dataloader() -> None:
    def schedule(**kwargs) -> EpochSteps:
        return EpochSteps(**({"length": 23, "batch_size": 4, "epochs": 2} | kwargs))

    assert schedule().steps_per_epoch == 6 and schedule().total_steps == 12
    assert schedule(drop_last_batch=True).steps_per_epoch == 5
    assert schedule(max_steps_per_epoch=3).consumed_per_epoch == 12
    assert schedule(length=3, drop_last_batch=True).total_steps == 0
    assert tuple(schedule().batch(6)) == (6, 0, 20, 23)
    assert tuple(schedule().batch(7)) == (7, 1, 0, 4)
    with pytest.raises(ValueError, match="trains no step"):
        schedule(length=3, drop_last_batch=True).batch(1)


def test_index_refuses_minutes_of_randperm(compose_cfg, tmp_path: Path) -> None:
    big = ["data=synthetic", "data.size=16000000", "epochs=20", "sampler.permutation=randperm"]
    run_ = load_run(write_run(tmp_path / "run", compose_cfg(*big)), world_size=2)
    with pytest.raises(ConfigError, match="320,000,000 indices with randperm"):
        index_hits(run_, 5)
