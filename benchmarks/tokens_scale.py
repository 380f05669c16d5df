"""A token file of 10^9 tokens costs what one of 10^6 costs: the first batch and the memory.

    python benchmarks/tokens_scale.py [--repeats 3] [--nproc 2] [--out report.md]

Writes two sparse uint16 token files (10^6 and 10^9 tokens of id 0: the big one takes 2 GB of
address space and no disk) with ``meta.json``, then, in rotated order every repeat:

* **first batch**: in a fresh process, the seconds from calling the ``data=tokens`` factory to
  the first batch of rank 0's training loader (the kind's sampler at 2 ranks, ``permutation=
  auto``, block 256, batch 32), and the resident memory that added (``/proc/self/statm``);
* **train.py**: ``train.py data=tokens task=lm model=gpt`` (a 1-layer GPT, one step, logger=none,
  shares.png drawn as by default) on ``--nproc`` ranks under benchmarks/_first_step_probe.py:
  each rank's seconds to its first optimizer step and peak RSS.

The 10^6 file runs twice per repeat (``small`` and ``small A/A``): their difference is the noise
floor the big file's differences are read against. Targets (issue "Language models"): the
first batch of the 10^9 file under 2 s, and at most 50 MiB more resident memory per rank than
the 10^6 file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _launch import ROOT, git_state, invocation, launch, run_tag

SIZES = {"small": 10**6, "small A/A": 10**6, "big": 10**9}
BLOCK, BATCH = 256, 32
GPT = ["model=gpt", "model.n_layer=1", "model.n_embd=32", "model.n_head=2"]


def rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def measure_first_batch(directory: Path) -> dict:
    """In this (fresh) process: the factory to rank 0's first training batch, and the memory."""
    import torch

    from ddp_template.config.schema import LoaderConfig, SamplerConfig
    from ddp_template.distributed import DistInfo

    before, start = rss_mib(), time.perf_counter()
    from ddp_template.optional.tokens.splits import tokens

    splits = tokens(str(directory), block_size=BLOCK)
    cpu = torch.device("cpu")
    info = DistInfo(
        rank=0, local_rank=0, world_size=2, local_world_size=2, backend=None, device=cpu, host="-"
    )
    cfg = LoaderConfig(batch_size=BATCH)
    kind = splits.kind
    sampler = kind.sampler(splits.train, SamplerConfig(), seed=0, info=info, loader=cfg)
    sampler.set_epoch(0)
    loader = kind.loader(splits.train, sampler, cfg, seed=0, drop_last=False, info=info)
    next(iter(loader))
    return {
        "first_batch_s": time.perf_counter() - start,
        "rss_added_mib": rss_mib() - before,
        "windows": len(splits.train),
        "permutation": sampler.permutation,
    }


def sparse_tokens(directory: Path, tokens: int) -> Path:
    """``tokens`` zero ids as a sparse uint16 file (and a small val.bin), with meta.json."""
    directory.mkdir(parents=True)
    with (directory / "train.bin").open("wb") as f:
        f.truncate(2 * tokens)
    (directory / "val.bin").write_bytes(bytes(2 * 10 * (BLOCK + 1)))
    meta = {"dtype": "uint16", "vocab_size": 256, "tokenizer": "bytes"}
    meta["tokens"] = {"train.bin": tokens, "val.bin": 10 * (BLOCK + 1)}
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


def first_batch(directory: Path) -> dict:
    cmd = [sys.executable, __file__, "--first-batch", str(directory)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{cmd} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def train(directory: Path, out: Path, nproc: int, tag: str) -> dict:
    script = [
        "train.py",
        "data=tokens",
        f"data.path={directory}",
        f"data.block_size={BLOCK}",
        "task=lm",
        *GPT,
        "optim=adamw",
        f"loader.batch_size={BATCH}",
        "logger=none",
        "epochs=1",
        "max_steps_per_epoch=1",
        f"paths.output_root={out}",
    ]
    result = launch(script, out / tag, nproc, tag)
    return {
        "first_step_s": [p["first_step_s"] for p in result["probes"]],
        "peak_rss_mib": [p["peak_rss_mib"] for p in result["probes"]],
        "load": result["load"],
    }


def spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:.3f} ({min(values):.3f}–{max(values):.3f})"


def report(rows: dict[str, list[dict]], nproc: int) -> str:
    lines = [
        "| file | windows | first batch s | RSS added by the data MiB | train.py first step s "
        "(max over ranks) | train.py peak RSS MiB (max over ranks) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, runs in rows.items():
        lines.append(
            f"| {name} ({SIZES[name]:.0e} tokens) | {runs[0]['windows']:,} "
            f"| {spread([r['first_batch_s'] for r in runs])} "
            f"| {spread([r['rss_added_mib'] for r in runs])} "
            f"| {spread([max(r['first_step_s']) for r in runs])} "
            f"| {spread([max(r['peak_rss_mib']) for r in runs])} |"
        )
    lines += [
        "",
        "Paired differences within a repeat (max over ranks of each rank's difference):",
        "",
    ]
    lines += ["| pair | first step s | peak RSS MiB per rank |", "|---|---:|---:|"]
    for name in ("big", "small A/A"):
        steps, memory = [], []
        for big, small in zip(rows[name], rows["small"], strict=True):
            steps.append(max(big["first_step_s"]) - max(small["first_step_s"]))
            rss = [b - s for b, s in zip(big["peak_rss_mib"], small["peak_rss_mib"], strict=True)]
            memory.append(max(rss))
        lines.append(f"| {name} − small | {spread(steps)} | {spread(memory)} |")
    loads = [r["load"] for runs in rows.values() for r in runs]
    lines += ["", f"{nproc} ranks; 1-min load average during the runs: {spread(loads)}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the report (markdown) here too")
    parser.add_argument("--first-batch", type=Path, help=argparse.SUPPRESS)  # one measurement
    args = parser.parse_args()
    if args.first_batch:
        print(json.dumps(measure_first_batch(args.first_batch)))
        return
    rows: dict[str, list[dict]] = {name: [] for name in SIZES}
    with tempfile.TemporaryDirectory(prefix="tokens_scale_") as tmp:
        root = Path(tmp)
        files = {n: sparse_tokens(root / f"tokens_{n}", n) for n in set(SIZES.values())}
        names = list(SIZES)
        for round_ in range(args.repeats):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                directory = files[SIZES[name]]
                row = first_batch(directory)
                tag = run_tag(name.replace(" ", "").replace("/", ""), round_)
                row |= train(directory, root / "runs", args.nproc, tag)
                rows[name].append(row)
                print(name, json.dumps(row), flush=True)
    text = "\n".join(
        [
            f"Command: `{invocation()}`",
            "",
            f"Template at {git_state()}.",
            "",
            report(rows, args.nproc),
        ]
    )
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
