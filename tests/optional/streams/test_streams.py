"""Bring your own loader: streams (``IterableDataset``) in the loop, audited per (rank, worker).

In-process: the standalone ``audited()`` wrapper on a plain WebDataset pipeline (with and
without ``split_by_worker``) and on Hugging Face ``datasets`` streaming across a resume (the
stream's own state_dict vs a stream that restarts), the verdict's symptoms from keys, the
refusals. Real launches (2 ranks x 2 loader workers, gloo; the forker's streams live in
tests/stream_data.py, registered as ``data`` options by a conf folder of the test's own): a
stream that shards itself trains with the verdict ok and one without a worker split is a loud
mismatch naming every worker; Hugging Face streaming from local Parquet is ok with
``split_dataset_by_node``, names the overlap without it, and with 3 shards on 2 ranks ends
without a hang, the sample left unread named by its id (``data.uneven=stop``) or read by the rank
that had it while the other shadows its step (``data.uneven=join``); a signal to the joined rank
during the tail stops both at one step. The refusals of ``data.uneven=join`` need no launch.
"""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, assert_one_run_dir, jsonl, run, run_env, train_cmd
from torch.utils.data import DataLoader, IterableDataset

from ddp_template.data.builtin import digits
from ddp_template.errors import EXIT_PREEMPTED, ConfigError
from ddp_template.optional.streams.audited import audited
from ddp_template.optional.streams.contract import Expected, check_stream, key_hash
from ddp_template.optional.streams.verify import key_report

W, K = 2, 2  # ranks, loader workers per rank
N = 1438  # the digits' training set


def write_parquet(folder: Path, sizes: list[int]) -> Path:
    """The digits' training set as Parquet shards of ``sizes`` rows: pixels, label, id."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    base = digits()
    x, y = base.train.x.flatten(1), base.train.y
    folder.mkdir(parents=True)
    lo = 0
    for s, n in enumerate(sizes):
        rows = range(lo, lo + n)
        table = {
            "pixels": [x[i].tolist() for i in rows],
            "label": [int(y[i]) for i in rows],
            "id": [f"d{i:04d}" for i in rows],
        }
        pq.write_table(pa.table(table), folder / f"part-{s}.parquet")
        lo += n
    assert lo == N
    return folder


def write_tars(folder: Path, shards: int = 4, per_shard: int = 10) -> str:
    folder.mkdir(parents=True)
    i = 0
    for s in range(shards):
        with tarfile.open(folder / f"train-{s:06d}.tar", "w") as tar:
            for _ in range(per_shard):
                payload = str(i % 3).encode()
                info = tarfile.TarInfo(f"{i:08d}.cls")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
                i += 1
    return str(folder / f"train-{{000000..{shards - 1:06d}}}.tar")


def _label(sample: dict) -> dict:
    return {"__key__": sample["__key__"], "cls": int(sample["cls"])}


@pytest.mark.parametrize("split_by_worker", [True, False])
def test_the_wrapper_on_a_webdataset_pipeline_names_a_missing_worker_split(
    tmp_path, split_by_worker
) -> None:
    import webdataset as wds

    urls = write_tars(tmp_path / "shards")
    stages = [wds.SimpleShardList(urls), wds.split_by_worker, wds.tarfile_to_samples()]
    if not split_by_worker:
        stages.remove(wds.split_by_worker)
    pipeline = wds.DataPipeline(*stages, wds.map(_label))
    loader = audited(DataLoader(pipeline, batch_size=4, num_workers=K), key="__key__", expected=40)
    labels = [b["cls"] for b in loader]  # the user's own batches, untouched
    assert sum(len(b) for b in labels) == 40 * (1 if split_by_worker else K)
    report = loader.verdict(echo=False)
    if split_by_worker:
        assert str(report.verdict) == "ok", str(report.verdict)
        assert [w.samples for w in report.workers] == [20, 20]
    else:
        assert "every sample was read by each loader worker (40 samples 2x)" in str(report.verdict)
        assert "split_by_worker" in str(report.verdict)
        assert not any(w.matches for w in report.workers)
    assert report.coverage.fraction == 1.0
    assert loader.verdict(echo=False).total_samples == 0  # the next epoch starts empty


def test_a_resume_that_restarts_a_hugging_face_stream_names_the_replayed_samples(tmp_path) -> None:
    """The stream's own state_dict resumes where it stood (ok); a stream built anew restarts
    and the audit, carried across the resume, names every replayed sample."""
    from datasets import load_dataset

    files = sorted(map(str, write_parquet(tmp_path / "pq", [360, 360, 359, 359]).glob("*")))

    def stream():
        return load_dataset("parquet", data_files=files, split="train", streaming=True)

    def read(dataset, batches=None, state=None):
        loader = audited(DataLoader(dataset, batch_size=32), key="id", expected=N)
        if state is not None:
            loader.load_state_dict(state)
        for b, _ in enumerate(loader):
            if b + 1 == batches:
                return loader
        return loader

    first = stream()
    before = read(first, batches=10)  # 320 rows, then a "crash" with both states saved
    saved, position = before.state_dict(), first.state_dict()
    resumed = stream()
    resumed.load_state_dict(position)
    ok = read(resumed, state=saved).verdict(echo=False)
    assert str(ok.verdict) == "ok", str(ok.verdict)
    assert ok.coverage.covered == N and ok.replayed == 0
    restarted = read(stream(), state=saved).verdict(echo=False)
    assert "320 samples replayed" in str(restarted.verdict), str(restarted.verdict)
    assert restarted.coverage.repeats == 320 and restarted.coverage.covered == N


def _keys(*ranges: range) -> list[np.ndarray]:
    return [np.array([key_hash(f"k{i}") for i in r], dtype=np.int64) for r in ranges]


def test_the_verdict_names_each_symptom_from_the_keys() -> None:
    expected = Expected.of([f"k{i}" for i in range(40)])
    ok = key_report([_keys(range(0, 10), range(10, 20)), _keys(range(20, 30), range(30, 40))])
    assert str(ok.verdict) == "ok" and ok.coverage.covered == 40
    same = key_report([_keys(range(0, 20), range(20, 40))] * 2, expected=expected)
    assert "every rank read the same 40 samples" in str(same.verdict)
    assert "split_dataset_by_node" in str(same.verdict)
    pairs = key_report(
        [_keys(range(0, 12), range(10, 20)), _keys(range(20, 30), range(30, 40))],
        expected=expected,
    )
    assert "rank 0 worker 0 and rank 0 worker 1 read the same 2 samples" in str(pairs.verdict)
    assert [w.matches for w in pairs.workers] == [False, False, True, True]
    unread = key_report(
        [_keys(range(0, 10), range(10, 20)), _keys(range(20, 30), range(30, 38))],
        expected=expected,
        unread=[[(0, []), (0, [])], [(0, []), (2, ["k38", "k39"])]],
    )
    assert "2 samples left unread: all ranks stopped when rank 0 ran out" in str(unread.verdict)
    assert "rank 1 worker 1: 2 (k38, k39)" in str(unread.verdict)
    assert "read by no rank" not in str(unread.verdict)  # the unread ones are not missing too
    missing = key_report([_keys(range(0, 10)), _keys(range(20, 30))], expected=expected)
    assert "20 of the 40 expected samples were read by no rank" in str(missing.verdict)
    dup = key_report([[np.array([1, 2, 2, 3])]])
    assert str(dup.verdict) == "MISMATCH: rank 0 worker 0 read 1 sample more than once"


class Pairs(IterableDataset):
    num_rows = 1  # its size declared: the default cosine schedule has its horizon

    def __iter__(self):
        yield torch.zeros(1), 0


class FloatKeys(IterableDataset):
    def __iter__(self):
        yield torch.zeros(1), 0, 0.5


def test_a_stream_without_a_key_is_refused_in_one_sentence() -> None:
    for dataset, says in ((Pairs(), "yields a 2-tuple"), (FloatKeys(), "yields the key 0.5")):
        with pytest.raises(ConfigError) as err:
            check_stream(dataset)
        assert says in str(err.value) and "must yield (x, y, key)" in str(err.value)
        assert str(err.value).count(". ") == 0  # one sentence
    with pytest.raises(TypeError, match="map-style"):
        audited(DataLoader(digits().train), key=2)


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("sampler=exact", "sampler.mode=exact has no effect on a training stream"),
        ("transforms=cifar", "augment and normalise in the stream itself"),
        ("checkpoint.every_steps=5", "a stream cannot resume mid-epoch"),
        ("eval_split=train", "a stream cannot be evaluated exactly"),
    ],
)
def test_options_a_stream_cannot_honour_are_refused_in_one_sentence(override, says) -> None:
    from conftest import compose_conf

    from ddp_template.config import boundary
    from ddp_template.data.contract import Splits
    from ddp_template.optional.streams.contract import StreamPosition, check_run

    cfg = boundary.typed(compose_conf(override))
    base = digits()
    with pytest.raises(ConfigError, match=says):
        check_run(cfg, Splits(Pairs(), base.test, base.info))
    check_run(boundary.typed(compose_conf()), Splits(Pairs(), base.test, base.info))  # defaults
    position = StreamPosition(expected=None, world_size=W, batch_size=32, workers=K)
    position.load_state_dict(position.state_dict(0))  # an epoch end's checkpoint resumes
    with pytest.raises(Exception, match="mid-epoch .* of a stream"):
        position.load_state_dict(position.state_dict(64))


# --- real launches: 2 ranks x 2 loader workers -------------------------------------------------


@pytest.fixture(scope="module")
def conf(tmp_path_factory) -> Path:
    """The forker's ``data`` options, as README's "Add a dataset" registers them."""
    root = tmp_path_factory.mktemp("streams")
    (root / "conf" / "data").mkdir(parents=True)
    options = {
        "own_stream": (
            "_target_: stream_data.digits_stream\nsplit_by_worker: true\nskewed: false\n"
            "uneven: stop\n"
        ),
        "no_key_stream": "_target_: stream_data.no_key_stream\n",
        "parquet_stream": (
            "_target_: stream_data.parquet_stream\npath: ???\nsplit_by_node: true\nuneven: stop\n"
        ),
    }
    for name, text in options.items():
        (root / "conf" / "data" / f"{name}.yaml").write_text(text)
    for name, sizes in {"even": [360, 360, 359, 359], "three": [449, 541, 448]}.items():
        write_parquet(root / name, sizes)
    return root


def launch(conf: Path, out: Path, *overrides: str, world: int = W, check: bool = True):
    here = str(ROOT / "tests" / "optional" / "streams")
    paths = [here, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = run_env(PYTHONPATH=os.pathsep.join(paths))
    cmd = train_cmd(
        out,
        f"hydra.searchpath=[file://{conf / 'conf'}]",
        f"dist.nproc={world}",
        f"loader.num_workers={K}",
        "checkpoint.enabled=false",
        *overrides,
    )
    return run(cmd, env=env, timeout=180, check=check)


def epoch_rows(run_dir: Path, rank: int) -> list[dict]:
    return [
        row for row in jsonl(run_dir / f"rank{rank}" / "metrics.jsonl") if "data/samples" in row
    ]


def shard_rows(run_dir: Path) -> list[dict]:
    return [r for r in jsonl(run_dir / "rank0" / "metrics.jsonl") if "shares/verdict_ok" in r]


@pytest.mark.slow
def test_a_stream_that_shards_itself_trains_with_the_verdict_ok(conf, tmp_path) -> None:
    proc = launch(conf, tmp_path, "data=own_stream", "epochs=2", "share_picture=true")
    d = assert_one_run_dir(tmp_path, W)
    for epoch in range(2):  # every epoch: fresh workers read the stream again, all of it
        rows = [epoch_rows(d, r)[epoch] for r in range(W)]
        assert [row["data/samples"] for row in rows] == [719, 719]
        assert [[row[f"data/worker{k}/samples"] for k in range(K)] for row in rows] == [
            [360, 359],
            [360, 359],
        ]
    report = shard_rows(d)
    assert [r["shares/verdict_ok"] for r in report] == [1, 1]
    assert report[-1]["shares/coverage"] == 1.0 and report[-1]["shares/overlap"] == 0
    assert "verdict ok" in proc.stdout + proc.stderr
    assert "shares.png" not in [p.name for p in d.iterdir()]  # a stream has no layout


@pytest.mark.slow
def test_a_stream_without_a_worker_split_is_a_shard_mismatch_naming_every_worker(
    conf, tmp_path
) -> None:
    proc = launch(conf, tmp_path, "data=own_stream", "data.split_by_worker=false", "epochs=1")
    out = proc.stdout + proc.stderr
    assert "SHARE MISMATCH in epoch 0" in out
    assert "on rank 0, 1 every sample was read by each loader worker" in out
    for r in range(W):
        for k in range(K):
            assert f"rank {r} worker {k}: 719 samples" in out
    (report,) = shard_rows(assert_one_run_dir(tmp_path, W))
    assert report["shares/verdict_ok"] == 0 and report["shares/overlap"] == N


def test_a_stream_that_yields_no_key_stops_the_run_in_one_sentence(conf, tmp_path) -> None:
    proc = launch(conf, tmp_path, "data=no_key_stream", world=1, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "the training stream (DigitsStream) yields a 2-tuple" in out
    assert "Traceback" not in out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("shards", "split_by_node", "verdict", "batches"),
    [
        ("even", "true", "verdict ok", 24),
        ("even", "false", "every rank read the same 1438 samples", 46),  # all 1438 each
        ("three", "true", "1 sample left unread: all ranks stopped when rank 1 ran out", 23),
    ],
)
def test_hugging_face_streaming_from_parquet(
    conf, tmp_path, shards, split_by_node, verdict, batches
) -> None:
    """split_dataset_by_node: ok; forgotten: the overlap; 3 shards on 2 ranks (HF then keeps
    every 2nd row per worker, so rank 0's worker 0 has one row more): no hang, the left-over
    row named by its id."""
    data = [
        "data=parquet_stream",
        f"data.path={conf / shards}",
        f"data.split_by_node={split_by_node}",
    ]
    proc = launch(conf, tmp_path, *data, "epochs=1")
    assert verdict in proc.stdout + proc.stderr
    d = assert_one_run_dir(tmp_path, W)
    (report,) = shard_rows(d)
    assert [epoch_rows(d, r)[0]["data/batches"] for r in range(W)] == [batches] * W
    if shards == "three":  # rank 0 had a 24th batch, rank 1 none: all stopped there
        assert "rank 0 worker 0: 1 (d1437)" in proc.stdout + proc.stderr
    assert report["shares/unread"] == (shards == "three")
    assert report["shares/verdict_ok"] == (verdict == "verdict ok")


@pytest.mark.slow
def test_uneven_join_trains_every_rank_on_all_of_its_stream(conf, tmp_path) -> None:
    """3 shards on 2 ranks, data.uneven=join: rank 1's stream ends a batch before rank 0's, it joins
    and shadows rank 0's 24th step, and nothing is left unread; the second epoch shows both
    ranks counted that step (their preemption checks still meet)."""
    data = ["data=parquet_stream", f"data.path={conf / 'three'}", "data.uneven=join"]
    proc = launch(conf, tmp_path, *data, "epochs=2")
    d = assert_one_run_dir(tmp_path, W)
    reports = shard_rows(d)
    assert len(reports) == 2
    for epoch, report in enumerate(reports):
        rows = [epoch_rows(d, r)[epoch] for r in range(W)]
        assert [row["data/batches"] for row in rows] == [24, 23]
        assert sum(row["data/samples"] for row in rows) == N
        assert [row["step"] for row in rows] == [24 * (epoch + 1)] * W
        assert report["shares/verdict_ok"] == 1
        assert report["shares/total_samples"] == N and report["shares/coverage"] == 1.0
        assert (report["shares/unread"], report["shares/repeats"]) == (0, 0)
    assert "left unread" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_signal_to_the_joined_rank_in_the_tail_stops_both_ranks_at_one_step(
    conf, tmp_path
) -> None:
    """Rank 0's stream ends after 16 steps, rank 1's after 30. SIGUSR1 reaches rank 0 after
    step 20, a step it only shadows; with checks every 2 steps its flag goes into step 20's
    agreement, read at step 22: both ranks stop there, rank 0 checkpoints its caught-up
    state after Join, and both exit 75."""
    proc = launch(
        conf,
        tmp_path,
        "data=own_stream",
        "data.skewed=true",
        "data.uneven=join",
        "epochs=1",
        "checkpoint.enabled=true",
        "checkpoint.preempt_check_every=2",
        "fault.crash_at_step=20",
        "fault.rank=0",
        "fault.signal=SIGUSR1",
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    assert "received SIGUSR1" in out and "preempted at step 22" in out, out[-3000:]
    d = assert_one_run_dir(tmp_path, W)
    rows = [epoch_rows(d, r)[0] for r in range(W)]
    assert [row["data/batches"] for row in rows] == [16, 22]
    assert [row["step"] for row in rows] == [22, 22]
    saved = torch.load(d / "checkpoints" / "last.pt", weights_only=True)
    assert saved["progress"]["step"] == 22  # rank 0's own, counted while it shadowed


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (
            ["syncbn=on"],
            "syncbn.enabled=true cannot run with data.uneven=join (SyncBatchNorm all-reduces",
        ),
        (["optim.accumulate=2"], "optim.accumulate=2 cannot run with data.uneven=join"),
        pytest.param(
            ["parallel=fsdp2"],
            "data.uneven=join cannot run with parallel=fsdp2",
            marks=pytest.mark.needs("fsdp2"),
        ),
        pytest.param(
            ["fault_tolerance=live"],
            "fault_tolerance=live cannot regroup inside torch's Join",
            marks=pytest.mark.needs("live"),
        ),
    ],
)
def test_uneven_join_refuses_what_join_cannot_shadow_in_one_sentence(overrides, says) -> None:
    """The stream's kind refuses them (``Streamed.check``, which ``train.build`` calls with the
    config in force: after an elastic resize, its accumulate)."""
    from conftest import compose_conf

    from ddp_template.config import boundary
    from ddp_template.data.contract import Splits
    from ddp_template.optional.streams.kind import Streamed

    cfg, base = boundary.typed(compose_conf(*overrides)), digits()
    splits = Splits(Pairs(), base.test, base.info)
    with pytest.raises(ConfigError) as err:
        Streamed(uneven="join").check(cfg, splits)
    msg = str(err.value)
    assert msg.startswith(says) and "data.uneven=stop" in msg and "\n" not in msg, msg
    Streamed(uneven="stop").check(cfg, splits)  # stop: accepted
    Streamed().check(cfg, splits)  # stop: the default


def test_uneven_join_on_a_stream_is_accepted() -> None:
    from conftest import compose_conf

    from ddp_template.config import boundary
    from ddp_template.data.contract import Splits
    from ddp_template.optional.streams.kind import Streamed

    base = digits()
    Streamed(uneven="join").check(
        boundary.typed(compose_conf()), Splits(Pairs(), base.test, base.info)
    )
    with pytest.raises(ConfigError, match=r"^data.uneven=both is not a way .* data.uneven=join\.$"):
        Streamed(uneven="both")
