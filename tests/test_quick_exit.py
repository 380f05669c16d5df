"""A process that imported torch ends without Python's teardown of it, and loses nothing else:
its exit status, its exit handlers, its threads, and its fork servers' handlers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers import ROOT

RUN = "import sys, atexit, threading, time\nfrom ddp_template.process import quick_exit\n"


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "tests"), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "main,status,stderr",
    [
        ("lambda: 0.5", 0, ""),
        ("lambda: sys.exit(3)", 3, ""),
        ("lambda: sys.exit(None)", 0, ""),
        ("lambda: sys.exit('no such file')", 1, "no such file\n"),
    ],
)
def test_run_ends_with_mains_status_after_every_handler_and_thread(main, status, stderr) -> None:
    code = (
        RUN
        + "atexit.register(print, 'handler ran', flush=False)\n"
        + "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()\n"
        + f"quick_exit.run({main})\n"
        + "print('after run')\n"
    )
    proc = _python(code)
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == "thread done\nhandler ran\n"  # joined, handled, flushed; never back
    assert proc.stderr == stderr


def test_an_uncaught_exception_keeps_pythons_own_exit() -> None:
    proc = _python(RUN + "quick_exit.run(lambda: 1 / 0)\n")
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ZeroDivisionError" in proc.stderr


SERVER = """
import multiprocessing as mp
from multiprocessing import forkserver
from ddp_template.process.preload import loaded_modules
mp.set_forkserver_preload({preload})
forkserver.ensure_running()
code = "import gc; print('forked, gc', gc.isenabled())"
mp.get_context("forkserver").Process(target=exec, args=(code,)).start()
"""


@pytest.mark.parametrize("ours", [True, False])
def test_a_fork_server_imports_without_gc_and_skips_the_teardown(
    ours: bool, tmp_path: Path
) -> None:
    """A fork server preloading ``preload.loaded_modules`` imports with the cyclic GC off, its
    forks have it on, and it ends after its parent with its exit handlers run but without
    tearing its modules down; the control (the probe alone) shows that the probe does see both."""
    probe = tmp_path / "probe.txt"
    preload = 'loaded_modules("teardown_probe")' if ours else '["teardown_probe"]'
    proc = _python(SERVER.format(preload=preload), TEARDOWN_PROBE=str(probe))
    assert proc.returncode == 0 and proc.stdout == "forked, gc True\n", proc.stderr
    first, *_ = probe.read_text().splitlines()
    assert first.endswith(f"gc {not ours}")
    server = psutil.Process(int(first.split()[1]))  # it outlives the parent until it sees EOF
    gone, alive = psutil.wait_procs([server], timeout=60)
    assert gone or alive[0].status() == psutil.STATUS_ZOMBIE, "the fork server did not end"
    said = probe.read_text().splitlines()[1:]
    assert said == (["handlers ran"] if ours else ["handlers ran", "torn down"])
