"""Start-up imports only what the config selects: the default job (one process, map-style
digits, EMA off) never imports a module of another data kind or of a switch that is off."""

from __future__ import annotations

import re
import sys

from helpers import run, train_cmd

# Modules that only a config choice may import: the whole optional wing and the EMA switch.
UNSELECTED = ("ddp_template.optional", "ddp_template.switches.ema")


def imported(stderr: str) -> set[str]:
    """The modules ``python -X importtime`` reports as imported."""
    return set(re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*([\w.]+)$", stderr, re.M))


def test_the_default_job_imports_no_module_it_did_not_select(tmp_path) -> None:
    cmd = train_cmd(tmp_path, "epochs=1", "max_steps_per_epoch=2")
    assert cmd[0] == sys.executable
    proc = run([cmd[0], "-X", "importtime", *cmd[1:]])
    modules = imported(proc.stderr)
    ours = {m for m in modules if m.startswith("ddp_template.")}
    assert {"ddp_template.kind", "ddp_template.switches"} <= ours, sorted(ours)  # it parsed
    assert not {m for m in ours if m.startswith(UNSELECTED)}, sorted(ours)
