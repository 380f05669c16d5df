"""The audit of a stream: what every (rank, loader worker) read, by key, against each other and
against what the epoch should hold.

A stream has no plan to check a rank against, so the verdict comes from the keys themselves:
duplicates within a (rank, worker), overlap between (rank, worker) pairs (with the symptoms
named: every rank the same samples, every worker of a rank the same samples), samples left
unread at uneven ends, samples replayed after a resume, and coverage against the expected key
set or count. Cost: where the expected keys are known and the ranks' counts and fingerprints
sum to them exactly, only a row per (rank, worker) is gathered; otherwise every rank's key
hashes are all-gathered (8 bytes a sample, once per epoch).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ddp_template.distributed import DistInfo, gather_objects
from ddp_template.ledger.records import (
    Coverage,
    EpochReport,
    RankLine,
    StreamRow,
    Unread,
    Verdict,
    WorkerLine,
)
from ddp_template.ledger.tally import fingerprint_hex, fingerprint_sum
from ddp_template.optional.streams.contract import Expected

_M64 = 2**64 - 1
NAMED = 12  # keys named per (rank, worker) in the verdict and the report
PAIRS = 64  # (rank, worker) pairs that the overlap is resolved between (a bit mask per key)


def _samples(n: int) -> str:
    return f"{n} sample{'' if n == 1 else 's'}"


def key_report(
    keys: list[list[np.ndarray]],
    *,
    expected: Expected | None = None,
    unread: list[list[Unread]] | None = None,
    before: list[np.ndarray] | None = None,
) -> EpochReport:
    """The verdict on one epoch of a stream from every rank's keys per worker (``keys[r][k]``),
    the samples each (rank, worker) left unread (``unread[r][k]``: count, first names) and the
    keys each rank read before a resume (``before[r]``)."""
    world, workers = len(keys), max(len(rank) for rank in keys)
    pairs = [(r, k) for r, rank in enumerate(keys) for k in range(len(rank))]
    flat = [a.astype(np.int64, copy=False) for rank in keys for a in rank]
    pair = np.repeat(np.arange(len(flat)), [len(a) for a in flat])
    every = np.concatenate(flat) if flat else np.zeros(0, np.int64)
    uniq, inverse = np.unique(every, return_inverse=True)
    twice = [len(a) - len(np.unique(a)) for a in flat]
    problems = [
        f"rank {r} worker {k} read {_samples(n)} more than once"
        for (r, k), n in zip(pairs, twice, strict=True)
        if n
    ]
    overlap, involved = 0, 0  # involved: a bit per pair that read what another pair read
    if len(flat) <= PAIRS and len(uniq):
        mask = np.zeros(len(uniq), dtype=np.uint64)
        np.bitwise_or.at(mask, inverse, np.left_shift(np.uint64(1), pair.astype(np.uint64)))
        problems += _overlaps(mask, pairs, world, workers)
        several = mask & (mask - np.uint64(1)) != 0  # more than one bit: read by several pairs
        overlap = int(several.sum())
        involved = int(np.bitwise_or.reduce(mask[several])) if overlap else 0
    fps = [fingerprint_sum(a) for rank in keys for a in rank]
    lines = [
        WorkerLine(
            rank=r,
            worker=k,
            samples=len(a),
            fingerprint=fingerprint_hex(fp),
            duplicates=n,
            matches=not n and not involved >> p & 1,
        )
        for p, ((r, k), a, fp, n) in enumerate(zip(pairs, flat, fps, twice, strict=True))
    ]
    replayed = 0
    if before is not None:
        earlier = np.unique(np.concatenate(before)) if before else np.zeros(0, np.int64)
        replayed = len(np.intersect1d(earlier, uniq, assume_unique=True))
        if replayed:
            problems.append(
                f"{_samples(replayed)} replayed: read before the resume and again after it (the "
                f"stream restarted instead of resuming where it stood)"
            )
        uniq = np.union1d(uniq, earlier)
    left = unread or [[] for _ in keys]
    unread_total = sum(n for rank in left for n, _ in rank)
    if unread_total:
        ran_out = [r for r, rank in enumerate(left) if not sum(n for n, _ in rank)]
        named = [
            f"rank {r} worker {k}: {n} ({', '.join(names)}{', …' if n > len(names) else ''})"
            for r, rank in enumerate(left)
            for k, (n, names) in enumerate(rank)
            if n
        ]
        problems.append(
            f"{_samples(unread_total)} left unread: all ranks stopped when rank "
            f"{', '.join(map(str, ran_out)) or '?'} ran out (uneven ends): " + "; ".join(named)
        )
    fraction = None
    if expected is not None:
        fraction = len(uniq) / expected.count if expected.count else 0.0
        if expected.hashes is not None:
            missing = len(np.setdiff1d(expected.hashes, uniq, assume_unique=True))
            stray = len(np.setdiff1d(uniq, expected.hashes, assume_unique=True))
            if stray:
                problems.append(f"{_samples(stray)} read whose keys the expected key set lacks")
        else:
            missing = max(expected.count - len(uniq), 0)
        missing -= min(missing, unread_total)
        if missing:
            problems.append(
                f"{missing} of the {expected.count} expected samples were read by no rank"
            )
    return EpochReport(
        mode="stream",
        dataset_size=expected.count if expected is not None else len(uniq),
        ranks=_rank_lines(lines, fps, world),
        total_samples=len(every),
        verdict=Verdict(tuple(problems)),
        coverage=Coverage(
            fraction=fraction,
            covered=len(uniq),
            overlap=overlap,
            repeats=len(every) - len(uniq) + replayed,
        ),
        workers=lines,
        unread=[
            f"rank {r} worker {k}: {name}"
            for r, rank in enumerate(left)
            for k, (_, names) in enumerate(rank)
            for name in names
        ],
        unread_samples=unread_total,
        replayed=replayed,
        hint="a stream's (rank, worker)s read overlapping, repeated or too few samples",
    )


def _overlaps(
    mask: np.ndarray, pairs: list[tuple[int, int]], world: int, workers: int
) -> list[str]:
    """The overlap between (rank, worker) pairs, by symptom where one explains it."""
    patterns, counts = np.unique(mask, return_counts=True)
    bits = [[p for p in range(len(pairs)) if int(m) >> p & 1] for m in patterns]
    shared = [(b, int(c)) for b, c in zip(bits, counts, strict=True) if len(b) > 1]
    if not shared:
        return []
    return (
        _not_split_by_rank(shared, pairs, world, int(counts.sum()))
        or _not_split_by_worker(bits, counts, pairs, world, workers)
        or _pairs_overlapping(shared, pairs)
    )


def _not_split_by_rank(
    shared: list[tuple[list[int], int]], pairs: list[tuple[int, int]], world: int, total: int
) -> list[str]:
    """Every rank read every sample: the stream is not split by rank."""
    rank_sets = [({pairs[p][0] for p in b}, c) for b, c in shared]
    if world > 1 and all(len(ranks) == world for ranks, _ in rank_sets):
        n = sum(c for _, c in shared)
        if n == total:
            return [
                f"every rank read the same {_samples(n)}: the stream is not split by rank "
                f"(split_dataset_by_node / wds.split_by_node forgotten? or split by "
                f"dist.get_rank() in __iter__, where a loader worker has no process group: read "
                f"the rank in __init__, or RANK/WORLD_SIZE from the environment as "
                f"wds.split_by_node does)"
            ]
    return []


def _not_split_by_worker(
    bits: list[list[int]],
    counts: np.ndarray,
    pairs: list[tuple[int, int]],
    world: int,
    workers: int,
) -> list[str]:
    """On some rank every sample was read by each of its loader workers."""
    missing = {}
    for r in range(world):
        own = [p for p, (rank, _) in enumerate(pairs) if rank == r]
        if workers < 2 or len(own) < 2:
            continue
        mine = [(set(b) & set(own), int(c)) for b, c in zip(bits, counts, strict=True)]
        mine = [(b, c) for b, c in mine if b]
        if mine and all(len(b) == len(own) for b, _ in mine):
            missing[r] = (sum(c for _, c in mine), len(own))
    if not missing:
        return []
    ranks = ", ".join(map(str, missing))
    each = "; ".join(f"{n} samples {k}x" for n, k in missing.values())
    return [
        f"on rank {ranks} every sample was read by each loader worker ({each}): the "
        f"stream is not split by worker (wds.split_by_worker forgotten? a dataset that "
        f"ignores get_worker_info?)"
    ]


def _pairs_overlapping(
    shared: list[tuple[list[int], int]], pairs: list[tuple[int, int]]
) -> list[str]:
    """The (rank, worker) pairs that read the same samples, the most first."""
    between: dict[tuple[int, int], int] = {}
    for b, c in shared:
        for i, p in enumerate(b):
            for q in b[i + 1 :]:
                between[p, q] = between.get((p, q), 0) + c
    named = sorted(between.items(), key=lambda kv: -kv[1])
    lines = [
        f"rank {pairs[p][0]} worker {pairs[p][1]} and rank {pairs[q][0]} worker {pairs[q][1]} "
        f"read the same {_samples(n)}"
        for (p, q), n in named[:8]
    ]
    if len(named) > 8:
        lines.append(f"and {len(named) - 8} more (rank, worker) pairs overlap")
    return lines


def _rank_lines(workers: list[WorkerLine], fps: list[int], world: int) -> list[RankLine]:
    """Each rank's line from its workers' (``fps``: their fingerprints, as ints)."""
    out = []
    for r in range(world):
        mine = [p for p, w in enumerate(workers) if w.rank == r]
        out.append(
            RankLine(
                rank=r,
                samples=sum(workers[p].samples for p in mine),
                duplicates=sum(workers[p].duplicates or 0 for p in mine),
                fingerprint=fingerprint_hex(sum(fps[p] for p in mine) & _M64),
                matches=all(workers[p].matches for p in mine),
            )
        )
    return out


def verify_stream(
    tally: Any,
    unread: list[Unread],
    expected: Expected | None,
    step_s: float,
    info: DistInfo,
) -> EpochReport | None:
    """Check one epoch of a stream: the report on rank 0, None elsewhere. A collective.

    ``tally`` is this rank's ``IndexTally`` (keys kept, per worker); ``unread`` what each of its
    workers left unread at uneven ends (count, first key names)."""
    own = StreamRow(
        workers=[[n, fp] for n, fp in zip(tally.worker_samples, tally.worker_fps, strict=True)],
        unread=unread,
        step_s=step_s,
        kept=tally.keep,
    )
    rows: list[StreamRow] = gather_objects(own, info)
    fast = _exact(rows, expected)
    keys = None
    if fast is None and all(row["kept"] for row in rows):
        keys = gather_objects(tally.worker_indices(), info)  # the rare path: O(N) bytes
    if not info.is_main:
        return None
    if keys is not None:
        report = key_report(keys, expected=expected, unread=[row["unread"] for row in rows])
    else:
        report = fast or _rows_only(rows, expected)
    return report.timed([row["step_s"] for row in rows])


def _exact(rows: list[StreamRow], expected: Expected | None) -> EpochReport | None:
    """The report without keys when the ranks' counts and fingerprints add up to exactly the
    expected keys and nothing was left unread; None otherwise (the keys must decide)."""
    if expected is None or expected.hashes is None:
        return None
    total = sum(n for row in rows for n, _ in row["workers"])
    fp = sum(f for row in rows for _, f in row["workers"]) & _M64
    unread = sum(n for row in rows for n, _ in row["unread"])
    if total != expected.count or fp != (expected.fingerprint or 0) & _M64 or unread:
        return None
    coverage = Coverage(fraction=1.0, covered=total, overlap=0, repeats=0)
    return _counted(rows, expected, Verdict(), coverage=coverage, unread_samples=0)


def _rows_only(rows: list[StreamRow], expected: Expected | None) -> EpochReport:
    """Counts and fingerprints only: some rank kept no keys (above ``share_report_max_n``)."""
    why = "the ranks kept no keys (more samples than share_report_max_n)"
    return _counted(rows, expected, Verdict(unchecked=why))


def _counted(
    rows: list[StreamRow],
    expected: Expected | None,
    verdict: Verdict,
    *,
    coverage: Coverage | None = None,
    unread_samples: int | None = None,
) -> EpochReport:
    """A report of the gathered rows' counts and fingerprints (no keys)."""
    counts = [
        (r, k, n, fp) for r, row in enumerate(rows) for k, (n, fp) in enumerate(row["workers"])
    ]
    lines = [
        WorkerLine(
            rank=r, worker=k, samples=n, fingerprint=fingerprint_hex(fp), duplicates=0, matches=True
        )
        for r, k, n, fp in counts
    ]
    return EpochReport(
        mode="stream",
        dataset_size=expected.count if expected is not None else 0,
        ranks=_rank_lines(lines, [fp for *_, fp in counts], len(rows)),
        total_samples=sum(line.samples for line in lines),
        verdict=verdict,
        coverage=coverage,
        workers=lines,
        unread_samples=unread_samples,
    )
