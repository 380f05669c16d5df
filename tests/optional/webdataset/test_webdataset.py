"""data=webdataset: tar shards, every (rank, worker)'s samples accounted for.

Seven shards of deliberately uneven sizes (3 … 17 samples, 61 in all: a prime) are read by 2
ranks x 2 loader workers. The plan, the ledger, the verdict and the mutations (the bugs sharded
loaders are known for) are checked in-process; three real launches (a reference, a SIGKILL
and its resume) prove what only a run can: the run finishes with equal steps on every rank,
each epoch reads every sample exactly once plus only the named pads, and a kill -9 mid-epoch
resumes to bit-identical weights with a joined ledger equal to the uninterrupted one. One
fork-started launch shows a mutation ends in a loud SHARE MISMATCH, not a hang.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, assert_killed_rank_reported, jsonl, run, run_env, train_cmd

from ddp_template.engine import EpochStats
from ddp_template.errors import EXIT_CONFIG_ERROR, ConfigError
from ddp_template.ledger.records import EpochReport
from ddp_template.ledger.tally import IndexTally, fingerprint_hex, fingerprint_sum
from ddp_template.ledger.verify import epoch_metrics, epoch_report, own_check
from ddp_template.optional.webdataset.index import ShardIndex
from ddp_template.optional.webdataset.plan import PlanSampler, ShardOrder
from ddp_template.optional.webdataset.reader import PlanReader, ShardSamples
from ddp_template.optional.webdataset.splits import webdataset

SIZES = (17, 3, 11, 5, 13, 7, 5)  # 61 samples: prime, so no world size divides it
N = sum(SIZES)
W, K, B = 2, 2, 4  # ranks, loader workers per rank, batch size


def write_shards(folder: Path, sizes=SIZES, name: str = "train", classes: int = 3) -> str:
    """Shards ``<name>-00000{s}.tar`` of 8x8 grayscale PNGs whose brightness tells the class;
    sample i (global, url order) has key ``{i:08d}`` and label ``i % classes``."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    i = 0
    for s, size in enumerate(sizes):
        with tarfile.open(folder / f"{name}-{s:06d}.tar", "w") as tar:
            for _ in range(size):
                label = i % classes
                rng = np.random.default_rng(i)
                pixels = np.clip(rng.normal(60 + 70 * label, 25, (8, 8)), 0, 255).astype(np.uint8)
                png = io.BytesIO()
                Image.fromarray(pixels).save(png, "png")
                for ext, payload in (("png", png.getvalue()), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"{i:08d}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
                i += 1
    return str(folder / f"{name}-{{000000..{len(sizes) - 1:06d}}}.tar")


def samplers(
    mode: str = "padded",
    seed: int = 0,
    block: int = 4,
    world: int = W,
    batch: int = B,
    workers: int = K,
) -> list[PlanSampler]:
    stream = ShardOrder(sizes=SIZES, seed=seed, shuffle=mode != "sequential", block=block)
    return [
        PlanSampler(
            stream, num_replicas=world, rank=r, mode=mode, batch_size=batch, workers=workers
        )
        for r in range(world)
    ]


def round_robin(per_worker: list[np.ndarray], batch: int = B) -> list[np.ndarray]:
    """The batches a DataLoader hands out: one from each worker in turn, in worker order."""
    batches = [[w[i : i + batch] for i in range(0, len(w), batch)] for w in per_worker]
    out = []
    while any(batches):
        out += [b.pop(0) for b in batches if b]
    return out


def epoch_verdict(ss: list[PlanSampler], epoch: int, start: int, reads) -> EpochReport:
    """Rank 0's report on one epoch in which loader worker w of rank r read
    ``reads(sampler, rank, w)`` (the plan's own range when ``reads`` is the plan's)."""
    rows = []
    for r, s in enumerate(ss):
        s.set_epoch(epoch)
        tally = IndexTally(workers=K, first_worker=s.worker_at(start))
        for batch in round_robin([reads(s, r, w) for w in range(K)])[
            : -(-(s.num_samples - start) // B)
        ]:
            tally.add(batch)
        stats = EpochStats(tally, steps=1, wall_s=1.0)
        metrics = epoch_metrics(stats, s, start, epoch)
        rows.append(own_check(stats, s, start, metrics, rank=r))
    return epoch_report(ss[0], rows)


def planned(s: PlanSampler, r: int, w: int, start: int = 0, epoch: int | None = None):
    epoch = s.epoch if epoch is None else epoch
    return s.worker_indices(r, s.loader_worker(w, start), start, epoch)


# ----------------------------------------------------------------------------- the plan
@pytest.mark.parametrize("mode", ["padded", "drop_last", "exact", "sequential"])
@pytest.mark.parametrize("world,batch,workers", [(2, 4, 2), (3, 3, 3), (2, 2, 4), (5, 5, 1)])
def test_the_plan_deals_every_sample_once_in_disjoint_contiguous_worker_ranges(
    mode, world, batch, workers
) -> None:
    ss = samplers(mode, world=world, batch=batch, workers=workers)
    for epoch in (0, 1):
        for s in ss:
            s.set_epoch(epoch)
        order, blocks = ss[0].order(epoch), ss[0].shard_order.blocks(epoch)
        for (shard, lo, n), at in zip(blocks, np.cumsum(blocks[:, 2]) - blocks[:, 2], strict=True):
            first = sum(SIZES[:shard]) + lo  # a block: its shard's samples lo..lo+n-1, shuffled
            assert sorted(order[at : at + n]) == list(range(first, first + n))
        lengths = [s.num_samples for s in ss]
        assert max(lengths) - min(lengths) <= (1 if mode == "exact" else 0)
        ranges = sorted(s.worker_slots(r, k, 0) for r, s in enumerate(ss) for k in range(workers))
        ranges = [r for r in ranges if r[0] < r[1]]
        assert ranges[0][0] == 0 and all(
            a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)
        )
        assert ranges[-1][1] == ss[0].total_size  # contiguous, disjoint, all the epoch's slots
        read = np.concatenate([s.index_at(np.arange(s.num_samples), r) for r, s in enumerate(ss)])
        counts = np.bincount(read, minlength=N)
        tail = ss[0].tail_names()
        assert len(tail["pads"]) == (counts > 1).sum() == read.size - N + len(tail["drops"])
        assert sorted(int(k) for k in tail["drops"]) == np.flatnonzero(counts == 0).tolist()
        for r, s in enumerate(ss):
            positions = np.arange(s.num_samples)
            slots = s.rule.slots(positions, r, s.epoch_length, world)
            assert [a.tolist() for a in s.rule.owners(slots, s.epoch_length, world)] == [
                [r] * len(positions),
                positions.tolist(),
            ]
            # what the workers read, handed out round robin, is the rank's list from any batch
            want = s.index_at(positions, r)
            for start in range(0, s.num_samples, batch):
                got = round_robin([planned(s, r, w, start) for w in range(workers)], batch)
                assert np.array_equal(np.concatenate(got), want[start:])
    assert not np.array_equal(ss[0].shard_order.order(0), ss[0].shard_order.order(1)) or (
        mode == "sequential"
    )


def test_a_resumed_worker_reads_at_most_one_shuffle_block_before_its_place(tmp_path) -> None:
    samples = ShardSamples(ShardIndex.of("train_urls", write_shards(tmp_path)), shuffle_block=4)
    s = samplers(block=4)[1]
    s.set_epoch(1)
    reads = []
    read = samples.read
    samples.read = lambda shard, lo, hi: reads.append((lo, hi)) or read(shard, lo, hi)
    reader = PlanReader(samples, s)
    start = 2 * B
    for w in range(K):
        want = reader.indices(w, 1, start)
        reads.clear()
        got = [i for _, _, i in reader.read(want)]
        assert got == want.tolist()
        shard = samples.index.shard_of(int(want[0]))
        first = int(samples.index.offsets[shard])
        block_start = first + (int(want[0]) - first) // 4 * 4  # the cursor's shuffle block
        assert reads[0][0] >= block_start and reads[0][1] < block_start + 4  # that block only
        assert sum(hi - lo + 1 for lo, hi in reads) < len(want) + 2 * 4  # never the prefix


# ----------------------------------------------------------------------------- the verdict
def test_the_plan_read_as_planned_is_ok_and_names_its_pads() -> None:
    ss = samplers()
    report = epoch_verdict(ss, 1, 0, planned)
    assert str(report.verdict) == "ok", report
    # the pad repeats the stream's first sample (rank 0's) on rank 1: one overlap, one repeat
    c = report.coverage
    assert c.fraction == 1.0 and c.overlap == 1 and c.repeats == 1
    assert len(report.pads) == 1 and len(report.workers) == W * K
    assert all(w.matches for w in report.workers)
    resumed = epoch_verdict(ss, 1, 2 * B, lambda s, r, w: planned(s, r, w, 2 * B))
    assert str(resumed.verdict) == "ok", resumed


def whole_rank(s: PlanSampler, r: int, w: int) -> np.ndarray:
    """The worker split removed: every worker reads its rank's whole range."""
    return s.index_at(np.arange(s.num_samples), r)


MUTATIONS = {
    "worker split removed": (whole_rank, "worker 1 read samples outside its range"),
    "node split removed": (lambda s, r, w: planned(s, 0, w), "rank 1 saw indices that differ"),
    "wrong epoch seed on a worker": (
        lambda s, r, w: planned(s, r, w, epoch=s.epoch + (w == 1)),
        "loader worker 1 read samples outside",
    ),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_mutations_turn_the_verdict_to_a_shard_mismatch(name) -> None:
    reads, said = MUTATIONS[name]
    report = epoch_verdict(samplers(), 1, 0, reads)
    assert str(report.verdict).startswith("MISMATCH"), report
    assert said in str(report.verdict), str(report.verdict)


def test_a_resume_that_restarts_the_epoch_is_a_shard_mismatch() -> None:
    start = 2 * B  # the checkpoint's position; the mutation reads the epoch from 0 again
    report = epoch_verdict(samplers(), 1, start, lambda s, r, w: planned(s, r, w, 0))
    assert str(report.verdict).startswith("MISMATCH"), report
    assert "rank 0 saw indices that differ" in str(report.verdict)


def test_a_worker_cursor_and_a_foreign_plan_in_the_checkpoint() -> None:
    s = samplers()[1]
    s.set_epoch(1)
    state = s.state_dict(2 * B)
    assert len(state["worker_cursors"]) == K
    assert state["worker_cursors"] == [s.worker_slots(1, k, 2 * B)[0] for k in range(K)]
    other = PlanSampler(
        ShardOrder(sizes=SIZES, seed=0, shuffle=True, block=4),
        num_replicas=W,
        rank=1,
        mode="padded",
        batch_size=B,
        workers=3,
    )
    with pytest.raises(ValueError, match="num_workers=2 but this run has num_workers=3"):
        other.load_state_dict(state)
    fresh = samplers()[1]
    fresh.load_state_dict(state)
    assert (int(fresh.shared[0]), int(fresh.shared[1])) == (1, 2 * B)


# ----------------------------------------------------------------------------- shards in
def test_the_index_is_cached_beside_the_shards_and_rebuilt_when_one_changes(tmp_path) -> None:
    pattern = write_shards(tmp_path)
    index = ShardIndex.of("train_urls", pattern)
    assert len(index) == N and tuple(index.sizes) == SIZES and index.keys[5] == "00000005"
    cache = tmp_path / "train-000001.tar.idx.json"
    assert cache.is_file()
    cache.write_text(cache.read_text().replace('"00000017"', '"cached!!"'))
    assert ShardIndex.of("train_urls", pattern).keys[17] == "cached!!"  # read, not rescanned
    shard = tmp_path / "train-000001.tar"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    assert ShardIndex.of("train_urls", pattern).keys[17] == "00000017"  # stale: rebuilt
    x, y, i = ShardSamples(index)[20]
    assert x.shape == (1, 8, 8) and y == 20 % 3 and i == 20


def test_train_py_exits_2_on_a_missing_shard(tmp_path) -> None:
    """Through train.py: the shard index's sentence, exit 2, no traceback."""
    cmd = train_cmd(
        tmp_path,
        "logger=none",
        "epochs=1",
        "data=webdataset",
        f"data.train_urls='{tmp_path / 'train-{000000..000001}.tar'}'",
        f"data.test_urls='{tmp_path / 'test-000000.tar'}'",
    )
    proc = run(cmd, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_CONFIG_ERROR, output[-3000:]
    assert "train-000000.tar, which does not exist" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def test_bad_shards_are_refused_in_one_sentence(tmp_path) -> None:
    pattern = write_shards(tmp_path / "ok")
    with pytest.raises(ConfigError, match=r"data.train_urls='' names no shards; give them"):
        ShardIndex.of("train_urls", "")
    missing = pattern.replace("000006}", "000007}")
    with pytest.raises(ConfigError, match=r"names .*train-000007.tar, which does not exist"):
        ShardIndex.of("train_urls", missing)
    with pytest.raises(
        ConfigError, match=r"data.train_urls=pipe:curl -s http://host is a pipe: URL, which"
    ):
        ShardIndex.of("train_urls", "pipe:curl -s http://host/train-{000000..000006}.tar")
    assert len(ShardIndex.of("train_urls", f"file://{pattern}")) == len(
        ShardIndex.of("train_urls", pattern)
    )
    bad = tmp_path / "bad" / "train-000000.tar"
    bad.parent.mkdir()
    with tarfile.open(bad, "w") as tar:
        info = tarfile.TarInfo("a7.png")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"png"))
    with pytest.raises(ConfigError, match=r"sample 'a7' in .* has no .cls member \(it has .png\)"):
        ShardIndex.of("test_urls", str(bad))


@pytest.fixture(scope="module")
def digit_shards(tmp_path_factory) -> Path:
    from ddp_template.optional.webdataset.writer import main

    out = tmp_path_factory.mktemp("digits")
    args = ["--from", "data=digits", "--out", str(out), "--samples-per-shard", "500"]
    assert main(["write", *args]) == 0
    return out


def test_digits_written_to_shards_are_the_digits(digit_shards) -> None:
    from ddp_template.data.builtin import digits

    splits = webdataset(
        train_urls=str(digit_shards / "train-{000000..000002}.tar"),
        test_urls=str(digit_shards / "test-000000.tar"),
    )
    want = digits()
    assert len(splits.train) == len(want.train) and len(splits.test) == len(want.test)
    assert splits.info == want.info
    for i in (0, 700, len(want.train) - 1):
        x, y, _ = splits.train[i]
        assert torch.equal(x, want.train[i][0]) and y == want.train[i][1]


# One rank (a gloo group of 1, no loader workers) trains twice in one interpreter: data=digits,
# then the same digits from shards with data=webdataset; prints both accuracies.
TWICE = """
import json, os, runpy, socket, sys
from pathlib import Path
from hydra import compose, initialize_config_dir
root, out, shards = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
train = runpy.run_path(str(root / "train.py"))["train"]  # not its __main__
from ddp_template.config import boundary
from ddp_template.run_identity import RunInfo
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  LOCAL_WORLD_SIZE="1")
sharded = ["data=webdataset", f"data.train_urls='{shards}/train-{{000000..000002}}.tar'",
           f"data.test_urls='{shards}/test-000000.tar'"]
accuracy = {}
for name, data in (("digits", ["data=digits"]), ("webdataset", sharded)):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    with initialize_config_dir(config_dir=str(root / "conf"), version_base="1.3"):
        overrides = ["logger=none", "epochs=2", "backend=gloo", *data]
        cfg = boundary.typed(compose(config_name="config", overrides=overrides))
    accuracy[name] = train(cfg, RunInfo(run_id=name, run_dir=out / name))
print(json.dumps(accuracy))
"""


def test_digits_from_shards_train_to_the_accuracy_of_digits(digit_shards, tmp_path) -> None:
    """Same seed, same model and steps; only the data order differs (the plan vs randperm)."""
    cmd = [sys.executable, "-c", TWICE, str(ROOT), str(tmp_path), str(digit_shards)]
    proc = run(cmd, timeout=240, leftovers=10)
    accuracy = json.loads(proc.stdout.strip().splitlines()[-1])
    assert accuracy["digits"] > 0.95, accuracy  # it learned
    assert abs(accuracy["webdataset"] - accuracy["digits"]) <= 0.01, accuracy


# ----------------------------------------------------------------------------- real runs
BASE = [
    "data=webdataset",
    "data.shuffle_block=4",
    f"loader.batch_size={B}",
    f"loader.num_workers={K}",
    "epochs=2",
    "logger=none",
    "checkpoint.every_steps=1",
    "model.width=8",
]
# 61 samples padded to 62: 31 per rank, 8 batches of 4 (the last of 3), 8 steps per epoch.
STEPS_PER_EPOCH = 8


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("shards")
    train = write_shards(folder)
    test = write_shards(folder, sizes=(6, 5), name="test")
    return [f"data.train_urls='{train}'", f"data.test_urls='{test}'"]


def launch(out: Path, run_id: str, *extra: str, check: bool = True):
    cmd = train_cmd(out, *BASE, "dist.nproc=2", *extra)
    return run(cmd, env=run_env(RUN_ID=run_id), check=check, timeout=180, leftovers=10)


def ledger(run_dir: Path) -> dict:
    """(epoch, rank, worker) -> (samples, fingerprint) from every rank's JSONL, a resumed
    epoch's joined keys (data/worker<k>/epoch_*) where present."""
    out = {}
    for r in range(W):
        for row in jsonl(run_dir / f"rank{r}" / "metrics.jsonl"):
            if "data/fingerprint" not in row:
                continue
            for k in range(K):
                pre = (
                    f"data/worker{k}/epoch_" if "data/epoch_samples" in row else f"data/worker{k}/"
                )
                out[row["epoch"], r, k] = (row[pre + "samples"], row[pre + "fingerprint"])
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shards) -> Path:
    out = tmp_path_factory.mktemp("ref")
    launch(out, "ref", *shards, "share_picture=true")
    return out / "outputs" / "ref"


def test_uneven_shards_on_2_ranks_x_2_workers_every_sample_once_equal_steps(reference) -> None:
    rows = {r: jsonl(reference / f"rank{r}" / "metrics.jsonl") for r in range(W)}
    epochs = {r: [row for row in rows[r] if "data/fingerprint" in row] for r in range(W)}
    assert [len(epochs[r]) for r in range(W)] == [2, 2]
    report = [row for row in rows[0] if "shares/verdict_ok" in row]
    assert [row["shares/verdict_ok"] for row in report] == [1, 1]
    assert all(row["shares/coverage"] == 1.0 and row["shares/overlap"] == 1 for row in report)
    assert all(row["shares/repeats"] == 1 for row in report)  # the one pad, named in the log
    book = ledger(reference)
    for e in range(2):
        assert {epochs[r][e]["data/samples"] for r in range(W)} == {31}
        assert {epochs[r][e]["data/batches"] for r in range(W)} == {STEPS_PER_EPOCH}
        pads = samplers(block=4)[0]
        pads.set_epoch(e)
        pad = [int(k) for k in pads.tail_names()["pads"]]
        total = sum(int(fp, 16) for _, fp in (book[e, r, k] for r in range(W) for k in range(K)))
        once = fingerprint_sum(np.arange(N)) + fingerprint_sum(np.array(pad))
        assert fingerprint_hex(total) == fingerprint_hex(once)  # all once, plus the pad
        assert sum(book[e, r, k][0] for r in range(W) for k in range(K)) == N + 1
    log = (reference / "train.log").read_text()
    assert "pads: " in log and "rank 1 worker 1:" in log
    assert (reference / "shares.png").is_file()  # the shard picture, drawn from the plan


def test_replay_names_each_step_s_samples_by_key(reference, capsys) -> None:
    from ddp_template import replay

    assert replay.main([str(reference), "--step", str(STEPS_PER_EPOCH + 2), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    s = samplers(block=4)[1]
    s.set_epoch(1)
    assert rows[1]["indices"] == s.index_at(np.arange(B, 2 * B), 1).tolist()
    assert rows[1]["keys"] == [f"{i:08d}" for i in rows[1]["indices"]]


def test_kill_9_mid_epoch_resumes_bit_identical_with_the_same_ledger(
    reference, shards, tmp_path
) -> None:
    step = STEPS_PER_EPOCH + 4  # mid-way through epoch 1, on rank 1
    kill = [f"fault.crash_at_step={step}", "fault.rank=1", "fault.signal=SIGKILL"]
    proc = launch(tmp_path, "chain", *shards, *kill, check=False)
    assert_killed_rank_reported(proc, rank=1, sig="SIGKILL")
    proc = launch(tmp_path, "chain", *shards)
    assert "resumed from" in proc.stdout + proc.stderr
    run_dir = tmp_path / "outputs" / "chain"
    a = torch.load(reference / "checkpoints" / "last.pt", weights_only=True)["model"]
    b = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    resumed = [
        row for row in jsonl(run_dir / "rank0" / "metrics.jsonl") if "data/epoch_samples" in row
    ]
    assert [(r["epoch"], r["data/epoch_samples"]) for r in resumed] == [(1, 31)]
    assert resumed[0]["data/samples"] < 31  # this launch read only the epoch's rest...
    assert ledger(run_dir) == ledger(reference)  # ...and joined, the ledger is the reference's


def test_a_node_split_removed_in_a_real_run_is_a_loud_mismatch_not_a_hang(shards, tmp_path) -> None:
    base = [o for o in BASE if not o.startswith(("loader.num_workers", "epochs"))]
    cmd = train_cmd(tmp_path, *base, "dist.nproc=2", "dist.start_method=fork", "epochs=1", *shards)
    cmd[1] = str(Path(__file__).with_name("shard_mutation.py"))  # every rank as rank 0
    proc = run(cmd, env=run_env(RUN_ID="mutant"), timeout=120, leftovers=10)
    out = proc.stdout + proc.stderr
    assert "SHARE MISMATCH in epoch 0" in out, out[-3000:]
    assert "rank 1 saw indices that differ" in out


def test_augmented_shards_stream_by_the_plan_as_map_style_would_augment(tmp_path) -> None:
    """transforms=cifar on sharded data: the plan still deals the stream (a PlanSampler, workers
    reading their ranges), and each sample gets the augmentation of (seed, epoch, index), the
    same tensor map-style reading of the same split gives."""
    from helpers import cpu_rank

    from ddp_template.config.choices import TransformName
    from ddp_template.config.options import TransformsConfig
    from ddp_template.config.schema import LoaderConfig, SamplerConfig
    from ddp_template.data.transforms import apply_transforms

    pattern = write_shards(tmp_path / "s")
    splits = webdataset(train_urls=pattern, test_urls=pattern)
    cifar = TransformsConfig(name=TransformName.cifar, padding=1)
    augmented = apply_transforms(splits, cifar, seed=3).train
    info, cfg = cpu_rank(0, 2), LoaderConfig(batch_size=B, num_workers=0)
    sampler = splits.kind.sampler(augmented, SamplerConfig(), seed=3, info=info, loader=cfg)
    assert isinstance(sampler, PlanSampler)
    loader = splits.kind.loader(augmented, sampler, cfg, seed=3, drop_last=False, info=info)
    assert isinstance(loader.dataset, PlanReader)
    for epoch in (0, 1):
        splits_epoch = apply_transforms(splits, cifar, seed=3)  # a fresh map-style reader
        splits_epoch.set_epoch(epoch)
        augmented.set_epoch(epoch)
        sampler.set_epoch(epoch)
        seen = [(x, i) for xs, _, idx in loader for x, i in zip(xs, idx.tolist(), strict=True)]
        assert [i for _, i in seen] == planned(sampler, 0, 0, epoch=epoch).tolist()
        for x, i in seen:
            assert torch.equal(x, splits_epoch.train[i][0]), (epoch, i)
        plain = [splits.train[i][0] for _, i in seen]
        assert sum(not torch.equal(x, p) for (x, _), p in zip(seen, plain, strict=True)) > 0
