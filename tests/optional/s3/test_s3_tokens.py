"""data=tokens from s3://: experiment=lm_bytes on token files in the local S3 server, each
window a range read. Rank 1 is killed mid-epoch at 2 ranks and the run resumed at 3: every
epoch's verdict is ok and replay lists each window of the interrupted epoch once. A bucket that
is not there is one sentence naming data.path."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_killed_rank_reported, jsonl, run, run_env, train_cmd

from ddp_template.errors import ConfigError
from ddp_template.optional.s3.server import LocalS3
from ddp_template.optional.tokens import file

pytestmark = pytest.mark.needs("tokens", "gpt")

URL = "s3://tokens/corpus"
WINDOWS = 281  # (9,000 train tokens - 33) // 32 + 1
LM = [
    "experiment=lm_bytes",
    "logger=none",
    "data=tokens",
    f"data.path={URL}",
    "data.block_size=32",
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "loader.batch_size=8",
    "epochs=2",
    "checkpoint.every_steps=1",
]


@pytest.fixture(scope="module")
def corpus(s3_server: LocalS3, tmp_path_factory: pytest.TempPathFactory) -> str:
    from ddp_template.optional.tokens.corpus import text
    from ddp_template.optional.tokens.writer import write_text

    folder = tmp_path_factory.mktemp("corpus")
    write_text(text(10_000), folder, 0.1)
    s3_server.bucket("tokens")
    s3_server.upload(folder, URL)
    return URL


def test_killed_at_2_ranks_resumed_at_3_every_window_once(s3, corpus, tmp_path) -> None:
    from test_elastic import replayed_epoch

    def launch(*extra: str, check: bool = True):
        cmd = train_cmd(tmp_path, *LM, *extra)
        env = run_env(RUN_ID="lm", **s3.env)
        return run(cmd, env=env, check=check, timeout=240, leftovers=10)

    kill = ["fault.crash_at_step=25", "fault.rank=1", "fault.signal=SIGKILL"]  # epoch 1's 7th
    assert_killed_rank_reported(launch("dist.nproc=2", *kill, check=False), 1, "SIGKILL")
    run_dir = tmp_path / "outputs" / "lm"
    proc = launch("dist.nproc=3", "elastic.global_batch=scale")
    assert "resumed from" in proc.stdout + proc.stderr
    rows = [r for r in jsonl(run_dir / "rank0" / "metrics.jsonl") if "shares/verdict_ok" in r]
    assert [(r["shares/verdict_ok"], r["shares/total_samples"]) for r in rows] == [(1, WINDOWS)] * 2
    seen = replayed_epoch(run_dir, epoch=1)
    assert len(seen) == WINDOWS and set(seen.values()) == {1}


@pytest.mark.parametrize("hold", [file.HOLD_BYTES, 0])
def test_token_windows_held_or_read_by_ranges_are_the_file_s(s3, corpus, tmp_path, hold) -> None:
    """A small object held whole, or (``HOLD_BYTES`` 0) each batch's windows by ranges."""
    from ddp_template.optional.tokens.splits import tokens

    local = tmp_path / "local"
    s3.client().download_file("tokens", "corpus/train.bin", str(local))
    ids = np.fromfile(local, dtype="<u2")
    file._held.clear()
    asked = s3.faults.served.range_reads
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(file, "HOLD_BYTES", hold)
        windows = tokens(corpus, block_size=32).train
        picked = [5, 0, 280, 6, 7, 100]  # near ones share a range; the order is kept
        x, y, index = windows.get_batch(picked)
    want = np.stack([ids[32 * i : 32 * i + 33] for i in picked])
    assert np.array_equal(x.numpy(), want[:, :-1]) and np.array_equal(y.numpy(), want[:, 1:])
    assert index.tolist() == picked
    assert s3.faults.served.range_reads - asked == (1 if hold else 4)  # 0; 5-7; 100; 280
    with pytest.raises(ConfigError, match=r"^data.path=s3://nowhere/c: bucket nowhere \(of "):
        tokens("s3://nowhere/c")
