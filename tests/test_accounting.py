"""Fingerprints and the shard report: the numbers that make a silent data bug visible."""

from __future__ import annotations

import numpy as np
import pytest

from ddp_template.data.accounting import IndexTally, fingerprint, fingerprint_sum
from ddp_template.data.samplers import ShardSampler
from ddp_template.data.shard_check import expected_fingerprint, shard_report

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


def _observe(samplers: list[ShardSampler], upto: int | None = None) -> list[dict]:
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
        s = ShardSampler(range(n), w, r, shuffle=shuffle, seed=seeds[r], mode=mode)
        s.set_epoch(epochs[r])
        out.append(s)
    return out


def _report(n: int, w: int, mode: str, seeds: list[int], epochs: list[int], upto=None):
    truth = _samplers(n, w, mode, [0] * w, [1] * w)  # what the mode defines (epoch 1, seed 0)
    observed = _observe(_samplers(n, w, mode, seeds, epochs), upto)
    expected = [expected_fingerprint(truth[0], r, 0, o["samples"]) for r, o in enumerate(observed)]
    return shard_report(mode, n, observed, expected)


@pytest.mark.parametrize(
    "mode,coverage,overlap", [("padded", 1.0, 1), ("drop_last", 10 / 11, 0), ("sequential", 1.0, 1)]
)
def test_report_for_each_mode(mode: str, coverage: float, overlap: int) -> None:
    report = _report(11, 2, mode, [0, 0], [1, 1])
    assert report["verdict"] == "ok"
    assert report["coverage"] == pytest.approx(coverage) and report["overlap"] == overlap
    assert [r["samples"] for r in report["ranks"]] == ([5, 5] if mode == "drop_last" else [6, 6])


def test_a_prefix_is_fine_but_a_wrong_seed_or_missing_set_epoch_is_not() -> None:
    assert _report(1000, 4, "padded", [0] * 4, [1] * 4, upto=100)["verdict"] == "ok"
    wrong_seed = _report(1000, 4, "padded", [0, 0, 7, 0], [1] * 4)
    assert wrong_seed["verdict"].startswith("MISMATCH") and "rank 2" in wrong_seed["verdict"]
    assert wrong_seed["overlap"] > 0  # and it shows: samples seen by two ranks
    stale = _report(1000, 4, "padded", [0] * 4, [0, 1, 1, 1])  # rank 0 forgot set_epoch
    assert "rank 0" in stale["verdict"] and "rank 1" not in stale["verdict"]


def test_expected_fingerprint_needs_no_full_list_for_huge_n() -> None:
    s = ShardSampler(range(10**10), 8, 3, seed=1, mode="padded", permutation="feistel")
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
