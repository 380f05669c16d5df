"""`python -m ddp_template.replay`: the batches it reconstructs are the ones training consumed.

One real 2-rank run (module fixture) trains on a user data module whose training dataset
appends every index it is asked for to ``rank<RANK>.txt``: with ``loader.num_workers=0`` the
order of ``__getitem__`` calls is the order the loop consumed, batch by batch. Replay must give the
same batches per step, the union of an epoch's steps must reproduce each rank's logged
``data/fingerprint``, and ``--index`` must agree. tests/test_replay_oracle.py covers every
mode, permutation, step cap and a resume without training.
"""

from __future__ import annotations

import io
import json
import os
import sys
import textwrap
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import jsonl, run, run_env, train_cmd

from ddp_template.data.identity import PROBES
from ddp_template.ledger.tally import fingerprint
from ddp_template.probe import SAMPLES
from ddp_template.replay import index_hits, load_run, main, step_rows

N, W, BATCH, EPOCHS = 45, 2, 4, 2  # L = 23 per rank: 6 steps per epoch, the last of 3
RECDATA = """
import os

from torch.utils.data import Dataset

from ddp_template.data.builtin import synthetic

from ddp_template.data.contract import Splits


class Recording(Dataset):
    def __init__(self, base, log_dir):
        self.base, self.log_dir = base, log_dir

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        if "RANK" in os.environ:  # a training rank, not the replay command
            with open(os.path.join(self.log_dir, f"rank{os.environ['RANK']}.txt"), "a") as f:
                f.write(f"{i}\\n")
        return self.base[i]


def recorded(size, log_dir, test_size=8):
    splits = synthetic(size=size, test_size=test_size, channels=1, image_size=8)
    return Splits(Recording(splits.train, log_dir), splits.test, splits.info)
"""


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The one training run of this module and the indices each rank's loop consumed."""
    root = tmp_path_factory.mktemp("replay")
    code, conf, records = root / "code", root / "conf" / "data", root / "records"
    for folder in (code, conf, records):
        folder.mkdir(parents=True)
    (code / "recdata.py").write_text(textwrap.dedent(RECDATA))
    (conf / "recorded.yaml").write_text(
        f"_target_: recdata.recorded\nsize: {N}\nlog_dir: {records}\n"
    )
    paths = [str(code), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = run_env(PYTHONPATH=os.pathsep.join(paths))
    overrides = [f"hydra.searchpath=[file://{root / 'conf'}]", "data=recorded", "dist.nproc=2"]
    overrides += ["logger=none", f"epochs={EPOCHS}", f"loader.batch_size={BATCH}", "model.width=4"]
    run(train_cmd(root, *overrides, "checkpoint.enabled=false", "seed=3"), env=env)
    (run_dir,) = [p for p in (root / "outputs").iterdir() if p.is_dir()]
    consumed = [
        [int(line) for line in (records / f"rank{r}.txt").read_text().split()] for r in range(W)
    ]
    # Before training, rank 0 probed the data for the provenance chain (data.identity): PROBES
    # samples spread over it, here all 45, in order; then the task's exactness probe read the
    # first SAMPLES training samples (probe.probe).
    assert consumed[0][:N] == list(range(N))
    assert consumed[0][N : N + SAMPLES] == list(range(SAMPLES))
    consumed[0] = consumed[0][min(PROBES, N) + SAMPLES :]
    return SimpleNamespace(run_dir=run_dir, code=code, consumed=consumed, env=env)


@pytest.fixture
def on_path(trained: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    monkeypatch.syspath_prepend(str(trained.code))  # replay imports the run's data module
    return trained


def recorded_steps(consumed: list[int]) -> list[list[int]]:
    """One rank's consumed stream cut into steps: 23 per epoch, batches of 4 (the last of 3)."""
    length = -(-N // W)
    assert len(consumed) == EPOCHS * length  # nothing but the training loop read the data
    epochs = [consumed[e * length : (e + 1) * length] for e in range(EPOCHS)]
    return [epoch[k : k + BATCH] for epoch in epochs for k in range(0, length, BATCH)]


def test_replay_gives_the_batches_training_consumed(on_path: SimpleNamespace) -> None:
    truth = [recorded_steps(c) for c in on_path.consumed]
    total = len(truth[0])
    assert total == 12
    for step in [1, 2, 6, 7, 12]:  # first, second, the short last batch, a new epoch, the end
        code, out, _ = cli(on_path.run_dir, "--step", step, "--json")
        rows = [json.loads(line) for line in out.splitlines()]
        assert code == 0 and [row["rank"] for row in rows] == list(range(W))
        for row in rows:
            assert row["indices"] == truth[row["rank"]][step - 1]
            assert (row["step"], row["epoch"], row["position"]) == (
                step,
                (step - 1) // 6,
                (step - 1) % 6 * BATCH,
            )


def test_an_epochs_steps_reproduce_the_logged_fingerprints(on_path: SimpleNamespace) -> None:
    run_ = load_run(on_path.run_dir)
    for rank in range(W):
        logged = [
            r["data/fingerprint"]
            for r in jsonl(on_path.run_dir / f"rank{rank}" / "metrics.jsonl")
            if "data/fingerprint" in r
        ]
        assert len(logged) == EPOCHS
        for epoch in range(EPOCHS):
            steps = range(epoch * 6 + 1, epoch * 6 + 7)
            union = [i for s in steps for i in step_rows(run_, s)[rank]["indices"]]
            assert fingerprint(np.array(union)) == logged[epoch]


def test_index_lists_every_step_that_trained_on_it(on_path: SimpleNamespace) -> None:
    truth = [recorded_steps(c) for c in on_path.consumed]
    padded_repeat = truth[1][5][-1]  # rank 1's last slot of epoch 0 repeats an index
    for index in sorted({0, 7, N - 1, padded_repeat}):
        expected = sorted(
            (step // 6, step + 1, rank)
            for rank in range(W)
            for step, batch in enumerate(truth[rank])
            for i in batch
            if i == index
        )
        code, out, _ = cli(on_path.run_dir, "--index", index, "--json")
        hits = [json.loads(line) for line in out.splitlines()]
        assert code == 0
        assert sorted((h["epoch"], h["step"], h["rank"]) for h in hits) == expected
    assert len(index_hits(load_run(on_path.run_dir), padded_repeat)) == 3  # once + the repeat


def test_save_writes_the_batch_through_the_data_config(on_path: SimpleNamespace, tmp_path) -> None:
    code, out, err = cli(on_path.run_dir, "--step", 6, "--save", tmp_path / "batch.pt")
    assert code == 0 and "rank 1: epoch 0, position 20:" in out and "batch.pt" in err
    saved = torch.load(tmp_path / "batch.pt", weights_only=True)
    assert (saved["step"], saved["epoch"], saved["position"]) == (6, 0, 20)
    splits_train = load_run(on_path.run_dir).train
    for entry, truth in zip(saved["ranks"], on_path.consumed, strict=True):
        assert entry["index"].tolist() == truth[20:23]
        assert torch.equal(entry["x"], torch.stack([splits_train[i][0] for i in truth[20:23]]))
        assert entry["y"].tolist() == [splits_train[i][1] for i in truth[20:23]]


def test_bad_input_is_one_sentence_and_exit_2(on_path: SimpleNamespace, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    cases = [
        ((tmp_path / "nope", "--step", 1), "does not exist"),
        ((tmp_path / "empty", "--step", 1), "config.yaml is missing"),
        ((on_path.run_dir, "--step", 0), "outside this run's steps [1, 12]"),
        ((on_path.run_dir, "--step", 13), "outside this run's steps [1, 12]"),
        ((on_path.run_dir, "--index", N), f"outside the training set [0, {N})"),
        ((on_path.run_dir, "--index", 1, "--save", tmp_path / "x.pt"), "--save needs --step"),
        ((on_path.run_dir, "--step", 1, "--world-size", 3), "contradicts the 2 ranks"),
    ]
    for args, message in cases:
        code, out, err = cli(*args)
        assert (code, out) == (2, "")
        assert err.startswith("error: ") and message in err and err.count("\n") == 1


# runpy re-executes the module this process already imported (as -m would in a fresh one).
@pytest.mark.filterwarnings("ignore:'ddp_template.replay' found in sys.modules:RuntimeWarning")
def test_the_command_line_entry_point(
    on_path: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``python -m ddp_template.replay``: the module's ``__main__`` block, run as ``-m`` runs
    it (runpy), in this process (a fresh interpreter would only add torch's import)."""
    import runpy

    argv = ["replay", str(on_path.run_dir), "--step", "99"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("ddp_template.replay", run_name="__main__", alter_sys=True)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    assert err.strip().count("\n") == 0 and "step=99 is outside" in err
