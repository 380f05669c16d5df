"""A checkpoint of named stateful parts: saved and restored by name, in order; each part
refuses its own misfit in one sentence that the checkpoint prefixes with the file's path; a
file of an older format is refused naming its version. In-process, one rank."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import cpu_rank

from ddp_template import checkpoint
from ddp_template.amp import scaler_part
from ddp_template.checkpoint import Checkpointer, Found, find_resume
from ddp_template.config.schema import CheckpointConfig, EmaConfig
from ddp_template.errors import ConfigError
from ddp_template.models import small_cnn, weights_part
from ddp_template.selection import Selection
from ddp_template.switches.ema import EMA

ONE = cpu_rank(0, 1)


class Counter:
    """A minimal part: what a new research-loop switch would be."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def checkpointer(tmp_path: Path, **parts) -> Checkpointer:
    return Checkpointer(
        directory=tmp_path,
        cfg=CheckpointConfig(),
        parts=parts,
        rank_parts={"counter": Counter()},
        config_yaml="",
        info=ONE,
    )


def test_parts_round_trip_by_name(tmp_path: Path) -> None:
    saved = checkpointer(
        tmp_path, model=weights_part(small_cnn(num_classes=3, in_channels=1, image_size=8))
    )
    saved.rank_parts["counter"].n = 7
    saved.save(copies=("best.pt",))
    payload = checkpoint.load(tmp_path / "best.pt")
    assert payload["ranks"] == [{"counter": {"n": 7}}] and payload["world_size"] == 1
    fresh = checkpointer(
        tmp_path, model=weights_part(small_cnn(num_classes=3, in_channels=1, image_size=8))
    )
    fresh.restore(find_resume("auto", tmp_path))
    assert fresh.rank_parts["counter"].n == 7
    a, b = saved.parts["model"].target.state_dict(), fresh.parts["model"].target.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_each_part_refuses_its_own_misfit(tmp_path: Path) -> None:
    checkpointer(
        tmp_path, model=weights_part(small_cnn(num_classes=3, in_channels=1, image_size=8))
    ).save()
    found = find_resume("auto", tmp_path)
    other = checkpointer(
        tmp_path, model=weights_part(small_cnn(num_classes=4, in_channels=1, image_size=8))
    )
    with pytest.raises(ConfigError, match=r"last.pt: it holds a different model .*resume=never"):
        other.restore(found)
    needs_more = checkpointer(
        tmp_path, model=weights_part(small_cnn(num_classes=3, in_channels=1, image_size=8))
    )
    needs_more.parts["selection"] = Selection(monitor="test/loss", mode="min", patience=None)
    with pytest.raises(ConfigError, match=r"holds no selection part, which this run needs"):
        needs_more.restore(found)
    scaler = scaler_part(torch.amp.GradScaler("cpu", enabled=True))
    with pytest.raises(ValueError, match="another amp mode"):
        scaler.load_state_dict(torch.amp.GradScaler("cpu", enabled=False).state_dict())


def test_a_part_that_can_start_fresh_does_and_an_extra_part_is_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = small_cnn(num_classes=3, in_channels=1, image_size=8)
    checkpointer(tmp_path, model=weights_part(model), extra=Counter()).save()
    ema = EMA(
        model=small_cnn(num_classes=3, in_channels=1, image_size=8),
        cfg=EmaConfig(decay=0.9),
        info=ONE,
    )
    ema.updates = 3
    resumed = checkpointer(tmp_path, model=weights_part(ema.source), ema=ema)
    with caplog.at_level("INFO", logger="ddp_template"):
        resumed.restore(find_resume("auto", tmp_path))
    assert "holds no ema part: the EMA starts from its weights" in caplog.text
    assert "holds a extra part, which this run has not: not restored" in caplog.text
    assert ema.updates == 0 and torch.equal(
        ema.module.state_dict()["0.weight"], model.state_dict()["0.weight"]
    )


def test_an_older_format_is_refused_naming_its_version(tmp_path: Path) -> None:
    old = tmp_path / "last.pt"
    checkpoint.save_atomic({"format": 2, "model": {}}, old)
    with pytest.raises(ConfigError, match=r"has format 2, .* reads format 4\); pass another"):
        checkpoint.load(old)
    with pytest.raises(ConfigError, match="holds a different model"):
        checkpoint.restore(
            Found(old, {"world_size": 1, "model": {"x": torch.ones(1)}, "ranks": [{}]}),
            parts={"model": weights_part(small_cnn(num_classes=3, in_channels=1, image_size=8))},
            rank_parts={},
            info=ONE,
        )


def test_checkpoint_py_names_no_part() -> None:
    text = Path(checkpoint.__file__).read_text().lower()
    assert not re.findall(r"\b(ema|scaler|best|sampler|optimizer|rng)\b", text)
