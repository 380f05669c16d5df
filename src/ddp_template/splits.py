"""The ``data`` group's builder: the factory instantiated, its splits accepted by their data
kind, and the validation split carved from the training data (``data.val_fraction``)."""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from ddp_template.data.contract import IndexedSubset, MapData, Splits
from ddp_template.errors import ConfigError, instantiate_clean
from ddp_template.kind import kind_of


def build_splits(data_cfg: Any) -> Splits:
    """Instantiate the ``data`` group's factory, check it kept the contract and carve the
    validation split (``data.val_fraction``)."""
    from omegaconf import OmegaConf

    resolved = OmegaConf.to_container(data_cfg, resolve=True)
    assert isinstance(resolved, dict)  # the data group: a mapping
    val_fraction = float(resolved.pop("val_fraction", 0.0))
    splits = instantiate_clean(OmegaConf.create(resolved))
    target = data_cfg.get("_target_")
    if not isinstance(splits, Splits):
        raise ConfigError(
            f"data._target_={target} returned {type(splits).__name__}; a data factory must "
            f"return ddp_template.data.contract.Splits(train, test, info)."
        )
    kind_of(splits).accept(splits, val_fraction=val_fraction, target=target)
    if val_fraction > 0:
        splits = carve_val(splits, val_fraction)
    return splits


def carve_val(splits: Splits, fraction: float) -> Splits:
    """The first ``round(N * fraction)`` of a permutation seeded with 0 (not the run's seed, so
    a seed sweep validates on one set) become the validation split, the rest train."""
    n = len(cast(MapData, splits.train))  # map-style: accept() refused a stream
    n_val = round(n * fraction)
    if not 1 <= n_val < n:
        raise ConfigError(
            f"data.val_fraction={fraction} leaves {n_val} of {n} training samples for validation "
            f"and {n - n_val} for training; pick a fraction that leaves both non-empty."
        )
    order = np.random.default_rng(0).permutation(n)
    val, train = np.sort(order[:n_val]), np.sort(order[n_val:])
    return Splits(
        IndexedSubset(splits.train, train),
        splits.test,
        splits.info,
        IndexedSubset(splits.train, val),
        splits.kind,
    )
