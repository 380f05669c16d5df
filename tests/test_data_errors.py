"""Bad input for every key of fine-tuning, evaluation, augmentation and the data builders:
one sentence naming the key, the value and the fix (exit 2 from train.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_conf
from helpers import run, train_cmd

from ddp_template import checks
from ddp_template.checkpoint import FORMAT_VERSION, save_atomic
from ddp_template.config import boundary
from ddp_template.config.schema import FinetuneConfig, TransformsConfig
from ddp_template.data.transforms import apply_transforms
from ddp_template.errors import EXIT_CONFIG_ERROR, ConfigError
from ddp_template.finetune import init_weights
from ddp_template.models import check_batch_statistics, small_cnn, torchvision_model
from ddp_template.splits import build_splits


def refused(call, *named: str) -> str:
    """``call()`` raises one ConfigError sentence (key=value; fix.) naming ``named``."""
    with pytest.raises(ConfigError) as caught:
        call()
    msg = str(caught.value)
    assert "\n" not in msg and msg.endswith(".") and "; " in msg, msg
    for part in named:
        assert part in msg, (part, msg)
    return msg


def checked(*overrides: str) -> None:
    checks.check(boundary.typed(compose_conf(*overrides)))


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["finetune.ema=true"], ["finetune.ema=true", "finetune.init_from=<checkpoint>"]),
        (["finetune.strict=false"], ["finetune.strict=false", "finetune.init_from=<checkpoint>"]),
        (["finetune.init_from=a.pt", "resume=b.pt"], ["finetune.init_from=a.pt", "resume=b.pt"]),
        (["task.label_smoothing=1.5"], ["task.label_smoothing=1.5", "task.label_smoothing=0.1"]),
        (["data.val_fraction=1.5"], ["data.val_fraction=1.5", "data.val_fraction=0.1"]),
        (["selection.monitor=test/f1"], ["selection.monitor=test/f1", "'test/top5'"]),
        (["selection.monitor=val/accuracy"], ["selection.monitor=val/accuracy", "val_fraction"]),
        (
            ["selection.monitor=test/loss", "checkpoint.enabled=false"],
            ["selection.monitor=test/loss", "checkpoint.enabled=true"],
        ),
        (["eval_split=val"], ["eval_split=val", "data.val_fraction"]),
        (["selection.patience=0"], ["selection.patience=0", ">= 1"]),
        (["selection.patience=2"], ["selection.patience=2", "selection.monitor=test/accuracy"]),
        (["transforms=cifar", "transforms.padding=-1"], ["transforms.padding=-1", "=4"]),
        (["transforms=imagenet", "transforms.scale=[0.5,0.1]"], ["scale=[0.5, 0.1]", "[0.08,1.0]"]),
        (["transforms.padding=8"], ["transforms.padding=8 belongs to transforms=cifar", "none"]),
        (["transforms=cifar", "transforms.scale=[0.5,1]"], ["transforms.scale=[0.5, 1.0] belongs"]),
        (["transforms=cifar", "transforms.padding=null"], ["cifar needs it", "padding=4"]),
        (["transforms.mean=[0.5]"], ["transforms.mean=[0.5]", "give both"]),
        (
            ["transforms=imagenet", "transforms.std=[0,1,1]"],
            ["transforms.std=[0.0, 1.0, 1.0]", "positive"],
        ),
    ],
)
def test_startup_check_refuses(overrides: list[str], named: list[str]) -> None:
    refused(lambda: checked(*overrides), *named)


def test_enum_keys_are_refused_by_hydra() -> None:
    for override in ("selection.mode=median", "transforms=autoaugment", "eval_split=holdout"):
        with pytest.raises(Exception, match="median|autoaugment|holdout"):
            compose_conf(override)
    checked("selection.monitor=val/top5", "data.val_fraction=0.2", "selection.mode=min")


def _checkpoint(tmp_path: Path, **extra) -> Path:
    model = small_cnn(num_classes=10, in_channels=1, image_size=8)
    path = tmp_path / "ckpt.pt"
    save_atomic({"format": FORMAT_VERSION, "model": model.state_dict(), **extra}, path)
    return path


def test_init_from_refusals(tmp_path: Path) -> None:
    model = small_cnn(num_classes=10, in_channels=1, image_size=8)
    refused(
        lambda: init_weights(FinetuneConfig(init_from="nope.pt", ema=False, strict=True), model),
        "finetune.init_from=nope.pt",
        "last.pt or best.pt",
    )
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    refused(
        lambda: init_weights(FinetuneConfig(init_from=str(junk), ema=False, strict=True), model),
        str(junk),
        "finetune.init_from=<path>",
    )
    path = _checkpoint(tmp_path)
    refused(
        lambda: init_weights(FinetuneConfig(init_from=str(path), ema=True, strict=True), model),
        "finetune.ema=true",
        "no EMA weights",
        "finetune.ema=false",
    )
    deeper = small_cnn(num_classes=10, in_channels=1, image_size=8, depth=3)
    refused(
        lambda: init_weights(FinetuneConfig(init_from=str(path), ema=False, strict=True), deeper),
        f"finetune.init_from={path}",
        "missing keys",
        "finetune.strict=false",
    )
    report = init_weights(FinetuneConfig(init_from=str(path), ema=False, strict=False), deeper)
    assert report.missing and report.unexpected and "0.weight" in report.loaded  # the rest fits

    shifted = {k: v + 1 for k, v in model.state_dict().items() if v.is_floating_point()}
    path = _checkpoint(tmp_path, ema={"model": shifted})
    init_weights(FinetuneConfig(init_from=str(path), ema=True, strict=False), model)
    assert torch.equal(model.state_dict()["0.weight"], shifted["0.weight"])


def test_torchvision_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A weights file the test writes itself loads; bad names and no network are refused."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "hub"))  # nothing cached
    kwargs = dict(num_classes=10, in_channels=3, image_size=32, name="mobilenet_v3_small")
    source = torchvision_model(**kwargs)[1]
    torch.save({k: v + 1 for k, v in source.state_dict().items()}, tmp_path / "w.pth")
    # Another number of classes: everything but the classifier's last layer is the file's.
    loaded = torchvision_model(**{**kwargs, "num_classes": 3}, weights_path=str(tmp_path / "w.pth"))
    state = loaded[1].state_dict()
    assert torch.equal(state["features.0.0.weight"], source.state_dict()["features.0.0.weight"] + 1)
    assert state["classifier.3.weight"].shape == (3, 1024)

    refused(
        lambda: torchvision_model(**kwargs, weights="IMAGENET9K"),
        "model.weights=IMAGENET9K",
        "IMAGENET1K_V1",
    )
    refused(
        lambda: torchvision_model(**kwargs, weights="DEFAULT"),
        "model.weights=DEFAULT",
        "model.weights_path=<local .pth>",
    )
    refused(
        lambda: torchvision_model(**kwargs, weights_path="missing.pth"),
        "model.weights_path=missing.pth",
        "torch.save(model.state_dict(), path)",
    )
    refused(
        lambda: torchvision_model(**kwargs, weights="DEFAULT", weights_path="w.pth"),
        "model.weights=DEFAULT",
        "model.weights_path=w.pth",
    )
    torch.save({"features.0.0.weight": torch.zeros(1)}, tmp_path / "other.pth")
    refused(
        lambda: torchvision_model(**kwargs, weights_path=str(tmp_path / "other.pth")),
        "model.weights_path=",
        "missing keys",
    )


def test_data_builder_refusals(tmp_path: Path) -> None:
    cfg = boundary.typed(compose_conf("data.val_fraction=0.0001"))
    refused(lambda: build_splits(cfg.data), "data.val_fraction=0.0001", "non-empty")
    digits = build_splits(boundary.typed(compose_conf()).data)
    refused(
        lambda: apply_transforms(
            digits, TransformsConfig(mean=[0.5, 0.5, 0.5], std=[1.0, 1.0, 1.0]), 0
        ),
        "transforms.mean=[0.5, 0.5, 0.5]",
        "has 1",
    )
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    images = boundary.typed(compose_conf("data=imagefolder", f"data.path={tmp_path}")).data
    refused(lambda: build_splits(images), f"data.path={tmp_path}", "train/<class>/")
    for split in ("train", "val"):
        (tmp_path / split / "cat").mkdir()
        (tmp_path / split / "cat" / "a.png").write_bytes(b"not a png")
    refused(lambda: build_splits(images), f"data.path={tmp_path}", "a.png", "replace or remove")


def test_batch_of_one_with_batch_norm_is_refused() -> None:
    def flat():  # CSV features as 1x1 images
        return torch.zeros(1, 5, 1, 1)

    model = small_cnn(num_classes=3, in_channels=5, image_size=1)
    check_batch_statistics(model, flat, last_batch=2)
    refused(
        lambda: check_batch_statistics(model, flat, last_batch=1),
        "sampler.drop_last_batch=true",
        "batch_size",
    )
    images = small_cnn(num_classes=3, in_channels=5, image_size=8)
    check_batch_statistics(images, lambda: torch.zeros(1, 5, 8, 8), last_batch=1)  # 64 a channel


def test_train_py_exits_2_on_data_errors(tmp_path: Path) -> None:
    """Through train.py: the builders' sentences, exit 2, no traceback (11 rows of flat CSV
    features, batch 5: the last batch holds 1 sample)."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 11), ("test", 4)):
        table = np.column_stack([rng.integers(0, 3, n), rng.normal(size=(n, 5))])
        np.savetxt(tmp_path / f"{split}.csv", table, delimiter=",")
    (tmp_path / "images" / "train").mkdir(parents=True)
    (tmp_path / "images" / "val").mkdir()
    cases = {
        "sampler.drop_last_batch=true": [
            "data=array",
            f"data.path={tmp_path}",
            "loader.batch_size=5",
        ],
        "train/<class>/": ["data=imagefolder", f"data.path={tmp_path / 'images'}"],
    }
    for expected, overrides in cases.items():
        cmd = train_cmd(tmp_path, "logger=none", "epochs=1", *overrides)
        proc = run(cmd, check=False)
        output = proc.stdout + proc.stderr
        assert proc.returncode == EXIT_CONFIG_ERROR, output[-3000:]
        assert expected in output and "Traceback" not in output, output[-3000:]


def test_uneven_is_a_stream_s_own_key_not_planned_data_s() -> None:
    """``data.uneven`` is an argument of a stream's factory (its kind's): planned data has no
    such key, and the root config none either."""
    from hydra.errors import ConfigCompositionException

    for override in ("uneven=join", "data.uneven=join"):
        with pytest.raises(ConfigCompositionException):
            compose_conf(override)
    assert "uneven" not in compose_conf()
