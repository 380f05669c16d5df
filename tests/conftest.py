"""W&B is offline in every test: nothing here may go online."""

import pytest


@pytest.fixture(autouse=True)
def _offline_wandb(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu`` tests need CUDA: skip them (with the reason) where there is none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marker gpu); run benchmarks/gpu_check.sh on a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
