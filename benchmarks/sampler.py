"""Benchmark: torch's DistributedSampler vs ShareSampler at large N (one rank's view).

For each (N, sampler) a fresh subprocess measures, so peak RSS is not polluted by earlier cases:
  * first index: construct + set_epoch + iter + next, in ms (imports and a tiny warm-up excluded)
  * peak RSS growth: ru_maxrss after the run minus ru_maxrss before constructing, in MiB
  * indices/s: iterating the rank's shard after the first index (whole shard, or its first
    `--limit` indices when the shard is larger; the table says which)

Usage: python benchmarks/sampler.py [--sizes 1e6 1e7 ...] [--quick] [--limit 20000000]
Targets: feistel first index <= 1 ms and RSS growth <= 4 MiB at any N, iteration >= 2M
indices/s per rank.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

TORCH_MAX_N = 10**8  # torch and randperm are only measured up to here (1e8: ~16 s, ~4.6 GiB)
FULL_SIZES = [10**6, 10**7, 10**8, 10**9, 10**10]
QUICK_SIZES = [10**5, 10**6]


def _build(kind: str, n: int, world: int, rank: int):
    """Construct the sampler under test over a dataset that only has a length."""
    from torch.utils.data.distributed import DistributedSampler

    from ddp_template.data.samplers import ShareSampler

    dataset = range(n)  # len() only; a range object holds no per-index memory
    if kind == "torch":
        return DistributedSampler(dataset, world, rank, shuffle=True, seed=0)
    return ShareSampler(dataset, world, rank, shuffle=True, seed=0, permutation=kind)


def _child(kind: str, n: int, world: int, rank: int, limit: int) -> dict:
    """Measure one case inside this (fresh) process and return the numbers."""
    import collections
    import itertools
    import resource
    import time

    for warm in ("torch", "randperm", "feistel"):  # one-time lazy initialisation, not per N
        next(iter(_build(warm, 10, world, rank)))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    sampler = _build(kind, n, world, rank)
    sampler.set_epoch(1)
    iterator = iter(sampler)
    next(iterator)
    first = time.perf_counter() - start
    rss_first = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    count = min(len(sampler), limit) - 1  # the first index was already taken
    start = time.perf_counter()
    collections.deque(itertools.islice(iterator, count), maxlen=0)
    rate = count / (time.perf_counter() - start)
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "kind": getattr(sampler, "permutation", "torch") if kind == "auto" else kind,
        "first_ms": first * 1e3,
        "rss_first_mib": (rss_first - rss_before) / 1024,  # ru_maxrss is in KiB on Linux
        "rss_mib": (rss_after - rss_before) / 1024,
        "rate": rate,
        "iterated": count + 1,
        "whole": count + 1 == len(sampler),
    }


def _cases(sizes: list[int]) -> list[tuple[int, str]]:
    cases = []
    for n in sizes:
        kinds = ["torch", "randperm", "auto", "feistel"] if n <= TORCH_MAX_N else ["feistel"]
        cases += [(n, kind) for kind in kinds]
    return cases


def _run_case(n: int, kind: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, str(n), str(args.world_size),
           str(args.rank), str(args.limit)]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _label(kind: str, resolved: str) -> str:
    names = {"torch": "torch DistributedSampler", "randperm": "ShareSampler randperm",
             "feistel": "ShareSampler feistel"}  # fmt: skip
    return f"ShareSampler auto (-> {resolved})" if kind == "auto" else names[kind]


def _table(rows: list[tuple[int, str, dict]], world: int, rank: int) -> str:
    lines = [
        f"W={world}, rank {rank}, shuffle=True, seed=0, epoch 1.",
        "",
        "| N | sampler | first index (ms) | peak RSS growth (MiB) | indices/s | iterated |",
        "|---|---|---:|---:|---:|---|",
    ]
    for n, kind, r in rows:
        iterated = "whole shard" if r["whole"] else f"first {r['iterated']:,}"
        lines.append(
            f"| {n:.0e} | {_label(kind, r['kind'])} | {r['first_ms']:.3f} | {r['rss_mib']:.1f} "
            f"| {r['rate'] / 1e6:.2f} M | {iterated} ({r['iterated']:,}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=float, help="dataset sizes, e.g. 1e6 1e8")
    parser.add_argument("--quick", action="store_true", help="small sizes only (< 30 s)")
    parser.add_argument("--limit", type=int, default=20_000_000, help="max indices iterated")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, n, world, rank, limit = args.child
        print(json.dumps(_child(kind, int(n), int(world), int(rank), int(limit))))
        return
    sizes = [int(s) for s in args.sizes] if args.sizes else FULL_SIZES
    if args.quick:
        sizes, args.limit = QUICK_SIZES, min(args.limit, 2_000_000)
    rows = []
    for n, kind in _cases(sizes):
        rows.append((n, kind, _run_case(n, kind, args)))
        print(f"done N={n:.0e} {kind}", file=sys.stderr, flush=True)
    print(_table(rows, args.world_size, args.rank))


if __name__ == "__main__":
    main()
