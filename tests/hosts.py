"""Hosts on one machine: network namespaces with their own addresses, names and links.

``Hosts(n)`` makes ``n`` hosts ``host0 … host<n-1>``, each a network namespace with

- ``eth0`` at ``10.77.0.<i+1>/24``, a veth whose other end is a port of a bridge that lives in
  a namespace of its own (the "switch"): the machine's own network is never touched;
- ``data0`` at ``10.78.<i>.1/24``, a second interface that reaches nothing (a veth whose
  other end is left alone), listed
  before ``eth0``: what a host with a management or InfiniBand interface looks like;
- its own hostname (a UTS namespace per command) and hosts file (``ip netns exec`` mounts
  ``/etc/netns/<ns>/hosts``), in which, as on Debian, its own name is ``127.0.1.1`` and the
  others' names are their ``eth0`` addresses.

``run``/``popen`` start a command on a host; ``cut``/``heal`` set the host's switch port down
and up (its processes stay alive, its packets go nowhere); ``kill`` SIGKILLs every process of
the host at once. Leaving the ``with`` block kills what is left and removes every namespace
and file it made, also when the test failed. Tests and benchmarks use it; it needs root.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

SUBNET = "10.77.0"
NETNS_ETC = Path("/etc/netns")


def address(host: int) -> str:
    return f"{SUBNET}.{host + 1}"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "the ip (iproute2) and unshare (util-linux) commands are missing"
    probe = f"ddpt-probe-{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as err:
        return f"ip netns add failed: {err.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


class Hosts:
    def __init__(self, n: int) -> None:
        self.n = n
        self.tag = uuid.uuid4().hex[:6]
        self.switch = f"ddpt-{self.tag}-sw"
        self.names = [f"host{i}" for i in range(n)]
        self.netns = [f"ddpt-{self.tag}-h{i}" for i in range(n)]
        self._made: list[str] = []

    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.netns):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", "data0", "type", "veth", "peer", "data0-end")
            _ip("-n", ns, "link", "set", "data0-end", "up")
            _ip("-n", ns, "addr", "add", f"10.78.{i}.1/24", "dev", "data0")
            _ip("-n", ns, "link", "set", "data0", "up")
            port = f"p{i}"
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "eth0", "netns", ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            etc = NETNS_ETC / ns
            etc.mkdir(parents=True, exist_ok=True)
            lines = ["127.0.0.1 localhost", f"127.0.1.1 {self.names[i]}"]
            lines += [f"{address(j)} {name}" for j, name in enumerate(self.names) if j != i]
            (etc / "hosts").write_text("\n".join(lines) + "\n")
            (etc / "hostname").write_text(self.names[i] + "\n")

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``host``: in its network namespace, under its own hostname."""
        name = self.names[host]
        inner = f'hostname {name} && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            self.netns[host],
            "unshare",
            "--uts",
            "sh",
            "-c",
            inner,
            "sh",
            *argv,
        ]

    def popen(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), **kwargs)

    def run(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), **kwargs)

    def pids(self, host: int) -> list[int]:
        out = subprocess.run(
            ["ip", "netns", "pids", self.netns[host]], capture_output=True, text=True
        ).stdout
        return [int(p) for p in out.split()]

    def kill(self, host: int, sig: int = signal.SIGKILL) -> list[int]:
        """Every process of ``host`` gets ``sig`` (SIGKILL: the host is gone), all at once."""
        pids = self.pids(host)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def cut(self, host: int) -> None:
        """The host's link goes down at the switch: its processes live on, unreachable."""
        _ip("-n", self.switch, "link", "set", f"p{host}", "down")

    def heal(self, host: int) -> None:
        _ip("-n", self.switch, "link", "set", f"p{host}", "up")

    def close(self) -> None:
        for ns in self._made:
            host = self.netns.index(ns) if ns in self.netns else None
            if host is not None:
                self.kill(host)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        self._made.clear()


@contextlib.contextmanager
def hosts(n: int) -> Iterator[Hosts]:
    with Hosts(n) as made:
        yield made
