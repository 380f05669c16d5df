"""task=lm on data=tokens with model=gpt, for real: every guarantee of the template for windows.

A 1-layer GPT on 30,000 bytes of the built-in corpus cut into 843 windows of 33 tokens (an odd
count), sampler=exact, 2 gloo ranks: every epoch's verdict ok with each rank's tokens in the
W&B report table and the file's tail named; the final test loss equal to one process's
evaluation of the checkpoint; 2 ranks x batch 8 ending on the weights of 1 process x batch 16;
rank 1 killed (SIGKILL) mid-epoch and resumed to the same weights bit for bit; the 2-rank
checkpoint resumed at 3 ranks with every window of the interrupted epoch read once (replay
lists them); `sample` printing a continuation; a broken token file refused at start-up without
touching the run it names. The task's sums against a direct computation are in-process.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import compose_conf
from helpers import (
    ROOT,
    assert_killed_rank_reported,
    cpu_rank,
    jsonl,
    run,
    run_env,
    summary,
    train_cmd,
)
from test_elastic import replayed_epoch
from test_resume import assert_identical
from torch.utils.data import DataLoader
from wandb_reader import find_runs

from ddp_template.data.contract import DataInfo
from ddp_template.errors import EXIT_CONFIG_ERROR, ConfigError
from ddp_template.evaluation import evaluate
from ddp_template.models import build_model
from ddp_template.optim import build_optimizer
from ddp_template.optional.tokens.corpus import text
from ddp_template.optional.tokens.writer import write_text
from ddp_template.replay import load_run, step_rows
from ddp_template.splits import build_splits
from ddp_template.task import build_task
from ddp_template.tasks.lm import LanguageModel

pytestmark = pytest.mark.needs("gpt")  # experiment=lm_bytes trains model=gpt

CPU = torch.device("cpu")
WINDOWS = 843  # (27,000 train tokens - 33) // 32 + 1
TINY_GPT = ["model=gpt", "model.n_layer=1", "model.n_embd=32", "model.n_head=2"]


def lm_overrides(data: Path) -> list[str]:
    return [
        "task=lm",
        *TINY_GPT,
        "data=tokens",
        f"data.path={data}",
        "data.block_size=32",
        "optim=adamw",
        "optim.lr=3e-3",
        "sampler=exact",
        "loader.batch_size=8",
    ]


# ------------------------------------------------------------------------------ in-process
def test_the_tasks_sums_give_the_per_token_loss_perplexity_and_bits_per_byte() -> None:
    """Any cut of the windows into shares (one empty), added as the all-reduce adds them: the
    mean over every token of its cross-entropy, its exp, and in bits where a token is a byte;
    the loss a window mean; a vocabulary the data must give."""
    gen = torch.Generator().manual_seed(0)
    logits, y = torch.randn(9, 5, 7, generator=gen), torch.randint(0, 7, (9, 5), generator=gen)
    want = F.cross_entropy(logits.double().flatten(0, 1), y.flatten()).item()
    for byte_level in (1, 0):
        task = LanguageModel()
        task.setup(DataInfo(extra={"vocab_size": 7, "byte_level": byte_level}), CPU)
        total = task.sums(CPU)
        for lo, hi in ((0, 4), (4, 4), (4, 9)):
            share = task.sums(CPU)
            task.update(share, logits[lo:hi], y[lo:hi])
            total += share
        got = task.result(total)
        assert (got.count, got.details["tokens"]) == (9, 45)
        assert got.values["loss"] == pytest.approx(want, rel=1e-6)
        assert got.values["perplexity"] == pytest.approx(math.exp(want), rel=1e-6)
        bpb = got.values["bpb"]
        assert bpb == pytest.approx(want / math.log(2), rel=1e-6) if byte_level else math.isnan(bpb)
    mean = task.loss(logits, y, "mean")
    assert mean.item() == pytest.approx(want, rel=1e-5)
    assert (task.loss(logits, y, "sum") / 9).item() == pytest.approx(want, rel=1e-5)
    assert task.loss(logits[:0], y[:0], "sum").item() == 0.0
    with pytest.raises(ConfigError, match=r"task=lm needs the data's vocabulary") as err:
        LanguageModel().setup(DataInfo(num_classes=10), CPU)
    assert "\n" not in str(err.value)


def test_the_lm_bytes_preset_composes_and_steps(tmp_path: Path) -> None:
    """experiment=lm_bytes: the corpus written on first use under paths.data_root (the same
    bytes a second time: no rewrite), the GPT told the data's vocabulary and block size, and
    one AdamW step on the task's loss."""
    cfg = compose_conf("experiment=lm_bytes", f"paths.data_root={tmp_path}", "data.size=5000")
    assert (cfg.dist.nproc, cfg.sampler.mode, cfg.optim.name) == (2, "exact", "adamw")
    splits = build_splits(cfg.data)
    written = tmp_path / "corpus-5000-0"
    assert sorted(p.name for p in written.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    mtime = (written / "train.bin").stat().st_mtime_ns
    assert len(build_splits(cfg.data).train) == len(splits.train) == (4500 - 129) // 128 + 1
    assert (written / "train.bin").stat().st_mtime_ns == mtime
    model = build_model(cfg.model, splits.info)
    assert model.lm_head.weight.shape == (256, 128)  # vocab_size x n_embd
    task = build_task(cfg.task)
    task.setup(splits.info, CPU)
    optimizer = build_optimizer(cfg.optim, model)
    x, y, _ = splits.train.get_batch([0, 5, 9])
    before = [p.detach().clone() for p in model.parameters()]
    loss = task.loss(model(x), y, "mean")
    loss.backward()
    optimizer.step()
    assert math.isfinite(loss.item()) and loss.item() > math.log(256) - 1.0  # untrained: ~uniform
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


# ------------------------------------------------------------------------- real gloo runs
def launch(out: Path, data: Path, run_id: str, *overrides: str, check: bool = True):
    cmd = train_cmd(out, *lm_overrides(data), "epochs=2", "checkpoint.every_steps=1", *overrides)
    return run(cmd, env=run_env(RUN_ID=run_id), check=check)


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The token files, and a 2-rank run of 2 epochs checkpointing every step (run id two),
    logged to W&B offline."""
    out = tmp_path_factory.mktemp("lm")
    data = out / "corpus"
    write_text(text(30_000), data, 0.1)
    launch(out, data, "two", "dist.nproc=2", "logger=wandb")
    return out, data


def report_rows(run_dir: Path) -> list[tuple[int, int]]:
    rows = jsonl(run_dir / "rank0" / "metrics.jsonl")
    return [
        (r["shares/verdict_ok"], r["shares/total_samples"])
        for r in rows
        if "shares/verdict_ok" in r
    ]


def test_every_epoch_reads_every_window_once_and_evaluates_exactly(lm) -> None:
    out, data = lm
    run_dir = out / "outputs" / "two"
    assert report_rows(run_dir) == [(1, WINDOWS)] * 2
    log = (run_dir / "train.log").read_text()
    assert "rank 0: 422 samples, 0 padded" in log and "rank 1: 421 samples, 0 padded" in log
    assert "drops: train.bin[26977:27000] (23 tokens after the last whole window)" in log
    assert f"{WINDOWS} windows x 32 = {WINDOWS * 32} target tokens" in log
    rows = step_rows(load_run(run_dir), 60)  # epoch 1's 7th step: replay names the windows
    assert [len(r["indices"]) for r in rows] == [8, 8]
    for r in rows:
        assert r["keys"] == [f"train.bin[{32 * i}:{32 * i + 33}]" for i in r["indices"]]
    (wb,) = [r for r in find_runs(run_dir) if r.path.is_relative_to(run_dir / "rank0")]
    paths = [row["shares/report.path"] for row in wb.history if "shares/report.path" in row]
    table = json.loads((wb.path.parent / "files" / paths[-1]).read_text())
    rows = [dict(zip(table["columns"], values, strict=True)) for values in table["data"]]
    assert [(r["rank"], r["samples"], r["tokens"]) for r in rows] == [
        (0, 422, 422 * 32),
        (1, 421, 421 * 32),
    ]
    s = summary(run_dir)
    assert s["eval_count"] == (3000 - 33) // 32 + 1 and s["eval_tokens"] == s["eval_count"] * 32
    counts = np.bincount(np.fromfile(data / "train.bin", dtype="<u2"), minlength=256)
    freq = counts[counts > 0] / counts.sum()
    unigram = float(-(freq * np.log2(freq)).sum())  # 4.43 bits: the bytes' own entropy
    assert s["eval_bpb"] < unigram - 0.1, (s["eval_bpb"], unigram)  # it learned context
    cfg = compose_conf(*lm_overrides(data))
    splits = build_splits(cfg.data)
    model = build_model(cfg.model, splits.info)
    model.load_state_dict(torch.load(run_dir / "checkpoints/last.pt", weights_only=True)["model"])
    task = build_task(cfg.task)
    task.setup(splits.info, CPU)
    one = evaluate(model, DataLoader(splits.test, batch_size=13), cpu_rank(), "off", task)
    assert one.count == s["eval_count"]
    for name in ("loss", "perplexity", "bpb"):
        assert one.values[name] == pytest.approx(s[f"eval_{name}"], rel=1e-6), name


def test_sample_prints_a_continuation_of_the_prompt(lm) -> None:
    out, _ = lm
    ckpt = out / "outputs/two/checkpoints/last.pt"
    cmd = [
        sys.executable,
        "-m",
        "ddp_template.optional.gpt.sample",
        str(ckpt),
        "--prompt",
        "The old",
    ]
    proc = subprocess.run([*cmd, "--tokens", "40"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The old") and len(proc.stdout.rstrip("\n")) >= 40


@pytest.mark.slow
def test_two_ranks_batch_8_equal_one_process_batch_16_on_843_windows(lm, tmp_path: Path) -> None:
    """sampler=exact on an odd window count: the ranks hold 422 and 421, so rank 0's last
    micro-batch has 6 windows and rank 1's 5; the weights match 1 process x 16."""
    _, data = lm
    launch(tmp_path, data, "ranks", "dist.nproc=2", "epochs=1")
    launch(tmp_path, data, "one", "loader.batch_size=16", "epochs=1")
    a, b = (
        torch.load(tmp_path / f"outputs/{r}/checkpoints/last.pt", weights_only=True)
        for r in ("ranks", "one")
    )
    assert a["progress"]["step"] == b["progress"]["step"] == 53
    worst = max((a["model"][k].double() - b["model"][k].double()).abs().max() for k in a["model"])
    assert worst < 1e-5, worst


@pytest.mark.slow
def test_rank_killed_mid_epoch_resumes_bit_identical_and_at_three_ranks_reads_each_window_once(
    lm, tmp_path: Path
) -> None:
    """SIGKILL to rank 1 at step 70 (epoch 1's 17th): resumed at 2 ranks, the 2-rank run's
    weights and optimizer state bit for bit; the same checkpoint resumed at 3 ranks finishes,
    and replay lists every window of epoch 1 exactly once."""
    out, data = lm
    kill = ["fault.crash_at_step=70", "fault.rank=1", "fault.signal=SIGKILL"]
    proc = launch(tmp_path, data, "cut", "dist.nproc=2", *kill, check=False)
    assert_killed_rank_reported(proc, rank=1, sig="SIGKILL")
    shutil.copytree(tmp_path / "outputs/cut", tmp_path / "outputs/three")
    progress = torch.load(tmp_path / "outputs/cut/checkpoints/last.pt", weights_only=True)
    assert (progress["progress"]["step"], progress["progress"]["epoch"]) == (69, 1)
    proc = launch(tmp_path, data, "cut", "dist.nproc=2")
    assert "resumed from" in proc.stdout
    ref = torch.load(out / "outputs/two/checkpoints/last.pt", weights_only=True)
    resumed = torch.load(tmp_path / "outputs/cut/checkpoints/last.pt", weights_only=True)
    assert ref["progress"]["step"] == resumed["progress"]["step"] == 106
    assert_identical(ref["model"], resumed["model"])
    assert_identical(ref["optimizer"]["state"][0], resumed["optimizer"]["state"][0])
    launch(tmp_path, data, "three", "dist.nproc=3", "elastic.global_batch=scale")
    run_dir = tmp_path / "outputs" / "three"
    assert [ok for ok, _ in report_rows(run_dir)] == [1, 1]
    seen = replayed_epoch(run_dir, epoch=1)
    assert len(seen) == WINDOWS and set(seen.values()) == {1}


def test_a_broken_token_file_is_refused_without_touching_the_run(lm, tmp_path: Path) -> None:
    """The run 'two' launched again on a token file cut short: exit 2, one sentence naming the
    file and the fix, its checkpoint and summary as they were."""
    out, data = lm
    broken = tmp_path / "broken"
    shutil.copytree(data, broken)
    with (broken / "train.bin").open("r+b") as f:
        f.truncate(27_000 * 2 - 1)
    run_dir = out / "outputs" / "two"
    before = {
        p: p.read_bytes() for p in (run_dir / "checkpoints/last.pt", run_dir / "summary.json")
    }
    cmd = train_cmd(out, *lm_overrides(data), f"data.path={broken}", "dist.nproc=2")
    proc = run(cmd, env=run_env(RUN_ID="two"), check=False)
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr[-2000:]
    said = [line for line in proc.stdout.splitlines() if "ERROR" in line]
    assert said and "not a whole number of uint16 tokens" in said[0], proc.stdout[-2000:]
    assert str(broken / "train.bin") in said[0]
    assert all(p.read_bytes() == b for p, b in before.items())


def test_a_token_outside_the_vocabulary_stops_the_run_naming_its_window(lm, tmp_path: Path):
    """Id 300 written at offset 5000 of a byte-level file: the rank whose loader worker reads
    window 156 stops the run with exit 2 and one sentence naming the file, the window and the
    fix (the worker's traceback taken back out of it)."""
    _, data = lm
    bad = tmp_path / "bad"
    shutil.copytree(data, bad)
    ids = np.fromfile(bad / "train.bin", dtype="<u2")
    ids[5000] = 300
    ids.tofile(bad / "train.bin")
    proc = launch(tmp_path, bad, "bad", "dist.nproc=2", "loader.num_workers=1", check=False)
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stdout[-3000:]
    said = [line for line in proc.stdout.splitlines() if "ERROR" in line and "token id" in line]
    assert said and "token id 300 at offset 5000 (window 156, train.bin[4992:5025])" in said[0]
    assert str(bad / "train.bin") in said[0] and "rewrite it" in said[0]
    assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
