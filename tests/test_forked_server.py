"""The ranks' fork server is a fork of the launcher (torch imported once per launch), but only
from a single-threaded launcher; either way it ends with the launcher and leaves nothing."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import PY, ROOT, run, run_env


def _probe(tmp_path: Path, mode: str) -> dict:
    proc = run(
        [PY, str(ROOT / "tests" / "forked_server_probe.py"), str(tmp_path / "launcher.log"), mode],
        env=run_env(PYTHONPATH=f"{ROOT / 'src'}"),
        leftovers=10,  # the server, its fork and the resource tracker end with the probe
        timeout=120,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_server_is_a_fork_of_the_launcher_without_its_log_handlers(tmp_path: Path) -> None:
    found = _probe(tmp_path, "single")
    assert found["forked"] is True
    assert found["server_parent"] == found["me"]  # forked by the launcher itself...
    assert found["server_cmdline"] == found["cmdline"]  # ...not exec'd: the same argv
    assert found["started_by"] == found["me"]  # the launcher's memory, not a re-run of it
    assert found["preloaded"]  # the preload still reaches the server
    assert found["log_handlers"] == 0  # the launcher's file handler stays the launcher's


def test_a_threaded_launcher_gets_multiprocessings_own_server(tmp_path: Path) -> None:
    found = _probe(tmp_path, "threaded")
    assert found["forked"] is False
    assert "from multiprocessing.forkserver import main" in " ".join(found["server_cmdline"])
    assert found["started_by"] != found["me"]  # a fresh interpreter ran this file again
    assert found["preloaded"]
