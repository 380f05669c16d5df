"""parallel=fsdp2 for real: FSDP2 on gloo ranks, checkpoints through DCP that reshard.

A 2-layer GPT (each block a unit of its own) on 874 windows of the built-in corpus, sampler=exact,
batch 6 x accumulate 2 x 2 ranks, gradient clipping and an EMA, checkpointing every 7 steps:
- it trains like the same run under DDP (final test loss within 1e-5 relative; every epoch's
  verdict ok), its checkpoint one DCP file per rank;
- rank 1 SIGKILLed mid-epoch and resumed: the weights, the optimizer state and the EMA of the
  uninterrupted run, bit for bit;
- the killed run's checkpoint resumed at 3 ranks and at 1 rank (global batch kept): each
  finishes, replay lists every window of the interrupted epoch once, and the LR of every step is
  the uninterrupted run's;
- the finished run's checkpoint evaluated at 1 and 3 ranks: the 2-rank numbers on 97 test
  windows (a count 2 and 3 do not divide: the ranks run different numbers of batches);
- finetune.init_from across layouts, both ways, and `export` of the sliced weights;
- the default job with syncbn=on under HSDP (parallel.replicate=2) equal to DDP's;
- compile=true on the sliced GPT learning as the eager run does.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import assert_killed_rank_reported, jsonl, run, run_env, summary, train_cmd
from test_elastic import _lr, replayed_epoch

from ddp_template.checkpoint import load, whole
from ddp_template.export import main as export_main
from ddp_template.tokens.corpus import text
from ddp_template.tokens.writer import write_text

TRAIN_WINDOWS, TEST_WINDOWS = 874, 97  # (27,990 - 33) // 32 + 1 and (3,110 - 33) // 32 + 1
LM = [
    "task=lm",
    "model=gpt",
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "data=tokens",
    "data.block_size=32",
    "optim=adamw",
    "optim.lr=3e-3",
    "optim.accumulate=2",
    "optim.grad_clip=1.0",
    "ema.decay=0.9",
    "sampler=exact",
    "loader.batch_size=6",
    "epochs=2",
    "log_every=1",
    "checkpoint.every_steps=7",  # DCP writes a checkpoint in ~50 ms here: step 49's is the kill's
]
FSDP2 = "parallel=fsdp2"
# 874 windows / (6 x 2 x 2) = 37 steps an epoch; step 50 is epoch 1's 13th.
KILL = ["fault.crash_at_step=50", "fault.rank=1", "fault.signal=SIGKILL"]


def launch(out: Path, data: Path, run_id: str, *overrides: str, check: bool = True):
    cmd = train_cmd(out, *LM, f"data.path={data}", *overrides)
    return run(cmd, env=run_env(RUN_ID=run_id), check=check)


def weights(run_dir: Path, *keys: str) -> dict[str, torch.Tensor]:
    path = run_dir / "checkpoints" / "last.pt"
    return whole(path, load(path), *keys)


def verdicts(run_dir: Path) -> list[tuple[int, int]]:
    rows = jsonl(run_dir / "rank0" / "metrics.jsonl")
    return [
        (r["shards/verdict_ok"], r["shards/total_samples"]) for r in rows if "shards/" in str(r)
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The token files; the run under DDP (ddp) and under FSDP2 (fsdp2); the FSDP2 run killed at
    step 50 (copied as three and one before it is resumed as cut)."""
    out = tmp_path_factory.mktemp("fsdp2")
    data = out / "corpus"
    write_text(text(31_100), data, 0.1)
    launch(out, data, "ddp", "dist.nproc=2")
    launch(out, data, "fsdp2", FSDP2, "dist.nproc=2")
    proc = launch(out, data, "cut", FSDP2, "dist.nproc=2", *KILL, check=False)
    assert_killed_rank_reported(proc, rank=1, sig="SIGKILL")
    for name in ("three", "one"):
        shutil.copytree(out / "outputs/cut", out / "outputs" / name)
    return out, data


def test_fsdp2_trains_like_ddp_with_a_dcp_file_per_rank(runs) -> None:
    out, _ = runs
    ddp, fsdp2 = out / "outputs/ddp", out / "outputs/fsdp2"
    assert verdicts(fsdp2) == verdicts(ddp) == [(1, TRAIN_WINDOWS)] * 2
    a, b = summary(ddp), summary(fsdp2)
    assert a["eval_count"] == b["eval_count"] == TEST_WINDOWS
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5)
    log = (fsdp2 / "train.log").read_text()
    assert "fsdp2: fully_shard on 2 units (blocks.0, blocks.1) and the root; mesh shard 2" in log
    payload = load(fsdp2 / "checkpoints/last.pt")
    assert "model" not in payload and "optimizer" not in payload and "ema" not in payload
    (kept,) = (fsdp2 / "checkpoints/slices").iterdir()  # the older ones pruned
    assert kept.name == payload["slices"]
    assert sorted(p.name for p in kept.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_a_rank_killed_mid_epoch_resumes_bit_identical(runs) -> None:
    out, data = runs
    progress = load(out / "outputs/cut/checkpoints/last.pt")["progress"]
    assert (progress["step"], progress["epoch"]) == (49, 1)
    proc = launch(out, data, "cut", FSDP2, "dist.nproc=2")
    assert "resume: continues run cut, link 0 → 1 at step 49: 0 samples skipped" in proc.stdout
    for keys in (("model",), ("optimizer",), ("ema", "model")):
        ref, resumed = weights(out / "outputs/fsdp2", *keys), weights(out / "outputs/cut", *keys)
        assert ref.keys() == resumed.keys() and len(ref) > 10, keys
        different = [k for k in ref if not torch.equal(ref[k], resumed[k])]
        assert not different, f"{keys}: {different}"


@pytest.mark.parametrize(("world", "batch"), [(3, "batch_size 6 → 4"), (1, "accumulate 2 → 4")])
def test_the_killed_run_resumed_at_another_world_size_reads_each_window_once(
    runs, world: int, batch: str
) -> None:
    out, data = runs
    name = {3: "three", 1: "one"}[world]
    proc = launch(out, data, name, FSDP2, f"dist.nproc={world}")
    assert f"world size 2 → {world} at step 49" in proc.stdout and batch in proc.stdout
    run_dir = out / "outputs" / name
    assert [ok for ok, _ in verdicts(run_dir)] == [1, 1]
    seen = replayed_epoch(run_dir, epoch=1)
    assert len(seen) == TRAIN_WINDOWS and set(seen.values()) == {1}
    assert _lr(run_dir) == pytest.approx(_lr(out / "outputs/fsdp2"), rel=1e-12)
    assert summary(run_dir)["eval_loss"] == pytest.approx(
        summary(out / "outputs/fsdp2")["eval_loss"], rel=1e-3
    )


def test_the_final_evaluation_is_the_same_at_1_2_and_3_ranks(runs) -> None:
    """The finished 2-rank run launched again at 3 and at 1 rank: DCP lays its slices out
    anew, nothing is left to train, and the final evaluation is the 2-rank one."""
    out, data = runs
    two = summary(out / "outputs/fsdp2")
    for world in (3, 1):
        name = f"eval{world}"
        shutil.copytree(out / "outputs/fsdp2", out / "outputs" / name)
        launch(out, data, name, FSDP2, f"dist.nproc={world}")
        got = summary(out / "outputs" / name)
        assert (got["eval_count"], got["eval_tokens"]) == (TEST_WINDOWS, two["eval_tokens"])
        assert got["eval_loss"] == pytest.approx(two["eval_loss"], rel=1e-6)


def test_weights_cross_layouts_both_ways_and_export_to_one_file(runs, tmp_path: Path) -> None:
    """finetune.init_from: DDP's weights into a 2-rank FSDP2 run, FSDP2's slices into a
    1-process DDP run; epochs=0 evaluates them, as their runs did. export writes the slices as
    one state_dict."""
    out, data = runs
    ddp, fsdp2 = out / "outputs/ddp", out / "outputs/fsdp2"
    for source, overrides in ((ddp, [FSDP2, "dist.nproc=2"]), (fsdp2, ["dist.nproc=1"])):
        init = f"finetune.init_from={source / 'checkpoints/last.pt'}"
        launch(tmp_path, data, source.name, init, "epochs=0", *overrides)
        got = summary(tmp_path / "outputs" / source.name)["eval_loss"]
        assert got == pytest.approx(summary(source)["eval_loss"], rel=1e-6)
    file = tmp_path / "model.pt"
    assert export_main([str(fsdp2 / "checkpoints/last.pt"), str(file)]) == 0
    exported, held = torch.load(file, weights_only=True), weights(fsdp2, "model")
    assert exported.keys() == held.keys()
    assert all(torch.equal(exported[k], held[k]) for k in held)


def test_the_default_job_with_syncbn_under_hsdp_equals_ddp(tmp_path: Path) -> None:
    """small_cnn on digits, SyncBN on, 2 epochs: FSDP2 on a replicate x shard mesh of 2 x 1
    ends on DDP's numbers (SyncBN's all-reduce in the forward works under FSDP2)."""
    base = ["dist.nproc=2", "epochs=2", "syncbn=on", "checkpoint.enabled=false"]
    for name, layout in (("ddp", []), ("hsdp", [FSDP2, "parallel.replicate=2"])):
        run(train_cmd(tmp_path, *base, *layout), env=run_env(RUN_ID=name))
    a, b = summary(tmp_path / "outputs/ddp"), summary(tmp_path / "outputs/hsdp")
    assert a["eval_correct"] == b["eval_correct"] and a["eval_count"] == b["eval_count"] == 359
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-6)
    log = (tmp_path / "outputs/hsdp/train.log").read_text()
    assert "mesh replicate 2 x shard 1" in log


@pytest.mark.slow
def test_a_compiled_fsdp2_run_learns_as_the_eager_one(runs, tmp_path: Path) -> None:
    """compile=true on the sliced GPT (Inductor on CPU) ends on the eager run's test loss (to
    10⁻³: Inductor's fused kernels round otherwise), every epoch's verdict ok."""
    out, data = runs
    launch(tmp_path, data, "compiled", FSDP2, "dist.nproc=2", "compile=true")
    eager, compiled = summary(out / "outputs/fsdp2"), summary(tmp_path / "outputs/compiled")
    assert compiled["eval_loss"] == pytest.approx(eager["eval_loss"], rel=1e-3)
    assert verdicts(tmp_path / "outputs/compiled") == [(1, TRAIN_WINDOWS)] * 2
