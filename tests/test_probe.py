"""The start-up probe (``ddp_template.probe``): a task and a model that do not fit are refused
in one sentence before the first step; the shipped ones pass. In-process on a forker's
denoiser (``forker_denoise.py``), then train.py's exit 2 without a traceback."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from forker_denoise import (
    BatchMean,
    Contrastive,
    Denoise,
    VectorLoss,
    denoiser,
    noisy,
)
from helpers import ROOT, run, train_cmd
from omegaconf import DictConfig

from ddp_template.errors import ConfigError
from ddp_template.models import build_model
from ddp_template.probe import check_fit
from ddp_template.splits import build_splits
from ddp_template.task import build_task

CPU = torch.device("cpu")
DENOISER = "forker_denoise.denoiser"


def _fit(task: object, mistake: str = "none") -> None:
    splits = noisy()
    check_fit(task, denoiser(1, mistake), splits, CPU, DENOISER)  # type: ignore[arg-type]


def test_the_right_denoiser_passes() -> None:
    _fit(Denoise())


@pytest.mark.parametrize(
    "task,mistake,needle",
    [
        (  # issue 52: the MSE broadcast to (B, B, 8, 8), exit 0, verdict ok
            Denoise,
            "squeezed",
            r"task Denoise \(tests/forker_denoise\.py\): loss\(output, y, 'mean'\) of 4 samples "
            r"together is .*, not the mean of their losses one by one \(.*\): output \(4, 8, 8\) "
            r"and target \(4, 1, 8, 8\) broadcast; make model\._target_=forker_denoise\.denoiser "
            r"\(tests/forker_denoise\.py\) return the target's shape \(4, 1, 8, 8\)",
        ),
        (
            Denoise,
            "flat",
            r"task Denoise \(tests/forker_denoise\.py\) cannot score the output of model\._target_="
            r"forker_denoise\.denoiser \(tests/forker_denoise\.py\): .*output \(4, 64\) "
            r"and target \(4, 1, 8, 8\) fails \(RuntimeError: The size of tensor",
        ),
        (
            VectorLoss,
            "none",
            r"task VectorLoss \(tests/forker_denoise\.py\): loss\(output, y, 'mean'\) returns "
            r"shape \(4,\), not a scalar tensor",
        ),
        (
            Denoise,
            "pair",
            r"model\._target_=forker_denoise\.denoiser \(tests/forker_denoise\.py\) returns a "
            r"tuple of 2 \[\(4, 1, 8, 8\), \(4, 1, 8, 8\)\] where task Denoise "
            r"\(tests/forker_denoise\.py\) expects a tensor",
        ),
        (
            Denoise,
            "first",
            r"returns \(1, 1, 8, 8\) for a batch of 4 samples \(target \(4, 1, 8, 8\)\): its "
            r"first dimension must be the batch's",
        ),
        (
            BatchMean,
            "none",
            r"task BatchMean .*: update\(sums, output, y\) of 4 samples together gives sums\[1\]",
        ),
    ],
)
def test_each_mistake_is_one_sentence(task: type, mistake: str, needle: str) -> None:
    if Path.cwd() != ROOT:
        needle = needle.replace(r"tests/forker_denoise\.py", r"[^)]*forker_denoise\.py")
    with pytest.raises(ConfigError, match=needle) as err:
        _fit(task(), mistake)
    assert "\n" not in str(err.value) and str(err.value).endswith(".")


def test_a_batch_level_task_skips_exactness_only() -> None:
    _fit(Contrastive())  # its update is a batch's mean: declared, so not refused
    with pytest.raises(ConfigError, match="not a scalar tensor"):
        Contrastive.loss = VectorLoss.loss  # type: ignore[method-assign]
        try:
            _fit(Contrastive())
        finally:
            del Contrastive.loss


SHIPPED = [
    ("task=classification", "model=small_cnn", "data=digits"),
    ("task=segmentation", "model=fcn", "data=shapes", "data.size=8", "data.test_size=4"),
    ("task=regression", "model=mlp", "data=diabetes"),
    (
        "task=classification",
        "model=mlp",
        "data=digits",
        "model.in_features=64",
        "model.out_features=10",
    ),
]


@pytest.mark.parametrize("overrides", SHIPPED, ids=lambda o: "-".join(o[:2]))
def test_shipped_tasks_pass(
    overrides: tuple[str, ...], compose_cfg: Callable[..., DictConfig]
) -> None:
    cfg = compose_cfg(*overrides)
    splits = build_splits(cfg.data)
    task = build_task(cfg.task)
    task.setup(splits.info, CPU)
    model = build_model(cfg.model, splits.info)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    start = time.perf_counter()
    check_fit(task, model, splits, CPU, cfg.model._target_)
    assert time.perf_counter() - start < 2.0  # ~10 ms on one idle thread
    assert torch.equal(torch.get_rng_state(), before) and model.training  # nothing disturbed


def _forker_conf(tmp_path: Path) -> Path:
    """A forker's YAMLs beside conf/: their data, task and models (hydra.searchpath)."""
    conf = tmp_path / "conf"
    for group, name, text in (
        ("data", "noisy", "_target_: forker_denoise.noisy\nsize: 64\n"),
        ("task", "denoise", "_target_: forker_denoise.Denoise\n"),
        ("model", "denoiser", f"_target_: {DENOISER}\nmistake: none\n"),
    ):
        (conf / group).mkdir(parents=True, exist_ok=True)
        (conf / group / f"{name}.yaml").write_text(text)
    return conf


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return env


def test_train_refuses_the_broadcast_before_the_first_step(tmp_path: Path) -> None:
    """Issue 52's run, on two ranks: exit 2 and one sentence, no traceback, no step."""
    conf = _forker_conf(tmp_path)
    common = [
        f"hydra.searchpath=[file://{conf}]",
        "data=noisy",
        "task=denoise",
        "model=denoiser",
        "epochs=1",
        "dist.nproc=2",
    ]
    proc = run(train_cmd(tmp_path, *common, "model.mistake=squeezed"), check=False, env=_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out
    assert "output (4, 8, 8) and target (4, 1, 8, 8) broadcast" in out
    assert out.count("not the mean of their losses one by one") == 1, out[-3000:]
    assert "train/loss" not in out and not list(tmp_path.rglob("last.pt"))


def test_train_refuses_a_tuple_in_one_sentence(tmp_path: Path) -> None:
    """One process, a model returning a tuple: exit 2, the sentence once, no traceback."""
    conf = _forker_conf(tmp_path)
    searched = f"hydra.searchpath=[file://{conf}]"
    overrides = [searched, "data=noisy", "task=denoise", "model=denoiser", "model.mistake=pair"]
    proc = run(train_cmd(tmp_path, *overrides, "epochs=1"), check=False, env=_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert out.count("returns a tuple of 2 [(4, 1, 8, 8), (4, 1, 8, 8)] where task Denoise") == 1
