"""Imported first by every fork server this template starts (``preload.loaded_modules``), and
by nothing else: the server then ends without tearing down torch and ``torch._dynamo``.

A fork server only forks. When its parent exits it raises ``SystemExit``, and Python's teardown
of what it preloaded takes about a second, which a shell pipe, a batch system or a test's leak
check waits for (the reason of :mod:`ddp_template.quick_exit`). Registered before anything else
it imports, this handler runs after every other one, then skips only the teardown. The forks it
serves never run it: each ends with ``os._exit`` after its target, as multiprocessing's
children do.
"""

from __future__ import annotations

import atexit
import os
import sys


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(0)


atexit.register(_exit_now)
