"""sampler=exact: every sample exactly once per epoch, no padding, no drop, no hang.

In-process: the step arithmetic (lengths, micro-batches, the loss weights) against a brute-force
oracle, the empty micro-batch, the refusals and the shard verdict. Real gloo runs, on sklearn's
digits cut to N=101 (``data=array``): 2 ranks x batch 10 hold 51 and 50 samples, so rank 1's
sixth micro-batch is empty; the run must log 101 samples an epoch, none twice, and end with the
weights of 1 process x batch 20 (also with ``optim.accumulate`` and with SyncBN). Then 3 ranks
on N=100 killed mid-epoch resume bit-identically, and the same 2-rank run with the empty step
removed (tests/exact_skip_empty.py) hangs until gloo's timeout.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, jsonl, last_checkpoint, run, run_env, train_cmd
from hypothesis import given, settings
from hypothesis import strategies as st
from test_resume import assert_identical

from ddp_template.data.epoch_steps import EpochSteps
from ddp_template.data.sampler_modes import SAMPLER_MODES
from ddp_template.data.samplers import ShareSampler
from ddp_template.engine import micro_batches
from ddp_template.ledger.tally import fingerprint_hex, fingerprint_sum
from ddp_template.ledger.verify import epoch_report, own_check
from ddp_template.sinks.share_draw import _headline
from ddp_template.sinks.share_plot import shares_from_sampler

EXACT = SAMPLER_MODES["exact"]


def exact_schedule(n: int, world: int, batch: int, **kwargs) -> EpochSteps:
    return EpochSteps(
        length=EXACT.length(n, world),
        rank_lengths=tuple(EXACT.rank_length(n, r, world) for r in range(world)),
        batch_size=batch,
        epochs=1,
        **kwargs,
    )


# ------------------------------------------------------------------------- step arithmetic
def test_101_on_2_ranks_batch_10_is_51_and_50_with_an_empty_last_micro_batch() -> None:
    s = exact_schedule(101, 2, 10)
    assert s.lengths == (51, 50) and (s.micro_batches, s.steps_per_epoch) == (6, 6)
    assert [s.held(r, 50, 51) for r in (0, 1)] == [1, 0]
    assert [s.weight(1, 5), s.weight(0, 5)] == [2.0, 0.0]  # DDP halves: rank 0's sample, once
    assert s.weight(10, 0) == 1.0 and s.last_micro_batch == 1


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 120),
    st.integers(1, 6),
    st.integers(1, 7),
    st.integers(1, 4),
    st.booleans(),
    st.sampled_from([None, 1, 2, 3]),
)
def test_steps_are_one_process_with_w_times_the_batch(n, world, batch, acc, drop, cap) -> None:
    """Oracle: 1 process, batch W*B, accumulate A, the same drop/cap. Step k of the W ranks
    reads exactly that step's slots (slot j -> rank j mod W, position j div W), every rank runs
    the same micro-batches, and the weights DDP averages give each real sample 1/|step|."""
    ranks = exact_schedule(
        n, world, batch, accumulate=acc, drop_last_batch=drop, max_steps_per_epoch=cap
    )
    one = EpochSteps(
        length=n,
        batch_size=world * batch,
        epochs=1,
        accumulate=acc,
        drop_last_batch=drop,
        max_steps_per_epoch=cap,
    )
    assert ranks.steps_per_epoch == one.steps_per_epoch
    for k in range(ranks.steps_per_epoch):
        start, stop = ranks.span(k)
        slots = {r + world * p for r in range(world) for p in range(start, stop)}
        real = {j for j in slots if j < n}
        assert real == set(range(*one.span(k)))
        micro = [(r, lo) for r in range(world) for lo in range(start, stop, batch)]
        sizes = [ranks.held(r, lo, min(lo + batch, stop)) for r, lo in micro]
        assert sum(sizes) == len(real)
        weights = [ranks.weight(size, k) for size in sizes]
        assert math.isclose(sum(weights) / world, 1.0)  # DDP's mean: the weights sum to one
        for w, size in zip(weights, sizes, strict=True):
            assert math.isclose(w, size * world / len(real))  # 1/|step| for every real sample


def test_padded_weights_are_todays_bit_for_bit() -> None:
    """With equal lists the weight n*W / (W*m) is the old n / m: the same rational, rounded
    once, so the default job's numbers cannot move."""
    for m in range(1, 40):
        uniform = EpochSteps(length=m, batch_size=m, epochs=1, rank_lengths=(m,) * 7)
        assert all(uniform.weight(n, 0) == n / m for n in range(m + 1))


def test_the_empty_micro_batch_has_the_data_shape_and_no_samples() -> None:
    """Rank 1 of 101 on 2 ranks: five real micro-batches, then an empty one shaped like them; a
    rank resumed past its list's end takes the shape from the dataset's first sample."""
    x, y = torch.randn(101, 1, 8, 8), torch.arange(101) % 10
    data = torch.utils.data.TensorDataset(x, y, torch.arange(101))
    sampler = ShareSampler(data, 2, 1, mode="exact")
    loader = torch.utils.data.DataLoader(data, batch_size=10, sampler=sampler)
    s = exact_schedule(101, 2, 10)
    out = list(micro_batches(loader, s, 0, rank=1))
    assert [len(b[2]) for b, _, _ in out] == [10] * 5 + [0]
    (ex, ey, ei), weight, last = out[-1]
    assert ex.shape == (0, 1, 8, 8) and ey.dtype == y.dtype and weight == 0.0 and last
    sampler.load_state_dict(sampler.state_dict(50))
    ((ex, _, ei), weight, _) = list(micro_batches(loader, s, 50, rank=1))[0]
    assert ex.shape == (0, 1, 8, 8) and len(ei) == 0 and weight == 0.0


def test_empty_micro_batch_gives_zero_gradients_not_nan() -> None:
    from helpers import step_trainer

    from ddp_template.engine import _forward_backward

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = step_trainer(
        model=model,
        optimizer=opt,
    )
    loss = _forward_backward(tr, torch.empty(0, 4), torch.empty(0, dtype=torch.long), 0.0, True)
    assert loss.item() == 0.0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_plain_batchnorm_leaves_running_stats_untouched_on_an_empty_batch() -> None:
    """Without SyncBN an empty rank's running statistics stay as they were (torch skips the
    update); with it every rank takes the global batch's (tests/test_syncbn.py, empty_0_8)."""
    bn = torch.nn.BatchNorm2d(3).train()
    bn(torch.randn(4, 3, 2, 2) + 1)
    before = {k: v.clone() for k, v in bn.state_dict().items() if k.startswith("running")}
    assert bn(torch.empty(0, 3, 2, 2)).shape == (0, 3, 2, 2)
    assert all(torch.equal(bn.state_dict()[k], v) for k, v in before.items())


# ------------------------------------------------------------------------- sampler and verdict
def test_state_holds_the_common_position_past_a_shorter_list() -> None:
    """The step boundary after the last step is 51 on every rank; rank 1's list has 50."""
    rank1 = ShareSampler(range(101), 2, 1, mode="exact")
    state = rank1.state_dict(51)
    fresh = ShareSampler(range(101), 2, 1, mode="exact")
    fresh.load_state_dict(state)
    assert len(fresh) == 0 and list(fresh) == []
    with pytest.raises(ValueError, match=r"outside this rank's epoch \[0, 51\]"):
        rank1.state_dict(52)


def test_drop_last_contradicts_exact_in_one_sentence() -> None:
    with pytest.raises(ValueError, match=r"mode='exact', which keeps every sample; pass"):
        ShareSampler(range(11), 2, 0, drop_last=True, mode="exact")


class _Stats:
    def __init__(self, indices: np.ndarray) -> None:
        from ddp_template.ledger.tally import IndexTally

        self.tally = IndexTally(keep=True)
        self.tally.add(indices)


def _rows(samplers, lists, start=0):
    metrics = {"data/duplicates": 0, "perf/step_s": 1.0}
    return [
        own_check(_Stats(np.asarray(idx, dtype=np.int64)), s, start, metrics, rank=r)
        for r, (s, idx) in enumerate(zip(samplers, lists, strict=True))
    ]


def test_verdict_checks_the_exact_layout() -> None:
    """A whole epoch: every index once, no overlap; a rank reading padded's repeat fails."""
    samplers = [ShareSampler(range(11), 2, r, mode="exact") for r in range(2)]
    for s in samplers:
        s.set_epoch(3)
    lists = [s.rank_indices() for s in samplers]
    report = epoch_report(samplers[0], _rows(samplers, lists))
    assert str(report.verdict) == "ok" and report.total_samples == 11
    c = report.coverage
    assert (c.fraction, c.overlap, c.repeats) == (1.0, 0, 0)
    padded = ShareSampler(range(11), 2, 1, mode="padded")
    padded.set_epoch(3)
    bad = epoch_report(samplers[0], _rows(samplers, [lists[0], padded.rank_indices()]))
    assert str(bad.verdict).startswith("MISMATCH: rank 1 saw indices that differ")


def test_replay_reports_the_empty_micro_batch(compose_cfg, tmp_path: Path, capsys) -> None:
    from test_replay_oracle import write_run

    from ddp_template.replay import load_run, main, step_rows

    overrides = ["data=synthetic", "data.size=101", "data.test_size=4", "data.image_size=4"]
    cfg = compose_cfg(*overrides, "sampler=exact", "loader.batch_size=10", "epochs=1")
    run_dir = write_run(tmp_path / "run", cfg)
    rows = step_rows(load_run(run_dir, world_size=2), 6)
    assert [(r["position"], len(r["indices"])) for r in rows] == [(50, 1), (50, 0)]
    assert main([str(run_dir), "--step", "6", "--world-size", "2"]) == 0
    assert "rank 1: epoch 0, position 50: none (sampler=exact" in capsys.readouterr().out


def test_picture_and_headline_show_both_lengths() -> None:
    shares = shares_from_sampler(ShareSampler(range(11), 2, 0, shuffle=False, mode="exact"))
    assert [r.tolist() for r in shares.ranks] == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9]]
    assert "per-rank length 6 or 5, 0 padding, 0 dropped" in _headline(shares, None)


# ------------------------------------------------------------------------- real gloo runs
RUN = [
    "epochs=2",
    "logger=none",
    "model.norm=none",
    "model.dropout=0.0",
    "optim.schedule=none",
    "optim.lr=0.05",  # higher rates amplify BN's float rounding past 1e-5 (0.3: 1e-2)
    "sampler=exact",
]


def launch(out: Path, data: Path, run_id: str, *overrides: str, check: bool = True):
    cmd = train_cmd(out, "data=array", f"data.path={data}", *RUN, *overrides)
    return run(cmd, env=run_env(RUN_ID=run_id), check=check)


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


BN = ["model.norm=batch"]
PAIRS = {  # W=2 ranks x batch B (x accumulate)  vs  1 process x 2B (x accumulate)
    "plain": (["loader.batch_size=10", "log_every=1"], ["loader.batch_size=20"]),
    "accumulate": (
        ["loader.batch_size=4", "optim.accumulate=3"],
        ["loader.batch_size=8", "optim.accumulate=3"],
    ),
    "syncbn": (["loader.batch_size=10", "syncbn=on", *BN], ["loader.batch_size=20", *BN]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(PAIRS))
def test_two_ranks_equal_one_process_with_twice_the_batch(
    case: str, digits101: Path, tmp_path: Path
) -> None:
    ranks, one = PAIRS[case]
    launch(tmp_path, digits101, "ranks", *ranks, "dist.nproc=2")
    launch(tmp_path, digits101, "one", *one)
    a, b = last_checkpoint(tmp_path, "ranks"), last_checkpoint(tmp_path, "one")
    assert a["progress"]["step"] == b["progress"]["step"] == {"accumulate": 10}.get(case, 12)
    assert worst(a["model"], b["model"]) < 1e-5, case  # every tensor: weights and BN buffers

    rows = [jsonl(tmp_path / f"outputs/ranks/rank{r}/metrics.jsonl") for r in (0, 1)]
    epochs = [[row for row in rank if "data/samples" in row] for rank in rows]
    whole = fingerprint_sum(np.arange(101))
    for r0, r1 in zip(*epochs, strict=True):
        assert (r0["data/samples"], r1["data/samples"]) == (51, 50)
        assert r0["data/duplicates"] == r1["data/duplicates"] == 0
        total = int(r0["data/fingerprint"], 16) + int(r1["data/fingerprint"], 16)
        assert fingerprint_hex(total) == fingerprint_hex(whole)
    if case == "plain":  # rank 1's sixth micro-batch held none, yet it ran all six steps
        assert [e["data/batches"] for e in (epochs[0][0], epochs[1][0])] == [6, 5]
        # ... and logs no loss for that step (0 samples: no mean to report, never a NaN)
        losses = [[row["step"] for row in rank if "train/loss" in row] for rank in rows]
        assert losses[0] == list(range(1, 13)), losses[0]
        assert losses[1] == [s for s in range(1, 13) if s % 6], losses[1]
        assert all(
            row["train/loss"] == row["train/loss"]
            for rank in rows
            for row in rank
            if "train/loss" in row
        )
    shards = [row for row in rows[0] if "shares/verdict_ok" in row]
    assert [(s["shares/verdict_ok"], s["shares/total_samples"]) for s in shards] == [(1, 101)] * 2
    assert all((s["shares/coverage"], s["shares/repeats"]) == (1.0, 0) for s in shards)


@pytest.mark.slow
def test_three_ranks_killed_mid_epoch_resume_bit_identically(digits101: Path, tmp_path: Path):
    """N=100 on 3 ranks, batch 11: lists of 34, 33, 33, so ranks 1 and 2 end the epoch with an
    empty micro-batch. SIGKILL at step 4, the last: the step-3 checkpoint resumes ranks 1 and 2
    at position 33, the end of their lists (their empty batch then takes its shape from the
    data), rank 0 one sample short of its end. One epoch, no loader workers: the resume is the
    claim (tests/test_resume.py covers workers and later epochs)."""
    with np.load(digits101) as arrays:  # the same digits, one sample fewer
        cut = {k: v[:100] if k.endswith("train") else v for k, v in arrays.items()}
    data = tmp_path / "digits100.npz"
    np.savez(data, **cut)
    common = ["epochs=1", "loader.batch_size=11", "dist.nproc=3", "checkpoint.every_steps=1"]
    launch(tmp_path, data, "ref", *common)
    kill = ["fault.crash_at_step=4", "fault.rank=2", "fault.signal=SIGKILL"]
    proc = launch(tmp_path, data, "chain", *common, *kill, check=False)
    assert proc.returncode != 0 and "SIGKILL" in proc.stderr, proc.stderr[-2000:]
    stopped = last_checkpoint(tmp_path, "chain")
    progress = stopped["progress"]
    assert (progress["step"], progress["epoch"], progress["position"]) == (3, 0, 33)
    proc = launch(tmp_path, data, "chain", *common)
    assert "resumed from" in proc.stdout
    ref, resumed = last_checkpoint(tmp_path, "ref"), last_checkpoint(tmp_path, "chain")
    assert ref["progress"]["step"] == resumed["progress"]["step"] == 4
    assert_identical(ref["model"], resumed["model"])
    assert_identical(ref["optimizer"]["state"][0], resumed["optimizer"]["state"][0])
    # The killed launch ended no epoch; the resumed one read the epoch's last sample.
    rows = jsonl(tmp_path / "outputs/chain/rank0/metrics.jsonl")
    shards = [
        (r["shares/verdict_ok"], r["shares/total_samples"])
        for r in rows
        if "shares/verdict_ok" in r
    ]
    assert shards == [(1, 1)]


@pytest.mark.slow
def test_without_the_empty_step_the_ranks_hang(digits101: Path, tmp_path: Path) -> None:
    """The mutation: ranks skip their empty micro-batch (tests/exact_skip_empty.py). Rank 0
    then waits in step 6's gradient all-reduce for rank 1, which has gone on to the epoch's
    shard check: nothing finishes until gloo's timeout (6 s; the same run with the empty step
    trains its whole epoch in well under a second) ends it, naming the wait (on whichever rank
    times out first)."""
    timeout_s = 6
    cmd = train_cmd(
        tmp_path,
        "data=array",
        f"data.path={digits101}",
        *RUN,
        "epochs=1",
        "loader.batch_size=10",
        "dist.nproc=2",
        "dist.start_method=fork",  # the ranks inherit the patched engine
        f"backend.timeout_s={timeout_s}",
    )
    cmd[1] = str(ROOT / "tests" / "exact_skip_empty.py")  # instead of train.py, which it runs
    began = time.monotonic()
    proc = run(cmd, env=run_env(RUN_ID="skip"), check=False, timeout=120)
    assert proc.returncode != 0 and time.monotonic() - began > timeout_s
    error = (tmp_path / "outputs/skip/rank0/error.json").read_text()
    assert "train_one_epoch" in error and "backward" in error, error[-1500:]
    # Which of the two waiting ranks times out first is a race: whichever does names the wait,
    # and the other then fails on the closed connection.
    errors = [(tmp_path / f"outputs/skip/rank{r}/error.json").read_text() for r in (0, 1)]
    assert any(f"Timed out waiting {timeout_s * 1000}ms" in e for e in errors), error[-1500:]
