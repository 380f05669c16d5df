"""From a checkpoint to a paper table: experiment presets, init_from, evaluation anywhere."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from helpers import PY, ROOT
from omegaconf import DictConfig, OmegaConf


def test_experiment_with_and_without_plus_compose_the_same(
    compose_cfg: Callable[..., DictConfig],
) -> None:
    cfg = compose_cfg("experiment=digits_ddp", "debug=fast")
    assert cfg.dist.nproc == 2  # the preset's own keys win over debug's
    shown = []
    for spelling in ("experiment=digits_ddp", "+experiment=digits_ddp"):
        cmd = [PY, str(ROOT / "train.py"), spelling, "--cfg", "job"]
        shown.append(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True))
    assert shown[0].stdout == shown[1].stdout
    assert OmegaConf.create(shown[0].stdout) == OmegaConf.create(
        OmegaConf.to_yaml(compose_cfg("experiment=digits_ddp"))
    )
