"""Test-only entry point: ``train.py`` with the node split removed from sharded data.

Every rank's loader reads rank 0's ranges of the epoch plan (webdataset's missing
``nodesplitter``: every rank the same data). Run with ``dist.start_method=fork`` and
``loader.num_workers=0``, so the ranks read in the patched process; test_webdataset shows the
epoch ends in a loud SHARE MISMATCH instead of a hang or a silent epoch.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from ddp_template.optional.webdataset.reader import PlanReader

TRAIN = Path(__file__).resolve().parents[3] / "train.py"


def _node_split_removed(self, loader_worker, epoch, start):
    s = self.sampler
    return s.worker_indices(0, s.loader_worker(loader_worker, start), start, epoch)


if __name__ == "__main__":
    PlanReader.indices = _node_split_removed
    sys.argv[0] = str(TRAIN)
    runpy.run_path(str(TRAIN), run_name="__main__")
