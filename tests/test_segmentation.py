"""task=segmentation data=shapes model=fcn: every epoch accounted for at 3 ranks, the final
evaluation at 3 and 2 ranks equal to one process's, a kill -9 resumed to the identical model,
and mean IoU from summed intersections and unions (averaging per-rank mIoUs would be wrong).

One uninterrupted 3-rank run is shared: the reference of the resume, the checkpoint the other
evaluations read, and its own final evaluation.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_killed_rank_reported, cpu_rank, jsonl, run, run_env, summary, train_cmd
from torch.utils.data import DataLoader

from ddp_template.data.builtin import shapes
from ddp_template.errors import ConfigError
from ddp_template.evaluation import evaluate
from ddp_template.models import fcn
from ddp_template.tasks.segmentation import Segmentation

# 97 training images on 3 ranks, batch 4: 33 per rank (padded), 9 steps per epoch; 37 test
# images evaluated in batches of 5: uneven shards (13, 12, 12 at 3 ranks; 19, 18 at 2).
DATA = ["data.size=97", "data.test_size=37", "loader.eval_batch_size=5"]
BASE = [
    "task=segmentation",
    "data=shapes",
    "model=fcn",
    *DATA,
    "loader.batch_size=4",
    "epochs=2",
    "checkpoint.every_steps=1",
]
STEPS = 18
KILL = ["fault.crash_at_step=13", "fault.rank=1", "fault.signal=SIGKILL"]  # mid epoch 1
COUNTS = ("count", "pixels", "correct_pixels", "per_class_intersection", "per_class_union")
FLOATS = ("miou", "pixel_accuracy", "loss")
# torchmetrics' mIoU beside the task's own, on the reference run only (it changes no weight).
JACCARD = [
    "+task.metrics.jaccard._target_=torchmetrics.classification.MulticlassJaccardIndex",
    "+task.metrics.jaccard.num_classes=3",
]


def launch(out: Path, run_id: str, *overrides: str, nproc: int = 3, check: bool = True):
    cmd = train_cmd(out, *BASE, f"dist.nproc={nproc}", *overrides)
    return run(cmd, env=run_env(RUN_ID=run_id), check=check, leftovers=10)


def checkpoint(out: Path, run_id: str) -> dict:
    return torch.load(out / "outputs" / run_id / "checkpoints" / "last.pt", weights_only=True)


def assert_same_evaluation(a: dict, b: dict) -> None:
    """Counts exactly, floats within 1e-6 relative (summary.json's eval_* keys)."""
    assert a["eval_split"] == b["eval_split"] == "test"
    for key in COUNTS:
        assert a[f"eval_{key}"] == b[f"eval_{key}"], key
    for key in FLOATS:
        assert a[f"eval_{key}"] == pytest.approx(b[f"eval_{key}"], rel=1e-6), key


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted 3-rank run: its summary, metrics rows and final checkpoint."""
    out = tmp_path_factory.mktemp("seg")
    launch(out, "ref", *JACCARD)
    run_dir = out / "outputs" / "ref"
    payload = checkpoint(out, "ref")
    assert payload["progress"]["step"] == STEPS and payload["progress"]["epoch"] == 2
    return {
        "out": out,
        "summary": summary(run_dir),
        "rows": jsonl(run_dir / "rank0" / "metrics.jsonl"),
        "model": payload["model"],
        "last": run_dir / "checkpoints" / "last.pt",
    }


def test_three_ranks_verdict_ok_every_epoch_and_evaluate_like_one_and_two(reference) -> None:
    """Every epoch's verdict is ok; the final evaluation at 3 ranks (the run's own) equals the
    checkpoint evaluated in this process (one rank, batches of 7) and at 2 ranks (epochs=0)."""
    verdicts = [r["shares/verdict_ok"] for r in reference["rows"] if "shares/verdict_ok" in r]
    assert verdicts == [1, 1]
    three = reference["summary"]
    assert three["world_size"] == 3 and three["eval_count"] == 37
    assert three["eval_pixels"] == 37 * 16 * 16
    # It learned: better than predicting the background everywhere, whose mIoU is below 1/3.
    assert three["eval_miou"] > 0.4, three
    # torchmetrics, updated with the same logits and masks and synced by itself, agrees (float32).
    assert three["eval_jaccard"] == pytest.approx(three["eval_miou"], rel=1e-6)

    splits = shapes(size=97, test_size=37)
    task = Segmentation()
    device = torch.device("cpu")
    task.setup(splits.info, device)
    model = fcn(num_classes=3, in_channels=1)
    model.load_state_dict(reference["model"])
    one = evaluate(model, DataLoader(splits.test, batch_size=7), cpu_rank(), "off", task)
    assert_same_evaluation(three, one.summary())

    out = reference["out"]
    launch(out, "two", "epochs=0", f"finetune.init_from={reference['last']}", nproc=2)
    two = summary(out / "outputs" / "two")
    assert two["world_size"] == 2
    assert_same_evaluation(three, two)


def test_kill_9_of_a_rank_mid_epoch_then_resume_gives_the_identical_model(
    reference, tmp_path: Path
) -> None:
    """Rank 1 SIGKILLed after step 13 (of 18), the run launched again: bit-identical weights,
    and every epoch's verdict ok."""
    proc = launch(tmp_path, "kill", *KILL, check=False)
    assert_killed_rank_reported(proc, rank=1, sig="SIGKILL")
    stopped = checkpoint(tmp_path, "kill")
    assert stopped["progress"]["epoch"] == 1 and 9 < stopped["progress"]["step"] < STEPS
    # Guard: where it stopped differs from the end, so "identical" means it trained on.
    assert any(not torch.equal(stopped["model"][k], v) for k, v in reference["model"].items())

    proc = launch(tmp_path, "kill")
    assert "resumed from" in proc.stdout, proc.stdout[-3000:]
    resumed = checkpoint(tmp_path, "kill")
    assert resumed["progress"]["step"] == STEPS
    assert resumed["model"].keys() == reference["model"].keys()
    different = [
        k for k, v in reference["model"].items() if not torch.equal(resumed["model"][k], v)
    ]
    assert not different, f"tensors differ after resume: {different}"
    # Epoch 0's report is the killed launch's, epoch 1's the resumed one's: what the latter
    # trained on is the rest of the epoch after the checkpoint's position (99 padded samples).
    rows = jsonl(tmp_path / "outputs" / "kill" / "rank0" / "metrics.jsonl")
    report = [r for r in rows if "shares/verdict_ok" in r]
    assert [(r["step"], r["shares/verdict_ok"]) for r in report] == [(9, 1), (STEPS, 1)], report
    rest = 99 - 3 * stopped["progress"]["position"]
    assert [r["shares/total_samples"] for r in report] == [99, rest], report


def _logits(pred: list[list[int]], num_classes: int = 3) -> torch.Tensor:
    """``(B, C, 1, W)`` logits whose argmax is ``pred`` (B rows of W pixels)."""
    return F.one_hot(torch.tensor(pred), num_classes).permute(0, 2, 1).unsqueeze(2).float()


def test_miou_from_summed_intersections_and_unions_is_one_process_not_the_ranks_mean() -> None:
    """Two "ranks" each evaluate half the images; their sums added (the all-reduce) give one
    process's mIoU exactly, 4/9 here, while the mean of the halves' own mIoUs is 11/24: a rank
    that never sees a class averages over fewer classes, so per-rank results cannot be
    averaged."""
    task = Segmentation()
    task.setup(shapes(size=1, test_size=1).info, torch.device("cpu"))
    # Half a: class 0 IoU 2/3, class 1 IoU 1/2, no class 2. Half b: classes 0 and 2 at 1/3 each.
    halves = {
        "a": (_logits([[0, 0, 1, 0]]), torch.tensor([[[0, 0, 1, 1]]])),
        "b": (_logits([[2, 0, 0, 0]]), torch.tensor([[[2, 2, 2, 0]]])),
    }
    sums = {}
    for name, (output, y) in halves.items():
        sums[name] = task.sums(torch.device("cpu"))
        task.update(sums[name], output, y)
    whole = task.sums(torch.device("cpu"))
    task.update(
        whole,
        torch.cat([o for o, _ in halves.values()]),
        torch.cat([y for _, y in halves.values()]),
    )

    one, reduced = task.result(whole), task.result(sums["a"] + sums["b"])
    a, b = task.result(sums["a"]), task.result(sums["b"])
    assert (a.values["miou"], b.values["miou"]) == pytest.approx((7 / 12, 1 / 3))
    assert one.values["miou"] == pytest.approx(4 / 9)
    assert reduced.values["miou"] == one.values["miou"]
    assert reduced.details["per_class_iou"] == one.details["per_class_iou"]
    assert reduced.count == one.count == 2 and reduced.details["pixels"] == 8
    assert reduced.values["pixel_accuracy"] == one.values["pixel_accuracy"] == 5 / 8
    assert reduced.values["loss"] == pytest.approx(one.values["loss"], rel=1e-12)
    mean_of_ranks = (a.values["miou"] + b.values["miou"]) / 2
    assert mean_of_ranks == pytest.approx(11 / 24) and mean_of_ranks != pytest.approx(4 / 9)


def test_the_loss_is_the_mean_over_samples_and_an_empty_batch_sums_to_zero() -> None:
    """ "mean" over a batch of 2 images is the mean of their own per-image losses (what the
    engine's per-sample weights assume); "sum" of an empty micro-batch is 0 and still reaches
    the model's weights (DDP's all-reduce runs on it)."""
    task = Segmentation()
    task.setup(shapes(size=1, test_size=1).info, torch.device("cpu"))
    output = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 3, (2, 4, 4), generator=torch.Generator().manual_seed(1))
    each = [task.loss(output[i : i + 1], y[i : i + 1], "mean") for i in range(2)]
    assert task.loss(output, y, "mean") == pytest.approx(float(sum(each) / 2), rel=1e-6)
    assert task.loss(output, y, "sum") == pytest.approx(float(sum(each)), rel=1e-6)
    model = fcn(num_classes=3, in_channels=1, width=4, depth=1)
    empty = task.loss(model(torch.zeros(0, 1, 4, 4)), torch.zeros(0, 4, 4, dtype=torch.long), "sum")
    empty.backward()
    assert empty.item() == 0.0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_shapes_are_deterministic_masks_of_every_class() -> None:
    """data=shapes: the same seed gives the same images, int64 masks holding the background and
    every shape class, a test split other than the training one; too few classes refused."""
    a, b = shapes(size=40, test_size=10, seed=3), shapes(size=40, test_size=10, seed=3)
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.y, b.test.y)
    x, y, i = a.train[5]
    assert x.shape == (1, 16, 16) and y.shape == (16, 16) and y.dtype == torch.int64 and i == 5
    assert a.train.y.unique().tolist() == [0, 1, 2]
    assert not torch.equal(a.train.y[:10], a.test.y)
    assert not torch.equal(shapes(size=40, test_size=10, seed=4).train.x, a.train.x)
    with pytest.raises(ConfigError, match="data.num_classes=1 must be at least 2"):
        shapes(num_classes=1)
