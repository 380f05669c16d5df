"""Preloaded by a fork server in test_quick_exit: writes to ``$TEARDOWN_PROBE`` when it is
imported (with the pid and whether the cyclic GC is on), when the exit handlers run, and when
Python tears the module down."""

from __future__ import annotations

import atexit
import gc
import os


class _Probe:
    def __init__(self, fd: int) -> None:
        self.fd, self.write = fd, os.write  # os may be gone by the time of the teardown

    def __del__(self) -> None:
        self.write(self.fd, b"torn down\n")


_fd = os.open(os.environ["TEARDOWN_PROBE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
os.write(_fd, f"imported {os.getpid()} gc {gc.isenabled()}\n".encode())
atexit.register(os.write, _fd, b"handlers ran\n")
probe = _Probe(_fd)
