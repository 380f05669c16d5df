"""The research-loop keys: each bad value refused at startup in one sentence naming key, value
and fix; every key reaches the W&B config."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from ddp_template.checks import check
from ddp_template.config.boundary import plain, typed
from ddp_template.errors import ConfigError
from ddp_template.models import build_model
from ddp_template.splits import build_splits


@pytest.mark.parametrize(
    "override,needle",
    [
        ("optim.accumulate=0", "optim.accumulate=0 must be >= 1"),
        ("ddp.bucket_cap_mb=0", "ddp.bucket_cap_mb=0.0 must be positive"),
        ("ema.decay=1.0", "ema.decay=1.0 must be in (0, 1), e.g. 0.999, or null"),
        ("ema.decay=0", "ema.decay=0.0 must be in (0, 1)"),
        ("ema.every=0", "ema.every=0 must be >= 1"),
        ("ema.warmup=-1", "ema.warmup=-1 must be >= 0"),
        ("profiler.wait=-1", "profiler.wait=-1 must be >= 0"),
        ("profiler.warmup=-2", "profiler.warmup=-2 must be >= 0"),
        ("profiler.active=0", "profiler.active=0 must be >= 1"),
        (
            "ddp.static_graph=true optim.accumulate=2",
            "ddp.static_graph=true cannot run with optim.accumulate=2",
        ),
    ],
)
def test_bad_value_is_one_sentence(compose_cfg, override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        check(typed(compose_cfg(*override.split())))
    message = str(err.value)
    assert message.startswith(needle) and message.endswith(".")
    assert ". " not in message.replace("e.g. ", "")  # one sentence


@pytest.mark.parametrize(
    "override",
    [
        "compile=maybe",
        "ddp.find_unused_parameters=maybe",
        "ddp.static_graph=maybe",
        "ddp.gradient_as_bucket_view=maybe",
        "ddp.broadcast_buffers=maybe",
        "profiler.enabled=maybe",
        "ema.decay=high",
    ],
)
def test_wrong_type_is_refused_by_composition_naming_it(compose_cfg, override: str) -> None:
    with pytest.raises(ConfigCompositionException, match=override.replace(".", r"\.")):
        compose_cfg(override)


def test_bad_norm_names_the_choices(compose_cfg) -> None:
    """model.norm is a closed set: Hydra refuses another value naming the choices; a direct
    call of the factory refuses it in one sentence."""
    with pytest.raises(Exception, match=r"model\.norm=layer"):
        compose_cfg("model.norm=layer", "data=synthetic", "data.size=8", "data.image_size=8")
    cfg = compose_cfg("data=synthetic", "data.size=8", "data.image_size=8")
    with pytest.raises(ConfigError, match=r"^model\.norm=layer is not a normalisation; use one of"):
        model = OmegaConf.create({**OmegaConf.to_container(cfg.model), "norm": "layer"})
        build_model(model, build_splits(cfg.data).info)


def test_every_loop_key_reaches_the_logged_config(compose_cfg) -> None:
    cfg = plain(typed(compose_cfg("optim.accumulate=4", "ema.decay=0.99", "compile=true")))
    assert cfg["optim"]["accumulate"] == 4 and cfg["compile"] is True
    assert cfg["ema"] == {"decay": 0.99, "every": 1, "warmup": 0}
    assert set(cfg["ddp"]) == {
        "find_unused_parameters",
        "static_graph",
        "gradient_as_bucket_view",
        "bucket_cap_mb",
        "broadcast_buffers",
    }
    assert cfg["profiler"] == {"enabled": False, "wait": 1, "warmup": 1, "active": 3}
    assert cfg["model"]["norm"] == "batch"
