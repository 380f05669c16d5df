"""fault_tolerance=live: what a lost rank costs, and what the live machinery costs when nothing
fails.

    python benchmarks/live.py [--rounds 3] [--epochs 3] [--out benchmarks/live_results.md]

* **recovery** (``--rounds`` runs of the default job at ``dist.nproc=3``, rank 2 SIGKILLed
  inside step 10's gradient all-reduce): from ``live.jsonl``, the time from the launcher seeing
  the death to the next committed step, and from the replacement's start to its admission and
  to the first step it committed with the others.
* **per-step cost** (the default job at ``dist.nproc=2``, ``--epochs`` epochs): ``--rounds``
  rounds of ``fault_tolerance=off``, ``live`` and ``off`` again (the A/A floor), the order
  rotating each round; each run's ``perf/step_s`` (compute time per optimizer step, every
  rank's every epoch, averaged) and the ratio to the round's first ``off`` run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
KILL = [
    "fault.rank=2",
    "fault.crash_at_step=10",
    "fault.signal=SIGKILL",
    "fault.phase=allreduce",
]


def train(out: Path, name: str, *overrides: str) -> Path:
    env = {**os.environ, "WANDB_MODE": "disabled", "RUN_ID": name}
    cmd = [PY, str(ROOT / "train.py"), f"paths.output_root={out}", "logger=none"]
    cmd += ["share_picture=false", "backend=gloo", *overrides]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True, timeout=600)
    return out / name


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def recovery(out: Path, i: int) -> dict[str, float]:
    run_dir = train(out, f"kill{i}", "dist.nproc=3", "fault_tolerance=live", *KILL)
    live = rows(run_dir / "live.jsonl")
    lost = next(r for r in live if r["event"] == "lost")
    started = next(r for r in live if r["event"] == "started" and r["incarnation"] == 1)
    admitted = next(r for r in live if r["event"] == "membership" and "2.1" in r["members"])
    commits = [r for r in live if r["event"] == "committed"]
    return {
        "kill → next committed step (s)": commits[0]["time"] - lost["time"],
        "replacement start → admitted (s)": admitted["time"] - started["time"],
        "replacement start → its first committed step (s)": commits[1]["time"] - started["time"],
    }


def step_s(run_dir: Path) -> float:
    found = [
        r["perf/step_s"]
        for path in run_dir.glob("rank*/metrics.jsonl")
        for r in rows(path)
        if "perf/step_s" in r
    ]
    return statistics.mean(found)


def table(first: str, column: str, rows: dict[str, list[float]]) -> list[str]:
    """A markdown table: a row per key, a column per run (or round), and their median."""
    n = len(next(iter(rows.values())))
    lines = [
        f"| {first} | " + " | ".join(f"{column} {i + 1}" for i in range(n)) + " | median |",
        "|---|" + "---|" * (n + 1),
    ]
    for key, values in rows.items():
        cells = " | ".join(f"{v:.3f}" for v in values)
        lines.append(f"| {key} | {cells} | {statistics.median(values):.3f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "live_results.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        faults = [recovery(out, i) for i in range(args.rounds)]
        order = ["off", "live", "off (A/A)"]
        ratios: dict[str, list[float]] = {k: [] for k in order}
        for r in range(args.rounds):
            times = {}
            for k in order[r % 3 :] + order[: r % 3]:
                mode = "live" if k == "live" else "off"
                run_dir = train(
                    out,
                    f"cost{r}{mode}{len(times)}",
                    "dist.nproc=2",
                    f"epochs={args.epochs}",
                    f"fault_tolerance={mode}",
                )
                times[k] = step_s(run_dir)
            for k in order:
                ratios[k].append(times[k] / times["off"])
    lines = [
        "# fault_tolerance=live: recovery and per-step cost",
        "",
        f"`python benchmarks/live.py --rounds {args.rounds} --epochs {args.epochs}` on this "
        "machine (2 cores, CPU, gloo).",
        "",
        "## Recovery (3 ranks, rank 2 SIGKILLed inside step 10's all-reduce)",
        "",
        *table("measure", "run", {key: [f[key] for f in faults] for key in faults[0]}),
        "",
        f"## Per-step cost when nothing fails (2 ranks, default job, {args.epochs} epochs)",
        "",
        "Ratio of each run's mean `perf/step_s` to its round's first `off` run; `off (A/A)` is the",
        "noise floor.",
        "",
        *table("mode", "round", ratios),
    ]
    floor = ratios["off (A/A)"]
    lines += [
        "",
        f"Noise floor (off vs off): {min(floor):.3f} to {max(floor):.3f}; live's median ratio "
        f"{statistics.median(ratios['live']):.3f}, off (A/A)'s {statistics.median(floor):.3f}.",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
