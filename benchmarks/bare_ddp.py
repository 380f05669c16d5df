"""The classic DDP recipe written plainly: the baseline the template's overhead is measured against.

    torchrun --standalone --nproc-per-node=2 benchmarks/bare_ddp.py [--out bare.json]

Same job as ``python train.py`` with its defaults: the template's small_cnn (imported, so the
same model by construction) on scikit-learn digits with the same split, 32 samples per rank per
step, SGD lr 0.1, momentum 0.9, Nesterov, weight decay 5e-4 on weights only (not on biases and
norm parameters, like the template), a per-step cosine schedule, 10 epochs, gloo on CPU. No Hydra,
no logging, no evaluation, no checkpoints, no data accounting.

``--model resnet18 --data synthetic --batch-size 64`` is the realistic step of
``benchmarks/overhead.py --suite realistic``: the template's ResNet-18 (CIFAR stem) on its
generated 3x32x32 data (``--size`` training samples), everything else as above.

Each rank prints one JSON line (and writes it to ``--out``, ``{rank}`` replaced by the rank):
seconds from process start to the end of the first optimizer step, per-epoch wall time and
samples/s of the training loop (timed like the template's ``perf/samples_per_s``: from creating
the epoch's iterator to the end of its last step, data wait included) and peak RSS.
"""

from __future__ import annotations

import argparse
import math
import os
import time


def _since_start():
    """Seconds since this process started (see _first_step_probe.py for why not psutil)."""
    with open("/proc/self/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return lambda: time.clock_gettime(time.CLOCK_BOOTTIME) - start


since_start = _since_start()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _launch import emit  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

from ddp_template.data.builtin import digits, synthetic  # noqa: E402
from ddp_template.models import resnet18, small_cnn  # noqa: E402


def parser(description: str = __doc__.splitlines()[0]) -> argparse.ArgumentParser:
    """The job's flags; benchmarks/lightning_ddp.py and accelerate_ddp.py add theirs to it."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", choices=["small_cnn", "resnet18"], default="small_cnn")
    p.add_argument("--data", choices=["digits", "synthetic"], default="digits")
    p.add_argument("--size", type=int, default=4096, help="training samples of --data synthetic")
    p.add_argument("--out", help="JSON file per rank; {rank} is replaced by the rank")
    return p


def build_data(args: argparse.Namespace):
    """The job's ``Splits``: digits (the template's split), or generated images."""
    return digits() if args.data == "digits" else synthetic(size=args.size, test_size=1)


def build_model(args: argparse.Namespace, info) -> torch.nn.Module:
    """The template's model, seeded so every rank starts from the same weights."""
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    factory = small_cnn if args.model == "small_cnn" else resnet18
    return factory(
        num_classes=info.num_classes, in_channels=info.in_channels, image_size=info.image_size
    )


def build_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum, weight decay on weights only (as the template)."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return torch.optim.SGD(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        momentum=0.9,
        nesterov=True,
    )


def cosine(optimizer: torch.optim.Optimizer, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The per-step cosine schedule over ``total`` optimizer steps."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1.0 + math.cos(math.pi * min(1.0, s / total)))
    )


def main() -> None:
    args = parser().parse_args()
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()

    splits = build_data(args)
    train, info = splits.train, splits.info
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    model = build_model(args, info)
    ddp = DDP(model)
    optimizer = build_optimizer(model, args)
    scheduler = cosine(optimizer, args.epochs * len(loader))

    first_step_s, epochs = None, []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        samples, start = 0, time.perf_counter()
        for x, y, _ in loader:
            loss = F.cross_entropy(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            samples += len(y)
            if first_step_s is None:
                first_step_s = since_start()
        wall = time.perf_counter() - start
        epochs.append(
            {
                "epoch": epoch,
                "wall_s": wall,
                "samples": samples,
                "samples_per_s": samples / wall,
                "loss_last_batch": loss.item(),
            }
        )

    result = {
        "first_step_s": first_step_s,
        "epochs": epochs,
    }
    dist.destroy_process_group()
    emit(result, args.out, rank, world)


if __name__ == "__main__":
    main()
