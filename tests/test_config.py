"""Real Hydra composition of every group option, and bad overrides rejected at startup."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import ROOT, run, train_cmd
from omegaconf import DictConfig, OmegaConf

from ddp_template.checks import check
from ddp_template.config.boundary import typed
from ddp_template.config.schema import SPLIT_KEYS, SamplerMode
from ddp_template.data.sampler_modes import SAMPLER_MODES
from ddp_template.errors import ConfigError
from ddp_template.models import build_model
from ddp_template.probe import check_fit
from ddp_template.splits import build_splits
from ddp_template.task import build_task

GROUPS = {
    "sampler": list(SAMPLER_MODES),
    "backend": ["auto", "gloo", "nccl"],
    "syncbn": ["off", "on"],
    "amp": ["off", "bf16", "fp16"],
    "model": ["small_cnn", "resnet18", "torchvision", "fcn", "mlp", "contrastive"],
    "data": [
        "digits",
        "synthetic",
        "cifar10",
        "mnist",
        "imagefolder",
        "array",
        "shapes",
        "diabetes",
    ],
    "optim": ["sgd", "adamw"],
    "logger": ["wandb", "none"],
    "task": ["classification", "segmentation", "regression", "lm", "contrastive"],
}


# Options of an optional folder (a data kind, the GPT): composed by the tests in its own folder.
KIND_OPTIONS = {
    ("data", "webdataset"): "tests/optional/webdataset",
    ("data", "tokens"): "tests/optional/tokens",
    ("data", "corpus"): "tests/optional/tokens",
    ("model", "gpt"): "tests/optional/gpt",
}


def test_every_group_folder_is_listed() -> None:
    """A new YAML in conf/<group>/ must be added here (and so get composed below), or be an
    optional kind's, whose tests compose it."""
    for group, options in GROUPS.items():
        on_disk = sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))
        kinds = [o for o in on_disk if (group, o) in KIND_OPTIONS]
        assert sorted(set(on_disk) - set(kinds)) == sorted(options), group
        for option in kinds:
            assert (ROOT / KIND_OPTIONS[group, option]).is_dir(), (group, option)


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_option_composes(group: str, option: str, compose_cfg: Callable[..., DictConfig]) -> None:
    cfg = compose_cfg(f"{group}={option}")
    choice = OmegaConf.to_container(cfg[group], resolve=True)
    assert choice, f"{group}={option} composed to an empty node"
    if group == "sampler":
        assert cfg.sampler.mode == option
        assert cfg.sampler.shuffle is SAMPLER_MODES[option].shuffles
    if group == "amp":
        assert cfg.amp.mode == option
    if group == "syncbn":
        assert cfg.syncbn.enabled is (option == "on")


# The task and data each model is for (a classifier's by default): a new model of another task
# adds its line here, and the probe checks that its output is what that task reads.
MODEL_JOBS = {
    "fcn": ["task=segmentation", "data=shapes", "data.size=8", "data.test_size=4"],
    "mlp": ["task=regression", "data=diabetes"],
    "contrastive": ["task=contrastive", "data=digits"],
}
CLASSIFIER = ["task=classification", "data=synthetic", "data.size=8", "data.image_size=16"]


@pytest.mark.parametrize("model", GROUPS["model"])
def test_every_model_instantiates_and_runs(
    model: str, compose_cfg: Callable[..., DictConfig]
) -> None:
    cfg = compose_cfg(f"model={model}", *MODEL_JOBS.get(model, CLASSIFIER))
    splits = build_splits(cfg.data)
    task = build_task(cfg.task)
    task.setup(splits.info, torch.device("cpu"))
    splits = task.training_data(splits, cfg.seed)  # what training reads (contrastive: views)
    net = build_model(cfg.model, splits.info)
    check_fit(task, net, splits, torch.device("cpu"), cfg.model._target_)  # what the task reads


def test_builtin_offline_data_instantiates(
    tmp_path: Path, compose_cfg: Callable[..., DictConfig]
) -> None:
    digits = build_splits(compose_cfg("data=digits").data)
    assert (len(digits.train), len(digits.test)) == (1438, 359)
    x, y, i = digits.train[5]
    assert x.shape == (1, 8, 8) and 0 <= y < 10 and i == 5
    synth = build_splits(compose_cfg("data=synthetic", "data.size=100", "data.test_size=7").data)
    assert (len(synth.train), len(synth.test)) == (100, 7)
    assert torch.equal(synth.train[3][0], synth.train[3][0])  # deterministic per index


def _image_folder(root: Path) -> Path:
    from PIL import Image

    for split in ("train", "val"):
        for cls, colour in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
            d = root / split / cls
            d.mkdir(parents=True)
            for k in range(3):
                Image.new("RGB", (20, 20), colour).save(d / f"{k}.png")
    return root


def test_imagefolder_instantiates(tmp_path: Path, compose_cfg: Callable[..., DictConfig]) -> None:
    cfg = compose_cfg(
        "data=imagefolder", f"data.path={_image_folder(tmp_path / 'img')}", "data.image_size=16"
    )
    splits = build_splits(cfg.data)
    assert len(splits.train) == 6 and splits.info.num_classes == 2
    assert splits.train[0][0].shape == (3, 16, 16)


def test_imagefolder_missing_path_names_the_key(
    tmp_path: Path, compose_cfg: Callable[..., DictConfig]
) -> None:
    cfg = compose_cfg("data=imagefolder", f"data.path={tmp_path / 'nope'}")
    with pytest.raises(ConfigError, match=r"data.path=.*nope.*train/"):
        build_splits(cfg.data)


@pytest.mark.parametrize("name", ["cifar10", "mnist"])
def test_torchvision_data_offline_is_a_clear_error(
    name: str, tmp_path: Path, compose_cfg: Callable[..., DictConfig]
) -> None:
    cfg = compose_cfg(f"data={name}", f"paths.data_root={tmp_path}")
    with pytest.raises(ConfigError, match=r"data.root=.* holds no .*copy the dataset"):
        build_splits(cfg.data)


@pytest.mark.parametrize(
    "override,needle",
    [
        ("sampler=nope", "sampler"),
        ("loader.batch_size=abc", "batch_size"),
        ("sampler.shufle=true", "shufle"),
        ("sampler.permutation=random", "permutation"),
        ("model=nope", "model"),
    ],
)
def test_bad_override_is_refused_by_composition_naming_it(
    override: str, needle: str, compose_cfg: Callable[..., DictConfig]
) -> None:
    """Hydra refuses these while composing, in train.py exactly as here, so before any run
    dir: that train.py then exits non-zero with Hydra's message and leaves no run dir is one
    start-up's claim, test_amp.py::test_unknown_amp_mode_fails_at_startup."""
    with pytest.raises(Exception) as err:
        compose_cfg(override, "logger=none")
    assert needle in f"{err.value} {err.value.__cause__}"


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["loader.batch_size=0"], "loader.batch_size=0"),
        (["sampler=sequential", "sampler.shuffle=true"], "sampler.shuffle"),
        (["backend=nccl"], "backend.name=nccl"),
        (["+nonsense_key=1"], "nonsense_key=1 is not a key of the config"),
        (["backend.lost_after_s=2"], "backend.lost_after_s=2.0 must exceed three heartbeats"),
        (["backend.heartbeat_s=0"], "backend.heartbeat_s=0.0 must be positive"),
    ],
)
def test_meaningless_values_are_refused_at_the_boundary(
    overrides: list[str], needle: str, compose_cfg: Callable[..., DictConfig]
) -> None:
    """train.py's own start-up checks (boundary.typed, boundary.check), in-process; the exit
    code 2 and one sentence they become is test_meaningless_values_get_one_sentence."""
    if "backend=nccl" in overrides and torch.cuda.is_available():
        pytest.skip("nccl is valid on a CUDA machine")
    cfg = compose_cfg(*overrides, "logger=none", "epochs=1")
    with pytest.raises(ConfigError, match=needle):
        check(typed(cfg))


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (
            ["loader.batch_size=0"],
            "loader.batch_size=0",
        ),  # refused by boundary.check, before any rank
        (["sampler=drop_last", "data=synthetic", "data.size=1", "dist.nproc=2"], "drop_last"),
    ],
)
def test_meaningless_values_get_one_sentence(
    tmp_path: Path, overrides: list[str], needle: str
) -> None:
    proc = run(train_cmd(tmp_path, *overrides, "logger=none", "epochs=1"), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert needle in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_sampler_modes_are_one_table() -> None:
    """The config enum, the sampler's mode table and conf/sampler/ name the same modes."""
    assert [str(m) for m in SamplerMode] == list(SAMPLER_MODES)
    assert sorted(p.stem for p in (ROOT / "conf" / "sampler").glob("*.yaml")) == sorted(
        SAMPLER_MODES
    )


def test_typed_config_reaches_builders_as_schema_dataclasses(
    compose_cfg: Callable[..., DictConfig],
) -> None:
    cfg = typed(compose_cfg("sampler=sequential", "optim=adamw", "logger=none"))
    assert type(cfg.sampler).__name__ == "SamplerConfig" and cfg.sampler.shuffle is False
    assert (str(cfg.sampler.mode), str(cfg.optim.name), str(cfg.logger.name)) == (
        "sequential",
        "adamw",
        "none",
    )
    assert type(str(cfg.sampler.mode)) is str  # plain strings reach samplers and checkpoints
    assert isinstance(cfg.model, DictConfig) and cfg.data._target_.endswith(".digits")
    assert not any(
        isinstance(getattr(cfg, f), DictConfig)
        for f in vars(cfg)
        if f not in ("model", "data", "task")
    )


@pytest.mark.parametrize(
    "override,needle",
    [
        ("+nonsense_key=1", "nonsense_key=1 is not a key of the config"),
        ("+sampler.shufle=true", "sampler.shufle=True is not a key of the config"),
        ("+model.widht=8", "model.widht=8 is not an argument of model._target_"),
    ],
)
def test_keys_no_schema_declares_are_refused(
    compose_cfg: Callable[..., DictConfig], override: str, needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        typed(compose_cfg(override))


def test_unknown_option_lists_only_options(tmp_path: Path) -> None:
    """Hydra's "Available options" for a misspelt option names the group's YAMLs only: the
    schemas live in their own group (``/schema/...``), not among the options."""
    proc = run(train_cmd(tmp_path, "model=nope"), check=False, timeout=60)
    listed = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Available options" in listed, listed[-2000:]
    options = listed.split("Available options in 'model':", 1)[1].split("Config search", 1)[0]
    assert options.split() == sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))


def test_template_data_keys_need_no_plus_with_a_forkers_factory(
    tmp_path: Path, compose_cfg: Callable[..., DictConfig]
) -> None:
    """``data.val_fraction`` (the keys the template reads itself, ``SPLIT_KEYS``) with a
    forker's factory YAML that names no schema and no such key: composed, typed, carved."""
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    (conf / "data" / "noisy.yaml").write_text("_target_: forker_denoise.noisy\nsize: 50\n")
    cfg = compose_cfg("data=noisy", "data.val_fraction=0.2", "logger=none", conf=conf)
    assert set(SPLIT_KEYS) <= set(cfg.data)
    splits = build_splits(typed(cfg).data)
    assert (len(splits.train), len(splits.val)) == (40, 10)  # type: ignore[arg-type]
    plain = compose_cfg("data=noisy", conf=conf)
    assert plain.data.val_fraction == 0.0 and len(build_splits(plain.data).train) == 50
