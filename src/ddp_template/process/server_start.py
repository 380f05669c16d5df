"""multiprocessing's fork server, started as a fork of the launcher instead of a new interpreter.

multiprocessing starts its fork server with ``exec``: a fresh interpreter that imports torch and
all that train.py imports again (2 s of CPU on a small machine, before the first rank can start),
though the launching process has imported all of it already. Forked from the launcher, the
server starts with those modules loaded, and a ``dist.nproc`` launch pays for torch's import
once. What the server does afterwards is multiprocessing's own ``forkserver.main``.

A process with Python threads running cannot be forked safely (a lock another thread holds stays
held in the child for good): :func:`start` forks only while this is the only Python thread,
before torch's elastic agent starts its store, and where multiprocessing's ``ForkServer`` has
the fields it has here and no authkey handshake (Python 3.14 adds one). Otherwise
multiprocessing starts its own server, as it always did. Native pools (OpenBLAS, OpenMP) stop
and restart around a fork by their own at-fork handlers, as they do for a DataLoader's forked
workers.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import sys
import threading
import traceback
from multiprocessing import connection, forkserver, resource_tracker, util
from typing import Any, NoReturn, TypeGuard

from ddp_template.process.quick_exit import exit_now

_SERVER_FIELDS = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")


def start(preload: list[str]) -> bool:
    """Set the fork server's ``preload`` and, where it is safe, start the server now as a fork
    of this process; True if it was forked here."""
    multiprocessing.set_forkserver_preload(preload)
    server = getattr(forkserver, "_forkserver", None)
    if not _forkable(server):
        return False
    resource_tracker.ensure_running()  # before the pipe: the tracker must not hold its end
    util._flush_std_streams()  # type: ignore[attr-defined]  # private, not in typeshed; or the server and every rank write the buffered output again
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]  # private
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        # The server ends at EOF on alive_r: once every holder of alive_w (this process, then
        # each rank) has exited.
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _serve(listener.fileno(), alive_r, alive_w, preload)
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    return True


def _forkable(server: Any) -> TypeGuard[Any]:  # True: not None
    return (
        server is not None
        and all(getattr(server, name, False) is None for name in _SERVER_FIELDS)  # none running yet
        and not hasattr(server, "_forkserver_authkey")  # Python 3.14's handshake: not forked
        and threading.active_count() == 1
        and sys.platform == "linux"
    )


def _serve(listener_fd: int, alive_r: int, alive_w: int, preload: list[str]) -> NoReturn:
    os.close(alive_w)
    _forget_logging()
    status = 0
    try:
        forkserver.main(listener_fd, alive_r, preload)
    except (SystemExit, KeyboardInterrupt):  # the launcher has gone; Ctrl-C during the preload
        pass
    except BaseException:
        traceback.print_exc()
        status = 1
    exit_now(status)  # no teardown of torch, no exit handler of the launcher's


def _forget_logging() -> None:
    """Ranks start as a new interpreter would, without the launcher's log handlers (Hydra's
    train.log and console): ``console.setup_console`` gives each rank its own."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        if isinstance(logger, logging.Logger):
            logger.handlers.clear()
    logging.getLogger().setLevel(logging.WARNING)
