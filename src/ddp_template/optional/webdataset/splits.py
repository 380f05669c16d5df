"""The ``data=webdataset`` factory: WebDataset tar shards as the template's splits, read in
training by the :class:`~ddp_template.optional.webdataset.kind.Sharded` kind."""

from __future__ import annotations

from ddp_template.data.contract import DataInfo, Splits
from ddp_template.errors import ConfigError
from ddp_template.optional.webdataset.index import ShardIndex
from ddp_template.optional.webdataset.kind import Sharded
from ddp_template.optional.webdataset.plan import DEFAULT_SHUFFLE_BLOCK
from ddp_template.optional.webdataset.reader import ShardSamples


def webdataset(
    train_urls: str,
    test_urls: str,
    shuffle_block: int = DEFAULT_SHUFFLE_BLOCK,
    num_classes: int | None = None,
) -> Splits:
    """The ``data=webdataset`` factory: train and test shards, indexed (and cached) once."""
    if shuffle_block < 1:
        raise ConfigError(
            f"data.shuffle_block={shuffle_block} must be >= 1 (samples shuffled together); "
            f"e.g. data.shuffle_block={DEFAULT_SHUFFLE_BLOCK}."
        )
    train = ShardSamples(ShardIndex.of("train_urls", train_urls), shuffle_block)
    test = ShardSamples(ShardIndex.of("test_urls", test_urls), shuffle_block)
    seen = int(max(train.index.labels.max(), test.index.labels.max())) + 1
    if num_classes is not None and num_classes < seen:
        raise ConfigError(
            f"data.num_classes={num_classes} but the shards hold label {seen - 1}; set "
            f"data.num_classes={seen} or more (or null: from the labels)."
        )
    x, _, _ = train[0]
    info = DataInfo(
        num_classes=num_classes or seen, in_channels=int(x.shape[0]), image_size=int(x.shape[-1])
    )
    return Splits(train, test, info, kind=Sharded())
