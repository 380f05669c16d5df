"""Training samples/s of the default shards job reading its shards from S3 against local disk.

    python benchmarks/s3_train.py [--rounds 5] [--epochs 6] [--out report.md]

The default shards job is ``conf/data/webdataset.yaml``'s: the digits written as tar shards of
200 (``python -m ddp_template.optional.webdataset.writer write --from data=digits``), trained by
``train.py data=webdataset`` at 2 ranks x 2 loader workers on gloo (``logger=none``, no
checkpoints). The shards are uploaded once to the local S3 server (``optional/s3/server.py``:
moto, credentials checked, without the fault proxy, in this process, on the same two cores as
the ranks: its CPU is the ranks' loss here, a real store's own elsewhere), and each round runs
three variants, the order rotated each round:

* ``local``: ``data.train_urls=/tmp/.../train-{000000..000007}.tar``;
* ``s3``: ``data.train_urls=s3://bench/digits/train-{000000..000007}.tar`` (and the test shards);
* ``local (A/A)``: the local shards again: the noise floor of a ratio.

A run's samples/s is each rank's ``perf/samples_per_s`` (the training loop: iterator to last
step, data wait included, evaluation excluded) averaged over epochs >= 1 and the ranks; ratios
are taken within a round (paired), and the table gives their median and min-max.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from shards import ratio_table  # noqa: E402

VARIANTS = ("local", "s3", "local (A/A)")
URL = "s3://bench/digits"


def write_digits(folder: Path) -> tuple[str, str]:
    """The digits as shards of 200; the train and test patterns."""
    cmd = [sys.executable, "-m", "ddp_template.optional.webdataset.writer", "write"]
    cmd += ["--from", "data=digits", "--out", str(folder), "--samples-per-shard", "200"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    pattern = {}
    for split in ("train", "test"):
        shards = sorted(p.name for p in folder.glob(f"{split}-*.tar"))
        pattern[split] = (
            f"{split}-{{{shards[0][len(split) + 1 : -4]}..{shards[-1][len(split) + 1 : -4]}}}.tar"
        )
    return pattern["train"], pattern["test"]


def train(where: str, train: str, test: str, out: Path, epochs: int) -> float:
    """One run; its training samples/s (epochs >= 1, mean over ranks)."""
    cmd = [sys.executable, "train.py", "data=webdataset", f"data.train_urls='{where}/{train}'"]
    cmd += [f"data.test_urls='{where}/{test}'", "dist.nproc=2", "loader.num_workers=2"]
    cmd += ["logger=none", "checkpoint.enabled=false", "share_picture=false", f"epochs={epochs}"]
    cmd += [f"paths.output_root={out}", "backend=gloo"]
    env = {**os.environ, "WANDB_MODE": "offline", "RUN_ID": "bench", "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT, env=env)
    per_rank = []
    for rank in (0, 1):
        rows = [json.loads(x) for x in (out / "bench" / f"rank{rank}" / "metrics.jsonl").open()]
        sps = [r["perf/samples_per_s"] for r in rows if "epoch" in r and "perf/samples_per_s" in r]
        per_rank.append(statistics.mean(sps[1:]))
    return statistics.mean(per_rank)


def main() -> None:
    from ddp_template.optional.s3.server import LocalS3

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, LocalS3() as server:
        os.environ.update(server.env)  # the ranks inherit it
        shards = Path(tmp) / "digits"
        train_pattern, test_pattern = write_digits(shards)
        server.bucket("bench")
        server.upload(shards, URL)
        places = {"local": str(shards), "s3": URL, "local (A/A)": str(shards)}
        rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for k in range(args.rounds):
            order = VARIANTS[k % 3 :] + VARIANTS[: k % 3]
            for variant in order:
                out = Path(tmp) / f"r{k}-{variant[:5].strip()}"
                rates[variant].append(
                    train(places[variant], train_pattern, test_pattern, out, args.epochs)
                )
            print(f"round {k}: " + ", ".join(f"{v} {rates[v][-1]:.0f}" for v in VARIANTS))
    report = table(rates, args)
    print(report)
    if args.out:
        args.out.write_text(report)


def table(rates: dict[str, list[float]], args: argparse.Namespace) -> str:
    load = os.getloadavg()[0]
    lines = [
        f"train.py data=webdataset, digits in shards of 200, 2 ranks x 2 workers, "
        f"{args.epochs} epochs (samples/s of epochs 1..), {args.rounds} paired rounds "
        f"(load {load:.2f})",
        "",
        *ratio_table(rates, "local", "samples/s"),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
