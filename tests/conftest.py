"""Shared fixtures: W&B offline in every test, real Hydra composition of conf/, GPU skips."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import ROOT
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from ddp_template import run_identity
from ddp_template.config import register_configs

register_configs()
run_identity.register_resolvers()


@pytest.fixture(autouse=True)
def _offline_wandb(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing here may go online."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def compose_conf(*overrides: str, conf: Path = ROOT / "conf") -> DictConfig:
    """Compose ``conf/`` (or a copy of it) with overrides, exactly as train.py's Hydra does."""
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def compose_cfg() -> Callable[..., DictConfig]:
    """``compose_cfg("data=array", ..., conf=<folder>)``: the composed ``DictConfig``."""
    return compose_conf


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu`` tests need CUDA: skip them (with the reason) where there is none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marker gpu); run benchmarks/gpu_check.sh on a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
