"""The data-kind seam: what a kind of training data decides, and map-style data's kind.

A ``data`` factory (the group's ``_target_``) returns ``Splits(train, test, info, kind=...)``;
``kind=None`` is map-style data (:class:`Planned`). A kind decides, for its training split:
what it accepts from the factory, which run options it refuses, its sampler and loader, its
steps per epoch, how its batches come and its epoch ends (a :class:`~ddp_template.engine.Feed`:
planned, agreed or joined), and how its ledger is verified at the epoch's end. Readers:
``data.splits.build_splits`` (``accept``), ``train.build`` (``check``, ``sampler``, ``loader``,
``steps``, ``feed``), ``train.set_epoch`` and ``train.resume`` (``steps``), ``train.account``
(``verify``), ``train.train`` (``pictured``), ``replay.Run`` (``sampler``).

The kinds beside this one live in folders of their own that the core never imports by name:
``ddp_template.optional.webdataset.kind.Sharded`` (tar shards read by an epoch plan) and
``ddp_template.optional.streams.kind.Streamed`` (an ``IterableDataset`` the template cannot plan).
"""

from __future__ import annotations

from typing import ClassVar, Protocol, cast

from torch.utils.data import DataLoader, Dataset, IterableDataset

from ddp_template.config.schema import Config, LoaderConfig, SamplerConfig
from ddp_template.data.contract import MapData, Sampler, Splits
from ddp_template.data.epoch_steps import EpochSteps
from ddp_template.data.loader import build_train_loader, build_train_sampler
from ddp_template.data.samplers import ShareSampler
from ddp_template.distributed import DistInfo
from ddp_template.engine import EpochStats, Feed, PlannedFeed, Trainer, TrainState
from ddp_template.errors import ConfigError
from ddp_template.ledger.records import EpochReport
from ddp_template.ledger.verify import verify_epoch
from ddp_template.switches import Switch


class DataKind(Protocol):
    """One kind of training data, as the recipe sees it."""

    pictured: ClassVar[bool]  # whether train.py draws its shares (shares.png)

    def accept(self, splits: Splits, *, val_fraction: float, target: str) -> None:
        """Refuse a factory's splits this kind cannot read (one sentence)."""

    def check(self, cfg: Config, splits: Splits) -> None:
        """Refuse the run options this kind cannot honour (one sentence each)."""

    def sampler(
        self,
        dataset: Dataset,
        cfg: SamplerConfig,
        *,
        seed: int,
        info: DistInfo,
        loader: LoaderConfig,
    ) -> Sampler:
        """The ``sampler`` group's builder for this kind."""

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
        """The ``loader`` group's training loader for this kind."""

    def steps(self, cfg: Config, sampler: Sampler, *, steps_before: int = 0) -> EpochSteps:
        """The optimizer steps of the sampler's current epoch."""

    def feed(self, cfg: Config, info: DistInfo, switches: dict[str, Switch]) -> Feed:
        """How an epoch's batches come and its end is met."""

    def verify(
        self, stats: EpochStats, tr: Trainer, state: TrainState, start: int, metrics: dict
    ) -> EpochReport | None:
        """The epoch's verdict on every rank's data (a collective); rank 0's report."""


class Planned:
    """Map-style data (``len`` and ``__getitem__``): a ``ShareSampler`` deals every epoch
    before it starts, so every rank's steps are known and no rank runs out before another."""

    pictured: ClassVar[bool] = True

    def accept(self, splits: Splits, *, val_fraction: float, target: str) -> None:
        if isinstance(splits.train, IterableDataset):
            raise ConfigError(
                f"data._target_={target} returned an IterableDataset as its training split "
                f"with no data kind to read it; return Splits(train, test, info, "
                f'kind=ddp_template.optional.streams.kind.Streamed()) (README "Streams").'
            )
        if len(cast(MapData, splits.train)) == 0:  # not an IterableDataset: map-style
            raise ConfigError("the training set is empty; check data.path / data.size.")

    def check(self, cfg: Config, splits: Splits) -> None:
        return None

    def sampler(
        self,
        dataset: Dataset,
        cfg: SamplerConfig,
        *,
        seed: int,
        info: DistInfo,
        loader: LoaderConfig,
    ) -> ShareSampler:
        return build_train_sampler(cast(MapData, dataset), cfg, seed=seed, info=info)

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
        data = cast(MapData, dataset)  # accept() refused an IterableDataset
        shares = cast(ShareSampler, sampler)  # this kind's sampler(): a ShareSampler
        return build_train_loader(data, shares, cfg, seed=seed, drop_last=drop_last, info=info)

    def steps(self, cfg: Config, sampler: Sampler, *, steps_before: int = 0) -> EpochSteps:
        return EpochSteps.of_sampler(cfg, sampler, steps_before=steps_before)

    def feed(self, cfg: Config, info: DistInfo, switches: dict[str, Switch]) -> Feed:
        return PlannedFeed()

    def verify(
        self, stats: EpochStats, tr: Trainer, state: TrainState, start: int, metrics: dict
    ) -> EpochReport | None:
        # state.prior: the epoch's prefixes read at other world sizes (elastic resume)
        return verify_epoch(stats, tr.sampler, start, metrics, tr.info, state.prior)


def kind_of(splits: Splits) -> DataKind:
    """The kind that reads ``splits``' training data."""
    return splits.kind if splits.kind is not None else Planned()
