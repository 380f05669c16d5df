"""``Sharded``: the data kind of WebDataset tar shards (``data=webdataset``).

Planned like map-style data (the same modes, lengths, steps and ledger check), but dealt by the
epoch's plan of the shards (``plan.PlanSampler``: one contiguous range of slots per rank, one of
whole batches per loader worker) and read by the workers themselves (``reader.PlanReader``: one
block's bytes per read). A training split that is not the shards themselves (a validation
carve) is read as map-style data.
"""

from __future__ import annotations

from typing import Any, cast

from torch.utils.data import DataLoader, Dataset

from ddp_template.config.schema import LoaderConfig, SamplerConfig
from ddp_template.data.contract import MapData, Sampler
from ddp_template.data.loader import check_world, training_loader
from ddp_template.distributed import DistInfo
from ddp_template.kind import Planned
from ddp_template.optional.webdataset.plan import PlanSampler, ShardOrder
from ddp_template.optional.webdataset.reader import PlanReader, sharded_source


class Sharded(Planned):
    """Tar shards read by an epoch plan."""

    def sampler(
        self,
        dataset: Dataset,
        cfg: SamplerConfig,
        *,
        seed: int,
        info: DistInfo,
        loader: LoaderConfig,
    ) -> Any:
        source = sharded_source(dataset)
        if source is None:
            return super().sampler(dataset, cfg, seed=seed, info=info, loader=loader)
        check_world(cast(MapData, dataset), cfg, info)  # shard samples: map-style too
        samples, _ = source
        order = ShardOrder(
            sizes=tuple(int(n) for n in samples.index.sizes),
            seed=seed if cfg.seed is None else cfg.seed,
            shuffle=cfg.shuffle,
            block=samples.shuffle_block,
        )
        return PlanSampler(
            order,
            num_replicas=info.world_size,
            rank=info.rank,
            mode=str(cfg.mode),
            batch_size=loader.batch_size,
            workers=loader.num_workers,
            keys=samples.index.keys,
        )

    def loader(
        self,
        dataset: Dataset,
        sampler: Sampler,
        cfg: LoaderConfig,
        *,
        seed: int,
        drop_last: bool,
        info: DistInfo,
    ) -> DataLoader:
        if not isinstance(sampler, PlanSampler):
            return super().loader(dataset, sampler, cfg, seed=seed, drop_last=drop_last, info=info)
        shards = sharded_source(dataset)
        assert shards is not None  # sampler() makes a PlanSampler only over shard samples
        samples, augment = shards
        source = PlanReader(samples, sampler, augment=augment)  # the workers read the plan
        return training_loader(source, cfg, seed=seed, drop_last=drop_last, info=info)
