"""From a checkpoint to a paper table: experiment presets, finetune.init_from, evaluation
anywhere."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import compose_conf
from helpers import (
    PY,
    ROOT,
    classification,
    cpu_rank,
    jsonl,
    run,
    run_dirs,
    run_env,
    step_trainer,
    summary,
    train_cmd,
)
from omegaconf import DictConfig, OmegaConf
from wandb_reader import find_runs

from ddp_template.config import boundary
from ddp_template.config.schema import FinetuneConfig
from ddp_template.data.contract import DataInfo
from ddp_template.data.loader import build_eval_loader
from ddp_template.engine import _step
from ddp_template.evaluation import evaluate
from ddp_template.finetune import init_weights
from ddp_template.models import build_model, small_cnn
from ddp_template.splits import build_splits
from ddp_template.task import EvalResult
from ddp_template.tasks.classification import Classification

TINY = ["logger=none", "epochs=1", "max_steps_per_epoch=4"]


def test_experiment_with_and_without_plus_compose_the_same(
    compose_cfg: Callable[..., DictConfig],
) -> None:
    cfg = compose_cfg("experiment=digits_ddp", "debug=fast")
    assert cfg.dist.nproc == 2  # the preset's own keys win over debug's
    shown = []
    for spelling in ("experiment=digits_ddp", "+experiment=digits_ddp"):
        cmd = [PY, str(ROOT / "train.py"), spelling, "--cfg", "job"]
        shown.append(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True))
    assert shown[0].stdout == shown[1].stdout
    assert OmegaConf.create(shown[0].stdout) == OmegaConf.create(
        OmegaConf.to_yaml(compose_cfg("experiment=digits_ddp"))
    )


ONE = cpu_rank()


def evaluate_here(ckpt: Path, *overrides: str) -> EvalResult:
    """``train.py epochs=0 finetune.init_from=<ckpt>`` in this process: one rank, the real
    builders."""
    cfg = boundary.typed(compose_conf(*overrides))
    splits = build_splits(cfg.data)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, splits.info)
    init_weights(FinetuneConfig(init_from=str(ckpt), ema=False, strict=True), model)
    loader = build_eval_loader(splits.test, cfg.loader, ONE)
    return evaluate(model, loader, ONE, "off", classification(splits.info.num_classes))


def _fresh_small_cnn(num_classes: int) -> torch.nn.Module:
    torch.manual_seed(0)  # as train.build seeds before building the model
    return small_cnn(num_classes=num_classes, in_channels=1, image_size=8)


@pytest.mark.slow
def test_checkpoint_evaluates_anywhere_and_fine_tunes(tmp_path: Path) -> None:
    """A 2-rank run's last.pt: evaluated on 1 and 3 processes it gives the run's own count;
    finetune.init_from it trains a fresh run from step 0; a 3-class model takes all but its head."""
    run(train_cmd(tmp_path / "two", *TINY, "dist.nproc=2"))
    trained = run_dirs(tmp_path / "two")[0]
    ckpt = trained / "checkpoints" / "last.pt"
    own = summary(trained)
    assert own["world_size"] == 2 and own["steps"] == 4 and own["eval_count"] == 359
    out = tmp_path / "eval3"
    run(train_cmd(out, "logger=none", "epochs=0", f"finetune.init_from={ckpt}", "dist.nproc=3"))
    three, one = summary(run_dirs(out)[0]), evaluate_here(ckpt).summary()
    assert three["world_size"] == 3
    for s in (three, one):
        assert (s["eval_correct"], s["eval_count"]) == (own["eval_correct"], own["eval_count"])
        assert s["eval_per_class_correct"] == own["eval_per_class_correct"]
        assert s["eval_top5_correct"] == own["eval_top5_correct"]

    proc = run(
        train_cmd(tmp_path / "ft", *TINY, f"finetune.init_from={ckpt}", "max_steps_per_epoch=2")
    )
    ft = run_dirs(tmp_path / "ft")[0]
    assert summary(ft)["steps"] == 2  # a fresh run: step 0, epoch 0, a new optimizer
    assert f"initialised from {ckpt}: 14 tensors loaded" in proc.stdout + proc.stderr
    payload = torch.load(ft / "checkpoints" / "last.pt", weights_only=True)
    assert payload["progress"]["step"] == 2 and payload["world_size"] == 1

    # 10 classes -> 3: every tensor but the head is the checkpoint's, the head starts fresh.
    source = torch.load(ckpt, weights_only=True)["model"]
    model, fresh = _fresh_small_cnn(3), _fresh_small_cnn(3).state_dict()
    report = init_weights(FinetuneConfig(init_from=str(ckpt), ema=False, strict=True), model)
    head = ["10.weight", "10.bias"]
    assert report.reinitialised == head and not report.missing and not report.unexpected
    for key, value in model.state_dict().items():
        assert torch.equal(value, fresh[key] if key in head else source[key]), key


@pytest.mark.slow
def test_best_checkpoint_holds_the_best_epoch_and_early_stop(tmp_path: Path) -> None:
    """best.pt is the epoch with the best test/accuracy: evaluating it gives that value exactly;
    selection.patience=1 ends the run after the first epoch without a new best; with
    logger.log_checkpoints=best each new best is one version of the W&B model artifact."""
    monitor = ["selection.monitor=test/accuracy", "selection.patience=1"]
    artifacts = ["logger=wandb", "logger.log_checkpoints=best"]
    env = run_env(WANDB_DATA_DIR=str(tmp_path / "wandb-data"))  # W&B's artifact staging copies
    run(train_cmd(tmp_path, *TINY, "epochs=5", "optim.lr=0.5", *monitor, *artifacts), env=env)
    d = run_dirs(tmp_path)[0]
    rows = [r for r in jsonl(d / "rank0" / "metrics.jsonl") if "test/accuracy" in r]
    accuracy = [r["test/accuracy"] for r in rows]
    best = max(range(len(accuracy)), key=lambda e: (accuracy[e], -e))  # the first best epoch
    assert len(rows) == best + 2 < 5, accuracy  # patience 1: stopped after one more epoch
    payload = torch.load(d / "checkpoints" / "best.pt", weights_only=True)
    assert payload["selection"] == {
        "monitor": "test/accuracy",
        "value": accuracy[best],
        "epoch": best,
    }
    assert payload["progress"]["epoch"] == best + 1
    assert evaluate_here(d / "checkpoints" / "best.pt").values["accuracy"] == accuracy[best]
    (wb,) = find_runs(d)
    versions = [a for a in wb.artifacts if a["type"] == "model"]
    new_bests = [e for e in range(len(accuracy)) if accuracy[e] > max(accuracy[:e], default=-1)]
    assert [a["metadata"]["epoch"] for a in versions] == new_bests
    assert all(a["files"] == ["best.pt"] and "best" in a["aliases"] for a in versions)
    assert versions[-1]["metadata"]["test/accuracy"] == accuracy[best]


def test_label_smoothing_is_the_training_loss() -> None:
    torch.manual_seed(0)
    model = small_cnn(num_classes=10, in_channels=1, image_size=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    tr = step_trainer(model=model, optimizer=optimizer, task=Classification(label_smoothing=0.2))
    x, y = torch.randn(6, 1, 8, 8), torch.arange(6)
    model.eval()  # BN running stats: the expected value sees the same normalisation
    expected = F.cross_entropy(model(x), y, label_smoothing=0.2)
    loss = _step(tr, x, y, want_norm=False).loss
    assert torch.allclose(loss, expected) and not torch.allclose(loss, F.cross_entropy(model(x), y))


def test_a_diverged_models_evaluation_reports_its_nan_loss_and_its_counts() -> None:
    """An fp16 run that overflowed gives NaN logits: the counts stay whole, the loss is NaN
    (it used to stop the run converting the NaN to an int)."""
    task = Classification()
    task.setup(DataInfo(num_classes=3), torch.device("cpu"))
    sums = task.sums(torch.device("cpu"))
    task.update(sums, torch.tensor([[0.0, 9.0, 0.0], [float("nan")] * 3]), torch.tensor([1, 2]))
    result = task.result(sums)
    assert (result.count, result.details["per_class_count"]) == (2, [0, 1, 1])
    assert result.values["correct"] == 1 and torch.isnan(torch.tensor(result.values["loss"]))


def test_val_fraction_carves_a_disjoint_seeded_split() -> None:
    cfg = boundary.typed(compose_conf("data.val_fraction=0.25"))
    a, b = build_splits(cfg.data), build_splits(cfg.data)
    full = build_splits(boundary.typed(compose_conf()).data)
    assert (len(a.train), len(a.val), len(a.test)) == (1078, 360, 359)
    train, val = set(a.train.indices.tolist()), set(a.val.indices.tolist())
    assert not train & val and train | val == set(range(len(full.train)))
    assert (a.val.indices == b.val.indices).all()  # seeded: the same carve every time
    x, y, j = a.val[3]
    assert j == 3 and torch.equal(x, full.train[int(a.val.indices[3])][0])


@pytest.mark.slow
def test_val_split_is_evaluated_each_epoch_and_test_once(tmp_path: Path) -> None:
    run(
        train_cmd(
            tmp_path,
            *TINY,
            "epochs=2",
            "data.val_fraction=0.25",
            "selection.monitor=val/loss",
            "selection.mode=min",
        )
    )
    d = run_dirs(tmp_path)[0]
    rows = jsonl(d / "rank0" / "metrics.jsonl")
    val = [r for r in rows if "val/accuracy" in r]
    test = [r for r in rows if "test/accuracy" in r]
    assert [r["epoch"] for r in val] == [0, 1] and len(test) == 1
    assert next(r for r in rows if "data/val_size" in r)["data/val_size"] == 360
    s = summary(d)
    assert (s["eval_count"], s["val_size"], s["train_size"]) == (359, 360, 1078)
    assert s["eval_accuracy"] == test[0]["test/accuracy"]
    best = torch.load(d / "checkpoints" / "best.pt", weights_only=True)["selection"]
    assert best["value"] == min(r["val/loss"] for r in val)
    # Any split at any world size: best.pt on the validation split, on 2 ranks.
    evaluated = ["epochs=0", "data.val_fraction=0.25", "eval_split=val", "dist.nproc=2"]
    ckpt = d / "checkpoints" / "best.pt"
    run(train_cmd(tmp_path / "eval", "logger=none", f"finetune.init_from={ckpt}", *evaluated))
    s = summary(run_dirs(tmp_path / "eval")[0])
    assert (s["eval_split"], s["eval_count"], s["world_size"]) == ("val", 360, 2)
    assert s["eval_correct"] == val[best["epoch"]]["val/correct"]
