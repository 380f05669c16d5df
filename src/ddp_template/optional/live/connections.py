"""This process's TCP connections to hosts that went silent, shut down.

A gloo collective waiting on a peer whose host is cut off waits for ``backend.timeout_s``: no
packet ever says the peer is gone, and torch can neither abort a gloo collective in flight nor
reconfigure the group under it (both measured on torch 2.14: the collective still waited for
its peer). Shutting the connection's socket down from another thread (a duplicate of its file
descriptor: the shutdown is the socket's, not the descriptor's) makes gloo's pair read the end
of the stream, so the collective fails at once with "Connection closed by peer" and the
survivor comes to the regroup.
"""

from __future__ import annotations

import contextlib
import os
import socket

import psutil


def sever(addresses: set[str], keep_port: int) -> int:
    """Shut down this process's connections to ``addresses`` but those to ``keep_port`` (the
    coordinator's store); returns how many."""
    if not addresses:
        return 0
    shut = 0
    for conn in psutil.Process().net_connections("tcp"):
        remote = conn.raddr
        if not remote or remote.ip not in addresses or remote.port == keep_port or conn.fd < 0:
            continue
        with contextlib.suppress(OSError):
            dup = socket.socket(fileno=os.dup(conn.fd))
            try:
                dup.shutdown(socket.SHUT_RDWR)
                shut += 1
            finally:
                dup.close()
    return shut
