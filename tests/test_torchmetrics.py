"""torchmetrics in a task (the task YAML's ``metrics:``), exact across ranks.

The metrics run on the template's unpadded contiguous evaluation shards and torchmetrics syncs
their states, so 3 gloo ranks report what 1 process does: a metric with sum states
(``MulticlassAccuracy``: tp/fp/tn/fn counts) and two with concatenated states (``MulticlassAUROC``,
``MulticlassAveragePrecision`` with ``thresholds=None``: every prediction kept), on N = 101
samples (shards of 33, 34, 34 in ragged batches of 8) and on N = 2 (rank 0's shard is empty: it
still runs one empty batch, so its concatenated states hold a zero-length tensor to sync like the
others', while its sum states sync their zeros: accuracy's update refuses an empty batch). One
3-rank spawn runs both cases; the reference is 1 process in the test's own. Then train.py from
the command line: ``+task.metrics={auroc: {...}}`` logs ``test/auroc`` per epoch and in
summary.json.
"""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import (
    cpu_rank,
    free_port,
    join_gloo,
    jsonl,
    run,
    run_dirs,
    save_gathered,
    summary,
    train_cmd,
)
from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassAUROC,
    MulticlassAveragePrecision,
)
from torchmetrics.functional.classification import multiclass_auroc

from ddp_template.config.schema import LoaderConfig
from ddp_template.data.contract import DataInfo, IndexedTensors
from ddp_template.data.loader import build_eval_loader
from ddp_template.evaluation import evaluate
from ddp_template.tasks.classification import Classification

CLASSES, FEATURES, WORLD = 10, 12, 3
SIZES = {"n101": 101, "n2": 2}  # N = 101 at 3 ranks: 33/34/34; N = 2: shards 0/1/1 (N < W)
LOADER = LoaderConfig(eval_batch_size=8, num_workers=0)


def make_task() -> Classification:
    return Classification(
        metrics={
            "macc": MulticlassAccuracy(num_classes=CLASSES),  # sum states, macro average
            "auroc": MulticlassAUROC(num_classes=CLASSES, thresholds=None),  # concatenated
            "ap": MulticlassAveragePrecision(num_classes=CLASSES, thresholds=None),  # concat.
        }
    )


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, CLASSES)


def make_data(n: int) -> IndexedTensors:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, FEATURES, generator=gen)
    y = torch.randperm(n, generator=gen) % CLASSES  # N = 101: every class present
    return IndexedTensors(x, y)


def evaluate_all(info) -> dict[str, Any]:
    """Each case on this rank: its shard's size, the result's values and count."""
    model, out = make_model(), {}
    for case, n in SIZES.items():
        task = make_task()
        task.setup(DataInfo(num_classes=CLASSES), info.device)
        loader = build_eval_loader(make_data(n), LOADER, info)
        with warnings.catch_warnings():  # N = 2: most classes have no positive sample
            warnings.simplefilter("ignore")
            result = evaluate(model, loader, info, "off", task)
        out[case] = {"shard": len(loader.sampler), "values": result.values, "count": result.count}
    return out


def worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    join_gloo(rank, world, port, timeout_s=60)
    try:
        try:
            mine = evaluate_all(cpu_rank(rank, world, backend="gloo"))
        except Exception:  # mp.spawn reports one rank's: often a peer's failed collective
            (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
            raise
        save_gathered(mine, world, Path(out) / "ranks.pt")
    finally:
        dist.destroy_process_group()


def test_torchmetrics_at_3_ranks_equal_1_process_also_with_an_empty_shard(tmp_path: Path) -> None:
    one = evaluate_all(cpu_rank(0, 1))
    # The 1-process reference is itself right: torchmetrics' functional AUROC over all samples.
    for case, n in SIZES.items():
        data = make_data(n)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logits = make_model()(data.x)
            auroc = float(multiclass_auroc(logits, data.y, CLASSES, thresholds=None))
        assert one[case]["values"]["auroc"] == pytest.approx(auroc, rel=1e-6), case
        assert one[case]["count"] == n
    try:
        mp.spawn(worker, args=(WORLD, free_port(), str(tmp_path)), nprocs=WORLD)
    except mp.ProcessRaisedException:
        errors = [p.read_text() for p in sorted(tmp_path.glob("rank*.err"))]
        errors.sort(key=lambda text: "gloo" in text.splitlines()[-1])  # the cause first
        raise AssertionError("each failed rank's error:\n" + "\n".join(errors)) from None
    ranks = torch.load(tmp_path / "ranks.pt", weights_only=False)
    assert [r["n101"]["shard"] for r in ranks] == [33, 34, 34]
    assert [r["n2"]["shard"] for r in ranks] == [0, 1, 1]  # rank 0 evaluates no sample
    for case in SIZES:
        ref = one[case]
        for rank, got in enumerate(r[case] for r in ranks):
            where = f"{case}, rank {rank}"
            assert got["count"] == ref["count"], where
            assert got["values"]["correct"] == ref["values"]["correct"], where  # exactly
            assert got["values"]["accuracy"] == ref["values"]["accuracy"], where
            assert set(got["values"]) == set(ref["values"]), where
            for name in ("loss", "macc", "auroc", "ap"):
                assert got["values"][name] == pytest.approx(ref["values"][name], rel=1e-6), (
                    f"{where}: {name} {got['values'][name]} != 1 process {ref['values'][name]}"
                )


def test_a_task_yaml_metric_from_the_command_line_is_logged(tmp_path: Path) -> None:
    """``+task.metrics={auroc: {_target_: ..., num_classes: 10}}`` at 2 ranks: ``test/auroc``
    in rank 0's metrics.jsonl each epoch and ``eval_auroc`` in summary.json; the sum-state
    metric (accuracy) agrees with the template's own."""
    metrics = (
        "+task.metrics={auroc: {_target_: torchmetrics.classification.MulticlassAUROC,"
        " num_classes: 10}, macc: {_target_: torchmetrics.classification.MulticlassAccuracy,"
        " num_classes: 10, average: micro}}"
    )
    run(train_cmd(tmp_path, "epochs=1", metrics, "dist.nproc=2"), timeout=300)
    (run_dir,) = run_dirs(tmp_path)
    rows = [row for row in jsonl(run_dir / "rank0" / "metrics.jsonl") if "test/auroc" in row]
    assert rows and 0.5 < rows[-1]["test/auroc"] <= 1.0, rows
    assert rows[-1]["test/macc"] == pytest.approx(rows[-1]["test/accuracy"], rel=1e-6)
    s = summary(run_dir)
    assert s["eval_auroc"] == pytest.approx(rows[-1]["test/auroc"], rel=1e-12), s
