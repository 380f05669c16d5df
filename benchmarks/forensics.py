"""What the provenance chain and spike forensics cost the default job when no spike fires.

    python benchmarks/forensics.py [--rounds 9] [--epochs 3] [--out benchmarks/forensics_results.md]

The default job (``data=digits``, ``model=small_cnn``, batch 32, 2 ranks on gloo, the CPU) is
built by ``train.build`` on each rank (the script starts itself under torchrun) and trained by
``engine.train_one_epoch`` in three variants:

* ``off``: a trainer built with ``spike.factor=null``: no spike rule;
* ``loss``: one built with ``spike.watch=[loss]`` (the rule before it watched more): each
  micro-batch held with its RNG state, the step's loss read on the host and judged against the
  rank's window;
* ``spike``: one built with the default rule (record only, ``spike.watch=[loss,grad_norm,
  input]``): also each micro-batch's largest per-sample input RMS and the step's gradient norm,
  on the device, read with the loss in one read and each judged against its own window;
* ``skip``: one built with ``spike.skip=true``: the same, and the ranks' verdicts all-reduced
  every step (what skipping needs);
* ``off (A/A)``: ``off`` again: the noise floor of a ratio.

A measurement is ``--epochs`` epochs (23 steps each) timed on rank 0 between barriers. Rounds
are paired and interleaved (the variants' order rotates each round) and every ratio is taken
within a round. The chain costs nothing per step: it is sealed into each checkpoint (a digest
of the ledgers) and checked on resume; its cost is measured as ``Checkpointer.payload`` with
and without the seal (paired, ``--saves`` each round) and the data's identity taken once.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from _launch import on_ranks, paired_table, publish, ratios, timed_epochs  # noqa: E402

VARIANTS = ("off", "loss", "spike", "skip", "off (A/A)")


def ranks(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from hydra import compose, initialize_config_dir

    import train
    from ddp_template import distributed
    from ddp_template.config import boundary
    from ddp_template.data.identity import identify
    from ddp_template.engine import TrainState
    from ddp_template.provenance import build_chain

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        raw = compose("config", overrides=["backend=gloo", "logger=none"])
        off = compose("config", overrides=["backend=gloo", "logger=none", "spike.factor=null"])
        skip = compose("config", overrides=["backend=gloo", "logger=none", "spike.skip=true"])
        loss = compose("config", overrides=["backend=gloo", "logger=none", "spike.watch=[loss]"])
    cfg = boundary.typed(raw)
    info = distributed.setup(cfg.backend)
    built = train.build(cfg, info)
    plain = train.build(boundary.typed(off), info).trainer
    agreeing = train.build(boundary.typed(skip), info).trainer
    alone = train.build(boundary.typed(loss), info).trainer
    spikes = built.trainer.spikes
    trainers = {"spike": built.trainer, "skip": agreeing, "loss": alone}
    trainers |= {"off": plain, "off (A/A)": plain}
    states = {v: TrainState() for v in ("spike", "skip", "loss", "off")}
    fired = 0

    def measure(variant: str) -> float:
        nonlocal fired
        took = timed_epochs(trainers[variant], states.get(variant, states["off"]), args.epochs)
        fired += sum(len(tr.spikes.take()) for tr in (built.trainer, agreeing, alone))
        return took

    chain = build_chain(cfg, plain=boundary.plain(cfg), run="bench", data=built.data)
    session = SimpleNamespace(  # what train.checkpointer reads of a Session
        built=built,
        state=states["spike"],
        run=SimpleNamespace(run_dir=Path("/tmp/forensics-bench")),
        cfg=cfg,
        plain=boundary.plain(cfg),
        chain=chain,
    )
    ckpt = train.checkpointer(session)

    def payload(sealed: bool) -> float:
        ckpt.seal = chain.seal if sealed else None
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.saves):
            ckpt.payload()
        return (time.perf_counter() - start) / args.saves

    measure("off")  # warm-up: allocator, threads, the first steps
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    saves: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        k = r % len(VARIANTS)
        for variant in VARIANTS[k:] + VARIANTS[:k]:
            seconds[variant].append(measure(variant))
        for sealed in (r % 2 == 0, r % 2 == 1):
            saves[sealed].append(payload(sealed))
        if info.is_main:
            print(f"round {r + 1}: " + ", ".join(f"{v} {seconds[v][-1]:.3f}s" for v in VARIANTS))
    start = time.perf_counter()
    identify(built.splits)
    identity_s = time.perf_counter() - start
    rule_s = rule_alone(built.trainer, spikes), rule_alone(alone, alone.spikes)
    if info.is_main:
        steps = plain.steps.steps_per_epoch
        report(args, seconds, saves, identity_s, rule_s, steps=steps, fired=fired)
    distributed.teardown()


def rule_alone(tr, spikes, steps: int = 2000) -> float:
    """The rule's own work for one step that does not spike, timed alone (seconds): a
    micro-batch held (its RNG state, its input RMS), its loss counted, the step judged (the
    gradient's norm: the model's gradients of one backward, kept)."""
    import torch

    x, y, idx = next(iter(tr.loader))
    tr.task.loss(tr.module(x), y, "mean").backward()
    loss = torch.tensor(0.5)
    for window in spikes.windows.values():
        window.clear()
        window.extend([1e9] * spikes.cfg.window)  # nothing fires
    start = time.perf_counter()
    for k in range(steps):
        spikes.hold(x, y, idx, tr.module)
        spikes.count(loss, len(idx))
        assert not spikes.judge(tr.module, k, 0)
    return (time.perf_counter() - start) / steps


def report(
    args: argparse.Namespace,
    seconds: dict[str, list[float]],
    saves: dict[bool, list[float]],
    identity_s: float,
    rule_s: tuple[float, float],
    steps: int,
    fired: int,
) -> None:
    note = f", spikes fired: {fired}"
    lines = paired_table(seconds, "off", epochs=args.epochs, steps=steps, note=note)
    aa, spike, skip = (ratios(seconds, v, "off") for v in ("off (A/A)", "spike", "skip"))
    more = ratios(seconds, "spike", "loss")
    per_step = 1000 / (args.epochs * steps)
    step_ms = statistics.median(seconds["off"]) * per_step
    sealed = [a - b for a, b in zip(saves[True], saves[False], strict=True)]
    seal_ms = statistics.median(sealed) * 1000
    lines += [
        "",
        f"spike / off: median {statistics.median(spike):.3f}x ({min(spike):.3f}-"
        f"{max(spike):.3f}); A/A (off / off again): median {statistics.median(aa):.3f}x "
        f"({min(aa):.3f}-{max(aa):.3f}); skip / off: median {statistics.median(skip):.3f}x "
        f"({min(skip):.3f}-{max(skip):.3f}); spike / loss (the gradient norm and input "
        f"watched too): median {statistics.median(more):.3f}x ({min(more):.3f}-"
        f"{max(more):.3f})",
        f"the rule's own work per step, timed alone: {rule_s[0] * 1e6:.1f} us = "
        f"{rule_s[0] * 1000 / step_ms * 100:.2f} % of the {step_ms:.2f} ms step (watching the "
        f"loss alone: {rule_s[1] * 1e6:.1f} us = {rule_s[1] * 1000 / step_ms * 100:.2f} %)",
        f"chain: sealing a checkpoint's payload adds {seal_ms:.3f} ms (median of paired "
        f"differences, {args.rounds} rounds x {args.saves} payloads; one save per epoch of "
        f"{steps} steps: {seal_ms / (steps * step_ms) * 100:.3f} % of a step); the data's "
        f"identity, once per launch: {identity_s * 1000:.1f} ms",
    ]
    publish("\n".join(lines), args.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--saves", type=int, default=20)
    parser.add_argument("--out", type=Path)
    on_ranks(ranks, parser.parse_args(), __file__)


if __name__ == "__main__":
    main()
