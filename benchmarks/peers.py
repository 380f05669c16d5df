"""The template against its peers on one job: bare DDP, Lightning and accelerate.

    python benchmarks/peers.py [--rounds 7] [--epochs 6] [--nproc 2] [--out report.md]
                               [--variants bare,none,...] [--keep DIR] [--raw runs.json]

The job is ``benchmarks/bare_ddp.py``'s (the template's defaults: small_cnn on scikit-learn's
digits, 32 samples per rank per step, SGD 0.1 / 0.9 Nesterov, weight decay on weights only, a
per-step cosine), 2 ranks under ``torchrun --standalone``, gloo on CPU, W&B offline. Variants:

* ``bare``: benchmarks/bare_ddp.py, training only; ``bare_aa``: the same again (A/A), whose
  ratios to ``bare`` are the noise floor every other ratio must clear;
* ``none`` and ``wandb``: train.py with ``logger=none`` / ``logger=wandb`` (offline);
* ``lightning`` and ``lightning_wandb``: benchmarks/lightning_ddp.py (lightning-hydra-template's
  pattern) with ``logger=False`` / a ``WandbLogger(offline=True)``;
* ``accelerate``: benchmarks/accelerate_ddp.py, no tracker.

Lightning and accelerate come from the ``bench`` extra (``pip install -e '.[bench]'``); neither
is a dependency of the template. A round runs every variant once, in an order rotated by one each
round (a drift in the machine's load, or whatever runs first, hits every variant alike), and
every ratio is taken within a round against that round's ``bare``: the table shows the median
of those paired ratios and their min–max over the rounds.

Every rank of every program runs under benchmarks/_first_step_probe.py with ``PROBE_STEPS=1``:
the time and the rank's CPU seconds (``getrusage``) at the end of every optimizer step. From
those, measured alike for all:

* steady step: epochs >= 1, from the end of an epoch's first step to the end of its
  second-to-last (full batches only: the data wait included, the epoch's start and end not);
  samples/s = ranks x 32 / step; "ms per step − bare" is the difference in ms;
* whole epoch incl. its end: end of epoch 0's last step to end of the last epoch's last step,
  over epochs - 1: an epoch's steps plus whatever the program does between epochs (evaluation,
  checkpoint, shard check, logging); shown as bare's epoch time ÷ the variant's (a speed);
* first step from launch: from starting torchrun to the last rank's end of its first step;
* CPU s/sample: the ranks' CPU seconds (summed) per training sample, in the steady window and
  for the whole process (start-up, evaluation and exit included; W&B's service process is not a
  rank and is not counted). CPU time barely moves with a neighbour's load; wall time does.

Lightning's and accelerate's own reports give the exactness rows: what each counts in the final
evaluation of the 359-sample test split on 2 ranks, against the template's ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from importlib import metadata
from pathlib import Path

from _launch import ROOT, git_state, invocation, launch, run_tag

BATCH = 32  # bare_ddp.py's default, per rank
NAMES = {
    "bare": "bare DDP (benchmarks/bare_ddp.py)",
    "bare_aa": "bare DDP again (A/A: the noise floor)",
    "none": "template, `logger=none`",
    "wandb": "template, `logger=wandb` (offline)",
    "lightning": "Lightning {lightning}, `logger=False` (lightning-hydra-template's pattern)",
    "lightning_wandb": "Lightning {lightning}, `WandbLogger(offline=True)`",
    "accelerate": "accelerate {accelerate}, no tracker",
}
VARIANTS = list(NAMES)
HEAD_TO_HEAD = [("none", "lightning"), ("wandb", "lightning_wandb"), ("none", "accelerate")]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7, help="7: every variant once in every slot")
    p.add_argument("--epochs", type=int, default=6, help="every program (at least 2)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; bare always")
    p.add_argument("--out", type=Path, help="also write the Markdown report here")
    p.add_argument("--keep", type=Path, help="keep the run directories under this folder")
    p.add_argument("--raw", type=Path, help="also write every run's figures here (JSON)")
    args = p.parse_args()
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    args.variants = [v for v in VARIANTS if v == "bare" or v in chosen]
    if args.epochs < 2:
        p.error("--epochs must be at least 2 (epoch 0 is start-up, left out of the steady figures)")
    return args


def command_for(variant: str, run_dir: Path, work: Path, epochs: int) -> list[str]:
    out = ["--out", str(run_dir / "out{rank}.json"), "--epochs", str(epochs)]
    if variant in ("bare", "bare_aa"):
        return ["benchmarks/bare_ddp.py", *out]
    if variant in ("none", "wandb"):
        return ["train.py", f"logger={variant}", f"epochs={epochs}", f"paths.output_root={work}"]
    if variant.startswith("lightning"):
        logger = "wandb" if variant == "lightning_wandb" else "none"
        return ["benchmarks/lightning_ddp.py", *out, "--root", str(run_dir), "--logger", logger]
    return ["benchmarks/accelerate_ddp.py", *out, "--root", str(run_dir)]


def measure(run: dict, epochs: int) -> dict:
    """One launch's figures from its ranks' per-step times and CPU seconds."""
    probes = run["probes"]
    counts = {len(p["steps"]) for p in probes}
    if len(counts) != 1 or next(iter(counts)) % epochs:
        raise SystemExit(f"{run['command']}: steps per rank {sorted(counts)}, not {epochs} epochs")
    per_epoch = next(iter(counts)) // epochs
    steady_s, steady_cpu, epoch_s = [], 0.0, []
    for p in probes:
        t, cpu = zip(*p["steps"], strict=True)
        firsts = range(per_epoch, epochs * per_epoch, per_epoch)  # epochs >= 1
        steady_s.append(
            sum(t[i + per_epoch - 2] - t[i] for i in firsts) / ((per_epoch - 2) * (epochs - 1))
        )
        steady_cpu += sum(cpu[i + per_epoch - 2] - cpu[i] for i in firsts)
        epoch_s.append((t[-1] - t[per_epoch - 1]) / (epochs - 1))
    step = statistics.mean(steady_s)
    first = max(p["start_boottime_s"] + p["first_step_s"] for p in probes)
    return {
        "steps_per_epoch": per_epoch,
        "sps": len(probes) * BATCH / step,
        "step_ms": step * 1000,
        "epoch_s": statistics.mean(epoch_s),
        "first_step_s": first - run["launched_boottime_s"],
        "steady_cpu": steady_cpu / (len(probes) * BATCH * (per_epoch - 2) * (epochs - 1)),
        "cpu_s": sum(p["cpu_s"] for p in probes),
        "wall_s": run["wall_s"],
        "load": run["load"],
    }


def exactness(variant: str, run_dir: Path, nproc: int) -> dict | None:
    """What the program counted in its final evaluation of the test split."""
    if variant in ("none", "wandb"):
        summary = json.loads((run_dir / "summary.json").read_text())
        return {"correct": summary["eval_correct"], "count": summary["eval_count"]}
    if variant.startswith("bare"):
        return None
    outs = [json.loads((run_dir / f"out{r}.json").read_text()) for r in range(nproc)]
    test = outs[0]["test"]
    if variant == "accelerate":
        return {"correct": test["correct"], "count": test["count"], "size": outs[0]["test_size"]}
    seen = [i for out in outs for i in out["test_indices"]]
    twice = sorted({i for i in seen if seen.count(i) > 1})
    return {
        "correct": round(test["test/correct"]),
        "count": round(test["test/count"]),
        "acc": test["test/acc"],
        "size": outs[0]["test_size"],
        "evaluated": len(seen),
        "twice": twice,
    }


def train_samples(run_dir: Path, nproc: int) -> int:
    """Training samples of one epoch, all ranks (from bare's own report)."""
    outs = [json.loads((run_dir / f"out{r}.json").read_text()) for r in range(nproc)]
    return sum(out["epochs"][0]["samples"] for out in outs)


def _cell(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    med = statistics.median(values)
    return f"{format(med, fmt)} ({format(min(values), fmt)}–{format(max(values), fmt)})"


def _machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {mem_kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        mem = ""
    return f"{os.cpu_count()} cores{' (' + model + ')' if model else ''}{mem}, {platform.system()}"


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("torch", "lightning", "accelerate", "wandb"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def report(results, exact, args, meta) -> str:
    versions = meta["versions"]
    base = results["bare"]
    rounds = len(base)

    def paired(variant: str, fn) -> str:
        return _cell([fn(v, b) for v, b in zip(results[variant], base, strict=True)], ".2f")

    b = {k: statistics.median(r[k] for r in base) for k in base[0]}
    loads = [r["load"] for runs in results.values() for r in runs]
    out = [
        f"Command: `{meta['command']}`",
        "",
        f"Date: {meta['date']}. Machine: {meta['machine']}. Template at {meta['git']}; "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + ".",
        "",
        f"{args.nproc} ranks, torchrun --standalone, gloo on CPU, W&B offline; {args.epochs} "
        f"epochs of {b['steps_per_epoch']} steps per rank ({meta['samples']} training samples an "
        f"epoch); {rounds} round(s), the order rotated by one each round. 1-min load average: "
        f"{meta['load_start']:.2f} at the start, {meta['load_end']:.2f} at the end, "
        f"{min(loads):.2f}–{max(loads):.2f} during the runs. One round took "
        f"{meta['round_s']:.0f} s (median).",
        "",
        "Median of the paired ratios (each against the same round's bare run), min–max over "
        "the rounds. Speeds (samples/s, whole epoch) are variant ÷ bare: below 1 is slower; "
        "times and CPU are variant ÷ bare: above 1 costs more.",
        "",
        "| variant | steady samples/s ÷ bare | whole epoch incl. its end ÷ bare | "
        "first step from launch ÷ bare | ms per step − bare | steady CPU s/sample ÷ bare | "
        "whole-process CPU s/sample ÷ bare | command wall s ÷ bare |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| bare DDP: its own values (median) | {b['sps']:.0f} samples/s | "
        f"{b['epoch_s'] * 1000:.0f} ms | {b['first_step_s']:.2f} s | {b['step_ms']:.2f} ms | "
        f"{b['steady_cpu'] * 1e6:.0f} µs | {b['cpu_s'] / meta['trained'] * 1e6:.0f} µs | "
        f"{b['wall_s']:.1f} s |",
    ]
    for variant in results:
        if variant == "bare":
            continue
        name = NAMES[variant].format(**versions)
        out.append(
            f"| {name} | {paired(variant, lambda v, b: v['sps'] / b['sps'])} | "
            f"{paired(variant, lambda v, b: b['epoch_s'] / v['epoch_s'])} | "
            f"{paired(variant, lambda v, b: v['first_step_s'] / b['first_step_s'])} | "
            + _cell(
                [v["step_ms"] - w["step_ms"] for v, w in zip(results[variant], base, strict=True)],
                "+.2f",
            )
            + f" | {paired(variant, lambda v, b: v['steady_cpu'] / b['steady_cpu'])} | "
            f"{paired(variant, lambda v, b: v['cpu_s'] / b['cpu_s'])} | "
            f"{paired(variant, lambda v, b: v['wall_s'] / b['wall_s'])} |"
        )
    heads = [(t, o) for t, o in HEAD_TO_HEAD if t in results and o in results]
    if heads:
        out += ["", "Head to head, paired in each round (template ÷ peer; median, min–max):", ""]
    for mine, theirs in heads:

        def versus(fn, mine=mine, theirs=theirs) -> str:
            pairs = zip(results[mine], results[theirs], strict=True)
            return _cell([fn(m, t) for m, t in pairs], ".2f")

        out.append(
            f"- {NAMES[mine]} ÷ {NAMES[theirs].format(**versions)}: steady samples/s "
            f"{versus(lambda m, t: m['sps'] / t['sps'])}, whole epoch "
            f"{versus(lambda m, t: t['epoch_s'] / m['epoch_s'])}, first step from launch "
            f"{versus(lambda m, t: m['first_step_s'] / t['first_step_s'])}, steady CPU/sample "
            f"{versus(lambda m, t: m['steady_cpu'] / t['steady_cpu'])}"
        )
    steps = {v: sorted({r["steps_per_epoch"] for r in runs}) for v, runs in results.items()}
    out += ["", f"Optimizer steps per rank and epoch: {steps}."]
    if exact:
        out += [
            "",
            "Final evaluation of the test split on 2 ranks, as each program reports it "
            "(every round alike unless a cell lists several):",
            "",
            "| program | reports | over | test samples | how |",
            "|---|---:|---:|---:|---|",
        ]
        for variant, seen in exact.items():
            cells = sorted({(e["correct"], e["count"]) for e in seen})
            reports = " or ".join(f"{c}/{n} = {c / n:.4f}" for c, n in cells)
            first = seen[0]
            size = first.get("size", first["count"])
            if variant.startswith("lightning"):
                how = (
                    f"`trainer.test`: `DistributedSampler` pads {size} to "
                    f"{first['evaluated']}; test index {first['twice']} evaluated on both ranks; "
                    f"`test/acc` {first['acc']:.4f}"
                )
            elif variant == "accelerate":
                how = "`gather_for_metrics` drops the padded duplicates"
            else:
                how = "`summary.json` `eval_correct` / `eval_count`: exact eval shards, no padding"
            name = NAMES[variant].format(**versions)
            out.append(f"| {name} | {reports} | {cells[0][1]} | {size} | {how} |")
    return "\n".join(out) + "\n"


def main() -> None:
    args = parse_args()
    meta = {
        "command": invocation(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": _machine(),
        "git": git_state(),
        "versions": _versions(),
        "load_start": os.getloadavg()[0],
    }
    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    exact: dict[str, list[dict]] = {}
    round_s = []
    # this checkout's src/ first, whichever checkout the venv's editable install points at
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        work = args.keep or Path(tmp)
        for r in range(args.rounds):
            k = r % len(args.variants)
            started = time.perf_counter()
            for variant in args.variants[k:] + args.variants[:k]:
                tag = run_tag(variant, r)
                run_dir = work / tag
                script = command_for(variant, run_dir, work, args.epochs)
                run = launch(script, run_dir, args.nproc, tag, PROBE_STEPS="1", PYTHONPATH=path)
                got = measure(run, args.epochs)
                results[variant].append(got)
                if variant == "bare" and "samples" not in meta:
                    meta["samples"] = train_samples(run_dir, args.nproc)
                seen = exactness(variant, run_dir, args.nproc)
                if seen is not None:
                    exact.setdefault(variant, []).append(seen)
                print(
                    f"round {r} {variant:>15}: {got['sps']:6.0f} samples/s, step "
                    f"{got['step_ms']:.2f} ms, epoch {got['epoch_s'] * 1000:.0f} ms, first step "
                    f"{got['first_step_s']:.2f} s, CPU {got['cpu_s']:.1f} s, wall "
                    f"{got['wall_s']:.1f} s, load {got['load']:.2f}",
                    flush=True,
                )
            round_s.append(time.perf_counter() - started)
    meta["round_s"] = statistics.median(round_s)
    meta["load_end"] = os.getloadavg()[0]
    meta["trained"] = meta["samples"] * args.epochs
    text = report(results, {v: exact[v] for v in results if v in exact}, args, meta)
    print("\n" + text)
    if args.out:
        args.out.write_text(text)
    if args.raw:
        args.raw.write_text(json.dumps({"meta": meta, "runs": results, "exact": exact}, indent=1))


if __name__ == "__main__":
    main()
