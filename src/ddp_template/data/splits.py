"""The ``data`` group's builder: the factory instantiated, its contract checked, and the
validation split carved from the training data (``data.val_fraction``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ddp_template.data.contract import IndexedSubset, Splits
from ddp_template.errors import ConfigError, instantiate_clean
from ddp_template.streams.contract import check_stream, is_stream

SPLIT_KEYS = ("val_fraction",)  # data keys build_splits applies itself (not the factory's)


def build_splits(data_cfg: Any) -> Splits:
    """Instantiate the ``data`` group's factory, check it kept the contract and carve the
    validation split (``data.val_fraction``)."""
    from omegaconf import OmegaConf

    resolved = OmegaConf.to_container(data_cfg, resolve=True)
    val_fraction = float(resolved.pop("val_fraction", 0.0))
    splits = instantiate_clean(OmegaConf.create(resolved))
    if not isinstance(splits, Splits):
        raise ConfigError(
            f"data._target_={data_cfg.get('_target_')} returned {type(splits).__name__}; a data "
            f"factory must return ddp_template.data.contract.Splits(train, test, info)."
        )
    if is_stream(splits.train):  # your own IterableDataset: no length, its items checked
        check_stream(splits.train)
        if val_fraction > 0:
            raise ConfigError(
                f"data.val_fraction={val_fraction} needs a map-style training set to carve from "
                f"and data._target_={data_cfg.get('_target_')} returned a stream; return a val "
                f"split from the factory instead, and drop data.val_fraction."
            )
        return splits
    if len(splits.train) == 0:
        raise ConfigError("the training set is empty; check data.path / data.size.")
    if val_fraction > 0:
        splits = carve_val(splits, val_fraction)
    return splits


def carve_val(splits: Splits, fraction: float) -> Splits:
    """The first ``round(N * fraction)`` of a permutation seeded with 0 (not the run's seed, so
    a seed sweep validates on one set) become the validation split, the rest train."""
    n = len(splits.train)
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
    )
