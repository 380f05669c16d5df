"""The boundary between Hydra and the template: the composed config as typed schema dataclasses.

``typed(cfg)`` turns the composed ``DictConfig`` into the schema dataclasses of ``config.schema``
(every builder receives its own group's typed config) and refuses keys that no schema declares:
``+nonsense_key=1`` would otherwise be accepted and ignored. The ``model`` and ``data`` groups
stay ``DictConfig`` (Hydra instantiates them); their keys must be arguments of their
``_target_``. The startup checks that give the values meaning are ``checks.check``.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import fields, is_dataclass
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from ddp_template.config.schema import SPLIT_KEYS, Config
from ddp_template.errors import ConfigError

log = logging.getLogger("ddp_template")

INSTANTIATED = ("model", "data", "task")  # groups Hydra instantiates: keys go to the _target_


def typed(cfg: DictConfig) -> Config:
    """The composed config as schema dataclasses; ``model``/``data`` resolved ``DictConfig``."""
    _refuse_unknown(cfg, Config, "")
    values: dict[str, Any] = {}
    for f in fields(Config):
        node = cfg[f.name]
        if f.name in INSTANTIATED:
            _refuse_unknown_arguments(node, f.name)
            values[f.name] = OmegaConf.create(OmegaConf.to_container(node, resolve=True))
        elif isinstance(node, DictConfig):
            values[f.name] = OmegaConf.to_object(node)
        else:
            values[f.name] = node
    return Config(**values)


def _refuse_unknown(node: DictConfig, schema: Any, prefix: str) -> None:
    declared = {f.name for f in fields(schema)}
    for key in node:
        if key not in declared:
            raise ConfigError(
                f"{prefix}{key!s}={node[key]} is not a key of the config (no schema declares it); "
                f"check its spelling against `python train.py --cfg job`, or drop it."
            )
        child = node[key]
        if isinstance(child, DictConfig) and key not in INSTANTIATED:
            child_schema = OmegaConf.get_type(child)
            if child_schema is not None and is_dataclass(child_schema):
                _refuse_unknown(child, child_schema, f"{prefix}{key}.")


def _refuse_unknown_arguments(node: DictConfig, group: str) -> None:
    """A key of ``model``/``data`` that its ``_target_`` does not take would fail mid-build."""
    from hydra._internal.utils import _locate

    target = node.get("_target_")
    try:
        params = inspect.signature(_locate(target)).parameters
    except Exception:  # an unimportable target: instantiate reports it with Hydra's own message
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    own = SPLIT_KEYS if group == "data" else ()
    for key in node:
        if not str(key).startswith("_") and key not in params and key not in own:
            raise ConfigError(
                f"{group}.{key!s}={node[key]} is not an argument of {group}._target_={target}; "
                f"check its spelling against `python train.py --cfg job`, or drop it."
            )


def experiment_spelling(argv: list[str]) -> list[str]:
    """``+experiment=<name>`` (the older spelling) as ``experiment=<name>``: the defaults list
    has an ``experiment: null`` slot, and Hydra refuses to append a second one."""
    return [a[1:] if a.startswith("+experiment=") else a for a in argv]


def plain(cfg: Config) -> dict[str, Any]:
    """The typed config as plain, resolved containers (W&B's config, the checkpoint's YAML)."""
    plain = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
    return cast("dict[str, Any]", plain)  # a structured config: a dict keyed by str
