"""Forking the template as a new user would: own model, own data, presets, debug, rename.

Everything runs for real — Hydra composition, train.py subprocesses with 2 gloo ranks, the
shell commands from docs/forking.md's "Make it yours" in a copy of the repository — on tiny data.

Presets are chosen with ``experiment=<name>`` (the last slot of the defaults list, so its keys
win); ``debug=<option>`` is listed in conf/config.yaml after ``_self_`` and overrides the base.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import CPU, PY, ROOT, jsonl, run, run_env, summary, train_cmd
from omegaconf import DictConfig, OmegaConf

from ddp_template.amp import autocast
from ddp_template.config.boundary import typed
from ddp_template.data.array import array_dataset
from ddp_template.errors import ConfigError
from ddp_template.models import build_model
from ddp_template.optim import build_optimizer
from ddp_template.splits import build_splits

EXPERIMENTS = ["digits_ddp", "cifar10_resnet18", "synthetic_throughput"]
FAST = ["logger=none", "epochs=1", "max_steps_per_epoch=3", "checkpoint.enabled=false"]


def only_run_dir(out: Path) -> Path:
    (run_dir,) = [p for p in (out / "outputs").iterdir() if p.is_dir()]
    return run_dir


# --- data=array: the worked dataset example ------------------------------------------------


def _npz(
    path: Path, n_train: int = 40, n_test: int = 10, features: int = 16, **replace: np.ndarray
) -> Path:
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.normal(size=(n_train, features)),
        "y_train": np.arange(n_train) % 3,
        "x_test": rng.normal(size=(n_test, features)),
        "y_test": np.arange(n_test) % 4,
    }
    arrays.update(replace)
    np.savez(path, **arrays)
    return path


def _csv_dir(root: Path, features: int = 64, header: bool = True) -> Path:
    root.mkdir()
    rng = np.random.default_rng(1)
    for split, n in (("train", 30), ("test", 12)):
        table = np.column_stack([np.arange(n) % 5, rng.normal(size=(n, features))])
        names = ",".join(["label"] + [f"f{k}" for k in range(features)])
        np.savetxt(
            root / f"{split}.csv", table, delimiter=",", header=names if header else "", comments=""
        )
    return root


def test_array_npz_flat_features_become_one_pixel_images(
    tmp_path: Path, compose_cfg: Callable[..., DictConfig]
) -> None:
    splits = build_splits(compose_cfg("data=array", f"data.path={_npz(tmp_path / 'd.npz')}").data)
    assert (len(splits.train), len(splits.test)) == (40, 10)
    assert splits.info.num_classes == 4  # max label over both splits (test has a 3) + 1
    x, y, i = splits.train[7]
    assert x.shape == (16, 1, 1) and x.dtype == torch.float32 and (y, i) == (1, 7)
    assert (splits.info.in_channels, splits.info.image_size) == (16, 1)


def test_array_csv_folder_with_image_shape(
    tmp_path: Path, compose_cfg: Callable[..., DictConfig]
) -> None:
    root = _csv_dir(tmp_path / "csv")
    cfg = compose_cfg("data=array", f"data.path={root}", "data.image_shape=[1,8,8]")
    splits = build_splits(cfg.data)
    assert (len(splits.train), len(splits.test), splits.info.num_classes) == (30, 12, 5)
    x, y, i = splits.test[11]
    assert x.shape == (1, 8, 8) and (y, i) == (1, 11)
    headerless = array_dataset(str(_csv_dir(tmp_path / "plain", header=False)), [1, 8, 8])
    assert torch.equal(headerless.train[3][0], splits.train[3][0])


@pytest.mark.parametrize(
    "case,needle",
    [
        ("missing", r"data.path=.*nope.*neither a .npz file nor a folder"),
        ("keys", r"data.path=.* lacks the arrays \['y_test'\]"),
        ("labels", r"data.path=.*train labels must be integers"),
        ("shape", r"16 features but data.image_shape=\[1, 8, 8\] needs 64"),
        ("square", r"data.image_shape=\[1, 2, 8\] must be \[C, H, W\] with H == W"),
        ("csv", r"data.path=.* has no test.csv"),
    ],
)
def test_array_bad_input_names_the_key(tmp_path: Path, case: str, needle: str) -> None:
    path, shape = tmp_path / "d.npz", None
    if case == "missing":
        path = tmp_path / "nope"
    elif case == "keys":
        rng = np.random.default_rng(0)
        np.savez(
            path,
            x_train=rng.normal(size=(4, 2)),
            y_train=np.zeros(4),
            x_test=rng.normal(size=(2, 2)),
        )
    elif case == "labels":
        _npz(path, y_train=np.linspace(0, 1, 40))
    elif case in ("shape", "square"):
        _npz(path)
        shape = [1, 8, 8] if case == "shape" else [1, 2, 8]
    else:
        path = tmp_path / "csv"
        path.mkdir()
        (path / "train.csv").write_text("0,1.0\n1,2.0\n")
    with pytest.raises(ConfigError, match=needle):
        array_dataset(str(path), shape)


# --- a user's own model and dataset, kept outside the repository ---------------------------

MYMODELS = """
from torch import nn


def tiny_mlp(num_classes, in_channels, image_size, hidden=16):
    features = in_channels * image_size * image_size
    return nn.Sequential(nn.Flatten(), nn.Linear(features, hidden), nn.ReLU(),
                         nn.Linear(hidden, num_classes))
"""

MYDATA = """
import torch

from ddp_template.data.contract import DataInfo, IndexedTensors, Splits


def blobs(size=64, test_size=16, features=4, num_classes=3, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def split(n):
        y = torch.randint(0, num_classes, (n,), generator=gen)
        x = torch.randn(n, features, 1, 1, generator=gen) + y.view(-1, 1, 1, 1)
        return IndexedTensors(x, y)

    return Splits(split(size), split(test_size), DataInfo(num_classes, features, image_size=1))
"""


def test_own_model_and_dataset_on_two_ranks(tmp_path: Path) -> None:
    code, conf = tmp_path / "code", tmp_path / "conf"
    for path, text in (
        (code / "mymodels.py", MYMODELS),
        (code / "mydata.py", MYDATA),
        (conf / "model" / "tiny_mlp.yaml", "_target_: mymodels.tiny_mlp\nhidden: 8\n"),
        (conf / "data" / "blobs.yaml", "_target_: mydata.blobs\nsize: 50\n"),
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    paths = [str(code), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = run_env(PYTHONPATH=os.pathsep.join(paths))
    run(
        train_cmd(
            tmp_path,
            f"hydra.searchpath=[file://{conf}]",
            "model=tiny_mlp",
            "data=blobs",
            "dist.nproc=2",
            "loader.batch_size=8",
            *FAST,
        ),
        env=env,
    )
    run_dir = only_run_dir(tmp_path)
    result = summary(run_dir)
    assert (result["world_size"], result["train_size"], result["eval_count"]) == (2, 50, 16)
    assert result["steps"] == 3
    epochs = [
        [r for r in jsonl(run_dir / f"rank{k}" / "metrics.jsonl") if "data/samples" in r]
        for k in (0, 1)
    ]
    assert [e[0]["data/samples"] for e in epochs] == [24, 24]  # 3 steps x batch 8 per rank
    hydra_cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    assert hydra_cfg.model._target_ == "mymodels.tiny_mlp" and hydra_cfg.model.hidden == 8


def test_another_torchvision_model_trains_a_step(compose_cfg: Callable[..., DictConfig]) -> None:
    cfg = compose_cfg(
        "model=torchvision",
        "model.name=shufflenet_v2_x0_5",
        "data=synthetic",
        "data.size=4",
        "data.image_size=16",
        "data.num_classes=5",
    )
    loss = _one_step(cfg)
    assert torch.isfinite(loss)


def _one_step(cfg: Any, batch: int = 4) -> torch.Tensor:
    """Build the config's data, model and optimizer; one optimizer step; the loss."""
    cfg = typed(cfg)
    splits = build_splits(cfg.data)
    torch.manual_seed(0)
    model = build_model(cfg.model, splits.info).train()
    optimizer = build_optimizer(cfg.optim, model)
    items = [splits.train[i] for i in range(batch)]
    x, y = torch.stack([it[0] for it in items]), torch.tensor([it[1] for it in items])
    before = [p.detach().clone() for p in model.parameters()]
    with autocast(cfg.amp.mode, torch.device("cpu")):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    return loss.detach()


# --- experiment presets and the debug group ----------------------------------------------


# Presets of an optional folder: composed and stepped by the tests in its own folder.
FOLDER_EXPERIMENTS = {"lm_bytes": "tests/optional/tokens"}


def test_every_experiment_is_listed() -> None:
    on_disk = {p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")}
    folders = on_disk & set(FOLDER_EXPERIMENTS)
    assert sorted(on_disk - folders) == sorted(EXPERIMENTS)
    assert all((ROOT / FOLDER_EXPERIMENTS[name]).is_dir() for name in folders)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_and_steps(name: str, compose_cfg: Callable[..., DictConfig]) -> None:
    cfg = compose_cfg(f"experiment={name}")
    expected = {
        "digits_ddp": ("small_cnn", "digits", 2, "off"),
        "cifar10_resnet18": ("resnet18", "cifar10", 1, "bf16"),
        "synthetic_throughput": ("small_cnn", "synthetic", 1, "off"),
    }[name]
    got = (
        cfg.model._target_.rsplit(".", 1)[1],
        cfg.data._target_.rsplit(".", 1)[1],
        cfg.dist.nproc,
        cfg.amp.mode,
    )
    assert got == expected
    if name != "digits_ddp":  # CIFAR-10 cannot be had offline; the preset's shape can
        cfg = compose_cfg(
            f"experiment={name}", "data=synthetic", "data.size=8", "data.image_size=32"
        )
    assert torch.isfinite(_one_step(cfg))


def test_debug_overfit_drives_the_loss_down(tmp_path: Path) -> None:
    run(train_cmd(tmp_path, "debug=overfit"))
    rows = jsonl(only_run_dir(tmp_path) / "rank0" / "metrics.jsonl")
    epochs = [r for r in rows if "data/samples" in r]
    assert {(r["data/first_index"], r["data/last_index"]) for r in epochs} == {(0, 63)}
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 60 and losses[-1] < 0.25 * losses[0], losses


def _conf_copy(tmp_path: Path) -> Path:
    """conf/ without conf/local/, as in a fresh clone."""
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf, ignore=shutil.ignore_patterns("local"))
    return conf


def test_local_and_debug_override_the_base_and_presets_win(
    tmp_path: Path, compose_cfg: Callable[..., DictConfig]
) -> None:
    conf = _conf_copy(tmp_path)
    (conf / "local").mkdir()
    local = "# @package _global_\nloader:\n  num_workers: 3\n"
    (conf / "local" / "default.yaml").write_text(local)
    cfg = compose_cfg(conf=conf)
    assert (cfg.epochs, cfg.loader.num_workers) == (10, 3)  # local overrides the base keys
    cfg = compose_cfg("debug=fast", conf=conf)
    fast = (cfg.dist.nproc, cfg.epochs, cfg.loader.num_workers, cfg.logger.name)
    assert fast == (1, 1, 0, "none")
    cfg = compose_cfg("experiment=digits_ddp", "debug=fast", conf=conf)
    assert cfg.dist.nproc == 2  # the preset is applied last: its keys win over debug's
    assert compose_cfg("experiment=cifar10_resnet18", conf=conf).model._target_.endswith("resnet18")


def test_local_example_overrides_and_is_optional(
    tmp_path: Path, compose_cfg: Callable[..., DictConfig]
) -> None:
    conf = _conf_copy(tmp_path)
    plain = compose_cfg("data=cifar10", conf=conf)  # a fresh clone: no conf/local/ at all
    assert (plain.paths.data_root, plain.logger.entity) == ("data", None)
    (conf / "local").mkdir()
    shutil.copy(ROOT / "docs" / "local.example.yaml", conf / "local" / "default.yaml")
    cfg = compose_cfg("data=cifar10", conf=conf)
    assert (cfg.paths.data_root, cfg.logger.entity) == ("/datasets", "my-team")
    assert cfg.data.root == "/datasets"  # data roots follow paths.data_root
    assert compose_cfg("logger.entity=me", conf=conf).logger.entity == "me"


# --- the doc's own commands ---------------------------------------------------------------


def _doc_block(heading: str) -> str:
    """The first ```bash block under a heading of the Make-it-yours section."""
    text = (ROOT / "docs" / "forking.md").read_text()
    section = text.split(heading, 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


@pytest.mark.skipif(shutil.which("git") is None, reason="the rename commands use git grep")
def test_rename_commands_work_on_a_copy(tmp_path: Path) -> None:
    """docs/forking.md's rename commands leave a copy that trains: debug=fast on data=array (the
    debug=fast-on-own-arrays smoke path's one run, too)."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    repo = tmp_path / "repo"
    for rel in filter(None, files.split("\0")):
        if (ROOT / rel).is_file():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, repo / rel)
    git = ["git", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run(
        ["bash", "-euo", "pipefail", "-c", _doc_block("### 1. Rename the package")],
        cwd=repo,
        check=True,
    )
    left = subprocess.run(
        ["git", "grep", "-nI", "-e", "ddp_template", "-e", "ddp-template"],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    assert left.returncode == 1, left.stdout[:2000]  # 1: no match anywhere
    assert (repo / "src" / "my_project" / "data" / "array.py").is_file()
    assert 'name = "my-project"' in (repo / "pyproject.toml").read_text()
    cmd = [
        PY,
        str(repo / "train.py"),
        f"paths.output_root={tmp_path / 'outputs'}",
        CPU,
        "debug=fast",
        "data=array",
        f"data.path={_npz(tmp_path / 'd.npz')}",
    ]
    env = run_env(PYTHONPATH=str(repo / "src"))
    run(cmd, env=env, cwd=repo)  # asserts exit 0
    # The same run is the quickest user path too: own arrays, no code, a smoke run that ends.
    run_dir = only_run_dir(tmp_path)
    assert summary(run_dir)["steps"] == 2  # 40 samples / batch 32: min(2 batches, 5 steps)
    assert not (run_dir / "rank0" / "wandb").exists()  # debug=fast turns W&B off
    assert not list((run_dir / "checkpoints").glob("*.pt"))


def test_sweep_over_an_experiment(tmp_path: Path) -> None:
    """The doc's sweep, shortened by debug=fast: one job per learning rate."""
    run(
        train_cmd(
            tmp_path,
            "-m",
            "+experiment=synthetic_throughput",
            "optim.lr=0.1,0.05",
            "debug=fast",
            "data.size=64",
            "data.test_size=16",
            "data.image_size=8",
            "loader.batch_size=16",
        )
    )
    (sweep,) = (tmp_path / "multirun").iterdir()
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1"]
    lrs = {OmegaConf.load(sweep / j / ".hydra" / "config.yaml").optim.lr for j in jobs}
    assert lrs == {0.1, 0.05}
    assert all(summary(sweep / j)["steps"] == 4 for j in jobs)
