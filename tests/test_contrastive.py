"""task=contrastive: NT-Xent over the global batch, exact at any world size.

In-process: the views are a function of (seed, epoch, index, view); the loss masks a padded
duplicate (against a brute-force reference that leaves every row of the anchor's dataset index
out, which the loss without its mask fails). Spawned gloo ranks: N=11 at W=2 under
``sampler=padded`` (a duplicate across the ranks), each rank's loss over the global batch
gathered with its gradients, the ranks' averaged gradient equal to one process's on the joined
batch; the evaluation at 2 and 3 ranks equal to one process's. Real train.py runs on 101 digits,
``sampler=exact`` (rank 1's last micro-batch empty): 2 ranks x 10 end with the weights of 1
process x 20; ``replay --losses`` gives each sample's contribution against the global batch
(each rank's mean is the loss it logged); a SIGKILL mid-run resumes bit-identically.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers import (
    cpu_rank,
    free_port,
    join_gloo,
    jsonl,
    last_checkpoint,
    run,
    run_env,
    save_gathered,
    train_cmd,
)
from test_resume import assert_identical

from ddp_template import replay, spike
from ddp_template.config.schema import LoaderConfig
from ddp_template.data.builtin import digits
from ddp_template.data.contract import IndexedTensors, Splits
from ddp_template.data.loader import build_eval_loader
from ddp_template.data.samplers import ShareSampler
from ddp_template.data.transforms import sample_seed
from ddp_template.evaluation import evaluate
from ddp_template.models import contrastive
from ddp_template.tasks.contrastive import Contrastive, Views

TAU = 0.5
LOADER = LoaderConfig(eval_batch_size=8, num_workers=0)


def small_digits(n_train: int = 11, n_test: int = 40) -> Splits:
    s = digits()
    train, test = s.train, s.test
    assert isinstance(train, IndexedTensors) and isinstance(test, IndexedTensors)
    return Splits(
        IndexedTensors(train.x[:n_train], train.y[:n_train]),
        IndexedTensors(test.x[:n_test], test.y[:n_test]),
        s.info,
    )


def make_task(splits: Splits) -> tuple[Contrastive, Splits]:
    task = Contrastive(temperature=TAU)
    task.setup(splits.info, torch.device("cpu"))
    return task, task.training_data(splits, seed=0)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return contrastive(1, 8, features=8, projection=4, width=4, depth=1)


def batch(train: Any, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    items = [train[i] for i in indices]
    return torch.stack([x for x, _, _ in items]), torch.stack([y for _, y, _ in items])


def deal(world: int) -> list[list[int]]:
    return [list(ShareSampler(range(11), world, r, mode="padded")) for r in range(world)]


# ------------------------------------------------------------------------- in-process
def test_views_are_seeded_by_seed_epoch_index_and_view() -> None:
    _, splits = make_task(small_digits())
    views = splits.train
    assert isinstance(views, Views)
    x, y, index = views[3]
    assert x.shape == (2, 1, 8, 8) and y.tolist() == [3, int(small_digits().train[3][1])]
    assert not torch.equal(x[0], x[1])  # two different views of one sample
    assert torch.equal(views[3][0], x)  # ... drawn again alike (any rank, worker, resume)
    views.set_epoch(1)
    assert not torch.equal(views[3][0], x)  # another epoch, other views
    assert sample_seed(0, 1, 3, view=0) != sample_seed(0, 1, 3, view=1) != sample_seed(0, 1, 3)


def brute_force(z: torch.Tensor, ids: list[int], tau: float, mask: bool = True) -> torch.Tensor:
    """Each sample's loss, one anchor at a time: its other view over every row but itself
    (and, with ``mask``, but every row of its dataset index: a padded duplicate)."""
    z = F.normalize(z, dim=-1)
    out = []
    for i in range(len(z)):
        terms = []
        for v in range(2):
            pos = z[i, v] @ z[i, 1 - v] / tau
            rest = [
                z[i, v] @ z[j, u] / tau
                for j in range(len(z))
                for u in range(2)
                if (j, u) != (i, v) and (j, u) != (i, 1 - v) and not (mask and ids[j] == ids[i])
            ]
            terms.append(torch.logsumexp(torch.stack([pos, *rest]), 0) - pos)
        out.append(torch.stack(terms).mean())
    return torch.stack(out)


def test_a_padded_duplicate_is_never_its_own_negative() -> None:
    """N=11 at W=2, sampler=padded: the global batch of 12 holds one index twice; its copies
    are out of each other's softmax (a reference that dedups), which the unmasked loss is not."""
    task, splits = make_task(small_digits())
    joined = [i for rank in deal(2) for i in rank]
    assert len(joined) == 12 and len(set(joined)) == 11
    x, y = batch(splits.train, joined)
    with torch.no_grad():
        _, z = make_model()(x)
    got = task.sample_losses((None, z), y)
    torch.testing.assert_close(got, brute_force(z, joined, TAU), rtol=1e-5, atol=1e-6)
    unmasked = brute_force(z, joined, TAU, mask=False)
    dup = [k for k, i in enumerate(joined) if joined.count(i) == 2]
    assert (unmasked[dup] - got[dup]).abs().min() > 0.01  # the mask is what the test sees
    assert task.loss((None, z), y, "mean") == pytest.approx(float(got.mean()), rel=1e-6)


# ------------------------------------------------------------------------- spawned gloo ranks
def train_step(rank: int, world: int) -> dict[str, Any]:
    """One step of ``world`` ranks on their padded shares of N=11: the loss over the global
    batch (gathered with gradients) weighted as the engine weights it, the gradients averaged
    as DDP averages them."""
    task, splits = make_task(small_digits())
    model = make_model()
    mine = deal(world)[rank]
    x, y = batch(splits.train, mine)
    loss = task.loss(model(x), y, "mean")
    (loss * (len(mine) * world / 12)).backward()  # EpochSteps.weight: n_r W / N
    grads = []
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        grads.append(p.grad / world)
    if rank == 0:  # spike forensics on one rank alone: no collective, no hang
        spike.sample_losses(model, task, [(x, y, mine, None)], "off", torch.device("cpu"))
    return {"grads": grads, "loss": float(loss)}


def eval_values(rank: int, world: int) -> dict[str, Any]:
    task, splits = make_task(small_digits())
    info = cpu_rank(rank, world, "gloo" if world > 1 else None)
    loader = build_eval_loader(splits.test, LOADER, info)
    result = evaluate(make_model(), loader, info, "off", task)
    return {"values": result.values, "count": result.count}


def worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    join_gloo(rank, world, port, timeout_s=60)
    try:
        try:
            mine = {"eval": eval_values(rank, world)}
            if world == 2:
                mine |= train_step(rank, world)
        except Exception:
            (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
            raise
        save_gathered(mine, world, Path(out) / f"world{world}.pt")
    finally:
        dist.destroy_process_group()


def spawn(world: int, out: Path) -> list[dict[str, Any]]:
    try:
        # forked: the ranks start with torch imported (a spawned rank re-imports it, seconds)
        mp.start_processes(
            worker, args=(world, free_port(), str(out)), nprocs=world, start_method="fork"
        )
    except mp.ProcessRaisedException:
        errors = [p.read_text() for p in sorted(out.glob("rank*.err"))]
        raise AssertionError("each failed rank's error:\n" + "\n".join(errors)) from None
    return torch.load(out / f"world{world}.pt", weights_only=False)


def test_two_ranks_gather_with_gradients_and_evaluate_as_one_process(tmp_path: Path) -> None:
    task, splits = make_task(small_digits())
    model = make_model()
    joined = [i for rank in deal(2) for i in rank]  # rank order: as the gather joins them
    x, y = batch(splits.train, joined)
    whole = task.loss(model(x), y, "mean")
    whole.backward()
    whole = whole.detach()
    one_eval = eval_values(0, 1)
    ranks = spawn(2, tmp_path)
    for got, want in zip(ranks[0]["grads"], model.parameters(), strict=True):
        assert want.grad is not None
        torch.testing.assert_close(got, want.grad, rtol=1e-5, atol=1e-7)
    # each rank's loss is its own samples' mean contribution: together, the global loss
    assert (ranks[0]["loss"] + ranks[1]["loss"]) / 2 == pytest.approx(float(whole), rel=1e-5)
    assert one_eval["values"]["correct"] > 0 and one_eval["count"] == 40
    for world, ranks_eval in ((2, ranks), (3, spawn(3, tmp_path))):
        for r in ranks_eval:
            assert r["eval"] == one_eval, world


# ------------------------------------------------------------------------- real train.py runs
RUN = [
    "task=contrastive",
    "model=contrastive",
    "model.width=8",
    "model.depth=1",
    "sampler=exact",
    "epochs=1",
    "optim.schedule=none",
    "optim.lr=0.05",
    "log_every=1",
    "checkpoint.every_steps=1",
]


def launch(out: Path, data: Path, run_id: str, *overrides: str, check: bool = True):
    cmd = train_cmd(out, "data=array", f"data.path={data}", *RUN, *overrides)
    return run(cmd, env=run_env(RUN_ID=run_id), check=check)


@pytest.mark.slow
def test_two_ranks_equal_one_process_replay_and_a_killed_run_resumes(
    digits101: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    launch(tmp_path, digits101, "two", "dist.nproc=2", "loader.batch_size=10")
    launch(tmp_path, digits101, "one", "loader.batch_size=20")
    a, b = last_checkpoint(tmp_path, "two"), last_checkpoint(tmp_path, "one")
    assert a["progress"]["step"] == b["progress"]["step"] == 6
    delta = max(
        (a["model"][k].double() - b["model"][k].double()).abs().max().item() for k in a["model"]
    )
    assert delta < 1e-5, delta  # measured: 8e-8

    # kill -9 mid-run (rank 1, step 4 of 6), resume: the uninterrupted run's weights, bit for bit
    kill = ["fault.crash_at_step=4", "fault.rank=1", "fault.signal=SIGKILL"]
    two = ["dist.nproc=2", "loader.batch_size=10"]
    proc = launch(tmp_path, digits101, "chain", *two, *kill, check=False)
    assert proc.returncode != 0 and "SIGKILL" in proc.stderr, proc.stderr[-2000:]
    assert last_checkpoint(tmp_path, "chain")["progress"]["step"] == 3

    # replay --losses with the step-3 checkpoint: each sample's contribution at step 4 against
    # the step's global batch; a rank's mean is the loss that rank logged (its part of the
    # global loss) in the uninterrupted run
    chain = tmp_path / "outputs" / "chain"
    capsys.readouterr()
    replay.main(
        [str(chain), "--step", "4", "--losses", str(chain / "checkpoints/last.pt"), "--json"]
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["rank"] for row in rows] == [0, 1]
    for row in rows:
        logged = [
            r["train/loss"]
            for r in jsonl(tmp_path / "outputs" / "two" / f"rank{row['rank']}" / "metrics.jsonl")
            if r.get("step") == 4 and "train/loss" in r
        ]
        assert len(row["losses"]) == len(row["indices"]) == 10
        assert sum(row["losses"]) / 10 == pytest.approx(logged[0], rel=1e-5)

    proc = launch(tmp_path, digits101, "chain", *two)
    assert "resumed from" in proc.stdout
    resumed = last_checkpoint(tmp_path, "chain")
    assert resumed["progress"]["step"] == 6
    assert_identical(a["model"], resumed["model"])
    assert_identical(a["optimizer"]["state"][0], resumed["optimizer"]["state"][0])
