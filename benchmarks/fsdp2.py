"""parallel=fsdp2 against parallel=ddp: each rank's memory for the model's state, and the
steady step time on CPU.

    python benchmarks/fsdp2.py [--rounds 5] [--steps 12] [--out benchmarks/fsdp2_results.md]
    python benchmarks/fsdp2.py --backend nccl --amp bf16 --worlds 1,2   # on GPUs (gpu_check.sh)

The GPT of ``experiment=lm_bytes`` (4 blocks of 128, vocabulary 256, windows of 128 bytes,
AdamW), built by ``train.build`` on each rank from the composed config (the script starts
itself under torchrun at each world size, gloo on the CPU), trains ``--steps`` steps under each
layout:

* **memory**: at every optimizer step (an optimizer step pre-hook, when parameters, gradients
  and optimizer state are all alive) the bytes this rank holds of each: a DDP rank a whole copy
  of each, an FSDP2 rank its slices (``DTensor.to_local``). The same at every step and on every
  rank but for padding; the report gives rank 0's largest, at W = 1, 2 and 4. What each rank
  also holds only for a while (activations; FSDP2's gathered unit and the next one it
  prefetches; DDP's gradient buckets) is left out of that count and stated beside it: the
  gathered units' bytes are their parameters' full size. On CUDA (``--backend nccl``) each
  layout's peak of every tensor its run allocated (``torch.cuda.max_memory_allocated`` over
  its build and its steps, activations and gathered units included) is reported beside it.
* **time** (W = 2): ``--rounds`` paired rounds of ddp, fsdp2 and ddp again (the A/A floor), the
  order rotating each round, each ``--steps`` steps of ``engine.train_one_epoch`` between
  barriers; ratios are taken within a round. No target on CPU: FSDP2 trades each unit's
  all-gather and reduce-scatter for memory, which a CPU over gloo pays for and a GPU over
  NCCL overlaps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from _launch import git_state, paired_table, publish, under_torchrun  # noqa: E402

LAYOUTS = ("ddp", "fsdp2")
TIMED = ("ddp", "fsdp2", "ddp (A/A)")
MIB = 2**20


def overrides(layout: str, args: argparse.Namespace) -> list[str]:
    return [
        "experiment=lm_bytes",
        f"backend={args.backend}",
        f"amp={args.amp}",
        "logger=none",
        f"parallel={layout}",
        f"max_steps_per_epoch={args.steps}",
        f"paths.data_root={ROOT / 'data'}",
    ]


def local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def state_bytes(tr) -> dict[str, int]:
    params = [p for p in tr.model.parameters()]
    states = [v for s in tr.optimizer.state.values() for v in s.values() if hasattr(v, "numel")]
    return {
        "parameters": local_bytes(params),
        "gradients": local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": local_bytes(states),
    }


def ranks(args: argparse.Namespace) -> None:
    import torch
    from _launch import timed_epochs
    from hydra import compose, initialize_config_dir

    import train
    from ddp_template import distributed
    from ddp_template.config import boundary
    from ddp_template.engine import TrainState

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfgs = {k: boundary.typed(compose("config", overrides=overrides(k, args))) for k in LAYOUTS}
    info = distributed.setup(cfgs["ddp"].backend)
    cuda = info.device.type == "cuda"
    trainers, result = {}, {"world": info.world_size, "memory": {}, "seconds": {}}
    for layout in LAYOUTS:  # one after the other: each one's CUDA peak is its own
        before = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        tr = trainers[layout] = train.build(cfgs[layout], info).trainer
        seen: list[dict[str, int]] = []
        hook = lambda *_, tr=tr, seen=seen: seen.append(state_bytes(tr))  # noqa: E731
        handle = tr.optimizer.register_step_pre_hook(hook)
        timed_epochs(tr, TrainState(), 1)  # also the warm-up of the timing below
        handle.remove()
        largest = max(seen, key=lambda row: sum(row.values()))
        full = sum(p.numel() * 4 for p in tr.module.parameters())  # fp32, whole
        units = [tr.module.get_submodule(u) for u in getattr(tr.parallel, "units", [])]
        unit_bytes = [sum(p.numel() * 4 for p in u.parameters()) for u in units]
        largest_unit = max([*unit_bytes, full - sum(unit_bytes)])  # the root's own too
        peak = torch.cuda.max_memory_allocated() - before if cuda else None
        result["memory"][layout] = {
            **largest,
            "whole_parameters": full,
            "largest_unit": largest_unit,
            "cuda_peak": peak,
        }
    if args.rounds and info.world_size == 2:
        states = {k: TrainState() for k in LAYOUTS}
        seconds: dict[str, list[float]] = {v: [] for v in TIMED}
        for r in range(args.rounds):
            for variant in TIMED[r % 3 :] + TIMED[: r % 3]:
                layout = variant.split()[0]
                seconds[variant].append(timed_epochs(trainers[layout], states[layout], 1))
        result["seconds"] = seconds
    if info.is_main:
        Path(args.scratch, f"world{info.world_size}.json").write_text(json.dumps(result))
    distributed.teardown()


def report(args: argparse.Namespace, worlds: list[int]) -> str:
    rows = {w: json.loads(Path(args.scratch, f"world{w}.json").read_text()) for w in worlds}
    lines = [
        f"Command: `python benchmarks/fsdp2.py --rounds {args.rounds} --steps {args.steps} "
        f"--worlds {args.worlds} --backend {args.backend} --amp {args.amp}`",
        "",
        f"Template at {git_state()}; the GPT of experiment=lm_bytes (batch 32 windows of 128 bytes "
        f"a rank), AdamW, amp={args.amp}, backend={args.backend} ({os.cpu_count()} CPU cores), "
        f"torchrun --standalone.",
        "",
        "Per-rank memory of the model's state at the optimizer step (rank 0, MiB): parameters + "
        "gradients + optimizer state",
        "",
        "| W | ddp | fsdp2 | fsdp2 / ddp | fsdp2: parameters, gradients, optimizer | CUDA peak "
        "ddp, fsdp2 |",
        "|---|---|---|---|---|---|",
    ]
    state = ("parameters", "gradients", "optimizer")
    for w in worlds:
        mem = rows[w]["memory"]
        d, f = (sum(mem[x][k] for k in state) for x in LAYOUTS)
        parts = ", ".join(f"{mem['fsdp2'][k] / MIB:.2f}" for k in state)
        peaks = [mem[x]["cuda_peak"] for x in LAYOUTS]
        cuda = "—" if None in peaks else ", ".join(f"{b / MIB:.1f}" for b in peaks)
        lines.append(f"| {w} | {d / MIB:.2f} | {f / MIB:.2f} | {f / d:.3f}x | {parts} | {cuda} |")
    whole = rows[worlds[0]]["memory"]["fsdp2"]["whole_parameters"] / MIB
    unit = rows[worlds[0]]["memory"]["fsdp2"]["largest_unit"] / MIB
    lines += [
        "",
        f"Held for a while besides (not counted above): activations (the same per rank under "
        f"both layouts), DDP's gradient buckets (a second copy of the gradients, "
        f"{whole:.2f} MiB), and under FSDP2 the unit being gathered and the next one "
        f"prefetched (the largest unit, whole, is {unit:.2f} MiB of the {whole:.2f} MiB of "
        f"parameters).",
    ]
    timed = rows.get(2, {}).get("seconds")
    if timed:
        job = "the GPT of experiment=lm_bytes, 2 ranks"
        lines += ["", *paired_table(timed, "ddp", epochs=1, steps=args.steps, job=job)]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl (a GPU per rank)")
    p.add_argument("--amp", default="off", help="off or bf16 (FSDP2's policy, DDP's autocast)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--scratch", default="/tmp/fsdp2_bench")
    args = p.parse_args()
    if "LOCAL_RANK" in os.environ:
        ranks(args)
        return
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    worlds = [int(w) for w in args.worlds.split(",")]
    for w in worlds:
        start = time.perf_counter()
        if under_torchrun(__file__, nproc=w):
            sys.exit(f"the {w}-rank measurement failed")
        print(f"W={w}: {time.perf_counter() - start:.0f} s")
    publish(report(args, worlds), args.out)


if __name__ == "__main__":
    main()
