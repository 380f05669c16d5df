"""ShareSampler as a drop-in DistributedSampler: signature, drop_last, strict types, index_at.

torch's DistributedSampler is the oracle for the lists; the Feistel permutation's inverse and
``locate`` are checked against the lists themselves.
"""

from __future__ import annotations

import inspect
import warnings
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data.distributed import DistributedSampler

from ddp_template.data.feistel import FeistelPermutation
from ddp_template.data.sampler_modes import SAMPLER_MODES
from ddp_template.data.samplers import ShareSampler


class Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


# --------------------------------------------------------------------------- drop-in
def test_signature_is_distributed_samplers_plus_keyword_only_extras() -> None:
    ours = list(inspect.signature(ShareSampler).parameters.values())
    torch_params = list(inspect.signature(DistributedSampler).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[:6]] == [
        (p.name, p.kind, p.default) for p in torch_params
    ]
    assert [(p.name, p.kind) for p in ours[6:]] == [
        ("mode", inspect.Parameter.KEYWORD_ONLY),
        ("permutation", inspect.Parameter.KEYWORD_ONLY),
    ]


@pytest.mark.parametrize("n", [1, 5, 11, 16, 33])
@pytest.mark.parametrize("w", [1, 2, 3, 4, 13])
@pytest.mark.parametrize("drop_last", [False, True])
def test_positional_drop_last_is_torchs(n: int, w: int, drop_last: bool) -> None:
    for r in range(w):
        theirs = DistributedSampler(Sized(n), w, r, True, 7, drop_last)
        ours = ShareSampler(Sized(n), w, r, True, 7, drop_last)
        assert isinstance(ours, DistributedSampler)
        for epoch in (0, 3):
            theirs.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(theirs)
        assert (ours.drop_last, ours.num_samples, ours.total_size, len(ours)) == (
            theirs.drop_last,
            theirs.num_samples,
            theirs.total_size,
            len(theirs),
        )
        assert ours.mode == ("drop_last" if drop_last else "padded")
        assert type(ours.mode) is str


def test_mode_and_drop_last_agree_or_are_refused() -> None:
    assert ShareSampler(Sized(10), 3, 0, mode="drop_last").drop_last is True
    assert ShareSampler(Sized(10), 3, 0, drop_last=True, mode="drop_last").num_samples == 3
    seq = ShareSampler(Sized(10), 3, 0, shuffle=False, mode="sequential")
    assert (seq.drop_last, seq.num_samples) == (False, 4)
    for mode in [m for m, rule in SAMPLER_MODES.items() if not rule.drops_tail]:
        with pytest.raises(ValueError, match=f"drop_last=True contradicts mode='{mode}'"):
            ShareSampler(Sized(10), 3, 0, False, 0, True, mode=mode)


# --------------------------------------------------------------------------- strict types
@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"seed": 1.5}, "seed=1.5"),
        ({"seed": True}, "seed=True"),
        ({"seed": "3"}, "seed='3'"),
        ({"num_replicas": 2.0}, "num_replicas=2.0"),
        ({"rank": True}, "rank=True"),
        ({"shuffle": "false"}, "shuffle='false'"),
        ({"shuffle": 1}, "shuffle=1"),
        ({"drop_last": 0}, "drop_last=0"),
    ],
)
def test_wrong_types_are_refused_naming_the_argument(kwargs: dict, named: str) -> None:
    args = {"num_replicas": 2, "rank": 0} | kwargs
    with pytest.raises(TypeError, match="pass") as info:
        ShareSampler(Sized(10), **args)
    assert str(info.value).startswith(named)
    assert str(info.value).count(".") >= 1 and "\n" not in str(info.value)


def test_wrong_types_in_methods_are_refused() -> None:
    sampler = ShareSampler(Sized(10), 2, 0)
    for call, named in [
        (lambda: sampler.set_epoch(1.0), "epoch=1.0"),
        (lambda: sampler.set_epoch(True), "epoch=True"),
        (lambda: sampler.state_dict(2.5), "position=2.5"),
        (lambda: sampler.index_at(0, rank=1.0), "rank=1.0"),
        (lambda: sampler.locate(3.0), "index=3.0"),
    ]:
        with pytest.raises(TypeError, match=named):
            call()
    with pytest.raises(TypeError, match="positions must be integers"):
        sampler.index_at(np.array([0.5]))
    with pytest.raises(TypeError, match="positions must be integers"):
        sampler.is_padding([True, False])


def test_numpy_integers_are_integers() -> None:
    plain = ShareSampler(Sized(50), 3, 1, seed=4)
    plain.set_epoch(2)
    numpy_args = ShareSampler(Sized(50), np.int64(3), np.int32(1), np.bool_(True), np.int16(4))
    numpy_args.set_epoch(np.int64(2))
    assert list(numpy_args) == list(plain)
    assert type(numpy_args.seed) is int and type(numpy_args.epoch) is int
    assert numpy_args.state_dict(np.int64(5)) == plain.state_dict(5)


# --------------------------------------------------------------------------- the count
@pytest.mark.parametrize("permutation", ["randperm", "feistel"])
def test_yielded_counts_what_was_taken_across_blocks(permutation: str) -> None:
    sampler = ShareSampler(Sized(9000), 2, 1, seed=3, permutation=permutation)
    sampler.set_epoch(2)
    full = list(sampler)
    for taken in (0, 1, 1023, 1024, 1025, 3072, 4500):
        iterator = iter(sampler)
        head = [next(iterator) for _ in range(taken)]
        assert sampler.yielded == taken and sampler.state_dict()["position"] == taken
        resumed = ShareSampler(Sized(9000), 2, 1, seed=3, permutation=permutation)
        resumed.load_state_dict(sampler.state_dict())
        assert head + list(resumed) == full and resumed.yielded == len(full)


def test_only_the_newest_iterator_counts_and_a_new_epoch_starts_at_zero() -> None:
    sampler = ShareSampler(Sized(5000), 2, 0)
    old, new = iter(sampler), iter(sampler)
    for _ in range(3):
        next(new)
    for _ in range(1100):  # into the old iterator's second block
        next(old)
    assert sampler.yielded == 3
    sampler.set_epoch(1)
    assert sampler.yielded == 0 and sampler.state_dict() == sampler.state_dict(0)
    for _ in range(1100):  # still the old epoch's list: no longer counted
        next(new)
    assert sampler.yielded == 0


def test_a_state_saved_before_yielded_existed_still_loads() -> None:
    saved = ShareSampler(Sized(1000), 4, 3, seed=9, permutation="feistel")
    saved.set_epoch(2)
    old_keys = ("epoch", "position", "mode", "seed", "shuffle", "permutation", "dataset_size")
    state = {
        k: v for k, v in saved.state_dict(17).items() if k in old_keys + ("num_replicas", "rank")
    }
    resumed = ShareSampler(Sized(1000), 4, 3, seed=9, permutation="feistel")
    resumed.load_state_dict(state)
    assert (resumed.epoch, len(resumed)) == (2, 250 - 17)
    assert list(resumed) == list(saved)[17:]


# --------------------------------------------------------------------------- index_at
@pytest.mark.parametrize("permutation", ["randperm", "feistel"])
@pytest.mark.parametrize("n", [1025, 3000])  # 2**b just above N: half the values cycle-walk
def test_index_at_python_scalars_and_arrays(permutation: str, n: int) -> None:
    sampler = ShareSampler(Sized(n), 3, 2, seed=5, permutation=permutation)
    sampler.set_epoch(1)
    full = list(sampler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy overflow warnings on scalars
        scalars = [sampler.index_at(p) for p in range(sampler.num_samples)]
        grid = sampler.index_at(np.arange(sampler.num_samples // 2 * 2).reshape(-1, 2))
    assert [int(v) for v in scalars] == full
    assert all(np.ndim(v) == 0 for v in scalars)
    assert grid.shape == (sampler.num_samples // 2, 2)
    assert grid.reshape(-1).tolist() == full[: grid.size]
    assert sampler.index_at([0, 1, 2]).tolist() == full[:3]
    with pytest.raises(IndexError):
        sampler.index_at(sampler.num_samples)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 1000, 1025, 65537])
def test_feistel_inverse_undoes_it(n: int) -> None:
    perm = FeistelPermutation(n, 9, 4)
    values = perm(np.arange(n))
    assert np.array_equal(perm.inverse(values), np.arange(n))
    assert [int(perm.inverse(int(v))) for v in values[:50]] == list(range(min(n, 50)))
    with pytest.raises(IndexError):
        perm.inverse(n)


def test_feistel_inverse_at_huge_n() -> None:
    perm = FeistelPermutation(2**63, 1, 2)
    x = np.array([0, 7, 2**40, 2**62 + 3, 2**63 - 1], dtype=np.uint64)
    assert np.array_equal(perm.inverse(perm(x)), x.astype(np.int64))


# --------------------------------------------------------------------------- locate
@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 120),
    st.integers(1, 9),
    st.sampled_from(list(SAMPLER_MODES)),
    st.sampled_from(["randperm", "feistel"]),
    st.integers(0, 20),
)
def test_locate_finds_every_slot_reading_an_index(n, w, mode, permutation, epoch) -> None:
    shuffle = SAMPLER_MODES[mode].shuffles
    samplers = [
        ShareSampler(Sized(n), w, r, shuffle, 3, mode=mode, permutation=permutation)
        for r in range(w)
    ]
    where = defaultdict(list)
    for r, s in enumerate(samplers):
        s.set_epoch(epoch)
        for pos, index in enumerate(s):
            where[index].append((r, pos))
    probe = samplers[0]
    for index in range(n):
        ranks, positions = probe.locate(index)
        assert sorted(zip(ranks.tolist(), positions.tolist(), strict=True)) == where[index]
