"""``s3://bucket/prefix`` as a ``storage.Storage`` (``storage.SCHEMES``): objects through boto3.

Credentials come the standard way, boto3's chain: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``
(``AWS_SESSION_TOKEN``), ``AWS_PROFILE`` and the shared config and credentials files, an
instance or container role; ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) points it at an
S3-compatible store. Nothing here prints, logs or stores a credential: a refusal names the
object and the store's error code, never a key.

Every request is retried here, not inside botocore (its own retries are off, so each fault is
seen and counted): ``ATTEMPTS`` tries with exponential backoff and full jitter on what object
stores return under load — a 5xx, throttling (``SlowDown``…), a connection reset or timeout, and
a short read (fewer bytes than the range asked for, which is never returned). After the last
try, one sentence names the object and the byte range. A missing bucket or object and refused
credentials are not retried: one sentence (``ConfigError``) each.

Each process makes its own client (a loader worker after the fork, too); a client is shared by
the process's threads (boto3's clients are thread-safe).
"""

from __future__ import annotations

import functools
import io
import logging
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, TypeVar

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystemBase

from ddp_template.errors import ConfigError
from ddp_template.storage import Fill, RangeFile

ATTEMPTS = 6  # tries of one request before it fails (5 retries)
BACKOFF_S = 0.05  # the first retry's longest wait; doubled per retry (full jitter), capped
BACKOFF_CAP_S = 2.0
PART_BYTES = 64 << 20  # a published object above this goes up in parts (multipart upload)
SPOOL_BYTES = 64 << 20  # an object being written stays in memory up to this, then a temp file
READ_BYTES = 8 << 20  # an object opened as a file is read in ranges of this many bytes

THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded"}
TRANSIENT = THROTTLED | {"InternalError", "ServiceUnavailable", "RequestTimeout", "503", "500"}
REFUSED = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AllAccessDisabled",
    "403",  # a HEAD's refusal: no body, so no code but its status
}
MISSING = {"NoSuchKey", "404", "NotFound"}

T = TypeVar("T")


class ReadFailed(OSError):
    """A request still failing after ``ATTEMPTS`` tries: one sentence naming the object (and
    the byte range)."""


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` → ``("bucket", "a/b")``."""
    rest = url.removeprefix("s3://")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ConfigError(f"{url} names no bucket; write s3://<bucket>/<key>.")
    return bucket, key.strip("/")


_clients: dict[int, Any] = {}
_clients_lock = threading.Lock()


def client() -> Any:
    """This process's S3 client (botocore's retries off: ``Bucket`` retries)."""
    pid = os.getpid()
    with _clients_lock:
        if pid not in _clients:
            import boto3
            from botocore.config import Config

            _clients.clear()  # a forked copy's parent's client is not this process's
            logging.getLogger("botocore").setLevel(logging.WARNING)  # "Found credentials in…"
            _clients[pid] = boto3.session.Session().client(
                "s3",
                config=Config(
                    retries={"total_max_attempts": 1, "mode": "standard"},
                    connect_timeout=10,
                    read_timeout=60,
                    max_pool_connections=32,
                ),
            )
        return _clients[pid]


@dataclass
class Counts:
    """What this process's requests met: bytes read, retries (by the kind of fault)."""

    bytes_read: int = 0
    reads: int = 0
    retries: int = 0

    def add(self, **counts: int) -> None:
        with _clients_lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)


COUNTS = Counts()


def _code(exc: BaseException) -> str | None:
    """A ClientError's code (or its HTTP status), else None."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code or str(status)


def _unwrapped(exc: Exception) -> Exception:
    """boto3's upload wraps the store's ``ClientError`` in ``S3UploadFailedError`` (its message
    only): the error it was raised from, to classify."""
    cause = exc.__context__
    if type(exc).__name__ == "S3UploadFailedError" and isinstance(cause, Exception):
        return cause
    return exc


def _transient(exc: BaseException) -> bool:
    from botocore import exceptions as bx
    from urllib3 import exceptions as ux

    code = _code(exc)
    if code is not None:
        status = getattr(exc, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in TRANSIENT or (isinstance(status, int) and status >= 500)
    return isinstance(
        exc,
        bx.ConnectionError
        | bx.ReadTimeoutError
        | bx.ResponseStreamingError
        | bx.IncompleteReadError
        | ux.HTTPError
        | ConnectionError
        | ShortRead,
    )


class ShortRead(OSError):
    """A body with fewer bytes than the request's range: retried."""


class Bucket:
    """The objects under ``s3://bucket/prefix``, by name relative to it."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/")
        self.bucket, self.prefix = split_url(self.root)

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}".strip("/") if self.prefix else name.strip("/")

    def where(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.key(name)}"

    def _call(self, what: str, name: str, request: Callable[[], T]) -> T:
        """``request()``, retried on transient faults; a refusal in one sentence."""
        for attempt in range(ATTEMPTS):
            try:
                return request()
            except Exception as raised:
                exc = _unwrapped(raised)
                code = _code(exc)
                if code is not None and not _transient(exc):
                    raise self._refusal(code, name) from None
                if not _transient(exc):
                    raise
                if attempt == ATTEMPTS - 1:
                    raise ReadFailed(
                        f"{what} {self.where(name)} failed {ATTEMPTS} times (last: "
                        f"{code or type(exc).__name__}); check the store at "
                        f"{endpoint()} and rerun: a resumed run continues where it stopped."
                    ) from None
                COUNTS.add(retries=1)
                time.sleep(random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_S * 2**attempt)))
        raise AssertionError("unreachable")

    def _refusal(self, code: str, name: str) -> ConfigError:
        if code == "NoSuchBucket":
            return ConfigError(
                f"bucket {self.bucket} (of {self.where(name)}) does not exist at {endpoint()}; "
                f"create it or fix the URL."
            )
        if code in MISSING:
            return ConfigError(
                f"{self.where(name)} does not exist; fix the URL or write the object first."
            )
        if code in REFUSED:
            return ConfigError(
                f"the store refuses the credentials found for {self.where(name)} ({code}); "
                f"set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to ones that "
                f"may use it."
            )
        return ConfigError(f"{self.where(name)}: the store answered {code}; fix the request.")

    def _guarded(self, what: str, name: str, request: Callable[[], T]) -> T:
        """``_call``, with no credentials at all said in one sentence too."""
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError

        try:
            return self._call(what, name, request)
        except (NoCredentialsError, PartialCredentialsError):
            raise ConfigError(
                f"no AWS credentials were found for {self.where(name)}; set AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY, or AWS_PROFILE (AWS_ENDPOINT_URL for an S3-compatible "
                f"store)."
            ) from None

    def read_range(self, name: str, begin: int, end: int) -> bytes:
        if end <= begin:
            return b""

        def get() -> bytes:
            body = client().get_object(
                Bucket=self.bucket, Key=self.key(name), Range=f"bytes={begin}-{end - 1}"
            )["Body"]
            try:
                data = body.read()
            finally:
                body.close()
            if len(data) != end - begin:
                raise ShortRead(f"{len(data)} of {end - begin} bytes")
            return data

        data = self._guarded(f"reading bytes {begin}..{end} of", name, get)
        COUNTS.add(bytes_read=len(data), reads=1)
        return data

    def read(self, name: str) -> bytes:
        def get() -> bytes:
            response = client().get_object(Bucket=self.bucket, Key=self.key(name))
            data = response["Body"].read()
            if len(data) != response["ContentLength"]:
                raise ShortRead(f"{len(data)} of {response['ContentLength']} bytes")
            return data

        data = self._guarded("reading", name, get)
        COUNTS.add(bytes_read=len(data), reads=1)
        return data

    def open(self, name: str) -> IO[bytes]:
        """A small object in one read; a larger one read by ranges as it is read."""
        whole = RangeFile(self, name)
        if whole.length <= READ_BYTES:
            return io.BytesIO(self.read(name))
        return io.BufferedReader(whole, buffer_size=READ_BYTES)

    def size(self, name: str) -> int:
        head = self._guarded(
            "asking the size of",
            name,
            lambda: client().head_object(Bucket=self.bucket, Key=self.key(name)),
        )
        return int(head["ContentLength"])

    def tag(self, name: str) -> str:
        """The object's ETag: changes whenever the object is written again."""
        head = self._guarded(
            "asking the ETag of",
            name,
            lambda: client().head_object(Bucket=self.bucket, Key=self.key(name)),
        )
        return str(head["ETag"]).strip('"')

    def exists(self, name: str) -> bool:
        def head() -> Any:
            try:
                return client().head_object(Bucket=self.bucket, Key=self.key(name))
            except Exception as exc:
                if _code(exc) in MISSING:
                    return None
                raise

        return self._guarded("looking for", name, head) is not None

    def _listed(self, name: str, delimiter: str | None) -> Iterator[dict[str, Any]]:
        """The listing's pages of everything under the folder ``name`` (by key prefix)."""
        key = self.key(name)
        prefix = f"{key}/" if key else ""
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            if delimiter:
                kwargs["Delimiter"] = delimiter
            if token:
                kwargs["ContinuationToken"] = token
            page: dict[str, Any] = self._guarded(
                "listing", name, functools.partial(client().list_objects_v2, **kwargs)
            )
            yield page
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]

    def names(self, folder: str = "") -> list[str]:
        prefix = self.key(folder)
        prefix = f"{prefix}/" if prefix else ""
        found: set[str] = set()
        for page in self._listed(folder, "/"):
            folders = page.get("CommonPrefixes", [])
            found |= {c["Prefix"][len(prefix) :].rstrip("/") for c in folders}
            found |= {o["Key"][len(prefix) :] for o in page.get("Contents", [])}
        return sorted(n for n in found if n)

    def publish(self, name: str, fill: Fill, before: Callable[[], None] | None = None) -> None:
        """The bytes spooled (memory, then a temp file), then one PUT (or a multipart upload
        completed at once): S3 shows the old object or the whole new one."""
        with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as spool:
            fill(spool)
            if before is not None:
                before()
            self.put(name, spool)

    def put(self, name: str, data: IO[bytes]) -> None:
        from boto3.s3.transfer import TransferConfig

        transfer = TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES)

        def upload() -> None:
            data.seek(0)
            if data.seek(0, io.SEEK_END) <= PART_BYTES:  # one PUT: the store's own errors
                data.seek(0)
                client().put_object(Bucket=self.bucket, Key=self.key(name), Body=data.read())
                return
            data.seek(0)
            client().upload_fileobj(data, self.bucket, self.key(name), Config=transfer)

        self._guarded("writing", name, upload)

    def copy(self, name: str, new_name: str) -> None:
        self._guarded(
            "copying",
            name,
            lambda: client().copy_object(
                Bucket=self.bucket,
                Key=self.key(new_name),
                CopySource={"Bucket": self.bucket, "Key": self.key(name)},
            ),
        )

    def remove(self, name: str) -> None:
        key = self.key(name)
        keys = [key] + [
            o["Key"] for page in self._listed(name, None) for o in page.get("Contents", [])
        ]
        for k in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": x} for x in keys[k : k + 1000]], "Quiet": True}
            delete = functools.partial(client().delete_objects, Bucket=self.bucket, Delete=batch)
            self._guarded("deleting", name, delete)

    def dcp_writer(self, name: str) -> FileSystemWriter:
        return DcpWriter(self, name)

    def dcp_reader(self, name: str) -> FileSystemReader:
        return DcpReader(self, name)


def endpoint() -> str:
    """Where requests go (no credential in it): AWS_ENDPOINT_URL, or AWS's own S3."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"


class Upload(io.BytesIO):
    """An object being written: published whole when closed (DCP closes its streams)."""

    def __init__(self, bucket: Bucket, name: str) -> None:
        super().__init__()
        self.bucket, self.name, self.published = bucket, name, False

    def close(self) -> None:
        if not self.published and not self.closed:
            self.published = True
            self.bucket.put(self.name, io.BytesIO(self.getbuffer()))
        super().close()


class Files(FileSystemBase):
    """DCP's file system over a bucket: a path is a name in it; a write is spooled and
    published whole when its stream closes."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase]:
        name = str(path)
        if "r" in mode:
            with self.bucket.open(name) as f:
                yield f  # type: ignore[misc]
            return
        with Upload(self.bucket, name) as upload:
            yield upload

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{path}/{suffix}"

    def init_path(self, path: str | os.PathLike, **kwargs: Any) -> str:
        return str(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.bucket.copy(str(path), str(new_path))
        self.bucket.remove(str(path))

    def mkdir(self, path: str | os.PathLike) -> None:
        pass  # a bucket has no folders: a name's prefix is one

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return str(checkpoint_id).startswith("s3://")

    def exists(self, path: str | os.PathLike) -> bool:
        return self.bucket.exists(str(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        self.bucket.remove(str(path))

    def ls(self, path: str | os.PathLike) -> list[str]:
        return [f"{path}/{n}" for n in self.bucket.names(str(path))]


class DcpWriter(FileSystemWriter):
    """DCP's writer into ``name`` of a bucket (the metadata last, as DCP writes it)."""

    def __init__(self, bucket: Bucket, name: str) -> None:
        super().__init__(name, sync_files=False)  # durable once a PUT returns
        self.fs = Files(bucket)  # type: ignore[assignment]
        self.path = name

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return Files.validate_checkpoint_id(checkpoint_id)


class DcpReader(FileSystemReader):
    """DCP's reader of ``name`` in a bucket, each item by its byte range."""

    def __init__(self, bucket: Bucket, name: str) -> None:
        super().__init__(name)
        self.fs = Files(bucket)  # type: ignore[assignment]
        self.path = name

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return Files.validate_checkpoint_id(checkpoint_id)
