"""The bare DDP job written the accelerate way: a peer of train.py in benchmarks/peers.py.

    torchrun --standalone --nproc-per-node=2 benchmarks/accelerate_ddp.py [--root DIR]

Needs the ``bench`` extra (``pip install -e '.[bench]'``; accelerate is never a dependency of the
template). Same job as ``benchmarks/bare_ddp.py``, whose definitions it imports: the template's
small_cnn with the same seed, the digits split, 32 samples per rank per step, SGD 0.1 / 0.9
Nesterov, weight decay on weights only, the per-step cosine schedule over bare's step count.

accelerate's own pattern (its ``examples/nlp_example.py``), no tracker: ``Accelerator(cpu=True)``
reads the ranks from torchrun's environment (gloo on CPU), ``prepare`` wraps the model in DDP and
shards plain loaders (``DataLoader(shuffle=True)``: accelerate deals whole batches to the ranks
and, with ``even_batches``, tops the last ones up with samples from the start, so each rank
runs bare's 23 steps an epoch, on slightly more samples); ``accelerator.backward``; after every
epoch an evaluation of the test split with ``gather_for_metrics`` (which drops the duplicates
its padding made) and ``accelerator.save_state`` (model, optimizer, RNG states) to
``--root``/checkpoint. The schedule is stepped once per optimizer step, as bare's (a prepared
scheduler would step once per rank).

``--out`` (``{rank}`` replaced by the rank) gets the final evaluation's correct/count and the
samples this rank trained on per epoch.
"""

from __future__ import annotations

import json
import os

import bare_ddp
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

EVAL_BATCH = 256  # per rank, the template's loader.eval_batch_size


def evaluate(accelerator: Accelerator, model: torch.nn.Module, loader: DataLoader) -> dict:
    model.eval()
    correct = count = 0
    with torch.no_grad():
        for x, y, _ in loader:
            preds, targets = accelerator.gather_for_metrics((model(x).argmax(1), y))
            correct += int((preds == targets).sum())
            count += len(targets)
    model.train()
    return {"correct": correct, "count": count, "accuracy": correct / count}


def main() -> None:
    p = bare_ddp.parser(__doc__.splitlines()[0])
    p.add_argument("--root", default="accelerate_out", help="where save_state writes")
    args = p.parse_args()
    # cpu=True is what `accelerate launch --cpu` sets (ACCELERATE_USE_CPU): without it accelerate
    # looks for an accelerator and, finding none, runs each torchrun rank on its own
    accelerator = Accelerator(cpu=True)

    splits = bare_ddp.build_data(args)
    train = DataLoader(splits.train, batch_size=args.batch_size, shuffle=True)
    test = DataLoader(splits.test, batch_size=EVAL_BATCH)
    model = bare_ddp.build_model(args, splits.info)
    optimizer = bare_ddp.build_optimizer(model, args)
    model, optimizer, train, test = accelerator.prepare(model, optimizer, train, test)
    scheduler = bare_ddp.cosine(optimizer, args.epochs * len(train))

    samples, evaluation = [], {}
    for _ in range(args.epochs):
        seen = 0
        for x, y, _ in train:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            seen += len(y)
        samples.append(seen)
        evaluation = evaluate(accelerator, model, test)
        accelerator.print(f"epoch {len(samples) - 1}: test accuracy {evaluation['accuracy']:.4f}")
        accelerator.save_state(os.path.join(args.root, "checkpoint"))
    accelerator.wait_for_everyone()
    result = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "test": evaluation,
        "test_size": len(splits.test),
        "train_samples_per_epoch": samples,
    }
    accelerator.end_training()
    if args.out:
        with open(args.out.replace("{rank}", str(result["rank"])), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
