"""Loader workers die with their rank: the watchdog each worker starts, on its own.

The end-to-end case (a rank SIGKILLed mid-epoch, nothing left behind) is in test_resume.py.
"""

from __future__ import annotations

import subprocess

import pytest
from helpers import PY, ROOT


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polling"])
def test_watchdog_waits_for_the_rank_then_exits(pidfd: bool) -> None:
    rank = subprocess.Popen([PY, "-c", "import time; time.sleep(120)"])
    code = (
        "import os, sys\n"
        "from ddp_template.data import loader\n"
        + ("" if pidfd else "del os.pidfd_open\n")
        + "print('watching', flush=True)\n"
        + f"loader._exit_when_gone({rank.pid})\n"
        + "sys.exit(5)\n"  # never reached: the watchdog leaves through os._exit(1)
    )
    watcher = subprocess.Popen([PY, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert watcher.stdout.readline().strip() == "watching"
        with pytest.raises(subprocess.TimeoutExpired):  # the rank lives: the worker stays
            watcher.wait(timeout=2)
        rank.kill()
        rank.wait()
        assert watcher.wait(timeout=30) == 1
    finally:
        rank.kill()
        watcher.kill()
