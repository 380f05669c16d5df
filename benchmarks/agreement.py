"""What the per-step "do all ranks still have data" agreement costs on the default job.

    python benchmarks/agreement.py [--rounds 9] [--epochs 3] [--out benchmarks/agreement_results.md]

The default job (``data=digits``, ``model=small_cnn``, batch 32, 2 ranks on gloo, the CPU) is
built by ``train.build`` on each rank (the script starts itself under torchrun) and trained by
``engine.train_one_epoch`` in three variants:

* ``planned``: the map-style loop as every map-style run has it: no agreement (the sampler
  mode plans every rank's steps);
* ``agreement``: the same loader's batches through the stream loop (``streams.stop.Agreement``):
  before each step one int all-reduced (MIN) on a gloo group of its own, issued one step ahead
  and waited for when the step begins — what a stream the template cannot plan pays;
* ``planned (A/A)``: the planned loop again: the noise floor of a ratio.

A measurement is ``--epochs`` epochs (23 steps each) timed on rank 0 between barriers. Rounds
are paired and interleaved (the variants' order rotates each round) and every ratio is taken
within a round, so drifts in the machine's load hit every variant alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from _launch import on_ranks, paired_table, publish, ratios, timed_epochs  # noqa: E402

VARIANTS = ("planned", "agreement", "planned (A/A)")


class StreamForm:
    """The map-style loader's ``(x, y, index)`` batches in a stream loader's form (the batch,
    its keys, the worker, the key names): what ``Agreement.micro_batches`` reads."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def __iter__(self):
        for x, y, index in self.loader:
            yield (x, y, index), index, 0, []


def ranks(args: argparse.Namespace) -> None:
    from hydra import compose, initialize_config_dir

    import train
    from ddp_template import distributed
    from ddp_template.config import boundary
    from ddp_template.engine import PlannedFeed, TrainState
    from ddp_template.optional.streams.stop import Agreement

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        raw = compose("config", overrides=["backend=gloo", "logger=none"])
    cfg = boundary.typed(raw)
    info = distributed.setup(cfg.backend)
    tr = train.build(cfg, info).trainer
    planned, agreement = tr.loader, Agreement(info=info)
    state = TrainState()

    def measure(variant: str) -> float:
        tr.feed = agreement if variant == "agreement" else PlannedFeed()
        tr.loader = StreamForm(planned) if variant == "agreement" else planned
        return timed_epochs(tr, state, args.epochs)

    measure("planned")  # warm-up: allocator, threads, the first steps
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:
            seconds[variant].append(measure(variant))
        if info.is_main:
            print(f"round {r + 1}: " + ", ".join(f"{v} {seconds[v][-1]:.3f}s" for v in VARIANTS))
    if info.is_main:
        report(args, seconds, steps=tr.steps.steps_per_epoch)
    distributed.teardown()


def report(args: argparse.Namespace, seconds: dict[str, list[float]], steps: int) -> None:
    lines = paired_table(seconds, "planned", epochs=args.epochs, steps=steps)
    aa = ratios(seconds, "planned (A/A)", "planned")
    agreed = ratios(seconds, "agreement", "planned")
    lines.append(
        f"\nagreement / planned: median {statistics.median(agreed):.3f}x "
        f"({min(agreed):.3f}-{max(agreed):.3f}); A/A (planned / planned again): median "
        f"{statistics.median(aa):.3f}x ({min(aa):.3f}-{max(aa):.3f})"
    )
    publish("\n".join(lines), args.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", type=Path)
    on_ranks(ranks, parser.parse_args(), __file__)


if __name__ == "__main__":
    main()
