"""Run a training script unchanged and record when its first optimizer step finished.

    python benchmarks/_first_step_probe.py SCRIPT [ARGS ...]
    torchrun --standalone --nproc-per-node=2 benchmarks/_first_step_probe.py train.py logger=none

Used by ``benchmarks/overhead.py`` for both ``train.py`` and ``bare_ddp.py``, so both are
measured the same way. The probe registers torch's global optimizer step post-hook (removed after
the first step, so later steps pay nothing), runs SCRIPT with ``runpy`` as ``__main__`` and, at
exit, writes a JSON file to ``$PROBE_OUT`` (``{rank}`` in it becomes ``$RANK``):

* ``first_step_s``: seconds from this process's start to the end of its first optimizer step;
* ``marks``: seconds from process start to milestones on the way there (``probe``: the probe
  module runs, i.e. interpreter start-up; ``script``: SCRIPT starts importing; ``hydra_main``,
  ``hydra_composed``, ``pg_init``/``pg_ready``, ``logger``/``logger_ready``, ``ddp``/``ddp_ready``
  where the script calls those functions);
* ``peak_rss_mib``: this process's peak RSS (``ru_maxrss``); ``children_peak_rss_mib``: the
  largest summed RSS of its child processes seen by a 0.5 s sampler (e.g. W&B's service);
* ``exit_s``: seconds from process start to exit;
* ``cpu_s``: this process's CPU seconds at exit (``getrusage``: user + system, all its threads);
* ``start_boottime_s``: the process start on ``CLOCK_BOOTTIME`` (null off Linux), so a launcher
  can time the first step from its own launch;
* with ``PROBE_STEPS=1``, ``steps``: ``[seconds from process start, CPU seconds]`` at the end of
  every optimizer step (the hook then stays; ``benchmarks/peers.py`` uses it).

Process start: ``psutil.Process().create_time()`` is derived from /proc/stat's ``btime``, an
integer number of seconds, so it is off by up to a second (measured here: 0.46 s). The probe
instead reads the start time in clock ticks since boot from ``/proc/self/stat`` and compares it
with ``CLOCK_BOOTTIME`` (10 ms resolution, no offset); psutil is the fallback off Linux.

``PROBE_PROFILE=DIR`` also runs SCRIPT under cProfile and dumps ``DIR/rank<r>.prof``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import resource
import sys
import threading
import time


def _elapsed_fn():
    """A function giving seconds since this process started, and the start on CLOCK_BOOTTIME."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        start = start_ticks / os.sysconf("SC_CLK_TCK")
        return (lambda: time.clock_gettime(time.CLOCK_BOOTTIME) - start), start
    except (OSError, ValueError, AttributeError):
        import psutil

        created = psutil.Process().create_time()
        return (lambda: time.time() - created), None


elapsed, _start_boottime = _elapsed_fn()
RESULT: dict = {
    "marks": {"probe": elapsed()},
    "first_step_s": None,
    "start_boottime_s": _start_boottime,
}


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def mark(name: str) -> None:
    """Record the first time ``name`` is reached (later calls keep the first)."""
    RESULT["marks"].setdefault(name, elapsed())


def _wrap(owner, attr: str, before: str, after: str | None = None) -> None:
    """Mark ``before`` when ``owner.attr`` is called and ``after`` when it returns."""
    fn = getattr(owner, attr, None)
    if fn is None:
        return

    def wrapper(*args, **kwargs):
        mark(before)
        out = fn(*args, **kwargs)
        if after:
            mark(after)
        return out

    wrapper.__wrapped__ = fn
    setattr(owner, attr, wrapper)


def _children_rss() -> None:
    import psutil

    me, peak = psutil.Process(), 0
    while True:
        total = 0
        for child in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += child.memory_info().rss
        peak = max(peak, total)
        RESULT["children_peak_rss_mib"] = peak / 2**20
        time.sleep(0.5)


def _install_hooks(script: str) -> None:
    import torch.distributed as dist
    import torch.nn.parallel
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = None

    def first_step(optimizer, args, kwargs) -> None:
        if RESULT["first_step_s"] is None:
            RESULT["first_step_s"] = elapsed()
            handle.remove()

    def every_step(optimizer, args, kwargs) -> None:
        steps.append((elapsed(), _cpu_s()))
        if RESULT["first_step_s"] is None:
            RESULT["first_step_s"] = steps[0][0]

    if os.environ.get("PROBE_STEPS") == "1":
        steps = RESULT["steps"] = []
        register_optimizer_step_post_hook(every_step)
    else:
        handle = register_optimizer_step_post_hook(first_step)
    _wrap(dist, "init_process_group", "pg_init", "pg_ready")
    ddp = torch.nn.parallel.DistributedDataParallel
    _wrap(ddp, "__init__", "ddp", "ddp_ready")
    if os.path.basename(script) == "train.py":  # the template's own milestones
        from ddp_template import launch
        from ddp_template.sinks import metrics as logging

        _wrap(importlib.import_module("hydra.main"), "_run_hydra", "hydra_main")
        _wrap(launch, "launch", "hydra_composed")
        _wrap(logging.RankLogger, "__init__", "logger", "logger_ready")


def _write(path: str | None, profile=None) -> None:
    RESULT["exit_s"] = elapsed()
    RESULT["cpu_s"] = _cpu_s()
    RESULT["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    RESULT["rank"] = int(os.environ.get("RANK", "0"))
    if profile is not None:
        profile.disable()
        folder = os.environ["PROBE_PROFILE"]
        os.makedirs(folder, exist_ok=True)
        profile.dump_stats(os.path.join(folder, f"rank{RESULT['rank']}.prof"))
    if path:
        path = path.replace("{rank}", str(RESULT["rank"]))
        with open(path + ".tmp", "w") as f:
            json.dump(RESULT, f, indent=1)
        os.replace(path + ".tmp", path)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    script = sys.argv[1]
    threading.Thread(target=_children_rss, name="probe-rss", daemon=True).start()
    profile = None
    if os.environ.get("PROBE_PROFILE"):
        import cProfile

        profile = cProfile.Profile()
    atexit.register(_write, os.environ.get("PROBE_OUT"), profile)
    _install_hooks(script)
    import runpy

    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as if SCRIPT had been run
    mark("script")
    if profile is not None:
        profile.enable()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
