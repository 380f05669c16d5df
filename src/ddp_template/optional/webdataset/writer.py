"""Write any map-style ``data`` option into WebDataset tar shards.

    python -m ddp_template.optional.webdataset.writer write --from data=digits --out DIR \\
        --samples-per-shard K
    python -m ddp_template.optional.webdataset.writer write --from data=synthetic --out DIR \\
        --samples-per-shard 1000 --format png data.size=20000

The ``data`` option is composed from ``conf/`` as ``train.py`` composes it (further overrides
after the flags), built with the training's own builder, and each split is written with
WebDataset's ``ShardWriter`` as ``DIR/train-%06d.tar`` and ``DIR/test-%06d.tar``: sample ``i``
is ``<i:08d>.npy`` (the input tensor as float32, exact) or ``.png`` (8-bit, the input clipped
to [0, 1]) plus ``<i:08d>.cls``. It prints the brace patterns to give ``data=webdataset``.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import numpy as np

from ddp_template.data.contract import MapData
from ddp_template.errors import EXIT_CONFIG_ERROR, ConfigError

CONF = Path(__file__).resolve().parents[4] / "conf"
FORMATS = ("npy", "png")


def encode(x: object, fmt: str) -> bytes:
    """The input as a .npy (float32) or an 8-bit .png (C, H, W in [0, 1]; 1 or 3 channels)."""
    array = np.asarray(x, dtype=np.float32)
    if fmt == "npy":
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        return buffer.getvalue()
    from PIL import Image

    pixels = np.clip(np.rint(array * 255.0), 0, 255).astype(np.uint8).transpose(1, 2, 0)
    buffer = io.BytesIO()
    Image.fromarray(pixels[:, :, 0] if pixels.shape[2] == 1 else pixels).save(buffer, "png")
    return buffer.getvalue()


def write_split(dataset: MapData, pattern: str, samples_per_shard: int, fmt: str) -> None:
    """``dataset``'s samples in index order into shards ``pattern`` (``%06d``: the shard)."""
    import webdataset as wds

    with wds.ShardWriter(pattern, maxcount=samples_per_shard, verbose=0) as sink:
        for i in range(len(dataset)):
            x, y, _ = dataset[i]
            sink.write({"__key__": f"{i:08d}", fmt: encode(x, fmt), "cls": str(int(y))})


def compose_data(source: str, overrides: Sequence[str]) -> object:
    """The ``data`` node of ``conf/`` composed with ``--from`` and the overrides."""
    from hydra import compose, initialize_config_dir

    from ddp_template.config.schema import register_configs
    from ddp_template.run_identity import register_resolvers

    register_configs()
    register_resolvers()
    if not source.startswith("data="):
        raise ConfigError(f"--from {source} is not a data option; pass e.g. --from data=digits.")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[source, *overrides]).data


def write(source: str, out: Path, samples_per_shard: int, fmt: str, overrides: Sequence[str]):
    """Both splits of ``source`` as shards under ``out``: {split: (brace pattern, samples)}."""
    from ddp_template.splits import build_splits

    if samples_per_shard < 1:
        raise ConfigError(
            f"--samples-per-shard {samples_per_shard} must be >= 1; e.g. --samples-per-shard 1000."
        )
    splits = build_splits(compose_data(source, overrides))
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, split in (("train", splits.train), ("test", splits.test)):
        dataset = cast(MapData, split)  # written in index order: map-style data
        count = -(-len(dataset) // samples_per_shard)
        write_split(dataset, str(out / f"{name}-%06d.tar"), samples_per_shard, fmt)
        brace = f"{{000000..{count - 1:06d}}}" if count > 1 else "000000"
        written[name] = (str(out / f"{name}-{brace}.tar"), len(dataset))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_template.optional.webdataset.writer")
    commands = parser.add_subparsers(dest="command", required=True)
    w = commands.add_parser("write", help="write a map-style data option into tar shards")
    w.add_argument("--from", dest="source", required=True, help="e.g. data=digits")
    w.add_argument("--out", type=Path, required=True, help="the folder the shards go to")
    w.add_argument("--samples-per-shard", type=int, required=True)
    w.add_argument("--format", choices=FORMATS, default="npy", help="the input member's type")
    w.add_argument("overrides", nargs="*", help="further overrides, e.g. data.size=1000")
    args = parser.parse_args(argv)
    try:
        written = write(args.source, args.out, args.samples_per_shard, args.format, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    for name, (pattern, n) in written.items():
        print(f"'data.{name}_urls=\"{pattern}\"'  # {n} samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
