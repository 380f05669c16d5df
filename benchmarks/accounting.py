"""Benchmark: the epoch-end shard check against N and W, before and after issue #16.

One process simulates one rank of a W-rank job with explicit ``num_replicas``/``rank`` on the
sampler (``padded``, shuffled, ``permutation=auto``: randperm below 2**24, Feistel above), as
if every rank read its whole list (the slowest epoch end: nothing capped). It measures that
rank's work at the epoch end and counts the bytes its all-gathers move. The permutation of the
epoch is built before timing: the epoch's own iteration already paid for it.

* **before** (the code until issue #16): every rank all-gathers its row and, for
  N <= ``share_report_max_n`` (10 M), its whole index list; rank 0 alone recomputes every
  rank's expected fingerprint (O(N)) and counts coverage from the lists (O(N)). The time is rank
  0's, the other ranks' wait: pickling its list, unpickling all W of them (``all_gather_object``
  does on every rank), the W expected fingerprints and the report.
* **after**: ``own_check`` (this rank's expected fingerprint, O(N/W), and its definition
  digest), pickling its row, unpickling W rows, and rank 0's ``epoch_report`` (coverage derived
  from the mode's layout, O(W)).

Bytes per rank: ``all_gather_object`` exchanges an 8-byte size, then every payload padded to
the largest; whichever algorithm the backend uses (ring or direct), a rank receives (and, in a
ring, sends) W-1 of them: (W-1) * (8 + largest pickled payload). Payloads of equal-length
lists differ by a few bytes at most; the largest is rank 0's (ceil(N/W) indices).

Usage: python benchmarks/accounting.py [--sizes 1e6 1e7 1e8] [--worlds 2 8 64] [--repeats 3]
Target: at N=1e8, W=64, under 2 s per rank and under 1 MiB of traffic per rank.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any

import numpy as np

from ddp_template.config.schema import Config
from ddp_template.data.samplers import ShareSampler
from ddp_template.ledger.tally import fingerprint_sum
from ddp_template.ledger.verify import (
    epoch_report,
    expected_fingerprint,
    own_check,
    share_report,
)

MAX_N = Config.share_report_max_n  # today's default: lists are kept and gathered up to here


@dataclass
class Seen:
    """What a rank's IndexTally holds at the epoch end (its fingerprint, set once known)."""

    samples: int
    keep: bool
    fp: int = 0


@dataclass
class Stats:
    tally: Seen


def sampler_for(n: int, world: int, rank: int) -> ShareSampler:
    s = ShareSampler(range(n), world, rank, shuffle=True, seed=0, mode="padded")
    s.set_epoch(1)
    s.index_at(np.zeros(1, dtype=np.int64))  # the epoch's permutation, built while iterating
    return s


def wire_bytes(payloads: list[bytes], world: int) -> int:
    """Bytes one rank receives (in a ring, also sends) in ``all_gather_object``."""
    return (world - 1) * (8 + max(len(p) for p in payloads))


def after(n: int, world: int, repeats: int) -> dict[str, Any]:
    sampler = sampler_for(n, world, 0)
    stats = Stats(Seen(samples=sampler.num_samples, keep=n <= MAX_N))
    metrics = {
        "data/duplicates": sampler.padding_in_prefix(sampler.num_samples),
        "perf/step_s": 0.1,
    }
    tracemalloc.start()
    stats.tally.fp = own_check(stats, sampler, 0, metrics, rank=0)["expected"]  # a correct rank
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        row = own_check(stats, sampler, 0, metrics, rank=0)
        mine = pickle.dumps(row)
        rows = [pickle.loads(mine) for _ in range(world)]  # every rank's row, unpickled
        report = epoch_report(sampler, rows)
        times.append(time.perf_counter() - t0)
    assert str(report.verdict) == "ok" and report.coverage.fraction == 1.0, report
    return {"s": times, "bytes": wire_bytes([mine], world), "peak": peak}


def before(n: int, world: int, repeats: int) -> dict[str, Any]:
    """The code before issue #16 as rank 0 ran it (the rank the others wait for). Above
    ``share_report_max_n`` no list exists; the fingerprints are then left at 0 (a mismatch
    verdict, the same work)."""
    samplers = [sampler_for(n, world, r) for r in range(world)]
    keep = n <= MAX_N
    rows = []
    for r, s in enumerate(samplers):
        row = {
            "samples": s.num_samples,
            "duplicates": s.padding_in_prefix(s.num_samples),
            "fingerprint": 0,
            "step_s": 0.1,
            "start": 0,
        }
        if keep:
            row["indices"] = s.rank_indices(r)
            row["fingerprint"] = fingerprint_sum(row["indices"])
        rows.append(row)
    payloads = [pickle.dumps(row) for row in rows]
    times, parts, peak = [], [], None
    for rep in range(repeats + keep):  # with lists, one more run traces the memory it adds
        traced = keep and rep == 0
        if traced:
            tracemalloc.start()
        t0 = time.perf_counter()
        pickle.dumps(rows[0])  # rank 0's own payload
        observed = [pickle.loads(p) for p in payloads]
        t1 = time.perf_counter()
        expected = [
            expected_fingerprint(samplers[0], r, o["start"], o["samples"])
            for r, o in enumerate(observed)
        ]
        t2 = time.perf_counter()
        report = share_report("padded", n, observed, expected)
        elapsed = time.perf_counter() - t0
        del observed
        if traced:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        else:
            times.append(elapsed)
            parts.append((t2 - t1, elapsed - (t2 - t1)))
    assert str(report.verdict) == "ok" or not keep, str(report.verdict)
    expected_s, rest_s = (statistics.median(p) for p in zip(*parts, strict=True))
    return {
        "s": times,
        "bytes": wire_bytes(payloads, world),
        "lists": keep,
        "peak": peak,
        "split": f"{expected_s:.3f} + {rest_s:.3f}",
    }


def human_bytes(b: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b} B"


def cell(result: dict[str, Any], note: str = "") -> str:
    times = result["s"]
    spread = f" ({min(times):.3f}–{max(times):.3f})" if len(times) > 1 else " (1 run)"
    if "split" in result:
        spread += f" | {result['split']}"
    peak = "—" if result["peak"] is None else human_bytes(result["peak"])
    traffic = human_bytes(result["bytes"]) + note
    return f"{statistics.median(times):.3f}{spread} | {traffic} | {peak}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e6, 1e7, 1e8])
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 8, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--before-repeats-above-max-n",
        type=int,
        default=1,
        help="repeats of 'before' where N > share_report_max_n (O(N) on one rank: slow)",
    )
    args = parser.parse_args()
    load = [os.getloadavg()[0]]
    lines = [
        "| N | W | before: s per rank, median (min–max) | before: s in expected fingerprints "
        "+ rest | before: bytes per rank | before: peak memory added "
        "| after: s per rank, median (min–max) | after: bytes per rank "
        "| after: peak memory added | speed-up |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in (int(s) for s in args.sizes):
        for world in args.worlds:
            reps = args.repeats if n <= MAX_N else args.before_repeats_above_max_n
            old = before(n, world, reps)
            load.append(os.getloadavg()[0])
            new = after(n, world, args.repeats)
            load.append(os.getloadavg()[0])
            ratio = statistics.median(old["s"]) / statistics.median(new["s"])
            note = "" if old["lists"] else " (no lists: N > max_n)"
            lines.append(f"| {n:.0e} | {world} | {cell(old, note)} | {cell(new)} | {ratio:.0f}x |")
            print(f"done N={n:.0e} W={world}", file=sys.stderr, flush=True)
    above = args.before_repeats_above_max_n
    print(f"{args.repeats} repeats ({above} for 'before' above share_report_max_n); ", end="")
    print(f"1-min load average {min(load):.2f}–{max(load):.2f}")
    print()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
