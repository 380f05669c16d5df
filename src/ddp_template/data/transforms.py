"""The ``transforms`` group: training-time augmentation on torchvision's transforms v2.

Augmentation is applied to the training split only (evaluation gets at most the deterministic
resize, centre crop and normalisation). Its randomness is a function of (seed, epoch, sample
index) alone: each item draws from torch's RNG reseeded with that triple, inside
``torch.random.fork_rng`` so the caller's RNG stream is untouched. Which worker, rank or process
loads a sample therefore never matters: a run killed mid-epoch with loader workers resumes to
bit-identical weights, and sample ``i`` at epoch ``e`` is the same tensor on any world size.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import Dataset

from ddp_template.config.schema import TransformsConfig
from ddp_template.data.contract import MapData, Splits
from ddp_template.errors import ConfigError
from ddp_template.splitmix import splitmix64


def sample_seed(seed: int, epoch: int, index: int, view: int | None = None) -> int:
    """The RNG seed of sample ``index`` at ``epoch``: a hash of the triple; of its ``view``
    (``task=contrastive``'s two views of a sample) a hash of the four."""
    key = splitmix64(np.uint64(seed % 2**64))
    key = splitmix64(key ^ np.uint64(epoch % 2**64))
    key = splitmix64(key ^ np.uint64(index % 2**64))
    if view is not None:
        key = splitmix64(key ^ np.uint64(view % 2**64))
    return int(key >> np.uint64(1))


class Augmented(Dataset):
    """An ``(x, y, index)`` dataset whose inputs pass through a random transform."""

    def __init__(self, base: MapData, transform: Any, seed: int, for_eval: Dataset) -> None:
        self.base, self.transform, self.seed = base, transform, seed
        self.for_eval = for_eval  # the same samples without augmentation (eval_split=train)
        # Shared memory: persistent loader workers hold a copy of this dataset, and set_epoch
        # in the rank must reach them before the epoch's first index does.
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        x, y, index = self.base[i]
        return self.augment(x, index), y, index

    def augment(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Sample ``index``'s input at this epoch (sharded data streams and calls it itself)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed(self.seed, int(self.epoch), index))
            return self.transform(x)


class Mapped(Dataset):
    """An ``(x, y, index)`` dataset whose inputs pass through a deterministic transform."""

    def __init__(self, base: MapData, transform: Any) -> None:
        self.base, self.transform = base, transform

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        x, y, index = self.base[i]
        return self.transform(x), y, index


def pipelines(
    cfg: TransformsConfig, image_size: int | None, channels: int | None
) -> tuple[Any, Any]:
    """(training transform, evaluation transform); None where nothing is applied."""
    name, normalize = str(cfg.name), cfg.mean is not None and cfg.std is not None
    if name == "none" and not normalize:
        return None, None  # torchvision unimported: its import costs every rank about 3 s of CPU
    from torchvision.transforms import v2

    norm = []
    if cfg.mean is not None and cfg.std is not None:  # normalize
        if not len(cfg.mean) == len(cfg.std) == channels:
            raise ConfigError(
                f"transforms.mean={list(cfg.mean)} and transforms.std={list(cfg.std)} need one "
                f"value per channel and the data has {channels}; give {channels} values each, "
                f"or null."
            )
        norm = [v2.Normalize(list(cfg.mean), list(cfg.std))]
    if name == "cifar":
        train = [v2.RandomCrop(image_size, padding=cfg.padding), v2.RandomHorizontalFlip()]
        test: list[Any] = []
    elif name == "imagenet":
        assert cfg.scale is not None  # TransformsConfig's check: imagenet needs a scale
        scale = (float(cfg.scale[0]), float(cfg.scale[1]))
        train = [v2.RandomResizedCrop(image_size, scale=scale), v2.RandomHorizontalFlip()]
        test = [v2.Resize(image_size), v2.CenterCrop(image_size)]
    else:
        train, test = [], []
    train_tf = v2.Compose(train + norm) if train or norm else None
    test_tf = v2.Compose(test + norm) if test or norm else None
    return train_tf, test_tf


def apply_transforms(splits: Splits, cfg: TransformsConfig, seed: int) -> Splits:
    """The ``transforms`` group's builder: augment the training split, map the others."""
    info = splits.info
    train_tf, test_tf = pipelines(cfg, info.image_size, info.in_channels)
    if train_tf is None and test_tf is None:
        return splits  # transforms=none: the data exactly as its builder gives it

    def mapped(ds: Dataset) -> Dataset:  # transforms apply to map-style data: item i
        return Mapped(cast(MapData, ds), test_tf) if test_tf is not None else ds

    train = splits.train
    if train_tf is not None:
        train = Augmented(cast(MapData, train), train_tf, seed, for_eval=mapped(train))
    val = mapped(splits.val) if splits.val is not None else None
    return Splits(train, mapped(splits.test), info, val, splits.kind)
