"""Shard verification: every rank's epoch gathered on rank 0 and checked against its sampler.

A rank's tally (count, fingerprint, and for small N the indices) is compared with the
fingerprint of exactly the positions its sampler mode defines from where the epoch started:
the loader may drop a last batch or a run may cap its steps, but a rank must never reorder,
skip or read another rank's data. The report also carries the exact coverage and overlap (small
N) and the slowest rank's step time over the fastest's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ddp_template.data.accounting import fingerprint_hex, fingerprint_sum
from ddp_template.distributed import DistInfo, gather_objects


def epoch_metrics(stats: Any, sampler: Any, start: int, epoch: int) -> dict[str, Any]:
    """This rank's ``data/*`` and ``perf/*`` numbers for one epoch that began at ``start``."""
    end = start + stats.tally.samples
    duplicates = sampler.padding_in_prefix(end) - sampler.padding_in_prefix(start)
    return {
        "epoch": epoch,
        **stats.as_metrics(duplicates),
        "data/fingerprint": fingerprint_hex(stats.tally.fp),
    }


def verify_epoch(
    stats: Any, sampler: Any, start: int, metrics: dict[str, Any], info: DistInfo
) -> dict[str, Any] | None:
    """Gather every rank's epoch and check it: the report on rank 0, None elsewhere.

    A collective: call it on every rank. ``start`` is the sampler position the epoch began at
    (non-zero after a mid-epoch resume).
    """
    mine = {
        "samples": stats.tally.samples,
        "duplicates": metrics["data/duplicates"],
        "fingerprint": stats.tally.fp,
        "step_s": metrics["perf/step_s"],
        "start": start,
    }
    if stats.tally.keep:
        mine["indices"] = stats.tally.indices()
    observed = gather_objects(mine, info)
    if not info.is_main:
        return None
    expected = [
        expected_fingerprint(sampler, r, o["start"], o["samples"]) for r, o in enumerate(observed)
    ]
    report = shard_report(sampler.mode, sampler.dataset_size, observed, expected)
    step_times = [o["step_s"] for o in observed]
    slowest = max(range(len(step_times)), key=step_times.__getitem__)
    fastest = min(step_times)
    report["slowest_rank"] = slowest
    report["step_s_max_over_min"] = step_times[slowest] / fastest if fastest > 0 else float("nan")
    return report


def expected_fingerprint(
    sampler: Any, rank: int, start: int, count: int, block: int = 1 << 20
) -> int:
    """Fingerprint of positions ``[start, start+count)`` of ``rank``'s list as the mode defines
    it, computed in blocks: O(count) time, O(block) memory, whatever N is."""
    total = 0
    for lo in range(start, start + count, block):
        positions = np.arange(lo, min(lo + block, start + count), dtype=np.int64)
        total = (total + fingerprint_sum(sampler.index_at(positions, rank))) & (2**64 - 1)
    return total


def shard_report(
    mode: str, dataset_size: int, observed: list[dict[str, Any]], expected: list[int]
) -> dict[str, Any]:
    """Rank 0's verdict on one epoch: did every rank see what its sampler mode defines?

    ``observed[r]`` holds rank r's ``samples``, ``duplicates``, ``fingerprint`` (int) and,
    for small N, ``indices``. ``expected[r]`` is the fingerprint of the first ``samples`` indices
    rank r's list holds from where the epoch started: a rank must have seen exactly those (the
    loader may drop a last batch, or a run may cap its steps, but never reorder or skip).
    """
    rows, problems = [], []
    for r, o in enumerate(observed):
        ok = expected[r] == o["fingerprint"]
        if not ok:
            problems.append(f"rank {r} saw indices that differ from its {mode} shard")
        rows.append(
            {
                "rank": r,
                "samples": int(o["samples"]),
                "duplicates": int(o["duplicates"]),
                "fingerprint": fingerprint_hex(o["fingerprint"]),
                "matches": ok,
            }
        )
    report: dict[str, Any] = {
        "mode": mode,
        "dataset_size": dataset_size,
        "ranks": rows,
        "total_samples": sum(row["samples"] for row in rows),
    }
    if all("indices" in o for o in observed):
        report.update(_coverage(dataset_size, [o["indices"] for o in observed]))
    report["verdict"] = "ok" if not problems else "MISMATCH: " + "; ".join(problems)
    return report


def _coverage(n: int, per_rank: list[np.ndarray]) -> dict[str, Any]:
    """Unique coverage of the dataset and overlap between ranks (exact; small N only)."""
    counts = np.zeros(n, dtype=np.int64)
    owners = np.zeros(n, dtype=np.int64)
    for idx in per_rank:
        uniq = np.unique(idx)
        np.add.at(counts, idx, 1)
        owners[uniq] += 1
    covered = int((counts > 0).sum())
    return {
        "coverage": covered / n if n else 0.0,
        "covered": covered,
        "overlap": int((owners > 1).sum()),
        "repeats": int(counts.sum() - covered),
    }
