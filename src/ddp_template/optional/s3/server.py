"""A real S3 server on this machine, and faults injected in front of it: for the tests, the
benchmark, and trying ``s3://`` runs on a laptop.

    python -m ddp_template.optional.s3.server --bucket data [--upload FOLDER s3://data/x]
    # prints the AWS_* lines to export; Ctrl-C stops

:class:`LocalS3` runs moto's S3 server (``moto[server]``) in this process on a loopback port,
with its credentials checked (an IAM user and its key, made once per process; any other key is
refused as S3 refuses it). :class:`Faults` is an HTTP proxy in front of it that passes every
request on (its signature intact: the Host header is kept) and, as told, answers a share of
range reads once with ``503 SlowDown``, cuts a number of range reads' bodies halfway (a
connection reset mid-object), or delays every request. It counts what it served: requests,
range reads, faults, body bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REGION = "us-east-1"
_POLICY = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
}
_key: dict[str, str] = {}  # this process's IAM user's key (moto's state is the process's)
_key_lock = threading.Lock()


@dataclass
class Served:
    """What the fault proxy passed on and did."""

    requests: int = 0
    range_reads: int = 0
    failed: int = 0  # answered 503 SlowDown
    cut: int = 0  # body cut halfway, connection closed
    body_bytes: int = 0  # body bytes sent back on GETs (cut ones: what was sent)


@dataclass
class Faults:
    """What the proxy injects: ``fail_share`` of the distinct range reads fail once (chosen by
    a hash of object and range, so the same ones in every run), the first ``cuts`` range reads
    of at least ``cut_min_bytes`` are cut halfway, every request waits ``delay_s`` first;
    ``down``: every GET fails (a store that stays down)."""

    fail_share: float = 0.0
    down: bool = False
    cuts: int = 0
    cut_min_bytes: int = 1024
    delay_s: float = 0.0
    served: Served = field(default_factory=Served)
    _failed: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def verdict(self, path: str, range_: str | None, length: int) -> str:
        """``pass``, ``fail`` or ``cut`` for one GET."""
        with self._lock:
            self.served.requests += 1
            if range_ is None:
                return "fail" if self.down else "pass"
            self.served.range_reads += 1
            what = f"{path} {range_}"
            draw = int(hashlib.sha256(what.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
            if self.down or (draw < self.fail_share and what not in self._failed):
                self._failed.add(what)
                self.served.failed += 1
                return "fail"
            if self.served.cut < self.cuts and length >= self.cut_min_bytes:
                self.served.cut += 1
                return "cut"
            return "pass"

    def sent(self, n: int) -> None:
        with self._lock:
            self.served.body_bytes += n


_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class Proxy(BaseHTTPRequestHandler):
    """Passes a request on to ``upstream`` and answers as ``faults`` decide."""

    protocol_version = "HTTP/1.1"
    upstream: tuple[str, int]
    faults: Faults

    def log_message(self, *args: Any) -> None:
        pass

    def _forward(self) -> None:
        if self.faults.delay_s:
            time.sleep(self.faults.delay_s)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for name, value in self.headers.items():
            conn.putheader(name, value)
        conn.endheaders(body)
        answer = conn.getresponse()
        data = answer.read()
        conn.close()
        verdict = "pass"
        if self.command == "GET" and answer.status < 300:
            verdict = self.faults.verdict(self.path, self.headers.get("Range"), len(data))
        if verdict == "fail":
            self._slow_down()
        else:
            self._answer(answer, data, cut=verdict == "cut")

    def _slow_down(self) -> None:
        self.send_response(503)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(_SLOW_DOWN)))
        self.end_headers()
        self.wfile.write(_SLOW_DOWN)

    def _answer(self, answer: http.client.HTTPResponse, data: bytes, *, cut: bool) -> None:
        self.send_response(answer.status)
        for name, value in answer.getheaders():
            if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(name, value)
        length_ = answer.getheader("Content-Length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length_ or str(len(data)))
        self.end_headers()
        if cut:
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.faults.sent(len(data) // 2)
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        if self.command != "HEAD":
            self.wfile.write(data)
            if self.command == "GET":
                self.faults.sent(len(data))

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


def _handler(upstream: tuple[str, int], faults: Faults) -> type[Proxy]:
    return type("BoundProxy", (Proxy,), {"upstream": upstream, "faults": faults})


class LocalS3:
    """moto's S3 server on a loopback port (credentials checked), optionally behind
    :class:`Faults`; ``env`` is what a client process needs (endpoint, key, region)."""

    def __init__(self, faults: Faults | None = None) -> None:
        self.faults = faults
        self._moto: Any = None
        self._proxy: ThreadingHTTPServer | None = None
        self.env: dict[str, str] = {}

    def start(self) -> LocalS3:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._moto.start()
        host, port = self._moto.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        if self.faults is not None:
            self._proxy = ThreadingHTTPServer(("127.0.0.1", 0), _handler((host, port), self.faults))
            self._proxy.daemon_threads = True
            threading.Thread(target=self._proxy.serve_forever, daemon=True).start()
            endpoint = f"http://127.0.0.1:{self._proxy.server_address[1]}"
        key = _user_key(f"http://{host}:{port}")
        self.env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": key["id"],
            "AWS_SECRET_ACCESS_KEY": key["secret"],
            "AWS_DEFAULT_REGION": REGION,
        }
        return self

    def stop(self) -> None:
        if self._proxy is not None:
            self._proxy.shutdown()
            self._proxy.server_close()
        if self._moto is not None:
            self._moto.stop()

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def client(self) -> Any:
        """A boto3 client of this server (the test's own, not through the faults)."""
        import boto3

        moto_host, moto_port = self._moto.get_host_and_port()
        return boto3.client(
            "s3",
            endpoint_url=f"http://{moto_host}:{moto_port}",
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name=REGION,
        )

    def bucket(self, name: str) -> str:
        """A new bucket; its URL."""
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"

    def upload(self, folder: Path, url: str) -> list[str]:
        """Every file under ``folder`` to ``url``'s prefix (same relative names); their URLs."""
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        s3, urls = self.client(), []
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            key = "/".join(filter(None, [prefix.strip("/"), path.relative_to(folder).as_posix()]))
            s3.upload_file(str(path), bucket, key)
            urls.append(f"s3://{bucket}/{key}")
        return urls


def _user_key(endpoint: str) -> dict[str, str]:
    """This process's IAM user's key, made while moto still takes requests unsigned; then
    moto checks every request's credentials (``INITIAL_NO_AUTH_ACTION_COUNT`` = 0)."""
    import boto3
    from moto import settings

    with _key_lock:
        if not _key:
            iam = boto3.client(
                "iam",
                endpoint_url=endpoint,
                aws_access_key_id="setup",
                aws_secret_access_key="setup",
                region_name=REGION,
            )
            iam.create_user(UserName="template")
            iam.put_user_policy(
                UserName="template", PolicyName="all", PolicyDocument=json.dumps(_POLICY)
            )
            made = iam.create_access_key(UserName="template")["AccessKey"]
            _key.update(id=made["AccessKeyId"], secret=made["SecretAccessKey"])
            settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
        return dict(_key)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bucket", action="append", default=[], help="create this bucket")
    parser.add_argument(
        "--upload",
        nargs=2,
        action="append",
        default=[],
        metavar=("FOLDER", "URL"),
        help="copy FOLDER's files under s3://bucket/prefix (a bucket --bucket made)",
    )
    args = parser.parse_args(argv)
    with LocalS3() as server:
        for name in args.bucket:
            server.bucket(name)
        for folder, url in args.upload:
            server.upload(Path(folder), url)
        for name, value in server.env.items():
            print(f"export {name}={value}")
        print("# serving until Ctrl-C", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
