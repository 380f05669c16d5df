"""debug=profiler: one Chrome trace per rank, and in it one gradient all-reduce per optimizer
step with optim.accumulate=2 (DDP's no_sync on the first micro-batch of each step)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from helpers import run, run_env, train_cmd


def test_profiler_traces_every_rank_one_all_reduce_per_step(tmp_path: Path) -> None:
    overrides = ["debug=profiler", "dist.nproc=2", "loader.batch_size=16", "optim.accumulate=2"]
    run(train_cmd(tmp_path, *overrides), env=run_env(RUN_ID="prof"))
    run_dir = tmp_path / "outputs" / "prof"
    for rank in (0, 1):
        traces = list((run_dir / f"rank{rank}").glob("trace*.json"))
        assert [t.name for t in traces] == ["trace_step5.pt.trace.json"]  # steps 3-5 recorded
        events = json.loads(traces[0].read_text())["traceEvents"]
        names = Counter(e.get("name") for e in events if e.get("ph") == "X")
        steps = sum(n for name, n in names.items() if str(name).startswith("ProfilerStep#"))
        assert steps == 3, names
        assert names["DistributedDataParallel.forward"] == 6  # 2 micro-batches per step
        assert names["gloo:all_reduce"] == 3, names  # one bucket, all-reduced once per step
