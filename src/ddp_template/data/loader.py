"""The ``sampler`` and ``loader`` groups' builders for map-style data, and the evaluation
loader every kind shares.

The position within an epoch lives in the sampler (``ShareSampler.state_dict(position)``), so a
resumed loader starts at the next unseen sample without loading any skipped one. Other kinds of
training data (``kind``) build their own sampler and loader from the same parts.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, Dataset

from ddp_template.config.schema import LoaderConfig, SamplerConfig
from ddp_template.data.contract import BatchFetch, MapData
from ddp_template.data.eval_sampler import EvalShareSampler
from ddp_template.data.sampler_modes import SAMPLER_MODES
from ddp_template.data.samplers import ShareSampler
from ddp_template.data.workers import loader_kwargs, seeded_generator
from ddp_template.distributed import DistInfo
from ddp_template.errors import ConfigError


def build_train_sampler(
    dataset: MapData, cfg: SamplerConfig, *, seed: int, info: DistInfo
) -> ShareSampler:
    """The ``sampler`` group's builder; the run's ``seed`` unless ``sampler.seed`` is set."""
    check_world(dataset, cfg, info)
    return ShareSampler(
        dataset,
        num_replicas=info.world_size,
        rank=info.rank,
        shuffle=cfg.shuffle,
        seed=seed if cfg.seed is None else cfg.seed,
        mode=str(cfg.mode),
        permutation=str(cfg.permutation),
    )


def check_world(dataset: MapData, cfg: SamplerConfig, info: DistInfo) -> None:
    """A mode that drops the tail leaves every rank empty when there are more ranks than
    samples: refused in one sentence."""
    if SAMPLER_MODES[str(cfg.mode)].drops_tail and info.world_size > len(dataset):
        raise ConfigError(
            f"sampler={cfg.mode} with {info.world_size} ranks and only {len(dataset)} training "
            f"samples leaves every rank empty (floor({len(dataset)}/{info.world_size}) = 0); use "
            f"sampler=padded or fewer ranks."
        )


def build_train_loader(
    dataset: MapData,
    sampler: ShareSampler,
    cfg: LoaderConfig,
    *,
    seed: int,
    drop_last: bool,
    info: DistInfo,
) -> DataLoader:
    """The ``loader`` group's training loader; ``drop_last`` is ``sampler.drop_last_batch``."""
    return training_loader(
        BatchFetch(dataset), cfg, seed=seed, drop_last=drop_last, info=info, sampler=sampler
    )


def training_loader(
    source: Dataset, cfg: LoaderConfig, *, seed: int, drop_last: bool, info: DistInfo, **given: Any
) -> DataLoader:
    """A training DataLoader over ``source`` (every kind's): the ``loader`` group's batch size
    and workers, seeded per rank; ``given`` adds or replaces DataLoader arguments (a sampler, a
    collate, no persistent workers)."""
    kwargs = {**loader_kwargs(cfg, info.device, source), **given}
    return DataLoader(
        source,
        batch_size=cfg.batch_size,
        drop_last=drop_last,
        generator=seeded_generator(seed, info.rank),
        **kwargs,
    )


def build_eval_loader(dataset: MapData, cfg: LoaderConfig, info: DistInfo) -> DataLoader:
    """Contiguous, unpadded shares: no sample is evaluated twice."""
    sampler = EvalShareSampler(dataset, num_replicas=info.world_size, rank=info.rank)
    return DataLoader(
        BatchFetch(dataset),
        batch_size=cfg.eval_batch_size,
        sampler=sampler,
        **loader_kwargs(cfg, info.device, dataset),
    )
