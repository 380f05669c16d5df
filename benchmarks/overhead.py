"""What the template costs: train.py against the bare DDP recipe (benchmarks/bare_ddp.py).

    python benchmarks/overhead.py [--repeats 3] [--nproc 2] [--suite default|realistic|all]
                                  [--out report.md] [--epochs N] [-- extra train.py overrides]

Runs, in one invocation and alternating (the order rotates every repeat, so slow drifts in
machine load hit every variant alike), under ``torchrun --standalone --nproc-per-node=N``
(gloo, CPU, W&B offline):

* ``bare``: benchmarks/bare_ddp.py, the classic loop (no Hydra, logging, eval or checkpoints);
* ``template logger=none`` and ``template logger=wandb`` (offline): train.py with its defaults;
* ``--suite realistic`` (or ``all``): a realistic step, ResNet-18 on generated 3x32x32 data,
  batch 64 per rank, 2 epochs of 512 samples (4 steps per rank each; a step takes seconds on a
  CPU core): ``bare_ddp.py --model resnet18 --data synthetic`` against train.py with
  ``logger=wandb`` (offline).

Every rank runs under benchmarks/_first_step_probe.py, so both programs are measured alike:
seconds from process start to the end of the first optimizer step and peak RSS. Steady-state
samples/s is the mean over epochs >= 1 of each epoch's training-loop samples/s (the template's
``perf/samples_per_s`` from ``rank<r>/metrics.jsonl``; bare_ddp.py times its loop the same way:
iterator creation to the end of the last step, data wait included, eval and checkpoints
excluded), averaged over ranks. "total wall s" is the whole torchrun command, so it includes what
the template does besides training (eval, shard report, checkpoints, W&B) and the bare loop does
not. Ratios are template / bare within the same repeat; the spread is min-max over repeats.

Targets (issue "Faster than the bare recipe"): samples/s >= 1.00x bare with logger=none and
>= 0.97x with W&B offline, >= 0.99x on the realistic step; time to the first optimizer step
<= 1.10x bare's with logger=none and <= 1.25x with W&B; peak RSS per rank <= 1.03x with
logger=none.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from _launch import invocation, launch, preamble, run_tag

MARKS = [
    "script",
    "hydra_main",
    "hydra_composed",
    "pg_init",
    "pg_ready",
    "ddp",
    "ddp_ready",
    "logger",
    "logger_ready",
]
# variant: (samples/s floor, first-step ceiling, peak-RSS ceiling); None: no target
TARGETS = {
    "none": (1.00, 1.10, 1.03),
    "wandb": (0.97, 1.25, None),
    "resnet_wandb": (0.99, None, None),
}
BASELINE = {"none": "bare", "wandb": "bare", "resnet_wandb": "resnet_bare"}
SUITES = {
    "default": ["bare", "none", "wandb"],
    "realistic": ["resnet_bare", "resnet_wandb"],
}
SUITES["all"] = SUITES["default"] + SUITES["realistic"]
RESNET_SIZE, RESNET_BATCH, RESNET_EPOCHS = 512, 64, 2


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--epochs", type=int, default=None, help="both programs (default: 10)")
    p.add_argument("--suite", choices=sorted(SUITES), default="default")
    p.add_argument("--out", type=Path, help="also write the Markdown report here")
    p.add_argument("--keep", type=Path, help="keep run directories under this folder")
    p.add_argument("overrides", nargs="*", help="extra train.py overrides (after --)")
    return p.parse_args()


def run_once(variant: str, args: argparse.Namespace, work: Path, tag: str) -> dict:
    """One torchrun launch; returns per-rank probe results, per-epoch samples/s and wall time."""
    run_dir = work / tag
    epochs = args.epochs
    if variant.endswith("bare"):
        cmd = ["benchmarks/bare_ddp.py", "--out", str(run_dir / "bare{rank}.json")]
        if variant == "resnet_bare":
            cmd += ["--model", "resnet18", "--data", "synthetic", f"--size={RESNET_SIZE}"]
            cmd += [f"--batch-size={RESNET_BATCH}"]
            epochs = epochs or RESNET_EPOCHS
        if epochs is not None:
            cmd += ["--epochs", str(epochs)]
    else:
        logger = variant.removeprefix("resnet_")
        cmd = ["train.py", f"logger={logger}", f"paths.output_root={work}", *args.overrides]
        if variant == "resnet_wandb":
            cmd += ["model=resnet18", "data=synthetic", f"data.size={RESNET_SIZE}"]
            cmd += ["data.test_size=128", f"loader.batch_size={RESNET_BATCH}"]
            epochs = epochs or RESNET_EPOCHS
        if epochs is not None:
            cmd.append(f"epochs={epochs}")
    run = launch(cmd, run_dir, args.nproc, tag)
    ranks = []
    for r, probe in enumerate(run["probes"]):
        if variant.endswith("bare"):
            rows = json.loads((run_dir / f"bare{r}.json").read_text())["epochs"]
            sps = [row["samples_per_s"] for row in rows]
        else:
            lines = (run_dir / f"rank{r}" / "metrics.jsonl").read_text().splitlines()
            rows = [json.loads(line) for line in lines]
            sps = [
                row["perf/samples_per_s"]
                for row in rows
                if "epoch" in row and "perf/samples_per_s" in row
            ]
        ranks.append({**probe, "epoch_sps": sps})
    return {
        "variant": variant,
        "wall_s": run["wall_s"],
        "load": run["load"],
        "ranks": ranks,
        "command": run["command"],
    }


def summarise(run: dict) -> dict:
    ranks = run["ranks"]
    steady = [statistics.mean(r["epoch_sps"][1:]) for r in ranks if len(r["epoch_sps"]) > 1]
    marks = {
        m: statistics.mean(r["marks"][m] for r in ranks)
        for m in MARKS
        if all(m in r["marks"] for r in ranks)
    }
    medians = [statistics.median(r["epoch_sps"][1:]) for r in ranks if len(r["epoch_sps"]) > 1]
    return {
        "sps": statistics.mean(steady) if steady else float("nan"),
        "sps_median": statistics.mean(medians) if medians else float("nan"),
        "first_step_s": statistics.mean(r["first_step_s"] for r in ranks),
        "rss": [r["peak_rss_mib"] for r in ranks],
        "child_rss": max(r.get("children_peak_rss_mib", 0.0) for r in ranks),
        "wall_s": run["wall_s"],
        "load": run["load"],
        "marks": marks,
        "exit_s": statistics.mean(r["exit_s"] for r in ranks),
    }


def _spread(values: list[float], fmt: str) -> str:
    mean = statistics.mean(values)
    if len(values) == 1:
        return format(mean, fmt)
    return f"{format(mean, fmt)} ({format(min(values), fmt)}–{format(max(values), fmt)})"


def _std(values: list[float], fmt: str) -> str:
    mean = statistics.mean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{format(mean, fmt)} ± {format(std, fmt)}"


def _derived(results: dict[str, list[dict]]) -> list[str]:
    """Startup costs the milestones isolate, mean over repeats (rank mean)."""
    spans = {
        "Hydra composition (hydra_main → hydra_composed)": ("hydra_main", "hydra_composed"),
        "init_process_group": ("pg_init", "pg_ready"),
        "data + model build (pg_ready → ddp)": ("pg_ready", "ddp"),
        "DDP constructor (imports torch._dynamo on first use)": ("ddp", "ddp_ready"),
        "RankLogger (W&B init with logger=wandb)": ("logger", "logger_ready"),
    }
    lines = []
    for label, (a, b) in spans.items():
        cells = []
        for variant, runs in results.items():
            vals = [
                s["marks"][b] - s["marks"][a] for s in runs if a in s["marks"] and b in s["marks"]
            ]
            if vals:
                cells.append(f"{variant} {statistics.mean(vals):.2f}")
        if cells:
            lines.append(f"- {label}: " + ", ".join(cells) + " s")
    return lines


def report(results: dict[str, list[dict]], args: argparse.Namespace, command: str) -> str:
    names = {
        "bare": "bare DDP (benchmarks/bare_ddp.py)",
        "none": "template, logger=none",
        "wandb": "template, logger=wandb (offline)",
        "resnet_bare": "bare DDP, ResNet-18 32 px batch 64",
        "resnet_wandb": "template, ResNet-18 32 px batch 64, logger=wandb (offline)",
    }
    loads = [s["load"] for runs in results.values() for s in runs]
    out = [
        *preamble(command, args.nproc, args.repeats, loads, ""),
        "",
        "Values: mean over repeats (min–max) or ± std. Ratios: template mean ÷ bare mean, "
        "then (min–max) of the ratios within each repeat (neighbours in time).",
        "",
        "| variant | steady samples/s | ÷ bare | first step s | ÷ bare | peak RSS MiB "
        + " / ".join(f"r{r}" for r in range(args.nproc))
        + " | ÷ bare | child procs MiB | total wall s | ÷ bare |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for variant, runs in results.items():

        def ratio(key, runs=runs, variant=variant):
            """Ratio of the means over repeats, then the per-repeat ratios' min–max."""
            if variant not in BASELINE:
                return "—"
            bare = results[BASELINE[variant]]
            of_means = statistics.mean(map(key, runs)) / statistics.mean(map(key, bare))
            each = [key(t) / key(b) for t, b in zip(runs, bare, strict=True)]
            return f"{of_means:.3f} ({min(each):.3f}–{max(each):.3f})"

        rss = " / ".join(_spread([s["rss"][r] for s in runs], ".0f") for r in range(args.nproc))
        out.append(
            f"| {names[variant]} | {_std([s['sps'] for s in runs], '.0f')} | "
            f"{ratio(lambda s: s['sps'])} | {_std([s['first_step_s'] for s in runs], '.2f')} | "
            f"{ratio(lambda s: s['first_step_s'])} | {rss} | {ratio(lambda s: max(s['rss']))} | "
            f"{statistics.mean(s['child_rss'] for s in runs):.0f} | "
            f"{_std([s['wall_s'] for s in runs], '.2f')} | {ratio(lambda s: s['wall_s'])} |"
        )
    out += [
        "",
        "Milestones, seconds from process start (mean over ranks and repeats); "
        "`script`: the probe has imported torch (and, for train.py, hydra and ddp_template) "
        "and starts the script; `hydra_main`→`hydra_composed`: Hydra composition; "
        "`pg_*`: init_process_group; `ddp*`: the DDP constructor; `logger*`: RankLogger "
        "(W&B init).",
        "",
        "| variant | " + " | ".join(MARKS) + " | first step | exit |",
        "|---|" + "---:|" * (len(MARKS) + 2),
    ]
    for variant, runs in results.items():
        cells = []
        for m in MARKS:
            vals = [s["marks"][m] for s in runs if m in s["marks"]]
            cells.append(f"{statistics.mean(vals):.2f}" if vals else "—")
        out.append(
            f"| {names[variant]} | " + " | ".join(cells) + " | "
            f"{statistics.mean(s['first_step_s'] for s in runs):.2f} | "
            f"{statistics.mean(s['exit_s'] for s in runs):.2f} |"
        )
    out += ["", "Startup spans (s):", *_derived(results), "", "Targets:"]
    for variant in results:
        if variant not in TARGETS:
            continue
        floor, ceiling, rss_ceiling = TARGETS[variant]
        bare = results[BASELINE[variant]]

        def of_means(key, runs: list[dict] = results[variant], bare: list[dict] = bare) -> float:
            return statistics.mean(map(key, runs)) / statistics.mean(map(key, bare))

        sps = of_means(lambda s: s["sps"])
        med = of_means(lambda s: s["sps_median"])
        line = (
            f"- {names[variant]}: samples/s {sps:.3f}× bare (with each run's median epoch "
            f"instead of its mean: {med:.3f}; target ≥ {floor}) {_verdict(sps >= floor)}"
        )
        if ceiling is not None:
            first = of_means(lambda s: s["first_step_s"])
            line += f"; first step {first:.2f}× (target ≤ {ceiling}) {_verdict(first <= ceiling)}"
        if rss_ceiling is not None:
            rss = of_means(lambda s: max(s["rss"]))
            line += f"; peak RSS {rss:.3f}× (target ≤ {rss_ceiling}) {_verdict(rss <= rss_ceiling)}"
        out.append(line)
    return "\n".join(out) + "\n"


def _verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def main() -> None:
    args = parse_args()
    command = invocation()
    variants = SUITES[args.suite]
    results: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        work = args.keep or Path(tmp)
        for rep in range(args.repeats):
            order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
            for variant in order:
                tag = run_tag(variant, rep)
                summary = summarise(run_once(variant, args, work, tag))
                results[variant].append(summary)
                print(
                    f"repeat {rep} {variant:>12}: {summary['sps']:7.0f} samples/s, first step "
                    f"{summary['first_step_s']:.2f} s, RSS {max(summary['rss']):.0f} MiB, "
                    f"wall {summary['wall_s']:.2f} s, load {summary['load']:.2f}",
                    flush=True,
                )
    text = report(results, args, command)
    print("\n" + text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
