"""A short torch.profiler window on every rank (`debug=profiler`), traces in the run dir.

The window is counted in optimizer steps: skip ``profiler.wait``, warm up for
``profiler.warmup``, record ``profiler.active``; rank r then writes
``<run_dir>/rank<r>/trace_step<k>.pt.trace.json`` (k: the window's last step), a Chrome trace
that Perfetto (ui.perfetto.dev → Open trace file) and TensorBoard's profiler plugin
(``tensorboard --logdir <run_dir>/rank<r>``) open. A run shorter than the window writes what
it recorded when it ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile, schedule

from ddp_template.config.schema import ProfilerConfig
from ddp_template.distributed import DistInfo


class StepProfiler:
    """``step()`` after every optimizer step; ``close()`` on every path (writes a partial
    window). Does nothing when the profiler is off."""

    def __init__(self, *, cfg: ProfilerConfig, run_dir: Path, info: DistInfo) -> None:
        self.directory = run_dir / f"rank{info.rank}"
        self.traces: list[Path] = []
        self.prof: Any = None
        if not cfg.enabled:
            return
        activities = [ProfilerActivity.CPU]
        if info.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.prof = profile(
            activities=activities,
            schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
            on_trace_ready=self._write,
        )
        self.prof.start()

    def _write(self, prof: Any) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"trace_step{prof.step_num}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        self.traces.append(path)

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.stop()
