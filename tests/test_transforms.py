"""Augmentation (transforms group): a function of (seed, epoch, index) only.

The same sample gets the same augmented tensor whichever rank, world size or loader worker
loads it, and a run killed mid-epoch with loader workers resumes to bit-identical weights.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import compose_conf
from helpers import cpu_rank
from test_resume import assert_identical, final_model, launch

from ddp_template.config import boundary
from ddp_template.data.loader import build_train_loader, build_train_sampler
from ddp_template.data.transforms import Augmented, apply_transforms
from ddp_template.splits import build_splits

AUGMENTED = ["transforms=cifar", "data.image_size=32"]  # after test_resume's BASE: 32 px


def _loaders(cfg, splits, world: int, workers: int) -> list:
    """Each rank's training sampler and loader at world size ``world``."""
    out = []
    for rank in range(world):
        info = cpu_rank(rank, world)
        sampler = build_train_sampler(splits.train, cfg.sampler, seed=cfg.seed, info=info)
        loader_cfg = dataclasses.replace(cfg.loader, num_workers=workers)
        drop = cfg.sampler.drop_last_batch
        loader = build_train_loader(
            splits.train, sampler, loader_cfg, seed=cfg.seed, drop_last=drop, info=info
        )
        out.append((sampler, loader))
    return out


def _epoch(splits, loaders: list, epoch: int) -> dict[int, torch.Tensor]:
    """Every training sample one epoch loads, by index, over all ranks."""
    splits.set_epoch(epoch)
    seen: dict[int, torch.Tensor] = {}
    for sampler, loader in loaders:
        sampler.set_epoch(epoch)
        for x, _, idx in loader:
            seen.update(zip(idx.tolist(), x, strict=True))
    return seen


def test_augmentation_is_the_same_on_any_world_size_and_worker() -> None:
    """World size 1 with 2 persistent loader workers vs. world size 2 loading in-process."""
    overrides = ["data=synthetic", "data.size=24", "loader.batch_size=4"]
    cfg = boundary.typed(compose_conf(*overrides, *AUGMENTED))
    splits = apply_transforms(build_splits(cfg.data), cfg.transforms, cfg.seed)
    assert isinstance(splits.train, Augmented)
    plain = build_splits(cfg.data).train
    one_rank, two_ranks = _loaders(cfg, splits, 1, workers=2), _loaders(cfg, splits, 2, workers=0)
    epochs = []
    for epoch in (0, 1):
        one, two = _epoch(splits, one_rank, epoch), _epoch(splits, two_ranks, epoch)
        assert sorted(one) == sorted(two) == list(range(24))
        for i in range(24):
            assert torch.equal(one[i], two[i]), (epoch, i)
        epochs.append(one)
    assert sum(not torch.equal(epochs[0][i], epochs[1][i]) for i in range(24)) > 12  # redrawn
    assert sum(not torch.equal(epochs[0][i], plain[i][0]) for i in range(24)) > 12  # augmented
    unaugmented = splits.split("train")  # eval_split=train evaluates the samples as they are
    assert all(torch.equal(unaugmented[i][0], plain[i][0]) for i in range(24))


@pytest.mark.slow
def test_augmented_run_killed_mid_epoch_resumes_identically(tmp_path: Path) -> None:
    """test_resume's crash at step 11 of 16 (2 ranks, 2 loader workers), with transforms=cifar."""
    launch(tmp_path, "ref", "logger=none", *AUGMENTED)
    crash = ["fault.crash_at_step=11", "fault.rank=1", "dist.max_restarts=1"]
    launch(tmp_path, "crash", "logger=none", *AUGMENTED, *crash)
    assert_identical(final_model(tmp_path, "ref"), final_model(tmp_path, "crash"))
