"""``Streamed``: the data kind of a training stream, an ``IterableDataset`` the template cannot
plan. A stream's factory returns ``Splits(train, test, info, kind=Streamed(uneven=uneven))``,
``uneven`` its own argument (``data.uneven``, stop by default).

Its items are read as they come and tagged with their key and loader worker (``contract``),
its epoch ends where the ranks agree (``stop``, ``data.uneven=stop``) or under torch's ``Join``
(``join``, ``data.uneven=join``: what Join cannot shadow refused by ``join.check_join``), and
its verdict comes from the keys (``verify``).
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

from torch.utils.data import DataLoader, Dataset

from ddp_template.config.schema import Config, LoaderConfig, SamplerConfig
from ddp_template.data.contract import Sampler, Splits, collate
from ddp_template.data.loader import training_loader
from ddp_template.distributed import DistInfo
from ddp_template.engine import EpochStats, Feed, Trainer, TrainState
from ddp_template.errors import ConfigError
from ddp_template.ledger.records import EpochReport
from ddp_template.optional.streams.contract import (
    Expected,
    StreamPosition,
    TagCollate,
    Tagged,
    check_run,
    check_stream,
)
from ddp_template.optional.streams.join import Joined, check_join
from ddp_template.optional.streams.stop import Agreement, StreamSteps
from ddp_template.optional.streams.verify import verify_stream

UNEVEN = ("stop", "join")  # data.uneven: how a stream's uneven ends are met


class Streamed:
    """A training stream: no sampler deals it, its keys account for it."""

    pictured: ClassVar[bool] = False  # nothing is dealt, so there are no shares to draw

    def __init__(self, uneven: str = "stop") -> None:
        """``uneven``: the stream's uneven ends (``data.uneven``): ``stop`` (all ranks stop at
        the first that runs out; what the others had left is counted as unread) or ``join``
        (each rank trains on all of its data under torch's Join)."""
        if str(uneven) not in UNEVEN:
            raise ConfigError(
                f"data.uneven={uneven} is not a way to meet a stream's uneven ends; use "
                f"data.uneven=stop (the default) or data.uneven=join."
            )
        self.uneven = str(uneven)

    def accept(self, splits: Splits, *, val_fraction: float, target: str) -> None:
        check_stream(splits.train)  # its first item: (x, y, key)
        if val_fraction > 0:
            raise ConfigError(
                f"data.val_fraction={val_fraction} needs a map-style training set to carve from "
                f"and data._target_={target} returned a stream; return a val "
                f"split from the factory instead, and drop data.val_fraction."
            )

    def check(self, cfg: Config, splits: Splits) -> None:
        """The run's options a stream cannot honour, and (data.uneven=join) what torch's Join
        cannot shadow: ``train.build`` calls it with the config in force (after a resize)."""
        check_run(cfg, splits)
        if self.uneven == "join":
            check_join(cfg)

    def sampler(
        self,
        dataset: Dataset,
        cfg: SamplerConfig,
        *,
        seed: int,
        info: DistInfo,
        loader: LoaderConfig,
    ) -> StreamPosition:
        return StreamPosition(
            expected=Expected.of(dataset),
            world_size=info.world_size,
            batch_size=loader.batch_size,
            workers=loader.num_workers,
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
        source = Tagged(dataset, key=2)  # (x, y, key) items, tagged by the worker reading them
        return training_loader(
            source,
            cfg,
            seed=seed,
            drop_last=drop_last,
            info=info,
            collate_fn=TagCollate(collate),
            # Fresh workers each epoch: only they see the epoch the stream was given (set_epoch).
            persistent_workers=False,
        )

    def steps(self, cfg: Config, sampler: Sampler, *, steps_before: int = 0) -> StreamSteps:
        return StreamSteps.of_sampler(cfg, sampler, steps_before=steps_before)

    def feed(self, cfg: Config, info: DistInfo, switches: dict[str, Any]) -> Feed:
        """All ranks stop at the first that runs out (data.uneven=stop), or each trains on all
        of its data under torch's Join (data.uneven=join; a joined rank's switches are caught up
        at the end with the optimizer's state)."""
        workers = max(cfg.loader.num_workers, 1)
        if self.uneven == "join":
            return Joined(info=info, workers=workers, switches=switches)
        return Agreement(info=info, workers=workers)

    def verify(
        self, stats: EpochStats, tr: Trainer, state: TrainState, start: int, metrics: dict
    ) -> EpochReport | None:
        unread = cast("Agreement | Joined", tr.feed).unread  # per worker: left at an uneven end
        step_s = metrics["perf/step_s"]
        position = cast(StreamPosition, tr.sampler)  # this kind's sampler()
        return verify_stream(stats.tally, unread, position.expected, step_s, tr.info)
