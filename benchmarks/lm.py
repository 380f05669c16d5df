"""``experiment=lm_bytes`` against its bare DDP loop (benchmarks/lm_bare.py): training tokens/s.

    python benchmarks/lm.py [--repeats 3] [--nproc 2] [--size BYTES] [--epochs 2]
                            [--loggers none,wandb] [--bucket25] [--out report.md]
                            [-- extra train.py overrides]

Writes the generated corpus once (``ddp_template.optional.tokens.corpus.corpus``: ``--size``
bytes, the
token files ``train.bin``/``val.bin``/``meta.json``) where the template's ``data=corpus`` looks
for it (``paths.data_root=<work>/data``), then runs, in one invocation and alternating (the order
rotates every repeat, so slow drifts in machine load hit every variant alike), under
``torchrun --standalone --nproc-per-node=N`` (gloo, CPU, W&B offline) and
benchmarks/_first_step_probe.py (with ``PROBE_STEPS=1``: wall and CPU seconds at every optimizer
step, measured alike for both programs), the same corpus, epochs, batch and model for all:

* ``template`` (``train.py experiment=lm_bytes logger=none``) and, with ``--loggers none,wandb``,
  ``template logger=wandb`` (offline, the template's default logger);
* ``bare``: benchmarks/lm_bare.py reading the token files the template reads;
* ``bare (A/A)``: the same bare loop once more: its ratio to ``bare`` is the noise floor;
* with ``--bucket25``, ``bare, bucket_cap_mb=25``: the bare loop with DDP built as the template
  builds it (``ddp.bucket_cap_mb=25`` passed explicitly, which makes torch drop its 1 MiB first
  bucket: one all-reduce per step at the end of backward instead of two), so the template's own
  cost is seen apart from that layout difference.

Reported per variant (rank mean, then mean over repeats):

* steady tokens/s: the mean over epochs >= 1 of each epoch's training-loop windows/s x block_size
  (the template's ``perf/samples_per_s`` from ``rank<r>/metrics.jsonl``; lm_bare.py times its
  loop the same way: iterator creation to the end of the last step, data wait included);
* step-span tokens/s and CPU s per 1e6 tokens: from the probe's per-step (wall, CPU) samples,
  from the end of each epoch's first step to the end of its last, epochs >= 1 (the same code
  measures both programs; CPU is the process's user + system over all its threads);
* peak RSS per rank, time to the first optimizer step, and the whole torchrun command's wall.

Ratios are variant / ``bare`` within one repeat (neighbours in time): their median and min-max
over repeats. Target (issue): template tokens/s >= 0.97x bare's, with the paired median outside
the A/A noise floor (the largest |A/A ratio - 1|).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from _launch import invocation, launch, preamble, run_tag
from overhead import _spread, _std

TARGET = 0.97
NAMES = {
    "template": "template, logger=none",
    "template_wandb": "template, logger=wandb (offline)",
    "bare": "bare DDP (benchmarks/lm_bare.py)",
    "bare_aa": "bare DDP again (A/A)",
    "bare_b25": "bare DDP, bucket_cap_mb=25 (the template's buckets)",
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--size", type=int, default=400_000, help="corpus bytes (data.size)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="windows per rank")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--loggers", default="none", help="template variants: none, wandb or none,wandb")
    p.add_argument(
        "--bucket25",
        action="store_true",
        help="also run the bare loop with DDP(bucket_cap_mb=25), as the template builds DDP",
    )
    p.add_argument("--out", type=Path, help="also write the Markdown report here (and .json)")
    p.add_argument("--keep", type=Path, help="keep run directories under this folder")
    p.add_argument("overrides", nargs="*", help="extra train.py overrides (after --)")
    args = p.parse_args()
    args.loggers = [x for x in args.loggers.split(",") if x]
    if args.epochs < 2:
        p.error("--epochs must be >= 2: epoch 0 is warm-up, steady state is epochs >= 1")
    return args


def variants(args: argparse.Namespace) -> list[str]:
    templates = [{"none": "template", "wandb": "template_wandb"}[x] for x in args.loggers]
    return [*templates, "bare", "bare_aa", *(["bare_b25"] if args.bucket25 else [])]


def write_corpus(work: Path, size: int) -> Path:
    """The token files, written once where ``data=corpus`` with ``data.size=size`` reads them."""
    from ddp_template.optional.tokens.corpus import corpus

    path = work / "data" / f"corpus-{size}-0"  # conf/data/corpus.yaml: corpus-${size}-${seed}
    corpus(str(path), size=size)
    return path


def run_once(variant: str, args: argparse.Namespace, work: Path, data: Path, tag: str) -> dict:
    """One torchrun launch; returns its per-rank epochs (windows, steps, windows/s) and probes."""
    run_dir = work / tag
    if variant.startswith("bare"):
        cmd = [
            "benchmarks/lm_bare.py",
            "--data",
            str(data),
            "--out",
            str(run_dir / "bare{rank}.json"),
        ]
        cmd += [f"--epochs={args.epochs}", f"--batch-size={args.batch_size}"]
        cmd += [f"--block-size={args.block_size}"]
        if variant == "bare_b25":
            cmd += ["--bucket-cap-mb=25"]
    else:
        logger = "wandb" if variant == "template_wandb" else "none"
        cmd = ["train.py", "experiment=lm_bytes", f"logger={logger}"]
        cmd += [f"data.size={args.size}", f"data.block_size={args.block_size}"]
        cmd += [f"epochs={args.epochs}", f"loader.batch_size={args.batch_size}"]
        cmd += [f"paths.output_root={work}", f"paths.data_root={work / 'data'}", *args.overrides]
    run = launch(cmd, run_dir, args.nproc, tag, PROBE_STEPS="1")
    ranks = []
    for r, probe in enumerate(run["probes"]):
        if variant.startswith("bare"):
            rows = json.loads((run_dir / f"bare{r}.json").read_text())["epochs"]
            epochs = [(row["samples"], row["steps"], row["samples_per_s"]) for row in rows]
            loop_cpu = [row["cpu_s"] for row in rows]
        else:
            lines = (run_dir / f"rank{r}" / "metrics.jsonl").read_text().splitlines()
            rows = [json.loads(line) for line in lines]
            rows = [row for row in rows if "epoch" in row and "perf/samples_per_s" in row]
            ends = [row["step"] for row in rows]  # optimizer steps at each epoch's end
            steps = [b - a for a, b in zip([0, *ends], ends, strict=False)]
            epochs = [
                (row["data/samples"], n, row["perf/samples_per_s"])
                for row, n in zip(rows, steps, strict=True)
            ]
            loop_cpu = None
        ranks.append({"probe": probe, "epochs": epochs, "loop_cpu_s": loop_cpu})
    return {**run, "variant": variant, "ranks": ranks, "run_dir": str(run_dir)}


def _rank_summary(rank: dict, args: argparse.Namespace) -> dict:
    """One rank: steady tokens/s, and from the probe's per-step samples the step-span tokens/s
    and CPU s per 1e6 tokens over epochs >= 1 (end of each epoch's first step to its last)."""
    block, epochs, steps = args.block_size, rank["epochs"], rank["probe"].get("steps", [])
    tps = [sps * block for _, _, sps in epochs]
    out = {"epoch_tps": tps, "tps": statistics.mean(tps[1:])}
    if len(steps) != sum(n for _, n, _ in epochs):  # a step the loop didn't count: don't guess
        out.update(span_tps=float("nan"), cpu_per_mtok=float("nan"))
        return out
    wall = cpu = tokens = 0.0
    begin = 0
    for e, (samples, n, _) in enumerate(epochs):
        first, last = steps[begin], steps[begin + n - 1]
        if e >= 1 and n >= 2:
            wall += last[0] - first[0]
            cpu += last[1] - first[1]
            tokens += (samples - min(samples, args.batch_size)) * block
        begin += n
    out["span_tps"] = tokens / wall if wall else float("nan")
    out["cpu_per_mtok"] = cpu / tokens * 1e6 if tokens else float("nan")
    if rank["loop_cpu_s"] is not None:  # lm_bare.py's own process_time over its loop
        loop_tokens = sum(s * block for s, _, _ in epochs[1:])
        out["loop_cpu_per_mtok"] = sum(rank["loop_cpu_s"][1:]) / loop_tokens * 1e6
    return out


def summarise(run: dict, args: argparse.Namespace) -> dict:
    ranks = [_rank_summary(r, args) for r in run["ranks"]]
    probes = [r["probe"] for r in run["ranks"]]
    summary = {
        "variant": run["variant"],
        "tps": statistics.mean(r["tps"] for r in ranks),
        "span_tps": statistics.mean(r["span_tps"] for r in ranks),
        "cpu_per_mtok": statistics.mean(r["cpu_per_mtok"] for r in ranks),
        "epoch_tps": [r["epoch_tps"] for r in ranks],
        "rss": [p["peak_rss_mib"] for p in probes],
        "rss_max": max(p["peak_rss_mib"] for p in probes),
        "first_step_s": statistics.mean(p["first_step_s"] for p in probes),
        "wall_s": run["wall_s"],
        "load": run["load"],
        "windows": [sum(s for s, _, _ in r["epochs"]) // len(r["epochs"]) for r in run["ranks"]],
        "steps": [r["epochs"][0][1] for r in run["ranks"]],
        "command": run["command"],
    }
    if all("loop_cpu_per_mtok" in r for r in ranks):
        summary["loop_cpu_per_mtok"] = statistics.mean(r["loop_cpu_per_mtok"] for r in ranks)
    return summary


def _paired(results: dict[str, list[dict]], variant: str, key: str, base="bare") -> list[float]:
    """``variant`` / ``base`` within each repeat."""
    return [t[key] / b[key] for t, b in zip(results[variant], results[base], strict=True)]


def _med_range(ratios: list[float]) -> str:
    if len(ratios) == 1:
        return f"{ratios[0]:.3f}"
    return f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})"


def report(results: dict[str, list[dict]], orders: list[list[str]], args, command: str) -> str:
    loads = [s["load"] for runs in results.values() for s in runs]
    first = results["bare"][0]
    out = [
        *preamble(command, args.nproc, args.repeats, loads, " (order rotated every repeat)"),
        "",
        f"Job: corpus of {args.size:,} bytes, block_size {args.block_size}, batch "
        f"{args.batch_size} windows per rank, {args.epochs} epochs of "
        f"{'/'.join(map(str, first['windows']))} windows and "
        f"{'/'.join(map(str, first['steps']))} optimizer steps per rank "
        f"(steady state: epochs >= 1).",
        "",
        "Values: mean over repeats ± std (or (min–max)). Ratios: variant ÷ bare within each "
        "repeat (neighbours in time): median (min–max) over repeats.",
        "",
        "| variant | steady tokens/s | ÷ bare | step-span tokens/s | ÷ bare | CPU s / 1e6 tokens "
        "| ÷ bare | peak RSS MiB "
        + " / ".join(f"r{r}" for r in range(args.nproc))
        + " | ÷ bare | first step s | total wall s | ÷ bare |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for variant, runs in results.items():

        def ratio(key, variant=variant):
            return "—" if variant == "bare" else _med_range(_paired(results, variant, key))

        rss = " / ".join(_spread([s["rss"][r] for s in runs], ".0f") for r in range(args.nproc))
        out.append(
            f"| {NAMES[variant]} | {_std([s['tps'] for s in runs], '.0f')} | {ratio('tps')} | "
            f"{_std([s['span_tps'] for s in runs], '.0f')} | {ratio('span_tps')} | "
            f"{_std([s['cpu_per_mtok'] for s in runs], '.1f')} | {ratio('cpu_per_mtok')} | "
            f"{rss} | {ratio('rss_max')} | {_std([s['first_step_s'] for s in runs], '.2f')} | "
            f"{_std([s['wall_s'] for s in runs], '.1f')} | {ratio('wall_s')} |"
        )
    loop = [s["loop_cpu_per_mtok"] for v in ("bare", "bare_aa") for s in results[v]]
    out += [
        "",
        f"Cross-check of the CPU measure: lm_bare.py's own `time.process_time()` over its "
        f"training loops (epochs >= 1) gives {statistics.mean(loop):.1f} CPU s / 1e6 tokens "
        f"(both bare rows), against the probe's step-span measure in the table.",
        "",
        "Per repeat (steady tokens/s, rank mean; run order; ratios to that repeat's bare):",
        "",
        "| repeat | order | "
        + " | ".join(NAMES[v] for v in results)
        + " | "
        + " | ".join(f"{NAMES[v]} ÷ bare" for v in results if v != "bare")
        + " | load |",
        "|---|---|" + "---:|" * (2 * len(results)),
    ]
    for rep, order in enumerate(orders):
        row = [results[v][rep] for v in results]
        ratios = [
            f"{results[v][rep]['tps'] / results['bare'][rep]['tps']:.3f}"
            for v in results
            if v != "bare"
        ]
        out.append(
            f"| {rep} | {' → '.join(order)} | "
            + " | ".join(f"{s['tps']:.0f}" for s in row)
            + " | "
            + " | ".join(ratios)
            + f" | {statistics.mean(s['load'] for s in row):.2f} |"
        )
    out += ["", "Per epoch (tokens/s per rank, repeat 0; epoch 0 is warm-up):", ""]
    for variant, runs in results.items():
        cells = "; ".join(
            f"r{r}: " + ", ".join(f"{v:.0f}" for v in tps)
            for r, tps in enumerate(runs[0]["epoch_tps"])
        )
        out.append(f"- {NAMES[variant]}: {cells}")
    aa = _paired(results, "bare_aa", "tps")
    floor = max(abs(r - 1) for r in aa)
    out += [
        "",
        f"Noise floor: bare (A/A) ÷ bare = {_med_range(aa)}, so ±{floor:.3f} "
        f"(the largest |A/A ratio − 1|).",
        "",
        "Target:",
    ]
    for variant in results:
        if not variant.startswith("template"):
            continue
        ratios = _paired(results, variant, "tps")
        med = statistics.median(ratios)
        met = med >= TARGET
        resolved = abs(med - TARGET) > floor
        out.append(
            f"- {NAMES[variant]}: tokens/s {_med_range(ratios)}× bare (paired median; target "
            f"≥ {TARGET}) {'MET' if met else 'MISSED'}; |median − {TARGET}| = "
            f"{abs(med - TARGET):.3f} {'>' if resolved else '<='} the A/A floor {floor:.3f}: "
            + ("resolved." if resolved else "not resolved (inside the noise).")
            + f" Its median distance from 1, {abs(med - 1):.3f}, is "
            + ("outside" if abs(med - 1) > floor else "inside")
            + " the A/A floor."
        )
        if "bare_b25" in results:
            same = _paired(results, variant, "tps", "bare_b25")
            out.append(
                f"  Against the bare loop with the template's DDP buckets (bucket_cap_mb=25): "
                f"{_med_range(same)}×."
            )
    return "\n".join(out) + "\n"


def main() -> None:
    args = parse_args()
    command = invocation()
    names = variants(args)
    results: dict[str, list[dict]] = {v: [] for v in names}
    orders = []
    with tempfile.TemporaryDirectory(prefix="lm-bench-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = write_corpus(work, args.size)
        for rep in range(args.repeats):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            orders.append(order)
            for variant in order:
                summary = summarise(
                    run_once(variant, args, work, data, run_tag(variant, rep)), args
                )
                results[variant].append(summary)
                print(
                    f"repeat {rep} {variant:>14}: {summary['tps']:7.0f} tokens/s (step-span "
                    f"{summary['span_tps']:.0f}), {summary['cpu_per_mtok']:.1f} CPU s/1e6 tok, "
                    f"RSS {max(summary['rss']):.0f} MiB, wall {summary['wall_s']:.1f} s, "
                    f"load {summary['load']:.2f}",
                    flush=True,
                )
    if args.out:  # the raw summaries first, so a report bug loses no run
        raw = {"orders": orders, "results": results}
        args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    text = report(results, orders, args, command)
    print("\n" + text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
