"""data=webdataset from s3://: the digits as uneven tar shards in the local S3 server, read by
2 ranks x 2 loader workers through its fault proxy.

Two real launches share the module: a fault-free one, and one where 5% of the range reads fail
once with 503 SlowDown and one block read is cut halfway (a connection reset mid-shard). Both
end every epoch with the verdict ok, replay lists each key of epoch 0 once, and the retried
reads change nothing: the final weights are the same bit for bit. A wrong bucket, a missing
shard and refused credentials are one sentence each naming the setting; through train.py the
refusal exits 2 and the secret is in no output and no file of the run.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import jsonl, run, run_env, train_cmd

from ddp_template.errors import EXIT_CONFIG_ERROR, ConfigError
from ddp_template.optional.s3 import bucket
from ddp_template.optional.s3.server import LocalS3

pytestmark = pytest.mark.needs("webdataset")

URL = "s3://digits/v1"
TRAIN, TEST = f"{URL}/train-{{000000..000003}}.tar", f"{URL}/test-000000.tar"
DATA = ["data=webdataset", f"data.train_urls='{TRAIN}'", f"data.test_urls='{TEST}'"]
RUN = [
    *DATA,
    "data.shuffle_block=16",
    "dist.nproc=2",
    "loader.num_workers=2",
    "sampler=exact",
    "epochs=2",
]


@pytest.fixture(scope="module")
def shards(s3_server: LocalS3, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The digits written as 4 shards of 400, 400, 400 and 238 samples, uploaded."""
    from ddp_template.optional.webdataset.writer import main

    out = tmp_path_factory.mktemp("digits")
    assert (
        main(["write", "--from", "data=digits", "--out", str(out), "--samples-per-shard", "400"])
        == 0
    )
    s3_server.bucket("digits")
    return s3_server.upload(out, URL)


def launch(server: LocalS3, out: Path, run_id: str) -> Path:
    run(train_cmd(out, *RUN), env=run_env(RUN_ID=run_id, **server.env), timeout=240, leftovers=10)
    return out / "outputs" / run_id


@pytest.fixture(scope="module")
def clean(s3_server: LocalS3, shards: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch(s3_server, tmp_path_factory.mktemp("clean"), "clean")


@pytest.fixture(scope="module")
def faulty(s3_server: LocalS3, clean: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run through faults (after the clean one: the shards' indexes are cached, so the
    cut falls on a block read of training, not on the scan)."""
    faults = s3_server.faults
    assert faults is not None
    failed, cut = faults.served.failed, faults.served.cut
    faults.fail_share, faults.cuts, faults.cut_min_bytes = 0.05, 1, 16 << 10
    try:
        run_dir = launch(s3_server, tmp_path_factory.mktemp("faulty"), "faulty")
    finally:
        faults.fail_share, faults.cuts, faults.cut_min_bytes = 0.0, 0, 1024
    assert faults.served.failed > failed and faults.served.cut == cut + 1
    return run_dir


def verdicts(run_dir: Path) -> list[int]:
    rows = jsonl(run_dir / "rank0" / "metrics.jsonl")
    return [row["shares/verdict_ok"] for row in rows if "shares/verdict_ok" in row]


def test_s3_shards_give_every_epoch_a_verdict_and_replay_each_key_once(s3, clean) -> None:
    from ddp_template.replay import load_run, step_rows

    assert verdicts(clean) == [1, 1]
    held = set(bucket.Bucket(URL).names())
    assert {f"train-00000{s}.tar.idx.json" for s in range(4)} <= held  # the index, cached
    replayed, keys = load_run(clean), Counter()
    for piece in (p for p in replayed.pieces if p.epoch == 0):
        for step in range(piece.first_step, piece.first_step + piece.steps):
            keys.update(key for row in step_rows(replayed, step) for key in row["keys"])
    assert len(keys) == 1438 and set(keys.values()) == {1}


def test_failed_and_cut_reads_are_retried_to_the_same_weights(clean, faulty) -> None:
    assert verdicts(faulty) == [1, 1]
    a, b = (
        torch.load(d / "checkpoints/last.pt", weights_only=True)["model"] for d in (clean, faulty)
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("urls", "said"),
    [
        (
            "s3://no-such-bucket/train-000000.tar",
            "data.train_urls=s3://no-such-bucket/train-000000.tar: bucket no-such-bucket (of "
            "s3://no-such-bucket/) does not exist",
        ),
        (
            f"{URL}/train-{{000000..000004}}.tar",
            f"data.train_urls={URL}/train-{{000000..000004}}.tar names {URL}/train-000004.tar, "
            "which does not exist; fix the pattern",
        ),
    ],
)
def test_a_wrong_bucket_or_shard_is_one_sentence_naming_the_setting(s3, shards, urls, said) -> None:
    from ddp_template.optional.webdataset.splits import webdataset

    with pytest.raises(ConfigError) as refused:
        webdataset(train_urls=urls, test_urls=TEST)
    assert str(refused.value).startswith(said) and "\n" not in str(refused.value)


def test_refused_credentials_exit_2_and_the_secret_is_nowhere(s3, shards, tmp_path) -> None:
    secret = "s3-data-secret-5f0c2b9e7d"
    env = run_env(RUN_ID="refused", **{**s3.env, "AWS_SECRET_ACCESS_KEY": secret})
    proc = run(train_cmd(tmp_path, *RUN), env=env, check=False, timeout=120, leftovers=10)
    output = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_CONFIG_ERROR, output[-3000:]
    said = [line for line in output.splitlines() if "refuses the credentials" in line]
    assert said and f"data.train_urls={TRAIN}: the store refuses" in said[0], output[-3000:]
    assert "Traceback" not in output and secret not in output
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files and not [p for p in files if secret.encode() in p.read_bytes()]
