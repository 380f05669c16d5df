"""Spike forensics: a poisoned sample at a known index is named by the rank that read it, at the
step it spikes, on 1, 2 and 3 ranks; skipped (every rank agreeing), it is named in the ledger's
verdict; replay reproduces its loss; a run killed after the spike resumes bit-identically (each
rank's window is checkpointed). A poisoned sample BatchNorm hides from the loss is named by its
input, each epoch, and the clean default job names nothing.

The poisoned data is ``data=diabetes`` with training sample ``poisoned.INDEX``'s features
multiplied by ``poisoned.SCALE``, and ``data=digits`` with sample ``poisoned.DIGIT``'s pixels
x100 and its label changed (tests/poisoned.py, data factories of the test's own)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import PY, ROOT, jsonl, run, run_env, summary, train_cmd
from poisoned import DIGIT, INDEX
from wandb_reader import find_runs

from ddp_template.checkpoint import load
from ddp_template.config.loop import SpikeConfig
from ddp_template.data.contract import DataInfo
from ddp_template.distributed import DistInfo
from ddp_template.spike import Spikes, sample_losses
from ddp_template.tasks.classification import Classification
from ddp_template.tasks.regression import Regression

POISONED = [
    "task=regression",
    "data=diabetes",
    "data._target_=poisoned.diabetes",
    "model=mlp",
    "epochs=2",
    "spike.after=1",
    "spike.skip=true",
]


def _env(name: str) -> dict[str, str]:
    return run_env(RUN_ID=name, PYTHONPATH=str(ROOT / "tests"))


def _spikes(run_dir: Path, world: int) -> list[list[dict]]:
    """Each recorded step's records, one per rank that recorded it (with its rank)."""
    steps: dict[int, list[dict]] = {}
    for r in range(world):
        for record in jsonl(run_dir / f"rank{r}" / "spikes.jsonl"):
            steps.setdefault(record["step"], []).append(record | {"rank": r})
    return [steps[s] for s in sorted(steps)]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The poisoned run on one rank: its run directory and what it said."""
    out = tmp_path_factory.mktemp("spike1")
    proc = run(train_cmd(out, *POISONED), env=_env("whole"))
    return out / "outputs" / "whole", proc.stdout + proc.stderr


@pytest.mark.parametrize("world", [1, 2])
def test_a_poisoned_sample_is_named_and_its_update_skipped(
    world: int, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Each epoch, the rank replay says read INDEX fires and names it first; every rank
    records its part of the step and skips its update, so training is sound; the verdict names
    the skipped samples and each rank's ledger counts them (data/spike_skipped)."""
    logged = ["logger=wandb", "logger.runs=main"] if world == 2 else []  # one W&B run
    if world == 1:
        run_dir, said = request.getfixturevalue("one_rank")
    else:
        overrides = [*POISONED, f"dist.nproc={world}", *logged]
        proc = run(train_cmd(tmp_path, *overrides), env=_env(f"spike{world}"))
        run_dir, said = tmp_path / "outputs" / f"spike{world}", proc.stdout + proc.stderr
    spikes = _spikes(run_dir, world)
    hits = subprocess.run(
        [PY, "-m", "ddp_template.replay", str(run_dir), "--index", str(INDEX), "--json"],
        cwd=ROOT,
        env=_env(run_dir.name),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    read = [json.loads(h) for h in hits]  # epoch 0 and epoch 1
    assert [(h["epoch"], h["step"]) for h in read] == [
        (r[0]["epoch"], r[0]["step"]) for r in spikes
    ]
    for records, hit in zip(spikes, read, strict=True):
        assert len(records) == world and all(r["skipped"] for r in records)  # agreed: all
        # the rank that read the poison: its loss fired (the gradient norm, averaged over the
        # ranks by DDP, may fire on every rank)
        (fired,) = [r for r in records if "loss" in r["signals"]]
        assert all(r["signals"] in ([], ["grad_norm"]) for r in records if r is not fired)
        assert fired["rank"] == hit["rank"] and fired["samples"][0]["index"] == INDEX
        assert fired["loss"] > 10 * fired["median"]
        assert fired["samples"][0]["loss"] > 100 * fired["median"]
        assert sum(len(r["samples"]) for r in records) == 32 * world  # the whole step
    assert f"highest per-sample losses: index {INDEX} (rank " in said
    verdicts = [line for line in said.splitlines() if "verdict ok; step " in line]
    assert len(verdicts) == 2 and all("skipped by the spike rule" in v for v in verdicts), said
    skipped = [
        r["data/spike_skipped"]
        for k in range(world)
        for r in jsonl(run_dir / f"rank{k}" / "metrics.jsonl")
        if "data/spike_skipped" in r
    ]
    assert skipped == [32] * (2 * world)
    assert summary(run_dir)["eval_r2"] > 0.3  # the poison never reached the weights
    if logged:  # rank 0's W&B run holds every rank's spike samples, gathered each epoch
        (wb,) = find_runs(run_dir)
        paths = [row["spikes/samples.path"] for row in wb.history if "spikes/samples.path" in row]
        assert len(paths) == 2, paths
        for path, hit in zip(paths, read, strict=True):
            table = json.loads((wb.path.parent / "files" / path).read_text())
            rows = [dict(zip(table["columns"], v, strict=True)) for v in table["data"]]
            assert len(rows) == 32 * world and (rows[0]["rank"], rows[0]["index"]) == (
                hit["rank"],
                INDEX,
            )


def test_replay_reproduces_the_losses_and_a_killed_run_resumes_bit_identically(
    one_rank: tuple[Path, str], tmp_path: Path
) -> None:
    """One rank: the uninterrupted run's first spike at step S; the same run checkpointed every
    step and killed at S (after its spike was judged): replay --step S --losses of its
    checkpoint of step S-1 gives the spike's per-sample losses; resumed, it ends with the
    uninterrupted run's weights, its second spike and both verdict notes."""
    whole, _ = one_rank
    (first,) = _spikes(whole, 1)[0]
    step = first["step"]
    cut = ["checkpoint.every_steps=1", f"fault.crash_at_step={step}"]
    killed = run(train_cmd(tmp_path, *POISONED, *cut), env=_env("cut"), check=False)
    assert killed.returncode != 0
    run_dir = tmp_path / "outputs" / "cut"
    assert load(run_dir / "checkpoints" / "last.pt")["progress"]["step"] == step - 1
    replayed = subprocess.run(
        [
            PY,
            "-m",
            "ddp_template.replay",
            str(whole),
            "--step",
            str(step),
            "--json",
            "--losses",
            str(run_dir / "checkpoints" / "last.pt"),
        ],
        cwd=ROOT,
        env=_env("cut"),
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"the step before: the weights step {step} ran with" in replayed.stderr
    row = json.loads(replayed.stdout.splitlines()[0])
    losses = dict(zip(row["indices"], row["losses"], strict=True))
    recorded = {s["index"]: s["loss"] for s in first["samples"]}
    assert losses.keys() == recorded.keys()
    assert all(math.isclose(losses[i], recorded[i], rel_tol=1e-6) for i in recorded)
    run(train_cmd(tmp_path, *POISONED, "checkpoint.every_steps=1"), env=_env("cut"))
    ends = [load(d / "checkpoints" / "last.pt")["model"] for d in (whole, run_dir)]
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])
    assert [s[0]["step"] for s in _spikes(run_dir, 1)] == [s[0]["step"] for s in _spikes(whole, 1)]


def _replay(run_dir: Path, *args: str) -> list[dict]:
    out = subprocess.run(
        [PY, "-m", "ddp_template.replay", str(run_dir), *args, "--json"],
        cwd=ROOT,
        env=_env(run_dir.name),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines()]


@pytest.mark.parametrize("world", [2])  # 1 and 3 ranks: the loss rule's test above
def test_a_poisoned_sample_batchnorm_hides_from_the_loss_is_named_by_its_input(
    world: int, tmp_path: Path
) -> None:
    """The default job's model (small_cnn, BatchNorm) on digits with sample DIGIT's pixels x100
    and its label changed: its step's loss barely moves (BatchNorm normalises the batch), its
    input does. Each epoch the rank replay says read it names it first, at that step, by its
    input RMS (replay --inputs gives the same); no other record names it. At 2 ranks the clean
    data, alongside: nothing fires."""
    poisoned = ["data._target_=poisoned.digits", "epochs=2", f"dist.nproc={world}"]
    run(train_cmd(tmp_path, *poisoned), env=_env(f"digits{world}"))
    run_dir = tmp_path / "outputs" / f"digits{world}"
    named = sorted(
        (record["epoch"], record["step"], r, record)
        for r in range(world)
        if (run_dir / f"rank{r}" / "spikes.jsonl").exists()
        for record in jsonl(run_dir / f"rank{r}" / "spikes.jsonl")
        if DIGIT in [s["index"] for s in record["samples"]]
    )
    read = _replay(run_dir, "--index", str(DIGIT))
    assert [(h["epoch"], h["step"], h["rank"]) for h in read] == [n[:3] for n in named]
    assert len(read) == 2  # once per epoch
    for _, step, rank, record in named:
        assert "input" in record["signals"] and record["by"] == "input"
        first = record["samples"][0]
        assert (
            first["index"] == DIGIT and first["input"] > 10 * record["measured"]["input"]["median"]
        )
        assert record["loss"] < 10 * record["median"]  # the loss rule alone would miss it
        (row,) = [r for r in _replay(run_dir, "--step", str(step), "--inputs") if r["rank"] == rank]
        inputs = dict(zip(row["indices"], row["inputs"], strict=True))
        assert math.isclose(inputs[DIGIT], first["input"], rel_tol=1e-5)
    if world == 2:
        run(train_cmd(tmp_path, "epochs=2", "dist.nproc=2"), env=_env("clean"))
        assert not list((tmp_path / "outputs" / "clean").glob("rank*/spikes.jsonl"))


# ----------------------------------------------------------------------------- the rule alone
def _alone() -> DistInfo:
    return DistInfo(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        backend=None,
        device=torch.device("cpu"),
        host="test",
    )


def _regression(outputs: int) -> Regression:
    task = Regression()
    task.setup(DataInfo(out_features=outputs), torch.device("cpu"))
    return task


def _step(spikes: Spikes, loss: float, step: int, module: torch.nn.Module) -> bool:
    x, y = torch.ones(2, 1), torch.zeros(2, 1)
    spikes.hold(x, y, torch.tensor([2 * step, 2 * step + 1]), module)
    spikes.count(torch.tensor(loss), 2)
    return spikes.judge(module, step, 0)


def test_the_rule_waits_for_its_window_takes_the_median_and_always_fires_on_nan() -> None:
    module = torch.nn.Linear(1, 1)
    cfg = SpikeConfig(factor=3.0, window=4, after=2, skip=True)
    spikes = Spikes(cfg=cfg, task=_regression(1), info=_alone(), amp_mode="off")
    assert not _step(spikes, 100.0, 1, module)  # nothing to compare with yet
    assert not _step(spikes, 1.0, 2, module)
    assert _step(spikes, 200.0, 3, module)  # > 3 x median(100, 1) = 151.5
    assert [r.step for r in spikes.take()] == [3] and spikes.take() == []
    for k, loss in enumerate([1.0, 1.0, 1.0], start=4):
        assert not _step(spikes, loss, k, module)
    assert list(spikes.recent) == [200.0, 1.0, 1.0, 1.0]  # the window's last 4
    assert _step(spikes, math.nan, 7, module) and _step(spikes, math.inf, 8, module)
    assert list(spikes.recent) == [200.0, 1.0, 1.0, 1.0]  # never the reference
    saved = spikes.state_dict()
    again = Spikes(cfg=cfg, task=_regression(1), info=_alone(), amp_mode="off")
    again.load_state_dict(saved)
    assert list(again.recent) == list(spikes.recent) and again.skips == spikes.skips
    assert again.notes(0)[0].startswith("step 3: the update of 2 samples skipped")
    again.load_resized([saved], world_size=2)  # another world size: a fresh window
    assert not again.recent and again.skips == spikes.skips
    recording = Spikes(
        cfg=SpikeConfig(factor=3.0, after=1), task=_regression(1), info=_alone(), amp_mode="off"
    )
    assert not _step(recording, 1.0, 1, module) and not _step(recording, 9.0, 2, module)
    (report,) = recording.take()  # recorded, the update kept (spike.skip=false)
    assert (report.step, report.fired, report.skipped, report.rank) == (2, True, False, 0)
    assert [s.index for s in report.samples] == [4, 5] and not recording.notes(0)


def test_sample_losses_are_the_forward_s_own_and_leave_the_model_and_rng_as_they_were() -> None:
    """Train mode with dropout and BatchNorm: the per-sample losses equal the training
    forward's (same RNG state, same batch statistics); running statistics and the RNG after
    are untouched."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3)
    )
    task = Classification()
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    rng = (torch.get_rng_state(), None)
    expected = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
    stats = [b.clone() for b in model.buffers()]
    after = torch.get_rng_state()
    index, losses = sample_losses(model, task, [(x, y, list(range(6)), rng)], "off", "cpu")
    assert index.tolist() == list(range(6))
    assert torch.allclose(torch.from_numpy(losses), expected.detach(), rtol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(stats, model.buffers(), strict=True))
    assert torch.equal(torch.get_rng_state(), after)


def test_a_task_s_default_sample_losses_are_each_sample_s_loss_alone() -> None:
    """``Task.sample_losses`` (each sample alone) agrees with the vectorised override."""
    task = Classification()
    out, y = torch.randn(5, 4), torch.randint(0, 4, (5,))
    generic = super(Classification, task).sample_losses(out, y)
    assert torch.allclose(generic, task.sample_losses(out, y), rtol=1e-6)
    regression = _regression(2)
    pred, target = torch.randn(3, 2), torch.randn(3, 2)
    assert torch.allclose(
        regression.sample_losses(pred, target), (pred - target).square().mean(dim=1), rtol=1e-6
    )


def test_with_syncbn_a_spike_on_one_rank_reruns_its_step_on_every_rank(tmp_path: Path) -> None:
    """SyncBN's forward is a collective: a step one rank's rule catches re-runs on every rank
    (they judge together), so nobody waits alone; each rank records its part of the step."""
    rule = ["spike.factor=1.01", "spike.window=3", "spike.after=3"]  # fires on noise
    run(train_cmd(tmp_path, "dist.nproc=2", "syncbn=on", "epochs=1", *rule), env=_env("sync"))
    records = [jsonl(tmp_path / "outputs" / "sync" / f"rank{r}" / "spikes.jsonl") for r in (0, 1)]
    steps = [[r["step"] for r in mine] for mine in records]
    assert steps[0] and steps[0] == steps[1]
    fired = [[r["fired"] for r in mine] for mine in records]
    assert all(a or b for a, b in zip(*fired, strict=True))
    assert any(a != b for a, b in zip(*fired, strict=True))  # one rank's rule alone
    assert all(r["samples"] for mine in records for r in mine)  # each rank its own part
