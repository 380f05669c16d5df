"""checkpoint.async_save: how long a save stops the training loop, synchronous vs asynchronous,
and what a background write costs the steps it runs beside.

    python benchmarks/async_checkpoint.py [--rounds 8] [--out FILE]

One process (CPU, or the GPU where there is one) trains a GPT of ~25 M parameters with AdamW
(~300 MB of state: weights, exp_avg, exp_avg_sq) on random byte windows through the template's
own ``Checkpointer`` (the model through ``models.weights_part``, the optimizer beside it). Each
round, in an order that alternates:

* **sync**: ``save()`` with ``checkpoint.async_save=false``: the time it blocks (the whole write:
  torch.save, fsync, rename);
* **async**: ``save()`` with ``async_save=true``: the time the loop is stalled by it, i.e. the
  ``save()`` call (the small parts copied, the rest handed to the writer thread) plus the wait
  in the next optimizer step's pre-hook for the writer thread's copy of the weights and the
  optimizer's state (``_InFlight.stalled``); then the steps that run while the writer thread
  copies and writes (``during``, the first of them the one whose forward and backward run beside
  the copy), timed one by one until the write is published, and as many steps with no write
  (``after``), paired;
* **A/A**: the steps before the round's saves (``before``) against ``after``: two sets of steps
  with no write, the floor any step-time ratio has to clear on a shared machine.

Ratios are per round (paired), reported as the median over rounds with the range.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from ddp_template import checkpoint as ck  # noqa: E402
from ddp_template.config.schema import CheckpointConfig  # noqa: E402
from ddp_template.distributed import DistInfo  # noqa: E402
from ddp_template.models import weights_part  # noqa: E402
from ddp_template.optional.gpt.model import gpt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--nice", type=int, default=ck.WRITER_NICE, help="the writer thread's")
    ap.add_argument("--embd", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    ck.WRITER_NICE = args.nice
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = gpt(256, 128, n_layer=args.layers, n_head=8, n_embd=args.embd).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randint(0, 256, (args.batch, args.tokens + 1), device=device)

    def step() -> float:
        t0 = time.perf_counter()
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(3):
        step()  # the optimizer's state exists from here on
    state_mb = (
        sum(t.numel() * t.element_size() for t in model.state_dict().values())
        + sum(
            v.numel() * v.element_size()
            for s in opt.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
    ) / 2**20
    info = DistInfo(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        backend=None,
        device=device,
        host=socket.gethostname(),
    )
    where = Path(tempfile.mkdtemp(prefix="async_ckpt_", dir=os.environ.get("BENCH_DIR")))

    def checkpointer(async_save: bool) -> ck.Checkpointer:
        return ck.Checkpointer(
            directory=where / ("async" if async_save else "sync"),
            cfg=CheckpointConfig(async_save=async_save),
            parts={"model": weights_part(model), "optimizer": opt},  # parallel=ddp's parts
            config_yaml="",
            info=info,
        )

    sync, asyn = checkpointer(False), checkpointer(True)
    asyn.save()  # the stager's CPU buffers exist from the first save on, as in a run
    asyn.wait()
    sources = [*model.state_dict().values()]
    sources += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    copies = [torch.empty_like(t, device="cpu") for t in sources]
    rows = []
    for r in range(args.rounds):
        before = [step() for _ in range(4)]
        order = ("sync", "async") if r % 2 == 0 else ("async", "sync")
        row: dict[str, Any] = {"before": before}
        for kind in order:
            if kind == "sync":
                t0, c0 = time.perf_counter(), time.thread_time()
                sync.save()
                row["sync_block"] = time.perf_counter() - t0
                row["sync_cpu"] = time.thread_time() - c0
                continue
            t0, c0 = time.perf_counter(), time.thread_time()
            asyn.save()
            row["async_call"] = time.perf_counter() - t0
            row["async_cpu"] = time.thread_time() - c0
            (flight,) = ck._IN_FLIGHT
            during = []
            while flight.thread is not None and flight.thread.is_alive():
                during.append(step())
            row["write_s"] = time.perf_counter() - t0
            asyn.wait()
            row["async_stall"] = flight.stalled  # the next optimizer step's wait for the copy
            row["async_block"] = row["async_call"] + flight.stalled
            row["during"] = during
            row["after"] = [step() for _ in range(max(2, len(during)))]
        t0 = time.perf_counter()
        for dst, src in zip(copies, sources, strict=True):
            dst.copy_(src)  # the floor of any copy of the state: one memcpy of its bytes
        row["memcpy"] = time.perf_counter() - t0
        rows.append(row)
        print(
            f"round {r}: sync blocks {row['sync_block']:.3f} s, async blocks "
            f"{row['async_block']:.3f} s (save() {row['async_call']:.3f} s + the optimizer "
            f"step's wait {row['async_stall']:.3f} s; write {row['write_s']:.2f} s, "
            f"{len(row['during'])} steps beside it: {statistics.mean(row['during']):.3f} s vs "
            f"{statistics.mean(row['after']):.3f} s after, {statistics.mean(before):.3f} s before)",
            flush=True,
        )
    asyn.close()
    report(args, rows, n_params, state_mb, device)


def _spread(values: list[float], fmt: str = "{:.3f}") -> str:
    mid, low, high = (fmt.format(f(values)) for f in (statistics.median, min, max))
    return f"{mid} ({low}–{high})"


def report(args: Any, rows: list[dict[str, Any]], n_params: int, state_mb: float, device) -> None:
    mean = statistics.mean
    block_ratio = [r["async_block"] / r["sync_block"] for r in rows]
    step_ratio = [mean(r["during"]) / mean(r["after"]) for r in rows if r["during"]]
    first_ratio = [r["during"][0] / mean(r["after"]) for r in rows if r["during"]]
    # what the steps beside the copy and write lost to it, summed: the rest of a save's cost
    extra = [sum(r["during"]) - len(r["during"]) * mean(r["after"]) for r in rows]
    total = [(r["async_block"] + x) / r["sync_block"] for r, x in zip(rows, extra, strict=True)]
    floor = [mean(r["before"]) / mean(r["after"]) for r in rows]
    load = os.getloadavg()
    lines = [
        f"- model: GPT, {args.layers} layers, n_embd {args.embd}: {n_params / 1e6:.1f} M "
        f"parameters; AdamW; {state_mb:.0f} MB of state saved per checkpoint; {device}, "
        f"writer nice {args.nice}, {torch.get_num_threads()} torch threads, "
        f"{os.cpu_count()} cores; load average "
        f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} at the end",
        f"- rounds: {len(rows)}, the order of sync and async alternating; "
        f"step = batch {args.batch} x {args.tokens} tokens",
        "",
        "| quantity | median (min–max) over rounds |",
        "|---|---|",
        f"| sync save: blocks the loop (s) | {_spread([r['sync_block'] for r in rows])} |",
        f"| async save: blocks the loop (s): save() + the next optimizer step's wait | "
        f"{_spread([r['async_block'] for r in rows])} |",
        f"| of which the save() call (s) | {_spread([r['async_call'] for r in rows])} |",
        f"| of which the next optimizer step's wait for the copy (s) | "
        f"{_spread([r['async_stall'] for r in rows])} |",
        f"| **async / sync blocking** | {_spread(block_ratio)} |",
        f"| sync save: CPU time of the training thread (s) | "
        f"{_spread([r['sync_cpu'] for r in rows])} |",
        f"| async save() call: CPU time of the training thread (s) | "
        f"{_spread([r['async_cpu'] for r in rows])} |",
        f"| async / sync, CPU time | {_spread([r['async_cpu'] / r['sync_cpu'] for r in rows])} |",
        f"| one memcpy of the state's bytes (s): the copy's floor | "
        f"{_spread([r['memcpy'] for r in rows])} |",
        f"| async: the background write, save to published (s) | "
        f"{_spread([r['write_s'] for r in rows])} |",
        f"| steps beside the write | {_spread([len(r['during']) for r in rows], '{:.0f}')} |",
        f"| step time beside the copy and write / after it (paired) | {_spread(step_ratio)} |",
        f"| the first step after save() (beside the copy, its wait included) / after | "
        f"{_spread(first_ratio)} |",
        f"| A/A: step time before / after (no write in either) | {_spread(floor)} |",
        f"| the steps beside the copy and write: time lost, summed (s) | {_spread(extra)} |",
        f"| async (blocking + that) / sync blocking: the loop's whole cost of a save | "
        f"{_spread(total)} |",
        f"| step time, no write (s) | {_spread([mean(r['after']) for r in rows])} |",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    threading.current_thread().name = "train"
    main()
