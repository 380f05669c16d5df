"""What the launching benchmarks share: one torchrun launch of a script under the probe.

``benchmarks/overhead.py`` and ``benchmarks/peers.py`` start every program the same way:
``torchrun --standalone --nproc-per-node=N benchmarks/_first_step_probe.py SCRIPT ARGS`` from the
repository root, W&B offline, torchrun's own ``OMP_NUM_THREADS=1`` per rank, and read each
rank's probe JSON back.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROBE = "benchmarks/_first_step_probe.py"


def torchrun(nproc: int) -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe), "--standalone", f"--nproc-per-node={nproc}", PROBE]


def launch(script: list[str], run_dir: Path, nproc: int, tag: str, **env_extra: str) -> dict:
    """Run ``script`` (path and arguments) on ``nproc`` ranks; exit with its output's tail if it
    fails. Returns the wall time, the mean 1-min load before and after, the launch on
    ``CLOCK_BOOTTIME``, each rank's probe result and the command."""
    run_dir.mkdir(parents=True)
    env = dict(
        os.environ,
        WANDB_MODE="offline",
        PROBE_OUT=str(run_dir / "probe{rank}.json"),
        RUN_ID=tag,
        PYTHONUNBUFFERED="1",
        **env_extra,
    )
    env.pop("OMP_NUM_THREADS", None)  # torchrun sets 1 per rank for every program, as users get it
    cmd = torchrun(nproc) + script
    load_before = os.getloadavg()[0]
    launched = time.clock_gettime(time.CLOCK_BOOTTIME)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    (run_dir / "output.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        sys.exit(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{tail}")
    probes = [json.loads((run_dir / f"probe{r}.json").read_text()) for r in range(nproc)]
    return {
        "wall_s": wall,
        "load": (load_before + os.getloadavg()[0]) / 2,
        "launched_boottime_s": launched,
        "probes": probes,
        "command": shlex.join(cmd),
    }


def git_state() -> str:
    """The template's commit, and which of its files differ from it (the numbers are for those)."""

    def git(*a: str) -> str:
        proc = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        return proc.stdout.rstrip()

    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "src", "train.py", "conf")
    files = [line[3:] for line in dirty.splitlines()]
    return git("rev-parse", "--short", "HEAD") + (
        f" + uncommitted changes in {', '.join(files)}" if files else " (clean)"
    )


def invocation() -> str:
    """This benchmark's command line, the interpreter relative to the root where it lies there."""
    exe = Path(sys.executable)
    exe_text = exe.relative_to(ROOT).as_posix() if exe.is_relative_to(ROOT) else sys.executable
    return shlex.join([exe_text, *sys.argv])


def run_tag(variant: str, round_: int) -> str:
    return f"{variant}-{round_}-{time.strftime('%H%M%S')}"


def emit(result: dict, out: str | None, rank: int, world: int) -> None:
    """A bare loop's rank result, with the rank, world size and the peak resident memory: one
    JSON line, and ``out`` (``{rank}`` replaced) if given."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"rank": rank, "world_size": world, **result, "peak_rss_mib": peak}
    print(json.dumps(result))
    if out:
        with open(out.replace("{rank}", str(rank)), "w") as f:
            json.dump(result, f, indent=1)


def on_ranks(ranks: Any, args: Any, script: str) -> None:
    """A rank (under torchrun) runs ``ranks(args)``; the command itself starts ``script`` on
    two ranks under torchrun and exits with its status."""
    if "LOCAL_RANK" in os.environ:
        ranks(args)
        return
    sys.exit(under_torchrun(script))


def publish(text: str, out: Path | None) -> None:
    """A report to the console, and to ``out`` if given."""
    print(text)
    if out:
        out.write_text(text + "\n")


def under_torchrun(script: str, nproc: int = 2) -> int:
    """Start ``script`` (with this process's arguments) on ``nproc`` ranks under torchrun, the
    package and the repository importable: a script that builds ``train.build`` on its ranks."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    command = [*launcher, f"--nproc-per-node={nproc}", script, *sys.argv[1:]]
    return subprocess.run(command, env=env).returncode


def timed_epochs(tr: Any, state: Any, epochs: int) -> float:
    """``epochs`` epochs of ``engine.train_one_epoch`` (no step hook, no logging), timed between
    barriers: every rank starts and ends together."""
    import torch.distributed as dist

    from ddp_template.engine import train_one_epoch

    dist.barrier()
    start = time.perf_counter()
    for _ in range(epochs):
        state.epoch, state.position = state.epoch + 1, 0
        tr.sampler.set_epoch(state.epoch)
        stats = train_one_epoch(tr, state, lambda s: False, lambda row, step: None)
        assert stats.steps == tr.steps.steps_per_epoch, stats.steps
    dist.barrier()
    return time.perf_counter() - start


def ratios(seconds: dict[str, list[float]], variant: str, base: str) -> list[float]:
    """``variant``'s time over ``base``'s, round by round."""
    return [a / b for a, b in zip(seconds[variant], seconds[base], strict=True)]


DEFAULT_JOB = "default job (digits, small_cnn, batch 32), 2 ranks, gloo, CPU"


def paired_table(
    seconds: dict[str, list[float]],
    base: str,
    *,
    epochs: int,
    steps: int,
    note: str = "",
    job: str = DEFAULT_JOB,
) -> list[str]:
    """The report of paired rounds on ``job``: its line, and a table of each variant's ms per
    step (median, range) and the median of its ratios to ``base`` taken within each round."""
    import statistics

    per_step_ms = 1000 / (epochs * steps)
    rows = [
        f"{job}; {epochs} epochs x "
        f"{steps} steps per measurement, {len(seconds[base])} paired rounds{note} (load "
        f"{os.getloadavg()[0]:.2f})",
        "",
        f"| variant | ms/step (median) | min-max | vs {base} (median of paired ratios) |",
        "|---|---|---|---|",
    ]
    for variant, times in seconds.items():
        paired = ratios(seconds, variant, base)
        ms = [t * per_step_ms for t in times]
        rows.append(
            f"| {variant} | {statistics.median(ms):.2f} | {min(ms):.2f}-{max(ms):.2f} | "
            f"{statistics.median(paired):.3f}x ({min(paired):.3f}-{max(paired):.3f}) |"
        )
    return rows


def preamble(command: str, nproc: int, repeats: int, loads: list[float], rotated: str) -> list[str]:
    """A report's first lines: the command, the template's git state, ranks, repeats, load."""
    mean = sum(loads) / len(loads)
    return [
        f"Command: `{command}`",
        "",
        f"Template at {git_state()}.",
        "",
        f"{nproc} ranks, torchrun --standalone, gloo on CPU ({os.cpu_count()} cores), "
        f"{repeats} repeats alternating{rotated}; 1-min load average during the runs: "
        f"{min(loads):.2f}–{max(loads):.2f} (mean {mean:.2f}).",
    ]
