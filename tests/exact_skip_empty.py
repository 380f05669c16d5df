"""Test-only entry point: ``train.py`` with the zero-contribution step removed.

Every rank skips the micro-batches its list holds no sample for (``sampler=exact``: the
shorter ranks' part of the epoch's last step), as a loop over the DataLoader alone would. The
ranks that still have samples then wait in DDP's gradient all-reduce for a rank that has gone on
to the epoch's end: test_exact proves that this hangs, so the empty step is what prevents it.
Run with ``dist.start_method=fork``, so the ranks inherit the patched engine.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from ddp_template import engine

TRAIN = Path(__file__).resolve().parents[1] / "train.py"
_micro_batches = engine.micro_batches


def _skipping_empty(*args, **kwargs):
    for batch, weight, last in _micro_batches(*args, **kwargs):
        if len(batch[2]):
            yield batch, weight, last


if __name__ == "__main__":
    engine.micro_batches = _skipping_empty
    sys.argv[0] = str(TRAIN)
    runpy.run_path(str(TRAIN), run_name="__main__")
