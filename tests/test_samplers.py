"""ShareSampler and EvalShareSampler: torch's DistributedSampler is the oracle, docs/ARCHITECTURE.md
the spec."""

from __future__ import annotations

import io
import itertools
import math
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2, chisquare
from torch.utils.data.distributed import DistributedSampler

from ddp_template.data.eval_sampler import EvalShareSampler
from ddp_template.data.feistel import FeistelPermutation
from ddp_template.data.samplers import (
    AUTO_FEISTEL_THRESHOLD,
    SAMPLER_MODES,
    ShareSampler,
)

ALPHA = 0.001


class Sized:
    """A dataset stand-in: the samplers only need len()."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def all_ranks(n: int, w: int, **kwargs) -> list[list[int]]:
    return [list(ShareSampler(Sized(n), w, r, **kwargs)) for r in range(w)]


def global_list(ranks: list[list[int]], mode: str) -> list[int]:
    """Undo the rank split: slot j of the global list, as docs/ARCHITECTURE.md defines it."""
    if mode == "sequential":
        return [i for shard in ranks for i in shard]
    w = len(ranks)
    return [ranks[j % w][j // w] for j in range(sum(map(len, ranks)))]


def mode_lengths(n: int, w: int, mode: str) -> list[int]:
    """Each rank's list length: L = floor or ceil(N/W); `exact` only the real slots r + W*j."""
    if mode == "exact":
        return [math.ceil((n - r) / w) for r in range(w)]
    return [n // w if mode == "drop_last" else math.ceil(n / w)] * w


# --------------------------------------------------------------------------- torch oracle
@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 11, 16, 33, 100, 101])
@pytest.mark.parametrize("w", [1, 2, 3, 4, 8, 13])
def test_exact_is_torch_padded_without_its_padding(n: int, w: int) -> None:
    """`exact` keeps torch's slot layout (slot j -> rank j mod W) and stops at slot N-1."""
    for seed, epoch, shuffle in [(0, 0, True), (7, 3, True), (123, 1, False)]:
        for r in range(w):
            torch_sampler = DistributedSampler(Sized(n), w, r, shuffle=shuffle, seed=seed)
            torch_sampler.set_epoch(epoch)
            ours = ShareSampler(Sized(n), w, r, shuffle, seed, mode="exact")
            ours.set_epoch(epoch)
            assert list(ours) == list(torch_sampler)[: math.ceil((n - r) / w)]
            assert ours.padding_in_prefix(len(ours)) == 0


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 11, 16, 33, 100])
@pytest.mark.parametrize("w", [1, 2, 3, 4, 8, 13])
def test_matches_torch_distributed_sampler(n: int, w: int) -> None:
    for drop_last in (False, True):
        mode = "drop_last" if drop_last else "padded"
        for seed, epoch, shuffle in [(0, 0, True), (7, 3, True), (123, 1, False), (-5, 2, True)]:
            for permutation in ("randperm", "auto"):
                for r in range(w):
                    torch_sampler = DistributedSampler(
                        Sized(n), w, r, shuffle=shuffle, seed=seed, drop_last=drop_last
                    )
                    torch_sampler.set_epoch(epoch)
                    ours = ShareSampler(
                        Sized(n), w, r, shuffle, seed, mode=mode, permutation=permutation
                    )
                    ours.set_epoch(epoch)
                    expected = list(torch_sampler)
                    assert list(ours) == expected
                    assert len(ours) == len(torch_sampler) == ours.num_samples
                    assert ours.total_size == torch_sampler.total_size


def test_auto_below_threshold_is_randperm_and_above_is_feistel() -> None:
    assert ShareSampler(Sized(1000), 2, 0).permutation == "randperm"
    assert ShareSampler(Sized(AUTO_FEISTEL_THRESHOLD - 1), 2, 0).permutation == "randperm"
    assert ShareSampler(Sized(AUTO_FEISTEL_THRESHOLD), 2, 0).permutation == "feistel"


def test_iteration_yields_python_ints() -> None:
    for permutation in ("randperm", "feistel"):
        values = list(ShareSampler(Sized(50), 3, 1, permutation=permutation))
        assert all(type(v) is int for v in values)


# ------------------------------------------------------------------ docs/ARCHITECTURE.md table
LAYOUT_TABLE = {
    ("padded", 11, 2): [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 0]],
    ("padded", 10, 4): [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]],
    ("drop_last", 11, 2): [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]],
    ("drop_last", 10, 4): [[0, 4], [1, 5], [2, 6], [3, 7]],
    ("sequential", 11, 2): [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 0]],
    ("sequential", 10, 4): [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1]],
    ("exact", 11, 2): [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9]],
    ("exact", 10, 4): [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]],
}


def test_every_mode_has_rows_in_the_layout_table() -> None:
    """Adding a mode to SAMPLER_MODES means writing down its lists here (docs/ARCHITECTURE.md)."""
    assert {mode for mode, _, _ in LAYOUT_TABLE} == set(SAMPLER_MODES)


@pytest.mark.parametrize(("mode", "n", "w"), list(LAYOUT_TABLE))
@pytest.mark.parametrize("permutation", ["randperm", "feistel", "auto"])
def test_design_table_without_shuffle(mode: str, n: int, w: int, permutation: str) -> None:
    got = all_ranks(n, w, shuffle=False, mode=mode, permutation=permutation)
    assert got == LAYOUT_TABLE[(mode, n, w)]


def test_design_shuffled_example() -> None:
    assert all_ranks(11, 2, shuffle=True, seed=0) == [[10, 4, 5, 2, 9, 6], [0, 3, 8, 1, 7, 10]]


def test_sequential_padding_and_duplicates_match_the_table() -> None:
    sampler = ShareSampler(Sized(10), 4, 3, shuffle=False, mode="sequential")
    assert sampler.is_padding(np.arange(3)).tolist() == [False, True, True]
    assert sampler.padding_in_prefix(3) == 2
    assert sampler.padding_in_prefix(1) == 0


# --------------------------------------------------------------------------- properties
sampler_args = st.fixed_dictionaries(
    {
        "n": st.integers(1, 300),
        "w": st.integers(1, 9),
        "seed": st.integers(-(2**40), 2**40),
        "epoch": st.integers(0, 1000),
        "mode": st.sampled_from(list(SAMPLER_MODES)),
        "permutation": st.sampled_from(["randperm", "feistel"]),
        "shuffle": st.booleans(),
    }
)


def build_all(a: dict) -> list[ShareSampler]:
    shuffle = a["shuffle"] and a["mode"] != "sequential"
    samplers = []
    for r in range(a["w"]):
        s = ShareSampler(
            Sized(a["n"]),
            a["w"],
            r,
            shuffle,
            a["seed"],
            mode=a["mode"],
            permutation=a["permutation"],
        )
        s.set_epoch(a["epoch"])
        samplers.append(s)
    return samplers


@settings(max_examples=150, deadline=None)
@given(sampler_args)
def test_union_of_ranks_is_what_the_mode_defines(a: dict) -> None:
    n, w, mode = a["n"], a["w"], a["mode"]
    samplers = build_all(a)
    ranks = [list(s) for s in samplers]
    lengths = mode_lengths(n, w, mode)
    assert [len(r) for r in ranks] == lengths
    assert all(
        s.num_samples == length == len(s) for s, length in zip(samplers, lengths, strict=True)
    )
    assert all(s.epoch_length == max(lengths) for s in samplers)
    g = global_list(ranks, mode)
    assert len(g) == samplers[0].total_size == sum(lengths)
    if mode == "exact":  # every index exactly once, the ranks' lengths differing by at most one
        assert sorted(g) == list(range(n)) and max(lengths) - min(lengths) <= 1
    if mode == "drop_last":
        assert len(set(g)) == len(g) and set(g) <= set(range(n))
        return
    # The first N slots are a permutation of the dataset; every later slot repeats the list
    # from its start (wrap-around when the padding exceeds N).
    assert sorted(g[:n]) == list(range(n))
    assert all(g[j] == g[j - n] for j in range(n, len(g)))
    if mode == "sequential" or not samplers[0].shuffle:
        assert g[:n] == list(range(n))


@settings(max_examples=150, deadline=None)
@given(sampler_args)
def test_padding_counts_are_the_duplicates(a: dict) -> None:
    samplers = build_all(a)
    n, duplicates_total = a["n"], 0
    seen: Counter[int] = Counter()
    for s in samplers:
        positions = np.arange(s.num_samples)
        flags = s.is_padding(positions)
        for k in range(s.num_samples + 2):
            assert s.padding_in_prefix(k) == int(flags[:k].sum())
        indices = s.rank_indices()
        assert indices.tolist() == list(s)
        assert np.array_equal(s.index_at(positions[::-1]), indices[::-1])
        seen.update(indices[~flags].tolist())
        duplicates_total += s.padding_in_prefix(s.num_samples)
    # Non-padding slots hold each dataset index at most once; padding slots are the surplus.
    assert all(c == 1 for c in seen.values())
    assert duplicates_total == samplers[0].total_size - len(seen)
    if a["mode"] != "drop_last":
        assert set(seen) == set(range(n))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200), st.integers(1, 9), st.integers(0, 2**31), st.integers(0, 50))
def test_feistel_padded_is_its_permutation_padded_like_torch(n, w, seed, epoch) -> None:
    perm = FeistelPermutation(n, seed, epoch)(np.arange(n)).tolist()
    total = math.ceil(n / w) * w
    expected = (perm * math.ceil(total / n))[:total]  # torch's padding rule, on this permutation
    samplers = build_all(
        {
            "n": n,
            "w": w,
            "seed": seed,
            "epoch": epoch,
            "mode": "padded",
            "permutation": "feistel",
            "shuffle": True,
        }
    )
    assert [list(s) for s in samplers] == [expected[r:total:w] for r in range(w)]


# --------------------------------------------------------------------------- Feistel quality
FEISTEL_SIZES = [
    1,
    2,
    3,
    4,
    5,
    7,
    13,
    31,
    32,
    33,
    97,
    127,
    128,
    129,
    1023,
    1024,
    1025,
    2**16 - 1,
    2**16,
    2**16 + 1,
    65537,
    99991,
]


@pytest.mark.parametrize(
    "n", FEISTEL_SIZES + [int(x) for x in np.random.default_rng(0).integers(2, 100_000, size=6)]
)
def test_feistel_is_a_bijection(n: int) -> None:
    for seed, epoch in [(0, 0), (1, 5)]:
        out = FeistelPermutation(n, seed, epoch)(np.arange(n))
        assert out.dtype == np.int64
        assert np.array_equal(np.sort(out), np.arange(n))


def test_feistel_differs_across_seeds_and_epochs() -> None:
    n = 1000
    keys = [(s, e) for s in range(8) for e in range(8)]
    perms = {tuple(FeistelPermutation(n, s, e)(np.arange(n)).tolist()) for s, e in keys}
    assert len(perms) == len(keys)
    # Unlike torch's seed+epoch, (seed, epoch) is the key: (0, 1) and (1, 0) differ.
    assert not np.array_equal(
        FeistelPermutation(n, 0, 1)(np.arange(n)), FeistelPermutation(n, 1, 0)(np.arange(n))
    )
    assert not np.array_equal(FeistelPermutation(n, 0, 0)(np.arange(n)), np.arange(n))
    # Small domains must also vary with the key (N=2: both orders occur).
    assert {tuple(FeistelPermutation(2, s, 0)(np.arange(2)).tolist()) for s in range(16)} == {
        (0, 1),
        (1, 0),
    }


@pytest.mark.parametrize("n", [3, 5, 8, 10, 37])
def test_feistel_positions_are_uniform_chi_square(n: int) -> None:
    """Where each index lands, over many keys, must look uniform (fixed keys: deterministic)."""
    samples = 1500
    counts = np.zeros((n, n))
    for seed in range(samples):
        counts[np.arange(n), FeistelPermutation(n, seed, 0)(np.arange(n))] += 1
    for index in {0, n // 2, n - 1}:  # one index: iid multinomial -> chisquare is exact
        assert chisquare(counts[index]).pvalue > ALPHA
    # Whole matrix: a sum of permutation matrices has (N-1)^2 degrees of freedom and each
    # cell's variance is S(N-1)/N^2, hence the (N-1)/S scaling instead of Pearson's N/S.
    stat = (n - 1) / samples * ((counts - samples / n) ** 2).sum()
    assert chi2.sf(stat, (n - 1) ** 2) > ALPHA


def test_feistel_breaks_neighbourhoods() -> None:
    n = 100_000
    out = FeistelPermutation(n, 3, 1)(np.arange(n))
    gaps = np.abs(np.diff(out))
    assert np.mean(gaps == 1) < 0.001  # a random permutation has ~2/N adjacent pairs
    assert abs(gaps.mean() / n - 1 / 3) < 0.01  # E|U-V| = N/3 for independent uniforms
    first, second = out[: n // 2], out[n // 2 :]
    assert abs(first.mean() - second.mean()) < 0.02 * n  # no drift along the list


@pytest.mark.parametrize("n", [10**10, 2**40 + 1, 2**62 + 12345, 2**63])
def test_feistel_handles_huge_n(n: int) -> None:
    positions = np.array([0, 1, 2, 3, 1000, 10**6, 10**9], dtype=np.int64)
    out = FeistelPermutation(n, 0, 0)(positions)
    assert ((out >= 0) & (out < n)).all()
    assert len(set(out.tolist())) == len(positions)
    assert out.max() > n // 1000  # values spread over the whole range, not near the positions


def test_sampler_at_ten_billion() -> None:
    sampler = ShareSampler(Sized(10**10), 8, 5, permutation="auto")
    assert sampler.permutation == "feistel"
    assert sampler.num_samples == 1_250_000_000
    head = list(itertools.islice(sampler, 3000))
    picked = sampler.index_at(np.array([0, 1, 2999, sampler.num_samples - 1]))
    assert picked[:3].tolist() == [head[0], head[1], head[2999]]
    assert len(set(head)) == len(head) and all(0 <= i < 10**10 for i in head)
    assert sampler.padding_in_prefix(sampler.num_samples) == 0


# --------------------------------------------------------------------------- resumption
@pytest.mark.parametrize("mode", ["padded", "drop_last", "sequential"])
@pytest.mark.parametrize("permutation", ["randperm", "feistel"])
def test_resume_yields_the_tail(mode: str, permutation: str) -> None:
    shuffle = mode != "sequential"
    n, w, epoch = 6000 + 7, 3, 4
    reference = ShareSampler(Sized(n), w, 2, shuffle, 11, mode=mode, permutation=permutation)
    reference.set_epoch(epoch)
    full = list(reference)
    for position in [0, 1, 1023, 1024, 1025, len(full) - 1, len(full)]:
        state = reference.state_dict(position)
        resumed = ShareSampler(Sized(n), w, 2, shuffle, 11, mode=mode, permutation=permutation)
        resumed.load_state_dict(state)
        assert resumed.epoch == epoch
        resumed.set_epoch(epoch)  # the usual loop calls set_epoch; same epoch keeps the offset
        assert len(resumed) == len(full) - position
        assert list(resumed) == full[position:]
        assert len(resumed) == len(full) and list(resumed) == full  # only one iteration


def test_set_epoch_to_another_epoch_clears_the_offset() -> None:
    sampler = ShareSampler(Sized(100), 2, 0)
    sampler.load_state_dict({**sampler.state_dict(10), "epoch": 3})
    sampler.set_epoch(4)
    assert len(sampler) == 50
    expected = ShareSampler(Sized(100), 2, 0)
    expected.set_epoch(4)
    assert list(sampler) == list(expected)


@pytest.mark.parametrize(
    ("key", "kwargs"),
    [
        ("mode", {"mode": "drop_last"}),
        ("seed", {"seed": 1}),
        ("shuffle", {"shuffle": False}),
        ("dataset_size", {"n": 101}),
        ("num_replicas", {"w": 4}),
        ("rank", {"rank": 1}),
        ("permutation", {"permutation": "feistel"}),
    ],
)
def test_load_state_dict_refuses_mismatches(key: str, kwargs: dict) -> None:
    saved = ShareSampler(Sized(100), 2, 0, seed=0, permutation="randperm").state_dict(5)
    args = {
        "n": 100,
        "w": 2,
        "rank": 0,
        "seed": 0,
        "shuffle": True,
        "mode": "padded",
        "permutation": "randperm",
    } | kwargs
    other = ShareSampler(
        Sized(args["n"]),
        args["w"],
        args["rank"],
        args["shuffle"],
        args["seed"],
        mode=args["mode"],
        permutation=args["permutation"],
    )
    with pytest.raises(ValueError, match=f"'{key}'") as info:
        other.load_state_dict(saved)
    assert repr(saved[key]) in str(info.value) and repr(getattr(other, key)) in str(info.value)
    assert len(other) == other.num_samples  # nothing was applied


def test_load_state_dict_refuses_missing_key_and_bad_position() -> None:
    sampler = ShareSampler(Sized(10), 2, 0)
    state = sampler.state_dict(3)
    with pytest.raises(ValueError, match="'position'"):
        sampler.load_state_dict({k: v for k, v in state.items() if k != "position"})
    with pytest.raises(ValueError, match="'position'"):
        sampler.load_state_dict({**state, "position": 6})
    with pytest.raises(ValueError, match="position"):
        sampler.state_dict(6)


def test_state_dict_survives_torch_save_weights_only() -> None:
    sampler = ShareSampler(Sized(1000), 4, 3, seed=9, permutation="feistel")
    sampler.set_epoch(2)
    state = sampler.state_dict(17)
    buffer = io.BytesIO()
    torch.save({"sampler": state}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["sampler"]
    assert loaded == state
    assert {type(v) for k, v in loaded.items() if k != "prior"} <= {int, str, bool}
    assert loaded["prior"] == []  # the epoch's prefixes at other world sizes: none here
    resumed = ShareSampler(Sized(1000), 4, 3, seed=9, permutation="feistel")
    resumed.load_state_dict(loaded)
    assert list(resumed) == list(sampler)[17:]


# --------------------------------------------------------------------------- errors
def test_argument_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="shuffle=False"):
        ShareSampler(Sized(10), 2, 0, shuffle=True, mode="sequential")
    with pytest.raises(ValueError, match=", ".join(SAMPLER_MODES)):
        ShareSampler(Sized(10), 2, 0, mode="pad")
    with pytest.raises(ValueError, match="auto, randperm, feistel"):
        ShareSampler(Sized(10), 2, 0, permutation="sobol")
    with pytest.raises(ValueError, match="Invalid rank 2"):
        ShareSampler(Sized(10), 2, 2)
    with pytest.raises(ValueError, match="Invalid rank -1"):
        EvalShareSampler(Sized(10), 2, -1)
    for bad_n in (0, 2**63 + 1):
        with pytest.raises(ValueError, match="FeistelPermutation"):
            FeistelPermutation(bad_n, 0, 0)
    with pytest.raises(IndexError):
        ShareSampler(Sized(10), 2, 0).index_at(np.array([5]))


@pytest.mark.skipif(torch.distributed.is_initialized(), reason="needs no process group")
def test_without_process_group_world_must_be_given() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        ShareSampler(Sized(10))
    with pytest.raises(RuntimeError, match="init_process_group"):
        EvalShareSampler(Sized(10), num_replicas=2)


# --------------------------------------------------------------------------- evaluation
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 10, 11, 100, 1001])
@pytest.mark.parametrize("w", [1, 2, 3, 4, 8, 16])
def test_eval_shards_are_exact(n: int, w: int) -> None:
    shards = [list(EvalShareSampler(Sized(n), w, r)) for r in range(w)]
    assert [len(EvalShareSampler(Sized(n), w, r)) for r in range(w)] == [len(s) for s in shards]
    assert [i for s in shards for i in s] == list(range(n))  # contiguous, disjoint, complete
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    if n < w:
        assert sizes.count(0) == w - n
