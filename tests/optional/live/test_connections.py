"""A connection severed from another thread: the thread blocked reading it (as gloo's pair is
in a collective waiting on a cut host) sees the stream end at once, the other connections
(the store's port, other addresses) untouched. In a child process: severing the loopback would
cut the test process's own connections."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from helpers import ROOT

CHILD = textwrap.dedent(
    """
    import socket, threading, time
    from ddp_template.optional.live.connections import sever

    def pair(address):
        server = socket.create_server((address, 0))
        client = socket.create_connection(server.getsockname(), source_address=(address, 0))
        peer, _ = server.accept()
        return server, client, peer

    waited, store, other = pair("127.0.0.1"), pair("127.0.0.1"), pair("127.0.0.2")
    ended = []

    def wait():
        start = time.monotonic()
        ended.append((waited[1].recv(1), time.monotonic() - start))

    reader = threading.Thread(target=wait)
    reader.start()
    time.sleep(0.2)  # the reader is blocked in recv: nothing will ever arrive
    shut = sever({"127.0.0.1"}, keep_port=store[0].getsockname()[1])
    reader.join(timeout=5)
    other[1].sendall(b"x")
    print(shut, ended[0][0], round(ended[0][1], 3), other[2].recv(1))
    """
)


def test_a_severed_connection_ends_the_read_waiting_on_it() -> None:
    """Severed: both ends of the waited pair, and the store pair's accepted end (its remote
    port is not the store's); kept: the store pair's client end, and the pair on 127.0.0.2."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=True,
    ).stdout.split()
    shut, read, waited_s, other = int(out[0]), out[1], float(out[2]), out[3]
    assert shut == 3, out
    assert read == "b''" and waited_s < 1.0, out
    assert other == "b'x'", out
