"""Images/s of the template's sharded loader against a plain WebDataset pipeline.

    python benchmarks/shards.py [--rounds 5] [--samples 4096] [--out report.md]

One set of PNG shards (synthetic 3x32x32 images written by
``ddp_template.optional.webdataset.writer``, 16 shards of 256) is read by 2 ranks x 2 loader
workers, batch 64, in three variants:

* ``template``: ``data=webdataset``'s loader (``PlanSampler`` + ``PlanReader``: the epoch plan,
  each worker's contiguous range) with the accounting on: every batch into the per-worker
  ``IndexTally``, and at the epoch's end the rank's own check (``own_check``: the expected
  fingerprints of its range, per worker);
* ``webdataset``: the documented recipe, ``wds.WebDataset(urls, nodesplitter=split_by_node,
  workersplitter=split_by_worker, shardshuffle=...)`` + ``.shuffle(1000)``, decoded by the same
  function, in a DataLoader of the same workers and batch;
* ``template (A/A)``: the template's loader again: the noise floor of a ratio.

A rank is a process of its own (both ranks run at once, as in training; no process group is
needed to read), timed from each epoch's iterator to its last batch over 3 epochs after one
warm-up epoch (persistent workers started); images/s is the epochs' images over the slower
rank's time.
Rounds are paired and interleaved (the variants' order rotates each round), and every ratio is
taken within a round, so the machine's drifts in load hit every variant alike.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

RANKS, WORKERS, BATCH = 2, 2, 64
EPOCHS = 3  # timed epochs per measurement, after one warm-up epoch
VARIANTS = ("template", "webdataset", "template (A/A)")


def write_shards(folder: Path, samples: int) -> tuple[str, int]:
    from ddp_template.optional.webdataset.writer import write

    overrides = [f"data.size={samples}", "data.test_size=64", "data.image_size=32"]
    pattern, _ = write("data=synthetic", folder, 256, "png", overrides)["train"]
    return pattern, samples


def template_epoch_s(pattern: str, rank: int) -> float:
    import torch

    from ddp_template.config.schema import LoaderConfig, SamplerConfig
    from ddp_template.distributed import DistInfo
    from ddp_template.engine import EpochStats
    from ddp_template.ledger.tally import IndexTally
    from ddp_template.ledger.verify import epoch_metrics, own_check
    from ddp_template.optional.webdataset.index import ShardIndex
    from ddp_template.optional.webdataset.kind import Sharded
    from ddp_template.optional.webdataset.reader import ShardSamples

    info = DistInfo(
        rank=rank,
        local_rank=rank,
        world_size=RANKS,
        local_world_size=RANKS,
        backend=None,
        device=torch.device("cpu"),
        host="bench",
    )
    cfg = LoaderConfig(batch_size=BATCH, num_workers=WORKERS)
    data = ShardSamples(ShardIndex.of("train_urls", pattern))
    kind = Sharded()
    sampler = kind.sampler(data, SamplerConfig(), seed=0, info=info, loader=cfg)
    loader = kind.loader(data, sampler, cfg, seed=0, drop_last=False, info=info)
    times = []
    for epoch in range(1 + EPOCHS):
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        stats = EpochStats(IndexTally(workers=sampler.workers), steps=1)  # per worker
        for _, _, index in loader:
            stats.tally.add(index.numpy())
        metrics = epoch_metrics(stats, sampler, 0, epoch)
        own_check(stats, sampler, 0, metrics, rank=rank)
        times.append(time.perf_counter() - start)
    return sum(times[1:])


def _decoded(sample: dict) -> tuple:
    """A WebDataset sample as the template decodes it (the same function, the same work)."""
    from ddp_template.optional.webdataset.reader import decode

    return decode("png", sample["png"]), int(sample["cls"]), sample["__key__"]


def webdataset_epoch_s(pattern: str, rank: int) -> float:
    import webdataset as wds
    from torch.utils.data import DataLoader

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(RANKS))
    dataset = (
        wds.WebDataset(
            pattern,
            nodesplitter=wds.split_by_node,
            workersplitter=wds.split_by_worker,
            shardshuffle=16,
            empty_check=False,
        )
        .shuffle(1000)
        .map(_decoded)
    )
    loader = DataLoader(
        dataset,
        batch_size=BATCH,
        num_workers=WORKERS,
        persistent_workers=True,
        prefetch_factor=4,
        multiprocessing_context="forkserver",
    )
    times = []
    for _ in range(1 + EPOCHS):
        start = time.perf_counter()
        for _batch in loader:
            pass
        times.append(time.perf_counter() - start)
    return sum(times[1:])


def _rank(variant: str, pattern: str, rank: int, out: mp.Queue) -> None:
    read = webdataset_epoch_s if variant == "webdataset" else template_epoch_s
    out.put((rank, read(pattern, rank)))


def measure(variant: str, pattern: str, samples: int) -> float:
    """Images/s of one epoch read by both ranks at once: images / the slower rank's seconds."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(variant, pattern, r, out)) for r in range(RANKS)]
    for p in procs:
        p.start()
    seconds = []
    while len(seconds) < len(procs):
        try:
            seconds.append(out.get(timeout=5)[1])
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"a {variant} rank failed (its traceback is above)") from None
    for p in procs:
        p.join()
    return EPOCHS * samples / max(seconds)


def ratio_table(rates: dict[str, list[float]], base: str, unit: str) -> list[str]:
    """The paired rounds' table: each variant's median ``unit`` and min-max, and the median
    (min-max) of its ratios to ``base`` taken within each round."""
    lines = [
        f"| variant | {unit} (median) | min-max | vs {base} (median of paired ratios) |",
        "|---|---|---|---|",
    ]
    for v, got in rates.items():
        ratios = [a / b for a, b in zip(got, rates[base], strict=True)]
        lines.append(
            f"| {v} | {statistics.median(got):.0f} | {min(got):.0f}-{max(got):.0f} | "
            f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f}) |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pattern, samples = write_shards(Path(tmp), args.samples)
        rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
            for variant in order:
                rates[variant].append(measure(variant, pattern, samples))
            print(f"round {r + 1}: " + ", ".join(f"{v} {rates[v][-1]:.0f}" for v in VARIANTS))
    lines = [
        f"{RANKS} ranks x {WORKERS} workers, batch {BATCH}, {samples} PNG 3x32x32 in "
        f"{samples // 256} shards, {args.rounds} paired rounds (load {os.getloadavg()[0]:.2f})",
        "",
        *ratio_table(rates, "webdataset", "images/s"),
    ]
    aa = [a / b for a, b in zip(rates["template (A/A)"], rates["template"], strict=True)]
    lines.append(f"\nA/A (template / template again): median {statistics.median(aa):.3f}x")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
