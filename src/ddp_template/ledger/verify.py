"""Share verification: every rank checks its own epoch; rank 0 combines a few numbers per rank.

Each rank compares its tally's fingerprint with the fingerprint of exactly the positions its
sampler mode defines from where the epoch started (O(N/W) work on every rank at once): the loader
may drop a last batch or a run may cap its steps, but a rank must never reorder, skip or read
another rank's data. Only a row per rank is gathered (O(W) bytes): counts, fingerprints and what
each rank's sampler defines for the epoch. When every rank matches and the ranks agree on the
definition, the exact coverage, overlap and repeats follow from the mode's deal in O(W); on a
mismatch, the index lists (kept up to ``share_report_max_n``) are gathered so that the report
shows what the ranks really read. The report also carries the slowest rank's step time over the
fastest's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, cast

import numpy as np

from ddp_template.data.contract import Sampler
from ddp_template.distributed import DistInfo, gather_objects
from ddp_template.errors import Unanimous
from ddp_template.ledger.records import (
    Coverage,
    Definition,
    EpochReport,
    PriorCheck,
    PriorLine,
    PriorStretch,
    RankLine,
    RankRow,
    SavedLedger,
    Seen,
    Tallied,
    Verdict,
    WorkerCheck,
    WorkerLine,
)
from ddp_template.ledger.tally import fingerprint_hex, fingerprint_sum, join_ledgers
from ddp_template.splitmix import splitmix64

_M64 = 2**64 - 1
DEFINITION_PROBES = 64  # slots of the epoch hashed into a rank's definition digest


def epoch_metrics(
    stats: Any, sampler: Sampler, start: int, epoch: int, carried: SavedLedger | None = None
) -> dict[str, float | str]:
    """This rank's ``data/*`` and ``perf/*`` numbers for one epoch that began at ``start``;
    an epoch resumed mid-way with ``carried`` (the ledger read before the resume) also gets
    ``data/epoch_*``: the whole epoch's, both launches joined."""
    tally = stats.tally
    end = start + tally.samples
    duplicates = sampler.padding_in_prefix(end) - sampler.padding_in_prefix(start)
    per_worker = {}
    if tally.workers > 1:  # the per-worker breakdown (sharded data's plan)
        for k, (n, fp) in enumerate(zip(tally.worker_samples, tally.worker_fps, strict=True)):
            per_worker[f"data/worker{k}/samples"] = n
            per_worker[f"data/worker{k}/fingerprint"] = fingerprint_hex(fp)
    if carried and carried["epoch"] == epoch:
        joined = join_ledgers(carried, tally)
        per_worker["data/epoch_samples"] = joined["samples"]
        per_worker["data/epoch_fingerprint"] = fingerprint_hex(joined["fingerprint"])
        for k, (n, fp) in enumerate(joined["workers"] if tally.workers > 1 else []):
            per_worker[f"data/worker{k}/epoch_samples"] = n
            per_worker[f"data/worker{k}/epoch_fingerprint"] = fingerprint_hex(fp)
    return {
        "epoch": epoch,
        **stats.as_metrics(duplicates),
        "data/fingerprint": fingerprint_hex(tally.fp),
        **per_worker,
    }


def verify_epoch(
    stats: Any,
    sampler: Any,
    start: int,
    metrics: dict[str, float | str],
    info: DistInfo,
    prior: Sequence[PriorStretch] = (),
) -> EpochReport | None:
    """Check this rank's epoch, gather every rank's row: the report on rank 0, None elsewhere.

    A collective: call it on every rank. ``start`` is the sampler position the epoch began at
    (non-zero after a mid-epoch resume); ``prior`` the epoch's prefixes read at other world
    sizes (``TrainState.prior``), whose old ranks' ledgers the ranks check in turn.
    """
    row = own_check(stats, sampler, start, metrics, rank=info.rank)
    row["prior"] = prior_checks(sampler, prior, rank=info.rank)
    rows: list[RankRow] = gather_objects(row, info)
    lists = None
    # Every rank holds the same rows, so every rank takes (or skips) this second collective.
    if not all_match(rows) and all(row["kept"] for row in rows):
        lists = gather_objects(stats.tally.indices(), info)
    if not info.is_main:
        return None
    return epoch_report(sampler, rows, lists)


def own_check(
    stats: Any, sampler: Any, start: int, metrics: dict[str, float | str], *, rank: int
) -> RankRow:
    """This rank's row of the gather: what it saw, the fingerprint its own share defines for
    that (O(samples) time, O(1) memory) and its sampler's definition of the epoch."""
    tally = stats.tally
    samples = tally.samples
    defined = max(0, min(samples, sampler.num_samples - start))  # more than its list never matches
    workers, _ = sampler.worker_lanes(start)  # 1 unless the sampler deals worker ranges
    expected = expected_fingerprints(sampler, rank, start, defined, workers=workers)
    row = RankRow(
        samples=samples,
        duplicates=int(metrics["data/duplicates"]),
        fingerprint=tally.fp,
        expected=sum(expected) & _M64,
        definition=definition(sampler),
        step_s=float(metrics["perf/step_s"]),
        start=start,
        kept=tally.keep,
        prior=[],
    )
    if workers > 1:  # each loader worker against its own range of the plan
        seen = zip(tally.worker_samples, tally.worker_fps, expected, strict=True)
        row["workers"] = [WorkerCheck(samples=n, fingerprint=fp, expected=e) for n, fp, e in seen]
    return row


def old_ranks(
    sampler: Any, prior: Sequence[PriorStretch], rank: int
) -> Iterator[tuple[int, Any, int, PriorStretch]]:
    """This epoch's prefixes read at other world sizes, as ``(stretch, its sampler, old rank
    q, prefix)`` for the old ranks this rank checks: q mod W = ``rank``."""
    for i, prefix in enumerate(prior):
        old = sampler.prefix_sampler(i)
        for q in range(rank, old.num_replicas, sampler.num_replicas):
            yield i, old, q, prefix


def prior_checks(sampler: Any, prior: Sequence[PriorStretch], *, rank: int) -> list[PriorCheck]:
    """The old ranks' ledgers of this epoch's prefixes against what their samplers defined:
    old rank q is checked by rank q mod W (O(prefix / W) per rank)."""
    checks = []
    for i, old, q, prefix in old_ranks(sampler, prior, rank):
        assert prefix["ledgers"] is not None  # loaded with the ledger part before a check
        ledger = prefix["ledgers"][q]
        samples = int(ledger["samples"])
        count = min(samples, old.length_of(q))
        check = PriorCheck(
            stretch=i,
            world_size=old.num_replicas,
            rank=q,
            samples=samples,
            fingerprint=int(ledger["fingerprint"]),
            expected=expected_fingerprint(old, q, 0, count),
            derived=bool(ledger.get("derived", False)),
        )
        checks.append(check)
    return checks


def resumed_prefix(
    sampler: Any,
    position: int,
    carried: SavedLedger | None,
    prior: Sequence[PriorStretch],
    *,
    rank: int,
) -> tuple[int, int, list[str]]:
    """What a resume continues from, proved against the sampler: the ledger of the epoch read
    before it (this rank's up to ``position``; after a resize, the old ranks' prefixes, old rank
    q checked by rank q mod W) against the positions the sampler defines there. Returns the
    samples skipped and repeated (count differences) and each read whose count matches but
    whose fingerprint does not (other samples were read)."""
    reads: list[tuple[Any, int, int, Tallied | SavedLedger | None]]
    reads = [(sampler, rank, position, carried)] if position else []
    reads += [
        (old, q, p["position"], cast("list[Tallied]", p["ledgers"])[q])  # loaded by now
        for _, old, q, p in old_ranks(sampler, prior, rank)
    ]
    skipped = repeated = 0
    wrong = []
    for s, q, pos, ledger in reads:
        defined = min(pos, s.length_of(q))
        read = int(ledger["samples"]) if ledger else 0
        skipped += max(0, defined - read)
        repeated += max(0, read - defined)
        fp = int(ledger.get("fingerprint", 0)) if ledger else 0
        if read == defined and fp != expected_fingerprint(s, q, 0, defined):
            wrong.append(
                f"rank {q} of {s.num_replicas} read {read} samples up to position {pos} but not "
                f"the ones this run's sampler puts there"
            )
    return skipped, repeated, wrong


def continuity(sampler: Any, state: Any, info: DistInfo) -> tuple[int, int]:
    """The epoch read before a resume against what the restored sampler puts there, on every
    rank (a collective; ``state``: the restored ``engine.TrainState``): the samples skipped and
    repeated, or a refusal every rank meets."""
    # A stream resumes only at an epoch's end (position 0, no prefix): nothing to prove.
    mine = resumed_prefix(sampler, state.position, state.carried, state.prior, rank=info.rank)
    rows = gather_objects(mine, info)
    wrong = [w for _, _, ws in rows for w in ws]
    if wrong:  # every rank holds the same rows: a refusal they all meet
        raise Unanimous(
            f"resume at step {state.step}: {wrong[0]}, so it would skip and repeat samples; "
            f"resume with the template version and config that wrote the checkpoint, or start "
            f"fresh with resume=never."
        )
    return sum(r[0] for r in rows), sum(r[1] for r in rows)


def epoch_report(
    sampler: Any, rows: list[RankRow], lists: list[np.ndarray] | None = None
) -> EpochReport:
    """Rank 0's report from every rank's ``own_check`` row (and, after a mismatch, the ranks'
    index lists): O(W) work, plus O(N) only on the mismatch path with lists. After a resume at
    another world size the report covers the whole epoch: the prefixes' old ranks too."""
    expected = agreed_expectations(rows)
    prior = sorted((p for row in rows for p in row["prior"]), key=_stretch_rank)
    observed: list[Seen] = list(rows)
    coverage = None
    if lists is not None:
        observed = [
            cast(Seen, {**row, "indices": idx}) for row, idx in zip(rows, lists, strict=True)
        ]
    elif all_match(rows):
        coverage = derived_coverage(sampler, [(row["start"], row["samples"]) for row in rows])
        coverage = with_prior_coverage(sampler, coverage, prior)
    report = share_report(sampler.mode, sampler.base_size, observed, expected, coverage=coverage)
    if prior:
        old = [
            PriorLine(
                world_size=p["world_size"],
                rank=p["rank"],
                samples=p["samples"],
                fingerprint=fingerprint_hex(p["fingerprint"]),
                matches=p["fingerprint"] == p["expected"],
                derived=p["derived"],
            )
            for p in prior
        ]
        wrong = [
            f"rank {p.rank} of the {p.world_size}-rank launch saw indices that differ "
            f"from its {sampler.mode} share"
            for p in old
            if not p.matches
        ]
        report = replace(
            report,
            prior=old,
            total_samples=report.total_samples + sum(p.samples for p in old),
            verdict=report.verdict.plus(wrong),
        )
    tails = sampler.tail_names()  # the epoch's pads and drops, by key (keyed data only)
    report = replace(report, pads=tails["pads"], drops=tails["drops"])
    return report.timed([row["step_s"] for row in rows])


def agreed_expectations(rows: list[RankRow]) -> list[int | None]:
    """Each rank's own expected fingerprint, or None where its sampler defines another epoch
    than most ranks do (a tie goes to rank 0's definition).

    A rank that checks itself against its own sampler cannot see that the sampler is wrong (a
    different seed, a missed ``set_epoch``, another world size): comparing definitions can.
    """
    definitions = [row["definition"] for row in rows]
    votes = Counter(definitions)
    reference = max(votes, key=lambda d: (votes[d], d == definitions[0]))
    return [row["expected"] if row["definition"] == reference else None for row in rows]


def all_match(rows: list[RankRow]) -> bool:
    expected = agreed_expectations(rows)
    return all(e == row["fingerprint"] for e, row in zip(expected, rows, strict=True))


def expected_fingerprint(
    sampler: Any, rank: int, start: int, count: int, block: int = 1 << 18
) -> int:
    """Fingerprint of positions ``[start, start+count)`` of ``rank``'s list as the mode defines
    it, computed in blocks: O(count) time, O(block) memory, whatever N is."""
    return expected_fingerprints(sampler, rank, start, count, block=block)[0]


def expected_fingerprints(
    sampler: Any, rank: int, start: int, count: int, *, workers: int = 1, block: int = 1 << 18
) -> list[int]:
    """``expected_fingerprint`` per loader worker (``sampler.worker_of`` each position; one
    worker: the rank's whole fingerprint)."""
    totals = [0] * workers
    for lo in range(start, start + count, block):
        positions = np.arange(lo, min(lo + block, start + count), dtype=np.int64)
        indices = sampler.index_at(positions, rank)
        owner = sampler.worker_of(positions) if workers > 1 else np.zeros_like(positions)
        for k in range(workers):
            totals[k] = (totals[k] + fingerprint_sum(indices[owner == k])) & _M64
    return totals


def definition(sampler: Any, probes: int = DEFINITION_PROBES) -> Definition:
    """What ``sampler`` defines for its epoch, in a few numbers: the mode, N, W, L and a hash of
    the (slot, index) pairs at ``probes`` positions spread over the first and the last rank's
    lists (so over the whole epoch; each rank checks its own list in full). L is the longest
    list's length, the same on every rank; a shorter last list is probed up to its end."""
    length, world = sampler.epoch_length, sampler.num_replicas
    spread = np.unique(np.linspace(0, max(length - 1, 0), num=min(probes, length) // 2 + 1))
    spread = spread.astype(np.int64) if length else np.zeros(0, dtype=np.int64)
    digest = 0
    for r in sorted({0, world - 1}):
        positions = spread[spread < sampler.length_of(r)]
        slots = sampler.rule.slots(positions, r, length, world).astype(np.uint64)
        pairs = splitmix64(sampler.index_at(positions, r)) ^ slots
        digest = (digest + fingerprint_sum(pairs)) & _M64
    return (sampler.mode, sampler.dataset_size, world, length, digest)


def _stretch_rank(check: PriorCheck) -> tuple[int, int]:
    return check["stretch"], check["rank"]


def with_prior_coverage(
    sampler: Any, coverage: Coverage, prior: list[PriorCheck]
) -> Coverage | None:
    """The rest's derived coverage joined with its prefixes' (disjoint by construction: a
    rest holds only what its prefix left unread), as a fraction of the whole dataset."""
    if not prior:
        return coverage
    if any(p["fingerprint"] != p["expected"] for p in prior):
        return None
    parts = [coverage]
    for i in sorted({p["stretch"] for p in prior}):
        old = sampler.prefix_sampler(i)
        counts = {p["rank"]: p["samples"] for p in prior if p["stretch"] == i}
        ranges = [(0, min(counts[q], old.length_of(q))) for q in range(old.num_replicas)]
        parts.append(derived_coverage(old, ranges))
    covered = sum(part.covered for part in parts)
    return Coverage(
        fraction=covered / sampler.base_size if sampler.base_size else 0.0,
        covered=covered,
        overlap=sum(part.overlap for part in parts),
        repeats=sum(part.repeats for part in parts),
    )


def derived_coverage(sampler: Any, ranges: list[tuple[int, int]]) -> Coverage:
    """Exact coverage, overlap and repeats when rank r read exactly the positions
    ``[start, start + count)`` (``ranges[r]``) of its list as the mode defines it: O(W) time and
    memory, no index list.

    Slot j holds perm(j mod N) and perm is a bijection, so two slots hold the same dataset index
    exactly when they agree mod N. Only the residues of padding slots (j >= N, fewer than W of
    them) have more than one slot; every other slot read is one index read once.
    """
    n, length, world = sampler.dataset_size, sampler.epoch_length, sampler.num_replicas
    reads = sum(count for _, count in ranges)
    if n == 0:
        return Coverage(fraction=0.0, covered=0, overlap=0, repeats=0)
    total = sampler.total_size  # W x L, or N in `exact`: no padding slot, nothing read twice
    residues = np.unique(np.arange(n, total, dtype=np.int64) % n)
    slots = residues[:, None] + n * np.arange(-(-total // n), dtype=np.int64)[None, :]
    exists = slots < total
    ranks, positions = sampler.rule.owners(np.where(exists, slots, 0), length, world)
    start = np.array([s for s, _ in ranges], dtype=np.int64)
    stop = start + np.array([c for _, c in ranges], dtype=np.int64)
    read = exists & (positions >= start[ranks]) & (positions < stop[ranks])
    a_reader = np.where(read, ranks, -1).max(axis=1, initial=-1)
    covered = reads - int(read.sum()) + int(read.any(axis=1).sum())
    return Coverage(
        fraction=covered / n,
        covered=covered,
        overlap=int((read & (ranks != a_reader[:, None])).any(axis=1).sum()),
        repeats=reads - covered,
    )


def share_report(
    mode: str,
    dataset_size: int,
    observed: list[Seen],
    expected: list[int | None],
    *,
    coverage: Coverage | None = None,
) -> EpochReport:
    """The verdict on one epoch: did every rank see what its sampler mode defines?

    ``observed[r]`` is what rank r saw (with ``indices`` where they were gathered).
    ``expected[r]`` is the fingerprint of the first ``samples`` indices rank r's list holds
    from where the epoch started (a rank must have seen exactly those: the loader may drop a
    last batch, or a run may cap its steps, but never reorder or skip), or None where rank r's
    sampler defines another epoch than the other ranks'. Coverage comes from the indices when
    every rank's are given, else from ``coverage`` (``derived_coverage``).
    """
    ranks, problems = [], []
    for r, o in enumerate(observed):
        ok = expected[r] == o["fingerprint"]
        if expected[r] is None:
            problems.append(f"rank {r}'s sampler defines another {mode} epoch than the others")
        elif not ok:
            problems.append(f"rank {r} saw indices that differ from its {mode} share")
        ranks.append(
            RankLine(
                rank=r,
                samples=int(o["samples"]),
                duplicates=int(o["duplicates"]),
                fingerprint=fingerprint_hex(o["fingerprint"]),
                matches=ok,
            )
        )
    workers = worker_lines(observed, expected)
    problems += [
        f"rank {w.rank}'s loader worker {w.worker} read samples outside its range of the plan"
        for w in workers
        if not w.matches
    ]
    if all("indices" in o for o in observed):
        coverage = _coverage(dataset_size, [o["indices"] for o in observed])
    return EpochReport(
        mode=mode,
        dataset_size=dataset_size,
        ranks=ranks,
        total_samples=sum(line.samples for line in ranks),
        verdict=Verdict(tuple(problems)),
        coverage=coverage,
        workers=workers,
    )


def worker_lines(observed: list[Seen], expected: list[int | None]) -> list[WorkerLine]:
    """One line per (rank, loader worker) where the ranks' rows carry workers: its samples,
    fingerprint and whether that is its range's (not where the rank's definition differs)."""
    return [
        WorkerLine(
            rank=r,
            worker=k,
            samples=int(w["samples"]),
            fingerprint=fingerprint_hex(w["fingerprint"]),
            duplicates=None,
            matches=expected[r] is not None and w["expected"] == w["fingerprint"],
        )
        for r, o in enumerate(observed)
        for k, w in enumerate(o.get("workers", []))
    ]


def _coverage(n: int, per_rank: list[np.ndarray]) -> Coverage:
    """Unique coverage of the dataset and overlap between ranks, from the index lists (O(N))."""
    counts = np.zeros(n, dtype=np.int64)
    owners = np.zeros(n, dtype=np.int64)
    for idx in per_rank:
        uniq = np.unique(idx)
        np.add.at(counts, idx, 1)
        owners[uniq] += 1
    covered = int((counts > 0).sum())
    return Coverage(
        fraction=covered / n if n else 0.0,
        covered=covered,
        overlap=int((owners > 1).sum()),
        repeats=int(counts.sum() - covered),
    )
