"""Ending a process that has imported torch without Python's teardown of torch.

Python's own exit ends by tearing down every module, which for torch (millions of objects) takes
about half a second in a launcher and a second with ``torch._dynamo`` loaded, and a shell pipe,
a batch system or a test's leak check waits for it. :func:`run` does everything else that exit
does, in its order (joins the non-daemon threads, runs every exit handler: logging's flush,
multiprocessing's, W&B's), flushes stdio, then ends with ``os._exit``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn


def run(main: Callable[[], Any]) -> NoReturn:
    """Call ``main``; end with its exit status: 0 when it returns, ``n`` for ``sys.exit(n)``
    (a message: printed, then 1, as Python does). An uncaught exception keeps Python's own
    exit, traceback and all."""
    try:
        main()
    except SystemExit as exc:
        code = exc.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        _finish(code or 0)
    _finish(0)


def _finish(status: int) -> NoReturn:
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    exit_now(status)


def exit_now(status: int) -> NoReturn:
    """Flush stdio and end with ``status``, running nothing else (no teardown)."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(status)
