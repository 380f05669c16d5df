"""Shared fixtures: W&B offline in every test, real Hydra composition of conf/, GPU skips."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from ddp_template import run_identity
from ddp_template.config.schema import register_configs

register_configs()
run_identity.register_resolvers()
torch.set_num_threads(1)  # as the runs' ranks (helpers.run_env): three test files share 2 cores


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


# Each module's measured seconds (a `make test` run's junit XML, summed per module). The longest
# modules start first: `make test` hands pytest-xdist workers whole modules in collection order
# (--dist loadfile --no-loadscope-reorder), and a long module picked up last is the suite's
# tail. A stale or missing entry only costs balance, never a result.
MODULE_SECONDS = json.loads((ROOT / "tests" / "module_seconds.json").read_text())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest modules first; ``gpu`` tests (``gpu(n)``: n GPUs, default 1) are the only
    ones that use CUDA: skip them, with the reason, where this machine has fewer."""
    items.sort(key=lambda item: -MODULE_SECONDS.get(item.path.relative_to(ROOT).as_posix(), 0))
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        need = marker.args[0] if marker and marker.args else 1
        if marker and found < need:
            reason = f"needs {need} CUDA GPU{'s' if need > 1 else ''} (marker gpu), found {found}"
            item.add_marker(pytest.mark.skip(reason=f"{reason}; run benchmarks/gpu_check.sh"))
        if gone := sorted(set(needed(item)) - WING_PRESENT):
            why = f"needs src/ddp_template/optional/{gone[0]}/, which this copy does not have"
            item.add_marker(pytest.mark.skip(reason=why))


WING = ROOT / "src" / "ddp_template" / "optional"
WING_FOLDERS = ("webdataset", "streams", "tokens", "gpt", "fsdp2", "live", "s3")
WING_PRESENT = {f for f in WING_FOLDERS if (WING / f).is_dir()}


MODULE_NEEDS = re.compile(r"^pytestmark = pytest\.mark\.needs\(([^)]*)\)", re.M)


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    """A test module whose ``pytestmark`` needs a deleted folder is not even imported (its
    imports of that folder would fail before any marker could skip it)."""
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    found = MODULE_NEEDS.search(collection_path.read_text())
    return True if found and set(re.findall(r'"(\w+)"', found[1])) - WING_PRESENT else None


def needed(item: pytest.Item) -> list[str]:
    """The optional folders a test needs: ``@pytest.mark.needs("gpt", ...)`` (or a module's
    ``pytestmark``), and its own folder's under ``tests/optional/<folder>/``. A forker who
    deletes a folder deletes its tests; a test of another folder that also uses it is skipped."""
    folders = [f for marker in item.iter_markers("needs") for f in marker.args]
    parts = item.path.relative_to(ROOT).parts
    if parts[:2] == ("tests", "optional") and len(parts) > 3:
        folders.append(parts[2])
    return folders


@pytest.fixture(scope="session")
def digits_fp32_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One fp32 2-rank digits run (plain torchrun, 3 epochs, W&B off), its ``out`` folder:
    test_train's "two ranks learn" and test_amp's SyncBN+bf16 baseline read the same run."""
    from helpers import run, torchrun, train_cmd

    out = tmp_path_factory.mktemp("digits_fp32")
    run(train_cmd(out, "logger=none", "epochs=3", launcher=torchrun(2, standalone=False)))
    return out


@pytest.fixture(scope="session")
def digits101(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sklearn's digits, the first 101 as the training split, the next 40 as the test split
    (``data=array``): odd on purpose, so every world size meets a padded or uneven tail."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = (digits.images / 16.0).astype(np.float32), digits.target
    path = tmp_path_factory.mktemp("digits101") / "digits101.npz"
    np.savez(path, x_train=x[:101], y_train=y[:101], x_test=x[101:141], y_test=y[101:141])
    return path


@pytest.fixture(scope="module")
def s3_server() -> Iterator[Any]:
    """The local S3 server (moto, credentials checked) behind the fault proxy, one per test
    module (``optional/s3/server.py``; imported here only when a test asks for it)."""
    from ddp_template.optional.s3.server import Faults, LocalS3

    with LocalS3(Faults()) as server:
        yield server


@pytest.fixture
def s3(s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The module's server, its credentials in this process's environment (``s3.env`` is what
    a run's processes need); ``s3.faults`` cleared after the test."""
    from ddp_template.optional.s3 import bucket
    from ddp_template.optional.s3.server import Faults

    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    bucket._clients.clear()  # a client made before holds the environment of then
    yield s3_server
    fresh = Faults()  # the proxy holds this object: reset in place
    for name in ("fail_share", "down", "cuts", "cut_min_bytes", "delay_s"):
        setattr(s3_server.faults, name, getattr(fresh, name))
    bucket._clients.clear()
