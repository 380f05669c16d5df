"""Loader workers die with their rank: the watchdog each worker starts, on its own.

The end-to-end case (a rank SIGKILLed mid-epoch, nothing left behind) is in test_resume.py.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess

import pytest

from ddp_template.data import workers


def _watch(pid: int, pidfd: bool) -> None:
    """A stand-in for a loader worker, from the forkserver like the real ones."""
    if not pidfd:
        del os.pidfd_open  # this child only: the polling fallback
    workers._exit_when_gone(pid)
    os._exit(5)  # never reached: the watchdog leaves through os._exit(1)


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polling"])
def test_watchdog_waits_for_the_rank_then_exits(pidfd: bool) -> None:
    rank = subprocess.Popen(["sleep", "120"])
    watcher = multiprocessing.get_context("forkserver").Process(
        target=_watch, args=(rank.pid, pidfd)
    )
    watcher.start()
    try:
        watcher.join(timeout=2)  # the rank lives: the worker stays
        assert watcher.exitcode is None
        rank.kill()
        rank.wait()
        watcher.join(timeout=30)
        assert watcher.exitcode == 1
    finally:
        rank.kill()
        if watcher.is_alive():
            watcher.kill()
