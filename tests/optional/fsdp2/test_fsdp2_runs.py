"""parallel=fsdp2 for real: FSDP2 on gloo ranks, checkpoints through DCP that reshard.

A 2-layer GPT (each block a unit of its own) on 874 windows of the built-in corpus, sampler=exact,
batch 6 x accumulate 2 x 2 ranks, gradient clipping and an EMA, one epoch of 37 steps,
checkpointing every 7:
- it trains like the same run under DDP (final test loss within 1e-5 relative; every epoch's
  verdict ok), its checkpoint one DCP file per rank;
- rank 1 SIGKILLed mid-epoch and resumed: the weights, the optimizer state and the EMA of the
  uninterrupted run, bit for bit;
- the killed run's checkpoint resumed at 3 ranks and at 1 rank (global batch kept): each
  finishes, replay lists every window of the interrupted epoch once, and the LR of every step is
  the uninterrupted run's;
- the finished run's checkpoint evaluated at 1 and 3 ranks: the 2-rank numbers on 97 test
  windows (a count 2 and 3 do not divide: the ranks run different numbers of batches);
- checkpoint.async_save: rank 0 SIGKILLed inside the background write of step 14's checkpoint
  (its slices written and renamed, last.pt's temporary file not yet published): resumed from
  step 7's at 2 ranks, the uninterrupted synchronous run's weights bit for bit; at 3 ranks,
  every window of the epoch once;
- finetune.init_from across layouts, both ways, and `export` of the sliced weights;
- the default job with syncbn=on under HSDP (parallel.replicate=2) equal to DDP's, and
  compiled (compile=true) under FSDP2 ending on DDP's numbers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import compose_conf
from helpers import (
    assert_killed_rank_reported,
    cpu_rank,
    jsonl,
    run,
    run_env,
    summary,
    train_cmd,
)
from test_elastic import _lr, replayed_epoch
from torch.utils.data import DataLoader

from ddp_template.checkpoint import load, whole
from ddp_template.config.loop import FinetuneConfig
from ddp_template.evaluation import evaluate
from ddp_template.export import main as export_main
from ddp_template.finetune import init_weights
from ddp_template.models import build_model
from ddp_template.optional.tokens.corpus import text
from ddp_template.optional.tokens.writer import write_text
from ddp_template.splits import build_splits
from ddp_template.task import build_task

pytestmark = pytest.mark.needs("tokens", "gpt")  # its runs train model=gpt on token files

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
    "loader.eval_batch_size=8",  # 97 test windows: 7 and 6 batches at 2 ranks, 5, 4, 4 at 3
    "epochs=1",
    "log_every=1",
    "checkpoint.every_steps=7",  # DCP writes a checkpoint in ~50 ms here: step 14's is the kill's
]
FSDP2 = "parallel=fsdp2"
# 874 windows / (6 x 2 x 2) = 37 steps an epoch, the last one short.
KILL = ["fault.crash_at_step=20", "fault.rank=1", "fault.signal=SIGKILL"]


def launch(out: Path, data: Path, run_id: str, *overrides: str, check: bool = True):
    cmd = train_cmd(out, *LM, f"data.path={data}", *overrides)
    return run(cmd, env=run_env(RUN_ID=run_id), check=check)


def weights(run_dir: Path, *keys: str) -> dict[str, torch.Tensor]:
    path = run_dir / "checkpoints" / "last.pt"
    return whole(path, load(path), *keys)


def verdicts(run_dir: Path) -> list[tuple[int, int]]:
    rows = jsonl(run_dir / "rank0" / "metrics.jsonl")
    return [
        (r["shares/verdict_ok"], r["shares/total_samples"]) for r in rows if "shares/" in str(r)
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The token files; the run under DDP (ddp) and under FSDP2 (fsdp2); the FSDP2 run killed at
    step 20 (copied as three and one before it is resumed as cut)."""
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
    assert verdicts(fsdp2) == verdicts(ddp) == [(1, TRAIN_WINDOWS)]
    a, b = summary(ddp), summary(fsdp2)
    assert a["eval_count"] == b["eval_count"] == TEST_WINDOWS
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5)
    log = (fsdp2 / "train.log").read_text()
    assert "fsdp2: fully_shard on 2 units (blocks.0, blocks.1) and the root; mesh slice 2" in log
    payload = load(fsdp2 / "checkpoints/last.pt")
    assert "model" not in payload and "optimizer" not in payload and "ema" not in payload
    (kept,) = (fsdp2 / "checkpoints/slices").iterdir()  # the older ones pruned
    assert kept.name == payload["slices"]
    assert sorted(p.name for p in kept.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_a_rank_killed_mid_epoch_resumes_bit_identical(runs) -> None:
    out, data = runs
    progress = load(out / "outputs/cut/checkpoints/last.pt")["progress"]
    assert (progress["step"], progress["epoch"]) == (14, 0)
    proc = launch(out, data, "cut", FSDP2, "dist.nproc=2")
    assert "resume: continues run cut, link 0 → 1 at step 14: 0 samples skipped" in proc.stdout
    for keys in (("model",), ("optimizer",), ("ema", "model")):
        ref, resumed = weights(out / "outputs/fsdp2", *keys), weights(out / "outputs/cut", *keys)
        assert ref.keys() == resumed.keys() and len(ref) > 10, keys
        different = [k for k in ref if not torch.equal(ref[k], resumed[k])]
        assert not different, f"{keys}: {different}"


ASYNC = "checkpoint.async_save=true"
WRITE_KILL = ["fault.crash_at_step=14", "fault.rank=0", "fault.signal=SIGKILL", "fault.phase=write"]


def test_async_saves_killed_inside_a_write_resume_from_the_previous_one(runs) -> None:
    out, data = runs
    proc = launch(out, data, "acut", FSDP2, "dist.nproc=2", ASYNC, *WRITE_KILL, check=False)
    assert_killed_rank_reported(proc, rank=0, sig="SIGKILL")
    ckpts = out / "outputs/acut/checkpoints"
    payload = load(ckpts / "last.pt")
    assert payload["progress"]["step"] == 7 and (ckpts / "last.pt.tmp").is_file()
    # step 14's slices complete, published as a directory no checkpoint names yet
    assert len(list((ckpts / "slices").iterdir())) == 2
    shutil.copytree(out / "outputs/acut", out / "outputs/athree")
    proc = launch(out, data, "acut", FSDP2, "dist.nproc=2", ASYNC)
    assert "resume: continues run acut, link 0 → 1 at step 7: 0 samples skipped" in proc.stdout
    for keys in (("model",), ("optimizer",), ("ema", "model")):
        ref, resumed = weights(out / "outputs/fsdp2", *keys), weights(out / "outputs/acut", *keys)
        assert ref.keys() == resumed.keys() and len(ref) > 10, keys
        assert [k for k in ref if not torch.equal(ref[k], resumed[k])] == [], keys
    (kept,) = (ckpts / "slices").iterdir()  # the orphan and the older ones pruned
    assert kept.name == load(ckpts / "last.pt")["slices"]
    proc = launch(out, data, "athree", FSDP2, "dist.nproc=3", ASYNC)
    assert "world size 2 → 3 at step 7" in proc.stdout
    assert verdicts(out / "outputs/athree") == [(1, TRAIN_WINDOWS)]
    seen = replayed_epoch(out / "outputs/athree", epoch=0)
    assert len(seen) == TRAIN_WINDOWS and set(seen.values()) == {1}


@pytest.mark.parametrize(("world", "batch"), [(3, "batch_size 6 → 4"), (1, "accumulate 2 → 4")])
def test_the_killed_run_resumed_at_another_world_size_reads_each_window_once(
    runs, world: int, batch: str
) -> None:
    out, data = runs
    name = {3: "three", 1: "one"}[world]
    proc = launch(out, data, name, FSDP2, f"dist.nproc={world}")
    assert f"world size 2 → {world} at step 14" in proc.stdout and batch in proc.stdout
    run_dir = out / "outputs" / name
    assert verdicts(run_dir) == [(1, TRAIN_WINDOWS)]
    seen = replayed_epoch(run_dir, epoch=0)
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
    """finetune.init_from: DDP's weights into a 2-rank FSDP2 run (epochs=0 evaluates them as
    the DDP run did), FSDP2's slices into one process's plain model (evaluated as the FSDP2 run
    did). export writes the slices as one state_dict."""
    out, data = runs
    ddp, fsdp2 = out / "outputs/ddp", out / "outputs/fsdp2"
    init = f"finetune.init_from={ddp / 'checkpoints/last.pt'}"
    launch(tmp_path, data, "into", init, "epochs=0", FSDP2, "dist.nproc=2")
    into = summary(tmp_path / "outputs/into")["eval_loss"]
    assert into == pytest.approx(summary(ddp)["eval_loss"], rel=1e-6)
    cfg = compose_conf(*LM, f"data.path={data}")
    splits = build_splits(cfg.data)
    model = build_model(cfg.model, splits.info)
    source = str(fsdp2 / "checkpoints/last.pt")
    init_weights(FinetuneConfig(init_from=source, ema=False, strict=True), model)
    task = build_task(cfg.task)
    task.setup(splits.info, torch.device("cpu"))
    back = evaluate(model, DataLoader(splits.test, batch_size=7), cpu_rank(), "off", task)
    assert back.values["loss"] == pytest.approx(summary(fsdp2)["eval_loss"], rel=1e-6)
    file = tmp_path / "model.pt"
    assert export_main([source, str(file)]) == 0
    exported, held = torch.load(file, weights_only=True), weights(fsdp2, "model")
    assert exported.keys() == held.keys()
    assert all(torch.equal(exported[k], held[k]) for k in held)


def test_the_default_job_under_hsdp_with_syncbn_and_compiled_ends_on_ddps_numbers(
    tmp_path: Path,
) -> None:
    """small_cnn on digits, 2 epochs: with SyncBN on, FSDP2 on a replicate x slice mesh of 2 x 1
    ends on DDP's numbers (SyncBN's all-reduce in the forward works under FSDP2); compiled
    (compile=true, Inductor on CPU), FSDP2 ends on DDP's counts and, to 10⁻³ (Inductor's fused
    kernels round otherwise), its loss."""
    base = ["dist.nproc=2", "epochs=2", "checkpoint.enabled=false"]
    runs = {
        "ddp-syncbn": ["syncbn=on"],
        "hsdp-syncbn": ["syncbn=on", FSDP2, "parallel.replicate=2"],
        "ddp": [],
        "compiled": [FSDP2, "compile=true"],
    }
    for name, layout in runs.items():
        run(train_cmd(tmp_path, *base, *layout), env=run_env(RUN_ID=name), timeout=480)
    got = {name: summary(tmp_path / "outputs" / name) for name in runs}
    for ours, theirs, rel in (("hsdp-syncbn", "ddp-syncbn", 1e-6), ("compiled", "ddp", 1e-3)):
        assert got[ours]["eval_correct"] == got[theirs]["eval_correct"], ours
        assert got[ours]["eval_loss"] == pytest.approx(got[theirs]["eval_loss"], rel=rel), ours
    log = (tmp_path / "outputs/hsdp-syncbn/train.log").read_text()
    assert "mesh replicate 2 x slice 1" in log
