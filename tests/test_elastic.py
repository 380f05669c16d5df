"""Elastic resume: a checkpoint written by W ranks continues at W' with every sample of the
interrupted epoch accounted for (the rest dealt by the sampler mode at W'), the global batch
kept or scaled, and replay answering across the change."""

from __future__ import annotations

import json
import random
import shutil
import signal
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    TORCHRUN,
    cpu_rank,
    free_port,
    jsonl,
    run,
    run_env,
    start,
    summary,
    train_cmd,
    wait_for,
)

from ddp_template.checkpoint import Found
from ddp_template.config.choices import GlobalBatch, OnResize
from ddp_template.config.schema import Config, ElasticConfig
from ddp_template.data.sampler_modes import SAMPLER_MODES
from ddp_template.data.samplers import ShareSampler
from ddp_template.elastic import plan_resize
from ddp_template.errors import ConfigError
from ddp_template.replay import load_run, step_rows

DIGITS = ["log_every=1", "checkpoint.every_steps=5"]
CRASH = ["fault.crash_at_step=7", "fault.rank=1"]
N_DIGITS = 1438


# ----------------------------------------------------------------------------- the data rule
def _lists(seq: list[int], mode: str, world: int) -> list[list[int]]:
    """The mode's rank lists over the sequence ``seq`` (the oracle: plain lists)."""
    rule, n = SAMPLER_MODES[mode], len(seq)
    length = rule.length(n, world)
    return [
        [seq[j % n] for j in rule.slots(np.arange(rule.rank_length(n, r, world)), r, length, world)]
        for r in range(world)
    ]


def _rest(seq: list[int], mode: str, world: int, position: int) -> list[int]:
    """What ``position`` positions of every list at ``world`` ranks left unread, in order."""
    rule, n = SAMPLER_MODES[mode], len(seq)
    if rule.contiguous:
        length = rule.length(n, world)
        return [
            seq[j]
            for r in range(world)
            for j in range(r * length + position, min((r + 1) * length, n))
        ]
    return seq[position * world :]


@pytest.mark.parametrize("permutation", ["randperm", "feistel"])
def test_the_rest_of_an_epoch_is_dealt_by_the_mode_at_the_new_world_size(permutation: str) -> None:
    """Against plain lists: two resizes in one epoch (W1 → W2 → W3) in every mode, the rest
    of the rest dealt as the mode deals M samples; every index locates where it is read."""
    rng = random.Random(0)
    for _ in range(150):
        mode = rng.choice(list(SAMPLER_MODES))
        shuffle = SAMPLER_MODES[mode].shuffles and rng.random() < 0.8
        n, (w1, w2, w3) = rng.randint(1, 40), (rng.randint(1, 4) for _ in range(3))
        kw = dict(shuffle=shuffle, seed=5, mode=mode, permutation=permutation)
        first = ShareSampler(range(n), w1, 0, **kw)
        first.set_epoch(3)
        seq = [int(i) for i in first._lookup(np.arange(n), first._permutation())]
        p1 = rng.randint(0, first.epoch_length)
        seq2 = _rest(seq, mode, w1, p1)
        p2 = rng.randint(0, SAMPLER_MODES[mode].length(len(seq2), w2))
        prior = [
            {"world_size": w1, "position": p1, "complete": False},
            {"world_size": w2, "position": p2, "complete": False},
        ]
        last = ShareSampler(range(n), w3, 0, **kw)
        last.set_epoch(3)
        last.continue_epoch(3, prior)
        expected = _lists(_rest(seq2, mode, w2, p2), mode, w3)
        assert [last.rank_indices(r).tolist() for r in range(w3)] == expected
        for index in range(n):
            ranks, positions = last.locate(index)
            pairs = zip(ranks, positions, strict=True)
            read = [int(last.index_at(np.array([p]), int(r))[0]) for r, p in pairs]
            assert read == [index] * sum(lst.count(index) for lst in expected)
        last.set_epoch(4)  # the next epoch is a whole one again
        assert last.dataset_size == n and last.prior == []


def test_a_prefix_that_ended_its_epoch_leaves_nothing() -> None:
    sampler = ShareSampler(range(10), 3, 0, shuffle=True, seed=1)
    sampler.continue_epoch(0, [{"world_size": 2, "position": 4, "complete": True}])
    assert sampler.dataset_size == 0 and sampler.rank_lengths == (0, 0, 0)


def _found(world: int, batch: int = 32, accumulate: int = 1, **progress) -> Found:
    saved = {"epoch": 0, "step": 5, "position": 160, "accumulate": accumulate} | progress
    return Found(Path("last.pt"), {"world_size": world, "progress": saved | {"batch_size": batch}})


def test_keeping_the_global_batch_adjusts_accumulation_and_refuses_what_cannot_divide() -> None:
    cfg = Config()
    keep = ElasticConfig()
    to_one = plan_resize(keep, found=_found(2), run=cfg, info=cpu_rank(0, 1))
    assert (to_one.batch_to, to_one.global_sizes()) == ((32, 2), (64, 64))  # per-rank batch kept
    assert "world size 2 → 1 at step 5" in to_one.describe()
    to_four = plan_resize(keep, found=_found(2), run=cfg, info=cpu_rank(0, 4))
    assert to_four.batch_to == (16, 1)  # 64 over 4 ranks: a smaller per-rank batch
    assert plan_resize(keep, found=_found(1), run=cfg, info=cpu_rank(0, 1)) is None
    with pytest.raises(
        ConfigError, match=r"64 does not divide by 3\); set elastic.global_batch=scale"
    ):
        plan_resize(keep, found=_found(2), run=cfg, info=cpu_rank(0, 3))
    scale = ElasticConfig(global_batch=GlobalBatch.scale)
    to_three = plan_resize(scale, found=_found(2), run=cfg, info=cpu_rank(0, 3))
    assert to_three.batch_to == (32, 1) and to_three.global_sizes() == (64, 96)
    refuse = ElasticConfig(on_resize=OnResize.refuse)
    with pytest.raises(ConfigError, match=r"elastic.on_resize=refuse; resume with 2 ranks"):
        plan_resize(refuse, found=_found(2), run=cfg, info=cpu_rank(0, 3))


def test_a_checkpoint_from_before_elastic_resume_is_refused_at_another_size_naming_its_format() -> (
    None
):
    old = Found(
        Path("last.pt"),
        {"world_size": 2, "progress": {"epoch": 0, "step": 5, "position": 160, "accumulate": 1}},
    )
    with pytest.raises(
        ConfigError, match=r"format written before elastic resume .* resume with 2 ranks"
    ):
        plan_resize(ElasticConfig(), found=old, run=Config(), info=cpu_rank(0, 1))
    assert plan_resize(ElasticConfig(), found=old, run=Config(), info=cpu_rank(0, 2)) is None


# ----------------------------------------------------------------------------- digits, 2 → 1, 3
def replayed_epoch(run_dir: Path, epoch: int = 0) -> Counter:
    """Every index replay lists for the epoch's steps, counted."""
    replayed = load_run(run_dir)
    seen: Counter = Counter()
    for piece in (p for p in replayed.pieces if p.epoch == epoch):
        for step in range(piece.first_step, piece.first_step + piece.steps):
            for row in step_rows(replayed, step):
                seen.update(row["indices"])
    return seen


def _lr(run_dir: Path) -> dict[int, float]:
    return {
        r["step"]: r["train/lr"]
        for r in jsonl(run_dir / "rank0" / "metrics.jsonl")
        if "train/lr" in r
    }


def _epoch_ends(run_dir: Path) -> list[tuple[int, dict]]:
    rows = jsonl(run_dir / "rank0" / "metrics.jsonl")
    return [(r["step"], r) for r in rows if "shares/verdict_ok" in r]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An uninterrupted 2-rank reference, and a 2-rank run killed after step 7 (its last
    checkpoint: step 5, mid-epoch 0)."""
    out = tmp_path_factory.mktemp("elastic")
    run(train_cmd(out, *DIGITS, "dist.nproc=2"), env=run_env(RUN_ID="reference"))
    proc = run(
        train_cmd(out, *DIGITS, *CRASH, "dist.nproc=2"), env=run_env(RUN_ID="cut"), check=False
    )
    assert proc.returncode != 0 and "fault injected: rank 1" in proc.stderr, proc.stderr[-2000:]
    return out / "outputs" / "reference", out / "outputs" / "cut"


def _resume(cut: Path, tmp: Path, name: str, *overrides: str, check: bool = True):
    shutil.copytree(cut, tmp / "outputs" / name)
    return run(train_cmd(tmp, *DIGITS, *overrides), env=run_env(RUN_ID=name), check=check)


def test_resumed_at_one_rank_with_the_global_batch_kept(interrupted, tmp_path: Path) -> None:
    """2 → 1 with `keep`: accumulate 2; the LR of every step and the steps per epoch are the
    uninterrupted run's, the final accuracy within a point; epoch 0's report is whole and ok;
    replay lists each of the 1,438 training indices exactly once for epoch 0."""
    reference, cut = interrupted
    proc = _resume(cut, tmp_path, "one", "dist.nproc=1")
    assert "world size 2 → 1 at step 5" in proc.stdout + proc.stderr
    run_dir = tmp_path / "outputs" / "one"
    ends, ref_ends = _epoch_ends(run_dir), _epoch_ends(reference)
    assert [s for s, _ in ends] == [s for s, _ in ref_ends]  # the same steps per epoch
    lr, ref_lr = _lr(run_dir), _lr(reference)
    assert lr == pytest.approx(ref_lr, rel=1e-9)  # steps 1-5 from before the kill
    assert abs(summary(run_dir)["eval_accuracy"] - summary(reference)["eval_accuracy"]) <= 0.01
    assert summary(run_dir)["eval_accuracy"] >= 0.95
    epoch0 = ends[0][1]
    assert (epoch0["shares/verdict_ok"], epoch0["shares/coverage"]) == (1, 1.0)
    assert epoch0["shares/total_samples"] == N_DIGITS
    seen = replayed_epoch(run_dir)
    assert len(seen) == N_DIGITS and set(seen.values()) == {1}  # 1 rank: the rest needs no pad
    log = (run_dir / "train.log").read_text()
    assert "before the resize, rank 1 of 2: 160 samples" in log


def test_resumed_at_three_ranks_scaling_the_global_batch(interrupted, tmp_path: Path) -> None:
    """2 → 3: `keep` refused in one sentence naming elastic.global_batch=scale, nothing
    written; with `scale` it finishes, epoch 0 whole and ok, replay: each index once plus the
    one pad the mode names at 3 ranks (1,118 samples left over 3 ranks)."""
    _, cut = interrupted
    refused = _resume(cut, tmp_path, "keep", "dist.nproc=3", check=False)
    assert refused.returncode == 2
    said = [line for line in refused.stdout.splitlines() if "ERROR" in line and "rank0" in line]
    assert len(said) == 1 and "elastic.global_batch=scale" in said[0], refused.stdout[-2000:]
    assert sorted(p.name for p in (tmp_path / "outputs/keep/checkpoints").iterdir()) == ["last.pt"]
    _resume(cut, tmp_path, "three", "dist.nproc=3", "elastic.global_batch=scale")
    run_dir = tmp_path / "outputs" / "three"
    assert summary(run_dir)["eval_accuracy"] >= 0.95
    epoch0 = _epoch_ends(run_dir)[0][1]
    assert (epoch0["shares/verdict_ok"], epoch0["shares/coverage"]) == (1, 1.0)
    seen = replayed_epoch(run_dir)
    assert len(seen) == N_DIGITS and sorted(Counter(seen.values()).items()) == [
        (1, N_DIGITS - 1),
        (2, 1),
    ]
    resized = [r for r in jsonl(run_dir / "rank0" / "metrics.jsonl") if "elastic/world_size" in r]
    assert [
        (r["elastic/world_size_from"], r["elastic/world_size"], r["elastic/global_batch"])
        for r in resized
    ] == [(2, 3, 96)]


# ----------------------------------------------------------------------------- N = 10,000,000
def _peak_rss_mib(run_dir: Path, world: int) -> float:
    """The largest peak resident memory of the run's ranks (``rank<r>/process.json``)."""
    return max(
        json.loads((run_dir / f"rank{r}/process.json").read_text())["peak_rss_mib"]
        for r in range(world)
    )


def test_ten_million_samples_resume_at_three_ranks_in_constant_memory(tmp_path: Path) -> None:
    """N = 10^7 synthetic samples, 8 steps an epoch, feistel-shuffled (the one permutation that
    could be O(N); the sequential mode's index is arithmetic): killed
    after step 4 (checkpoint at 3) at 2 ranks, resumed at 3: epoch 0 ok, no index read twice,
    and the resumed ranks' peak RSS no larger than a 3-rank run's at N = 10^4 (plus noise):
    nothing O(N) is built."""
    common = [
        "data=synthetic",
        "data.image_size=8",
        "data.test_size=64",
        "model.width=8",
        "loader.batch_size=24",
        "max_steps_per_epoch=8",
        "epochs=2",
        "checkpoint.every_steps=3",
        "log_every=1",
    ]
    run(train_cmd(tmp_path, *common, "data.size=10000", "dist.nproc=3"), env=run_env(RUN_ID="n4"))
    small = _peak_rss_mib(tmp_path / "outputs" / "n4", world=3)
    for name, sampler in [("feistel", "sampler.permutation=feistel")]:  # sequential: O(1) too
        data = [*common, sampler, "data.size=10000000"]
        proc = run(
            train_cmd(tmp_path, *data, "dist.nproc=2", "fault.crash_at_step=4", "fault.rank=1"),
            env=run_env(RUN_ID=name),
            check=False,
        )
        assert proc.returncode != 0, proc.stderr[-2000:]
        run(train_cmd(tmp_path, *data, "dist.nproc=3"), env=run_env(RUN_ID=name))
        run_dir = tmp_path / "outputs" / name
        assert "world size 2 → 3 at step 3" in (run_dir / "train.log").read_text()
        epoch0 = _epoch_ends(run_dir)[0][1]
        assert epoch0["shares/verdict_ok"] == 1 and epoch0["shares/total_samples"] == 8 * 48
        seen = replayed_epoch(run_dir)
        assert len(seen) == 8 * 48 and set(seen.values()) == {1}
        big = _peak_rss_mib(run_dir, world=3)
        print(f"{sampler}: peak RSS at N=1e4: {small:.0f} MiB, at N=1e7: {big:.0f} MiB")
        assert big < small + 40  # randperm(1e7) alone would add 76 MiB


# ----------------------------------------------------------------------------- torchrun elastic
# Two torchrun agents on localhost, one node each, as two machines would be. torch's agent
# shares one TCPStore across rendezvous rounds by default, and a node that joins a later round
# then waits for a MASTER_ADDR nobody publishes (pytorch/pytorch#135712): README's elastic
# command sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, and so do these agents.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _agent(port: int, rdzv_id: str, *, host: bool, last_call_s: int) -> list[str]:
    # A node is dead after 5 missed heartbeats of 1 s (torch's default: 3 of 5 s).
    alive = "keep_alive_interval=1,keep_alive_max_attempt=5"
    conf = f"is_host={str(host).lower()},last_call_timeout={last_call_s},{alive}"
    return [
        *TORCHRUN,
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--max-restarts=3",
        "--monitor-interval=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{port}",
        f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf={conf}",
    ]


def _every_epoch_ok(run_dir: Path, epochs: int) -> None:
    """Every report ok (a preempted epoch's partial one too); one whole report an epoch, all N
    samples once; replay lists each training index of epoch 0 exactly once."""
    reports = [row for _, row in _epoch_ends(run_dir)]
    assert all(r["shares/verdict_ok"] == 1 for r in reports), reports
    whole = [r for r in reports if r["shares/coverage"] == 1.0]
    assert [r["shares/total_samples"] for r in whole] == [N_DIGITS] * epochs, reports
    seen = replayed_epoch(run_dir)
    assert len(seen) == N_DIGITS and set(seen.values()) == {1}


def test_torchrun_elastic_continues_on_the_agent_left_when_one_is_killed(tmp_path: Path) -> None:
    """Two agents form a 2-rank run; after step 7 (checkpoint at 5) rank 1 takes its whole
    node down (agent included, SIGKILL). The agent left restarts its worker alone: the run
    continues at 1 rank from step 5 with the rest of epoch 0, the dead rank named, and
    finishes with every epoch ok."""
    port, rdzv = free_port(), "killed"
    fault = [*CRASH, "fault.signal=SIGKILL", "fault.scope=node", "epochs=1", *DIGITS]
    env = run_env(**ELASTIC_ENV)
    # The first round completes as soon as both agents are in (max nodes), long before the
    # last call. Ranks go by node (address, pid): the host, started first, is rank 0, so the
    # node rank 1 takes down is the other one (the store's host going down ends any job).
    a, b = (
        start(
            train_cmd(tmp_path, *fault, launcher=_agent(port, rdzv, host=host, last_call_s=10)),
            env=env,
            new_session=True,
        )
        for host in (True, False)
    )
    lost = b.wait(check=False)
    assert lost.returncode == -signal.SIGKILL, lost.stderr[-3000:]
    a.wait(timeout=300)
    run_dir = tmp_path / "outputs" / rdzv
    log = (run_dir / "train.log").read_text()
    assert "world size 2 → 1 at step 5" in log, log[-3000:]
    assert "rank 1 (pid" in log and "without a Python exception" in log, log[-3000:]
    _every_epoch_ok(run_dir, epochs=1)
    assert summary(run_dir)["world_size"] == 1


def test_torchrun_elastic_grows_when_an_agent_joins_later(tmp_path: Path) -> None:
    """One agent runs alone (1 rank) and holds after step 7 (checkpoint at 5), so it is still
    training when a second agent joins: torchrun restarts the worker (its SIGTERM is a
    preemption: checkpointed at the next check) and the two continue at 2 ranks with the rest
    of epoch 0, every epoch ok."""
    port, rdzv = free_port(), "joined"
    hold = ["fault.crash_at_step=7", "fault.rank=0", "fault.hold=true", "epochs=1", *DIGITS]
    env = run_env(**ELASTIC_ENV)
    first = _agent(port, rdzv, host=True, last_call_s=1)
    a = start(train_cmd(tmp_path, *hold, launcher=first), env=env, new_session=True)
    run_dir = tmp_path / "outputs" / rdzv
    wait_for(run_dir / "checkpoints" / "last.pt", a)  # the step-5 checkpoint: 1 rank, held at 7
    later = _agent(port, rdzv, host=False, last_call_s=1)
    b = start(train_cmd(tmp_path, *hold, launcher=later), env=env, new_session=True)
    a.wait(timeout=300)
    b.wait(timeout=300)
    log = (run_dir / "train.log").read_text()
    assert "world size 1 → 2 at step" in log, log[-3000:]
    _every_epoch_ok(run_dir, epochs=1)
    assert summary(run_dir)["world_size"] == 2
