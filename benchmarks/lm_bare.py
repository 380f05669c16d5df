"""The bare DDP loop of ``experiment=lm_bytes``: the baseline benchmarks/lm.py measures it against.

    torchrun --standalone --nproc-per-node=2 benchmarks/lm_bare.py --data DIR [--out bare.json]

The classic recipe written plainly, like benchmarks/bare_ddp.py (its JSON output, one line per
rank): ``init_process_group(gloo)`` → the token file ``DIR/train.bin`` that the template's
``data=corpus`` wrote (read through the template's ``TokenFile`` and ``Windows``, so the windows
are the same by construction: ``block_size + 1`` tokens every ``block_size``) →
``DistributedSampler(shuffle=True, drop_last=False)`` → ``DataLoader(batch_size=B)`` → DDP of the
template's ``gpt(...)`` (imported: the same model by construction, seeded alike on every rank) →
AdamW with ``experiment=lm_bytes``'s lr 2e-3, betas (0.9, 0.95), weight decay 0.1 on tensors of
ndim > 1 only, a per-step linear warm-up of 50 steps then cosine to zero at the run's last step,
gradient clipping at norm 1.0 → next-token cross-entropy. No Hydra, no eval, no checkpoints, no
logging, no data accounting. DDP with torch's defaults, unless ``--bucket-cap-mb`` is given.

Per epoch: wall time and windows/s of the training loop, timed like the template's
``perf/samples_per_s`` (from creating the epoch's iterator to the end of its last step, data wait
included), tokens/s (windows/s x block_size: every window has block_size target tokens) and the
process's CPU seconds over the same span (``time.process_time``: user + system, all threads).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _first_step_probe import elapsed as since_start  # seconds since this process started
from _launch import emit
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_template.optional.gpt.model import gpt
from ddp_template.optional.tokens.file import TokenFile
from ddp_template.optional.tokens.windows import Windows


def parser() -> argparse.ArgumentParser:
    """``experiment=lm_bytes``'s settings as flags, its values as defaults."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="the token directory (train.bin, meta.json)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="windows per rank")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95))
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="DDP's bucket_cap_mb; unset: torch's default (a 1 MiB first bucket, then 25 MiB). "
        "Passing 25 gives the template's layout: torch then drops the small first bucket",
    )
    p.add_argument("--out", help="JSON file per rank; {rank} is replaced by the rank")
    return p


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int, total: int):
    """Per step: linear warm-up over ``warmup`` steps, then cosine to zero at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def main() -> None:
    args = parser().parse_args()
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()

    file = TokenFile.open(args.data, "train.bin", "--data")
    train = Windows(file, args.block_size, args.block_size)
    sampler = DistributedSampler(
        train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=False
    )
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = gpt(
        vocab_size=file.meta.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=0.0,
        bias=False,
    )
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=tuple(args.betas),
    )
    scheduler = warmup_cosine(optimizer, args.warmup_steps, args.epochs * len(loader))

    first_step_s, epochs = None, []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        samples, steps = 0, 0
        cpu, start = time.process_time(), time.perf_counter()
        for x, y, _ in loader:
            logits = ddp(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            scheduler.step()
            samples += len(y)
            steps += 1
            if first_step_s is None:
                first_step_s = since_start()
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu
        epochs.append(
            {
                "epoch": epoch,
                "wall_s": wall,
                "samples": samples,
                "steps": steps,
                "samples_per_s": samples / wall,
                "tokens_per_s": samples * args.block_size / wall,
                "cpu_s": cpu,
                "loss_last_batch": loss.item(),
            }
        )

    result = {
        "first_step_s": first_step_s,
        "block_size": args.block_size,
        "epochs": epochs,
    }
    dist.destroy_process_group()
    emit(result, args.out, rank, world)


if __name__ == "__main__":
    main()
