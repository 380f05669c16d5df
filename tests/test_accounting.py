"""Fingerprints and the shard report: the numbers that make a silent data bug visible."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from ddp_template.data.samplers import ShareSampler
from ddp_template.engine import EpochStats
from ddp_template.ledger.records import Coverage
from ddp_template.ledger.tally import IndexTally, fingerprint, fingerprint_sum
from ddp_template.ledger.verify import (
    all_match,
    derived_coverage,
    epoch_metrics,
    epoch_report,
    expected_fingerprint,
    own_check,
    share_report,
)

M = 2**64 - 1


def splitmix64_reference(x: int) -> int:
    """docs/ARCHITECTURE.md "Accounting", verbatim."""
    x = (x + 0x9E3779B97F4A7C15) & M
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M
    return x ^ (x >> 31)


def test_fingerprint_matches_the_design_formula() -> None:
    idx = [0, 1, 2, 10, 12345, 2**40 + 7, 10**12]
    want = sum(splitmix64_reference(i) for i in idx) % 2**64
    assert fingerprint(np.array(idx)) == f"{want:016x}"
    assert fingerprint(np.array([], dtype=np.int64)) == "0" * 16


def test_fingerprint_is_order_independent_and_additive() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 10**9, 1000), rng.integers(0, 10**9, 500)
    assert fingerprint(a) == fingerprint(rng.permutation(a))
    assert (fingerprint_sum(a) + fingerprint_sum(b)) % 2**64 == fingerprint_sum(
        np.concatenate([a, b])
    )
    assert fingerprint(a) != fingerprint(a[:-1])


def test_tally_counts_batches_and_ends() -> None:
    t = IndexTally(keep=True)
    for batch in ([5, 3], [9], [1, 2, 4]):
        t.add(np.array(batch))
    assert (t.samples, t.batches, t.first_index, t.last_index) == (6, 3, 5, 4)
    assert t.fp == fingerprint_sum(np.array([5, 3, 9, 1, 2, 4]))
    assert t.indices().tolist() == [5, 3, 9, 1, 2, 4]


def _observe(samplers: list[ShareSampler], upto: int | None = None) -> list[dict]:
    out = []
    for s in samplers:
        idx = np.array(list(s))[:upto]
        out.append(
            {
                "samples": len(idx),
                "duplicates": s.padding_in_prefix(len(idx)),
                "fingerprint": fingerprint_sum(idx),
                "indices": idx,
            }
        )
    return out


def _samplers(n: int, w: int, mode: str, seeds: list[int], epochs: list[int]) -> list:
    shuffle = mode != "sequential"
    out = []
    for r in range(w):
        s = ShareSampler(range(n), w, r, shuffle=shuffle, seed=seeds[r], mode=mode)
        s.set_epoch(epochs[r])
        out.append(s)
    return out


def _report(n: int, w: int, mode: str, seeds: list[int], epochs: list[int], upto=None):
    truth = _samplers(n, w, mode, [0] * w, [1] * w)  # what the mode defines (epoch 1, seed 0)
    observed = _observe(_samplers(n, w, mode, seeds, epochs), upto)
    expected = [expected_fingerprint(truth[0], r, 0, o["samples"]) for r, o in enumerate(observed)]
    return share_report(mode, n, observed, expected)


@pytest.mark.parametrize(
    "mode,coverage,overlap", [("padded", 1.0, 1), ("drop_last", 10 / 11, 0), ("sequential", 1.0, 1)]
)
def test_report_for_each_mode(mode: str, coverage: float, overlap: int) -> None:
    report = _report(11, 2, mode, [0, 0], [1, 1])
    assert str(report.verdict) == "ok"
    c = report.coverage
    assert c.fraction == pytest.approx(coverage) and c.overlap == overlap
    assert [r.samples for r in report.ranks] == ([5, 5] if mode == "drop_last" else [6, 6])


def test_a_prefix_is_fine_but_a_wrong_seed_or_missing_set_epoch_is_not() -> None:
    assert str(_report(1000, 4, "padded", [0] * 4, [1] * 4, upto=100).verdict) == "ok"
    wrong_seed = _report(1000, 4, "padded", [0, 0, 7, 0], [1] * 4)
    assert str(wrong_seed.verdict).startswith("MISMATCH") and "rank 2" in str(wrong_seed.verdict)
    assert wrong_seed.coverage.overlap > 0  # and it shows: samples seen by two ranks
    stale = _report(1000, 4, "padded", [0] * 4, [0, 1, 1, 1])  # rank 0 forgot set_epoch
    assert "rank 0" in str(stale.verdict) and "rank 1" not in str(stale.verdict)


def test_expected_fingerprint_needs_no_full_list_for_huge_n() -> None:
    s = ShareSampler(range(10**10), 8, 3, seed=1, mode="padded", permutation="feistel")
    got = expected_fingerprint(s, 3, 5_000, 2_000, block=512)
    want = fingerprint_sum(s.index_at(np.arange(5_000, 7_000), 3))
    assert got == want


def test_tally_folds_many_batches_without_losing_any() -> None:
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 10**6, 7) for _ in range(3 * IndexTally.FOLD + 5)]
    t = IndexTally(keep=True)
    for b in batches:
        t.add(b)
    everything = np.concatenate(batches)
    assert t.fp == fingerprint_sum(everything) and t.samples == len(everything)
    assert t.indices().tolist() == everything.tolist()


# ------------------------------------------------ each rank checks itself; rank 0 gets rows only
def _oracle_coverage(n: int, lists: list[np.ndarray]) -> Coverage:
    """Coverage, overlap and repeats counted from the index lists, with sets."""
    seen = [set(idx.tolist()) for idx in lists]
    covered = len(set().union(*seen))
    owners = {i: sum(i in s for s in seen) for i in set().union(*seen)}
    reads = sum(len(idx) for idx in lists)
    overlap = sum(k > 1 for k in owners.values())
    return Coverage(fraction=covered / n, covered=covered, overlap=overlap, repeats=reads - covered)


@pytest.mark.parametrize("mode", ["padded", "drop_last", "sequential"])
@pytest.mark.parametrize("n,w", [(1, 1), (7, 3), (11, 2), (12, 4), (5, 8), (3, 7), (100, 9)])
def test_derived_coverage_is_what_the_lists_say(mode: str, n: int, w: int) -> None:
    """Any per-rank range of positions (resumed starts, capped or dropped last batches)."""
    if mode == "drop_last" and w > n:
        return  # refused at startup: no rank would get a sample
    samplers = _samplers(n, w, mode, [5] * w, [2] * w)
    length, rng = samplers[0].num_samples, np.random.default_rng(n * 31 + w)
    for _ in range(25):
        starts = rng.integers(0, length + 1, w)
        ranges = [(int(s), int(rng.integers(0, length - s + 1))) for s in starts]
        lists = [samplers[r].rank_indices()[s : s + c] for r, (s, c) in enumerate(ranges)]
        assert derived_coverage(samplers[0], ranges) == _oracle_coverage(n, lists)


def _epoch_rows(samplers: list[ShareSampler], start: int, count: int, seen=None):
    """Every simulated rank's own_check row after reading ``count`` positions from ``start`` of
    its own sampler's list, or the indices ``seen[r]`` where a test makes rank r's loader err."""
    rows, lists = [], []
    for r, s in enumerate(samplers):
        idx = (seen or {}).get(r, s.rank_indices()[start : start + count])
        stats = EpochStats(IndexTally(keep=True))
        for batch in np.array_split(idx, max(1, len(idx) // 8)):
            stats.tally.add(batch)
        metrics = epoch_metrics(stats, s, start, s.epoch)
        rows.append(own_check(stats, s, start, metrics, rank=r))
        lists.append(stats.tally.indices())
    return rows, lists


@pytest.mark.parametrize("mode", ["padded", "drop_last", "sequential"])
@pytest.mark.parametrize("start,count", [(0, None), (40, 96), (0, 8)])
def test_a_clean_epoch_is_reported_exactly_from_rows_alone(mode: str, start: int, count) -> None:
    samplers = _samplers(1003, 4, mode, [0] * 4, [3] * 4)
    count = samplers[0].num_samples - start if count is None else count
    rows, lists = _epoch_rows(samplers, start, count)
    report = epoch_report(samplers[0], rows)
    assert str(report.verdict) == "ok" and all(r.matches for r in report.ranks)
    from_lists = epoch_report(samplers[0], rows, lists)
    assert report.coverage == from_lists.coverage
    assert report.total_samples == from_lists.total_samples
    assert len(pickle.dumps(rows)) < 2048  # what the ranks exchange: no index list


def test_a_wrong_seed_passes_its_own_check_but_not_the_definitions() -> None:
    samplers = _samplers(1000, 4, "padded", [0, 0, 7, 0], [1] * 4)
    rows, lists = _epoch_rows(samplers, 0, 250)
    assert rows[2]["expected"] == rows[2]["fingerprint"]  # its loader did follow its sampler
    assert not all_match(rows)
    report = epoch_report(samplers[0], rows, lists)
    assert (
        str(report.verdict)
        == "MISMATCH: rank 2's sampler defines another padded epoch than the others"
    )
    assert [r.matches for r in report.ranks] == [True, True, False, True]
    assert report.coverage.overlap > 0  # the lists gathered on a mismatch show it


def test_the_odd_rank_out_is_named_even_when_it_is_rank_0() -> None:
    stale = _samplers(1000, 4, "drop_last", [0] * 4, [0, 1, 1, 1])  # rank 0 missed set_epoch
    report = epoch_report(stale[0], _epoch_rows(stale, 0, 250)[0])
    assert "rank 0" in str(report.verdict) and "rank 1" not in str(report.verdict)
    assert report.coverage is None  # no lists, no derived coverage after a mismatch


def test_a_loader_that_reads_another_ranks_batch_is_caught() -> None:
    samplers = _samplers(1000, 4, "padded", [0] * 4, [1] * 4)
    wrong = samplers[3].rank_indices()[:100].copy()
    wrong[8:16] = samplers[1].rank_indices()[8:16]
    rows, _ = _epoch_rows(samplers, 0, 100, seen={3: wrong})
    report = epoch_report(samplers[0], rows)
    assert str(report.verdict) == "MISMATCH: rank 3 saw indices that differ from its padded share"


def test_a_rank_that_reads_past_its_list_mismatches_instead_of_raising() -> None:
    samplers = _samplers(1000, 4, "padded", [0] * 4, [1] * 4)
    extra = np.append(samplers[1].rank_indices()[200:], 5)
    report = epoch_report(samplers[0], _epoch_rows(samplers, 200, 50, seen={1: extra})[0])
    assert str(report.verdict) == "MISMATCH: rank 1 saw indices that differ from its padded share"
