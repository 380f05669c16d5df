"""The two ways a forker's own stream went wrong silently, now said.

A stream that does not declare its size gives the cosine schedule no horizon (the LR was 0 from
the first steps on): ``optim.schedule=cosine`` with it is refused before the first step, in one
sentence, at compose level and through a real 2-rank launch. A split by ``dist.get_rank()`` in
``__iter__`` reads everything on every rank, since a loader worker has no process group: the
audit's hint names that cause, and the split README gives instead (``RANK``/``WORLD_SIZE`` from
the worker's environment) reads each rank's share (a real launch, 2 ranks x 2 workers).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, assert_one_run_dir, jsonl, run, run_dirs, run_env, train_cmd
from torch.utils.data import IterableDataset

from ddp_template.config import boundary
from ddp_template.data.builtin import digits
from ddp_template.data.contract import Splits
from ddp_template.errors import ConfigError
from ddp_template.optional.streams.contract import check_run
from ddp_template.optional.streams.verify import key_report

W, K = 2, 2  # ranks, loader workers per rank
REFUSAL = (
    "optim.schedule=cosine needs the run's length to decay the LR over and the training stream "
    "({name}) does not declare its size; give it a __len__, a num_rows or an expected_keys "
    "attribute, or set optim.schedule=none."
)


class Sizeless(IterableDataset):
    def __iter__(self):
        yield torch.zeros(1), 0, 0


class WithLen(Sizeless):
    def __len__(self) -> int:
        return 1


class WithRows(Sizeless):
    num_rows = 1


class WithKeys(Sizeless):
    expected_keys = [0]


def stream_splits(train: IterableDataset) -> Splits:
    base = digits()
    return Splits(train, base.test, base.info)


def test_a_cosine_schedule_on_a_stream_of_unknown_size_is_refused_in_one_sentence() -> None:
    from conftest import compose_conf

    with pytest.raises(ConfigError) as err:
        check_run(boundary.typed(compose_conf()), stream_splits(Sizeless()))  # the default
    assert str(err.value) == REFUSAL.format(name="Sizeless")
    assert str(err.value).count(". ") == 0
    check_run(boundary.typed(compose_conf("optim.schedule=none")), stream_splits(Sizeless()))
    for sized in (WithLen(), WithRows(), WithKeys()):  # a declared size: the cosine has a horizon
        check_run(boundary.typed(compose_conf()), stream_splits(sized))


def test_the_hint_for_every_rank_reading_everything_names_the_workers_missing_group() -> None:
    keys = [np.arange(0, 700, dtype=np.int64), np.arange(700, 1400, dtype=np.int64)]
    report = key_report([keys, keys])  # 2 ranks x 2 workers, each rank the whole stream
    verdict = str(report.verdict)
    assert verdict.startswith("MISMATCH: every rank read the same 1400 samples"), verdict
    assert "split_dataset_by_node / wds.split_by_node forgotten?" in verdict
    assert "a loader worker has no process group" in verdict
    assert "read the rank in __init__, or RANK/WORLD_SIZE from the environment" in verdict


# --- real launches: 2 ranks x 2 loader workers -------------------------------------------------


@pytest.fixture(scope="module")
def conf(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stream_faults")
    (root / "conf" / "data").mkdir(parents=True)
    text = "_target_: stream_data.env_split_stream\nsized: false\n"
    (root / "conf" / "data" / "env_split_stream.yaml").write_text(text)
    return root


def launch(conf: Path, out: Path, *overrides: str, check: bool = True):
    here = str(ROOT / "tests" / "optional" / "streams")
    paths = [here, *filter(None, [os.environ.get("PYTHONPATH")])]
    cmd = train_cmd(
        out,
        f"hydra.searchpath=[file://{conf / 'conf'}]",
        "data=env_split_stream",
        f"dist.nproc={W}",
        f"loader.num_workers={K}",
        "checkpoint.enabled=false",
        *overrides,
    )
    return run(cmd, env=run_env(PYTHONPATH=os.pathsep.join(paths)), timeout=180, check=check)


def test_a_stream_of_unknown_size_is_refused_before_the_first_step(conf, tmp_path) -> None:
    proc = launch(conf, tmp_path, "epochs=3", check=False)  # the default optim.schedule=cosine
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-2000:]
    assert REFUSAL.format(name="EnvSplitDigits") in out
    assert "Traceback" not in out
    (d,) = run_dirs(tmp_path)
    files = sorted(d.glob("rank*/metrics.jsonl"))  # rank 0's logger starts before its refusal
    assert d / "rank0" / "metrics.jsonl" in files
    for f in files:  # no rank logged a step
        assert not [row for row in jsonl(f) if "train/lr" in row], f


@pytest.mark.slow
def test_a_stream_split_by_the_workers_environment_reads_each_ranks_share(conf, tmp_path) -> None:
    """README's split: RANK/WORLD_SIZE reach the loader workers (forks of the rank's own fork
    server), so each rank reads its half, the verdict is ok and the declared size gives the
    cosine its horizon (the LR above 0 until the run's last step)."""
    proc = launch(conf, tmp_path, "data.sized=true", "epochs=1", "log_every=1")
    d = assert_one_run_dir(tmp_path, W)
    rows = jsonl(d / "rank0" / "metrics.jsonl")
    (report,) = [r for r in rows if "shares/verdict_ok" in r]
    assert report["shares/verdict_ok"] == 1 and report["shares/coverage"] == 1.0
    assert [r["data/samples"] for r in rows if "data/samples" in r] == [719]
    lrs = [r["train/lr"] for r in rows if "train/lr" in r]
    assert len(lrs) == 24 and min(lrs[:-1]) > 0, lrs  # 360 + 359 a rank: 12 + 12 batches
    assert "verdict ok" in proc.stdout + proc.stderr
