"""Starts a fork server through ``server_start.start`` and a process from it; prints what that
process found as JSON (tests/test_forked_server.py). ``threaded`` keeps a second Python thread
running while the server starts."""

import json
import logging
import multiprocessing as mp
import os
import sys
import threading

import psutil

from ddp_template.process import server_start

STARTED_BY = os.getpid()  # a fork keeps this; a fresh server re-runs this file and gets its own


def report(conn) -> None:
    server = psutil.Process().parent()
    conn.send(
        {
            "server_parent": server.ppid(),
            "server_cmdline": server.cmdline(),
            "started_by": STARTED_BY,
            "preloaded": "wave" in sys.modules,
            "log_handlers": len(logging.getLogger().handlers),
        }
    )


if __name__ == "__main__":
    logging.basicConfig(filename=sys.argv[1])  # the launcher's log file: not the ranks'
    release = threading.Event()
    if sys.argv[2] == "threaded":
        threading.Thread(target=release.wait).start()
    forked = server_start.start(preload=["wave"])
    release.set()
    ctx = mp.get_context("forkserver")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=report, args=(send,))
    child.start()
    found = receive.recv()
    child.join()
    print(
        json.dumps(
            {"forked": forked, "me": os.getpid(), "cmdline": psutil.Process().cmdline(), **found}
        )
    )
