"""Numerics and GPU speed keys: deterministic, matmul_precision, cudnn_benchmark, channels_last,
pin_memory, persistent_workers, optim.fused. Each set for real in this process (torch's flags
read back), a bad value refused naming the key, and one 1-rank run of train.py that reads the
rank's numerics back from its log.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers import run, summary, train_cmd
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig
from torch import nn

from ddp_template import checks, numerics
from ddp_template.config import boundary
from ddp_template.config.schema import LoaderConfig, MatmulPrecision, NumericsConfig, OptimConfig
from ddp_template.data import workers
from ddp_template.errors import ConfigError
from ddp_template.models import small_cnn
from ddp_template.optim import build_optimizer


@pytest.fixture
def restore_numerics(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``apply`` changes process-wide torch state: put it back for the other tests."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.get_float32_matmul_precision(),
    )
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2:4]
    torch.set_float32_matmul_precision(saved[4])


def test_deterministic_turns_on_torch_deterministic_mode(restore_numerics: None) -> None:
    numerics.apply(NumericsConfig(deterministic=True, matmul_precision=MatmulPrecision.highest))
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.get_float32_matmul_precision() == "highest"
    numerics.apply(NumericsConfig())  # the defaults: fast, not reproducible across runs on CUDA
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
    assert torch.get_float32_matmul_precision() == "high"
    numerics.apply(NumericsConfig(cudnn_benchmark=False, matmul_precision=MatmulPrecision.medium))
    assert not torch.backends.cudnn.benchmark
    assert torch.get_float32_matmul_precision() == "medium"


@pytest.mark.parametrize(
    "override,needle",
    [
        ("numerics.deterministic=maybe", "'maybe' is not a valid bool"),
        ("numerics.matmul_precision=low", "'low', expected one of [highest, high, medium]"),
        ("numerics.cudnn_benchmark=sometimes", "'sometimes' is not a valid bool"),
        ("numerics.channels_last=nhwc", "'nhwc' is not a valid bool"),
        ("loader.pin_memory=fast", "'fast' is not a valid bool"),
        ("loader.persistent_workers=yes_please", "'yes_please' is not a valid bool"),
        ("optim.fused=cuda", "'cuda' is not a valid bool"),
    ],
)
def test_bad_numerics_values_are_refused_naming_the_key(
    compose_cfg: Callable[..., DictConfig], override: str, needle: str
) -> None:
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg(override)
    key = override.split("=")[0]
    assert f"override {override}" in str(err.value)
    assert needle in str(err.value.__cause__) and f"full_key: {key}" in str(err.value.__cause__)


def test_cudnn_benchmark_contradicting_deterministic_is_one_sentence(
    compose_cfg: Callable[..., DictConfig],
) -> None:
    cfg = boundary.typed(
        compose_cfg("numerics.deterministic=true", "numerics.cudnn_benchmark=true")
    )
    with pytest.raises(ConfigError) as err:
        checks.check(cfg)
    message = str(err.value)
    assert message.startswith(
        "numerics.cudnn_benchmark=true contradicts numerics.deterministic=true"
    )
    assert "drop numerics.cudnn_benchmark" in message and "\n" not in message
    deterministic = boundary.typed(compose_cfg("numerics.deterministic=true"))
    checks.check(deterministic)  # benchmark off by itself


def test_channels_last_converts_weights_and_every_input_batch() -> None:
    torch.manual_seed(0)
    plain = small_cnn(num_classes=3, in_channels=2, image_size=8).eval()
    model = small_cnn(num_classes=3, in_channels=2, image_size=8).eval()
    model.load_state_dict(plain.state_dict())
    numerics.to_channels_last(model)
    conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    seen = []
    conv.register_forward_pre_hook(lambda _, a: seen.append(a[0]))
    x = torch.randn(4, 2, 8, 8)
    torch.testing.assert_close(model(x), plain(x))
    assert seen[0].is_contiguous(memory_format=torch.channels_last)
    assert not seen[0].is_contiguous()  # NHWC, not the loader's NCHW


def test_channels_last_without_convolutions_is_one_sentence() -> None:
    with pytest.raises(ConfigError, match=r"^numerics\.channels_last=true needs a model with 2-D"):
        numerics.to_channels_last(nn.Sequential(nn.Flatten(), nn.Linear(4, 2)))


def test_pin_memory_and_persistent_workers_reach_the_loader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(workers, "_worker_start_method", lambda _: "spawn")  # no fork server here
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")

    def kwargs(cfg: LoaderConfig, device: torch.device) -> dict:
        return workers.loader_kwargs(cfg, device, dataset=None)

    assert kwargs(LoaderConfig(num_workers=2), cuda)["pin_memory"] is True
    assert kwargs(LoaderConfig(num_workers=2), cpu)["pin_memory"] is False
    assert kwargs(LoaderConfig(pin_memory=False), cuda)["pin_memory"] is False
    assert kwargs(LoaderConfig(num_workers=2), cpu)["persistent_workers"] is True
    off = LoaderConfig(num_workers=2, persistent_workers=False)
    assert kwargs(off, cpu)["persistent_workers"] is False


@pytest.mark.parametrize("fused,host_reads", [(True, 0), (False, 1)])
def test_fused_optimizer_steps_fp16_without_reading_found_inf(
    monkeypatch: pytest.MonkeyPatch, fused: bool, host_reads: int
) -> None:
    """GradScaler.step reads the inf flag with .item() (a host sync on CUDA) unless the
    optimizer is fused; CPU has fused kernels too, so the count is real here."""
    torch.manual_seed(0)
    model = small_cnn(num_classes=3, in_channels=1, image_size=8)
    optimizer = build_optimizer(OptimConfig(fused=fused), model)
    assert bool(optimizer.defaults["fused"]) is fused
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 1, 8, 8)).float().logsumexp(1).mean()
    scaler.scale(loss).backward()
    reads, item = [], torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(t) or item(t))
    scaler.step(optimizer)
    assert len(reads) == host_reads
    monkeypatch.undo()
    scaler.update()
    assert not bool(OptimConfig().fused)  # unset: fused only for CUDA parameters
    assert build_optimizer(OptimConfig(), model).defaults["fused"] is False


def test_one_rank_run_reports_deterministic_mode_and_trains_channels_last(
    tmp_path: Path,
) -> None:
    run(
        train_cmd(
            tmp_path,
            "numerics.deterministic=true",
            "numerics.channels_last=true",
            "data=synthetic",
            "data.size=64",
            "data.test_size=32",
            "data.image_size=8",
            "epochs=1",
            "max_steps_per_epoch=2",
            "logger=none",
            "checkpoint.enabled=false",
        ),
        timeout=180,
    )
    [run_dir] = (tmp_path / "outputs").iterdir()
    log = (run_dir / "train.log").read_text()
    assert (
        "numerics: deterministic_algorithms=True cudnn.deterministic=True cudnn.benchmark=False "
        "matmul_precision=high CUBLAS_WORKSPACE_CONFIG=:4096:8"
    ) in log, log
    assert summary(run_dir)["steps"] == 2
