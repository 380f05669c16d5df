"""What forking the ranks' fork server from the launcher saves a ``dist.nproc`` launch.

    python benchmarks/launch_server.py [--rounds 8] [--nproc 2] [--out report.md]

One short job (the default digits/small_cnn job, gloo, ``logger=none``, 1 epoch of 4 steps) is
launched as ``python train.py dist.nproc=N`` in three variants, alternating, the order rotated
every round so drifts in machine load hit every variant alike:

* ``forked``: train.py as it is: the fork server is a fork of the launcher
  (``process.server_start``);
* ``forked again``: the same command, the A/A row: its spread is the noise floor;
* ``spawned``: the same command with ``process.server_start`` refusing to fork, so multiprocessing
  starts its own server, a new interpreter importing torch again (how every launch started
  before ``process.server_start``).

Per launch: wall seconds of the whole command, and the machine's CPU seconds (user + system of
every process, from ``/proc/stat``) over it, which counts the server and the ranks too (they are
not the launcher's waited-for children). Ratios are to ``forked`` in the same round. Run it on
an otherwise idle machine: other work shows up in the CPU column.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _launch import ROOT, git_state, invocation

JOB = ["logger=none", "share_picture=false", "backend=gloo", "epochs=1", "max_steps_per_epoch=4"]
REFUSE_FORK = (
    "import runpy, sys; from ddp_template.process import server_start; "
    "server_start._forkable = lambda server: False; "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)
VARIANTS = {"forked": [], "forked again": [], "spawned": ["-c", REFUSE_FORK]}


def _machine_cpu_s() -> float:
    with open("/proc/stat") as stat:
        user, nice, system = (int(x) for x in stat.readline().split()[1:4])
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")


def run_once(variant: str, nproc: int, out: Path) -> dict[str, float]:
    cmd = [
        sys.executable,
        *VARIANTS[variant],
        str(ROOT / "train.py"),
        *JOB,
        f"dist.nproc={nproc}",
        f"paths.output_root={out / 'outputs'}",
        f"paths.multirun_root={out / 'multirun'}",
    ]
    env = dict(os.environ, WANDB_MODE="offline")
    cpu, start = _machine_cpu_s(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, _machine_cpu_s() - cpu
    if proc.returncode != 0:
        sys.exit(f"{variant} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return {"wall_s": wall, "cpu_s": cpu}


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}–{max(values):.2f}]"


def report(results: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> str:
    base = results["forked"]
    lines = [
        "# The ranks' fork server: forked from the launcher against a new interpreter",
        "",
        f"Commit: {git_state()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{os.cpu_count()} CPUs; `{invocation()}`; {args.rounds} rounds, "
        f"`dist.nproc={args.nproc}`, `{' '.join(JOB)}`.",
        "",
        "| variant | wall s, median [min–max] | ÷ forked | machine CPU s | ÷ forked |",
        "|---|---|---|---|---|",
    ]
    for variant, runs in results.items():
        walls = [r["wall_s"] for r in runs]
        cpus = [r["cpu_s"] for r in runs]
        wall_ratio = [r["wall_s"] / b["wall_s"] for r, b in zip(runs, base, strict=True)]
        cpu_ratio = [r["cpu_s"] / b["cpu_s"] for r, b in zip(runs, base, strict=True)]
        same = variant == "forked"
        lines.append(
            f"| {variant} | {_spread(walls)} | {'—' if same else _spread(wall_ratio)} "
            f"| {_spread(cpus)} | {'—' if same else _spread(cpu_ratio)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    names = list(VARIANTS)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="launch-server-") as work:
        for round_ in range(args.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for variant in order:
                results[variant].append(run_once(variant, args.nproc, Path(work)))
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    text = report(results, args)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
