"""Benchmark: `python -m ddp_template.replay` is O(batch), not O(N).

No training: each case composes the config (as `train.py` would) and writes only the run dir's
`.hydra/config.yaml`; the world size comes from `--world-size`. For each case a fresh
subprocess imports the template once, then calls `replay.main` `--repeat` times (stdout
discarded): the first call apart (it pays one-time lazy imports), then the median and fastest
of the others in ms, and the peak RSS growth (ru_maxrss, MiB) of the first call and of the
later ones. Each call does everything the command does after its imports: read and type the
config, build the dataset and every rank's sampler, evaluate the step. The end-to-end column
is one `python -m ddp_template.replay` run, imports (torch, Hydra) included.

Usage: python benchmarks/replay.py [--repeat 15] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORLD = 8
CASES = [  # label, overrides, replay arguments
    (
        "N=1e9, auto (-> feistel), --step 3,000,000 (epoch 0 of 1)",
        ["data.size=1000000000", "epochs=1"],
        ["--step", "3000000"],
    ),
    (
        "N=1e9, auto (-> feistel), --step 35,000,000 (epoch 8 of 10)",
        ["data.size=1000000000", "epochs=10"],
        ["--step", "35000000"],
    ),
    (
        "N=1e9, auto (-> feistel), --index 123456789 (10 epochs)",
        ["data.size=1000000000", "epochs=10"],
        ["--index", "123456789"],
    ),
    (
        "N=1e7, auto (-> randperm), --step 30,000 (epoch 0 of 1)",
        ["data.size=10000000", "epochs=1"],
        ["--step", "30000"],
    ),
    (
        "N=1e6, auto (-> randperm), --index 4321 (10 epochs)",
        ["data.size=1000000", "epochs=10"],
        ["--index", "4321"],
    ),
]


def write_run(folder: Path, overrides: list[str]) -> Path:
    """A run dir holding the composed config, exactly what rank 0 writes to .hydra/."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ddp_template.config.schema import register_configs

    register_configs()
    base = ["data=synthetic", "loader.batch_size=32", "seed=7", "logger=none"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=base + overrides)
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    return folder


def _child(args: list[str], repeat: int) -> dict:
    """Time `replay.main(args)` in this fresh process, imports excluded.

    The first call also pays one-time lazy imports and caches (Hydra's instantiate, OmegaConf's
    structured configs), so it is reported apart; RSS is measured around it and around the rest.
    """
    import contextlib
    import io
    import resource

    from ddp_template.replay import main

    def rss() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

    def call() -> float:
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            code = main(args)
        assert code == 0, f"replay {args} exited {code}"
        return time.perf_counter() - start

    before = rss()
    first = call()
    after_first = rss()
    times = [call() for _ in range(repeat - 1)]
    return {
        "first_ms": first * 1e3,
        "median_ms": statistics.median(times) * 1e3,
        "min_ms": min(times) * 1e3,
        "rss_first_mib": after_first - before,
        "rss_rest_mib": rss() - after_first,
    }


def _measure(run_dir: Path, replay_args: list[str], repeat: int) -> dict:
    args = [str(run_dir), *replay_args, "--world-size", str(WORLD), "--json"]
    cmd = [sys.executable, __file__, "--child", json.dumps(args), str(repeat)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ddp_template.replay", *args], check=True,
                   capture_output=True)  # fmt: skip
    return result | {"cli_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15, help="calls per case")
    parser.add_argument("--quick", action="store_true", help="the first case only, 5 calls")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child[0]), int(args.child[1]))))
        return
    cases, repeat = (CASES[:1], 5) if args.quick else (CASES, args.repeat)
    lines = [
        f"W={WORLD}, batch_size=32, seed=7, {repeat} calls per case, one fresh process each.",
        "",
        "| case | first call (ms) | median, later calls (ms) | fastest (ms) "
        "| RSS growth: first call, later calls (MiB) | end-to-end CLI (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for k, (label, overrides, replay_args) in enumerate(cases):
            run_dir = write_run(Path(tmp) / f"run{k}", overrides)
            r = _measure(run_dir, replay_args, repeat)
            lines.append(
                f"| {label} | {r['first_ms']:.1f} | {r['median_ms']:.1f} | {r['min_ms']:.1f} "
                f"| {r['rss_first_mib']:.1f}, {r['rss_rest_mib']:.1f} | {r['cli_s']:.2f} |"
            )
            print(f"done {label}", file=sys.stderr, flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
