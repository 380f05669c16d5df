"""Fork servers start their forks with the modules those need: a loader worker does not import
its dataset's module itself (seconds of CPU per worker for torchvision or a forker's module)."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from pathlib import Path

import torch
from helpers import ROOT

from ddp_template.data.transforms import Augmented
from ddp_template.process.preload import FORK_SERVER, loaded_modules, modules_of

LOADER = """
import preload_probe
from ddp_template.config.schema import LoaderConfig
from ddp_template.data.loader import build_eval_loader
from helpers import cpu_rank
cfg = LoaderConfig(num_workers=2, eval_batch_size=1)
loader = build_eval_loader(preload_probe.Pids(), cfg, cpu_rank(0, 1))
print(sorted({int(x) for x, _, _ in loader for x in x.flatten().tolist()}))
"""


def test_a_loader_worker_starts_with_its_datasets_module(tmp_path: Path) -> None:
    log = tmp_path / "imports.txt"
    # On PYTHONPATH, as a forker's package is: Python 3.11's fork server ignores sys.path edits.
    env = {"PRELOAD_PROBE_LOG": str(log), "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}"}
    proc = subprocess.run(
        [sys.executable, "-c", LOADER],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    workers = set(eval(proc.stdout.strip().splitlines()[-1]))
    importers = {int(line) for line in log.read_text().split()}
    assert len(workers) == 2, proc.stdout  # two workers loaded the items...
    assert len(importers) == 2 and not importers & workers, (importers, workers)  # ...itself


def test_modules_of_names_what_unpickling_imports_without_copying_data() -> None:
    from torchvision.transforms import v2

    big = torch.zeros(64, 1024, 1024)  # 256 MB, which a plain pickle would copy
    dataset = Augmented(big, v2.RandomHorizontalFlip(), seed=0, for_eval=big)
    tracemalloc.start()
    found = modules_of(dataset)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 * 2**20, peak
    assert "ddp_template.data.transforms" in found and "torch" in found
    assert any(m.startswith("torchvision.transforms.v2") for m in found), found
    assert modules_of(lambda: None) == []  # not picklable: the worker's own start says so


def test_loaded_modules_put_the_named_first_once() -> None:
    """After the fork server's own exit (imported by nothing but a fork server's preload)."""
    names = loaded_modules("torch", "ddp_template.process.preload")
    assert names[:3] == [FORK_SERVER, "torch", "ddp_template.process.preload"]
    assert FORK_SERVER not in sys.modules
    assert len(names) == len(set(names)) and "ddp_template.data.transforms" in names
    assert all(n.split(".")[0] in {"torch", "ddp_template", "hydra", "omegaconf"} for n in names)
