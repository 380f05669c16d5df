"""The boundary between Hydra and the template: a typed config, checked once before anything runs.

``typed(cfg)`` turns the composed ``DictConfig`` into the schema dataclasses of ``config.py``
(every builder receives its own group's typed config) and refuses keys that no schema declares:
``+nonsense_key=1`` would otherwise be accepted and ignored. The ``model`` and ``data`` groups
stay ``DictConfig`` (Hydra instantiates them); their keys must be arguments of their
``_target_``. ``check(cfg)`` then runs every startup check — meaning beyond types, the AMP mode
on this device, the backend, the fault settings — before any process group or builder exists.
"""

from __future__ import annotations

import inspect
import os
import signal
from dataclasses import fields, is_dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from ddp_template import cluster
from ddp_template.amp import check_amp
from ddp_template.config import Config
from ddp_template.data.samplers import SAMPLER_MODES
from ddp_template.distributed import LAUNCHER_VAR, choose_backend, launched_by_torchrun
from ddp_template.errors import ConfigError

INSTANTIATED = ("model", "data")  # groups Hydra instantiates: their keys go to the _target_


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
                f"{prefix}{key}={node[key]} is not a key of the config (no schema declares it); "
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
    for key in node:
        if not str(key).startswith("_") and key not in params:
            raise ConfigError(
                f"{group}.{key}={node[key]} is not an argument of {group}._target_={target}; "
                f"check its spelling against `python train.py --cfg job`, or drop it."
            )


def experiment_spelling(argv: list[str]) -> list[str]:
    """``+experiment=<name>`` (the older spelling) as ``experiment=<name>``: the defaults list
    has an ``experiment: null`` slot, and Hydra refuses to append a second one."""
    return [a[1:] if a.startswith("+experiment=") else a for a in argv]


def plain(cfg: Config) -> dict[str, Any]:
    """The typed config as plain, resolved containers (W&B's config, the checkpoint's YAML)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check(cfg: Config) -> None:
    """Every startup check, before any process group, data, model or W&B run exists."""
    _check_sizes(cfg)
    _check_sampler(cfg)
    _check_launch(cfg)
    _require(
        cfg.fault.signal is None or hasattr(signal, str(cfg.fault.signal)),
        f"fault.signal={cfg.fault.signal} is not a signal name; use e.g. SIGTERM or SIGUSR1.",
    )
    if choose_backend(cfg.backend.name) != "nccl":
        # On CUDA each rank probes its own GPU when it builds AMP (amp.build_scaler): probing
        # here would create a CUDA context in the launching process.
        check_amp(cfg.amp.mode, torch.device("cpu"))


def _check_sizes(cfg: Config) -> None:
    for key in ("batch_size", "eval_batch_size", "log_every"):
        value = getattr(cfg, key)
        _require(value >= 1, f"{key}={value} must be >= 1; e.g. {key}=32.")
    _require(cfg.epochs >= 0, f"epochs={cfg.epochs} must be >= 0 (0 only evaluates).")
    _require(cfg.num_workers >= 0, f"num_workers={cfg.num_workers} must be >= 0.")
    _require(cfg.dist.nproc >= 1, f"dist.nproc={cfg.dist.nproc} must be >= 1.")
    _require(cfg.dist.max_restarts >= 0, f"dist.max_restarts={cfg.dist.max_restarts} must be >= 0.")
    _require(
        cfg.max_steps_per_epoch is None or cfg.max_steps_per_epoch >= 1,
        f"max_steps_per_epoch={cfg.max_steps_per_epoch} must be >= 1 or null.",
    )
    _require(
        cfg.optim.lr > 0, f"optim.lr={cfg.optim.lr} must be positive; try optim.lr=0.1 for sgd."
    )
    _require(
        cfg.checkpoint.every_steps >= 0 and cfg.checkpoint.keep >= 0,
        "checkpoint.every_steps and checkpoint.keep must be >= 0.",
    )
    _require(
        cfg.checkpoint.preempt_check_every >= 1,
        f"checkpoint.preempt_check_every={cfg.checkpoint.preempt_check_every} must be >= 1.",
    )


def _check_launch(cfg: Config) -> None:
    """A launcher already started this rank: dist.nproc must not start more ranks inside it."""
    if cfg.dist.nproc == 1 or not launched_by_torchrun():
        return
    outer = cluster.detect()
    launcher = os.environ.get(LAUNCHER_VAR, outer.launcher)
    _require(
        cfg.dist.nproc == outer.local_world_size,
        f"dist.nproc={cfg.dist.nproc} would start ranks inside rank {outer.rank} of "
        f"{outer.world_size} that {launcher} already started ({outer.local_world_size} on this "
        f"node); drop dist.nproc (the launcher starts the ranks) or set it to "
        f"{outer.local_world_size}.",
    )


def _check_sampler(cfg: Config) -> None:
    mode = SAMPLER_MODES[str(cfg.sampler.mode)]
    _require(
        mode.shuffles or not cfg.sampler.shuffle,
        f"sampler.shuffle=true contradicts sampler={cfg.sampler.mode} ({mode.summary}); set "
        f"sampler.shuffle=false or pick sampler=padded.",
    )
