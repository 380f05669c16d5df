"""The local S3 server (moto, credentials checked) behind the fault proxy, one per test module:
``s3.env`` is what a run's processes need; ``s3.faults`` is changed by a test and reset after it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ddp_template.optional.s3 import bucket
from ddp_template.optional.s3.server import Faults, LocalS3


@pytest.fixture(scope="module")
def s3_server() -> Iterator[LocalS3]:
    with LocalS3(Faults()) as server:
        yield server


@pytest.fixture
def s3(s3_server: LocalS3, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalS3]:
    """The module's server, its credentials in this process's environment too; the faults
    cleared after the test."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    bucket._clients.clear()  # a client made before holds the environment of then
    yield s3_server
    assert s3_server.faults is not None
    fresh = Faults()  # the proxy holds this object: reset in place
    for name in ("fail_share", "down", "cuts", "cut_min_bytes", "delay_s"):
        setattr(s3_server.faults, name, getattr(fresh, name))
    bucket._clients.clear()
