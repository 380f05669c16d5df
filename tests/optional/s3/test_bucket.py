"""``s3://`` storage against the local S3 server: exact ranges through faults, atomic publish,
DCP through it, and one sentence for each refusal, never a credential."""

from __future__ import annotations

import io
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ddp_template import storage
from ddp_template.errors import ConfigError
from ddp_template.optional.s3 import bucket


def test_range_reads_are_exact_through_failures_and_cut_bodies(s3) -> None:
    s3.bucket("ranges")
    where = storage.at("s3://ranges/run")
    data = bytes(range(256)) * 64
    where.publish("blob", lambda f: f.write(data))
    s3.faults.fail_share, s3.faults.cuts, s3.faults.cut_min_bytes = 0.3, 3, 64
    before, failed = bucket.COUNTS.retries, s3.faults.served.failed
    got = [where.read_range("blob", k * 100, k * 100 + 300) for k in range(40)]
    assert got == [data[k * 100 : k * 100 + 300] for k in range(40)]
    faults = s3.faults.served.failed - failed + 3
    assert s3.faults.served.cut == 3 and faults > 3
    assert bucket.COUNTS.retries - before == faults  # each fault retried once, none hidden


def test_a_read_failing_every_try_names_the_object_and_range(s3, monkeypatch) -> None:
    s3.bucket("always")
    where = storage.at("s3://always")
    where.publish("o", lambda f: f.write(b"x" * 1000))
    monkeypatch.setattr(bucket, "BACKOFF_S", 0.001)
    s3.faults.down = True
    asked = s3.faults.served.requests
    with pytest.raises(bucket.ReadFailed) as failed:
        where.read_range("o", 10, 20)
    assert str(failed.value).startswith(
        f"reading bytes 10..20 of s3://always/o failed {bucket.ATTEMPTS} times (last: SlowDown)"
    )
    assert s3.faults.served.requests - asked == bucket.ATTEMPTS


def test_publish_is_whole_or_nothing(s3) -> None:
    s3.bucket("atomic")
    where = storage.at("s3://atomic/ck")
    where.publish("last.pt", lambda f: torch.save({"v": 1}, f))

    def fail() -> None:
        raise RuntimeError("killed between writing and publishing")

    with pytest.raises(RuntimeError):
        where.publish("last.pt", lambda f: torch.save({"v": 2}, f), before=fail)
    assert torch.load(io.BytesIO(where.read("last.pt")))["v"] == 1
    assert where.names() == ["last.pt"]


def test_dcp_round_trip_and_removal(s3) -> None:
    s3.bucket("slices")
    where = storage.at("s3://slices/run")
    state = {"w": torch.randn(64, 8), "b": torch.arange(5)}
    with pytest.warns(UserWarning):  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=where.dcp_writer("slices/a"), no_dist=True)
    assert ".metadata" in where.names("slices/a")
    loaded = {"w": torch.zeros(64, 8), "b": torch.zeros(5, dtype=torch.long)}
    with pytest.warns(UserWarning):
        dcp.load(loaded, storage_reader=where.dcp_reader("slices/a"), no_dist=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    where.remove("slices")
    assert where.names() == []


@pytest.mark.parametrize(
    ("url", "said"),
    [
        (
            "s3://no-such-bucket/x",
            "bucket no-such-bucket (of s3://no-such-bucket/x/o) does not exist",
        ),
        ("s3://known/missing", "s3://known/missing/o does not exist; fix the URL"),
    ],
)
def test_a_wrong_bucket_or_object_is_one_sentence(s3, url, said) -> None:
    s3.bucket("known")
    with pytest.raises(ConfigError, match=re.escape(said)):
        storage.at(url).read("o")


def test_bad_credentials_are_refused_without_saying_them(s3, monkeypatch) -> None:
    s3.bucket("guarded")
    storage.at("s3://guarded").publish("o", lambda f: f.write(b"1"))
    secret = "wrong-secret-0123456789abcdef"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    bucket._clients.clear()
    with pytest.raises(ConfigError) as refused:
        storage.at("s3://guarded").read("o")
    said = str(refused.value)
    assert "refuses the credentials" in said and "SignatureDoesNotMatch" in said
    assert secret not in said and s3.env["AWS_ACCESS_KEY_ID"] not in said
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    bucket._clients.clear()
    with pytest.raises(ConfigError, match="no AWS credentials were found for s3://guarded/o"):
        storage.at("s3://guarded").read("o")


def test_a_scheme_nobody_reads_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint.folder=gs://b/x is a gs: URL"):
        storage.at("gs://b/x")
