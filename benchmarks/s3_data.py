"""Images/s of the sharded loader reading its shards from S3 against the same shards on disk.

    python benchmarks/s3_data.py [--rounds 5] [--samples 4096] [--out report.md]

The shards of ``benchmarks/shards.py`` (synthetic 3x32x32 PNGs, 16 shards of 256) are written
once to a local folder and uploaded to the local S3 server (``optional/s3/server.py``: moto
behind the fault proxy, no faults, running in this process). The template's loader
(``data=webdataset``: ``PlanSampler`` + ``PlanReader`` with read-ahead, the accounting on) reads
them with 2 ranks x 2 loader workers, batch 64, in three variants:

* ``local``: ``/tmp/.../train-{000000..000015}.tar``;
* ``s3``: ``s3://bench/shards/train-{000000..000015}.tar`` (each block run a range read);
* ``local (A/A)``: the local shards again: the noise floor of a ratio.

Each is timed as ``benchmarks/shards.py`` times it (both ranks at once, 3 epochs after a warm-up
epoch, images over the slower rank's seconds). Rounds are paired and interleaved, the order
rotated each round, and every ratio is taken within a round. Then the bytes: one more s3
measurement's body bytes as the server counts them, per epoch, against the bytes of the samples
(each sample's byte range in its shard, summed): what a read costs beyond the samples it serves;
and the server's own CPU seconds, which here come out of the same cores the ranks decode on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shards import BATCH, EPOCHS, RANKS, WORKERS, measure, ratio_table, write_shards  # noqa: E402

VARIANTS = ("local", "s3", "local (A/A)")
URL = "s3://bench/shards"


def main() -> None:
    from ddp_template.optional.s3.server import Faults, LocalS3
    from ddp_template.optional.webdataset.index import ShardIndex

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, LocalS3(Faults()) as server:
        os.environ.update(server.env)  # the rank processes inherit it
        local, samples = write_shards(Path(tmp), args.samples)
        server.bucket("bench")
        server.upload(Path(local).parent, URL)
        remote = f"{URL}/{Path(local).name}"
        patterns = {"local": local, "s3": remote, "local (A/A)": local}
        index = ShardIndex.of("train_urls", remote)  # both indexes cached before any timing
        ShardIndex.of("train_urls", local)
        rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
        server_s: list[float] = []
        for r in range(args.rounds):
            order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
            for variant in order:
                cpu = time.process_time()  # this process runs only the server meanwhile
                rates[variant].append(measure("template", patterns[variant], samples))
                if variant == "s3":
                    server_s.append(time.process_time() - cpu)
            print(f"round {r + 1}: " + ", ".join(f"{v} {rates[v][-1]:.0f}" for v in VARIANTS))
        assert server.faults is not None
        served = server.faults.served
        before = (served.body_bytes, served.range_reads)
        measure("template", remote, samples)
        read = (served.body_bytes - before[0]) / (1 + EPOCHS)
        reads = (served.range_reads - before[1]) / (1 + EPOCHS)
        needed = int((index.stops - index.starts).sum())
    base = rates["local"]
    lines = [
        f"{RANKS} ranks x {WORKERS} workers, batch {BATCH}, {samples} PNG 3x32x32 in "
        f"{samples // 256} shards, {args.rounds} paired rounds (load {os.getloadavg()[0]:.2f})",
        "",
        *ratio_table(rates, "local", "images/s"),
    ]
    aa = [a / b for a, b in zip(rates["local (A/A)"], base, strict=True)]
    lines += [
        f"\nA/A (local / local again): median {statistics.median(aa):.3f}x",
        f"bytes read from S3 per epoch (both ranks): {read:,.0f} in {reads:.0f} range reads; "
        f"the samples' bytes: {needed:,}; read / needed = {read / needed:.3f}",
        f"the local S3 server's CPU (moto and the proxy, in the benchmark's process, on the "
        f"ranks' cores): median {statistics.median(server_s):.2f} s per s3 measurement",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
