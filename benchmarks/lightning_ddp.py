"""The bare DDP job written the Lightning way: a peer of train.py in benchmarks/peers.py.

    torchrun --standalone --nproc-per-node=2 benchmarks/lightning_ddp.py [--logger none|wandb]

Needs the ``bench`` extra (``pip install -e '.[bench]'``: Lightning is never a dependency of the
template). Same job as ``benchmarks/bare_ddp.py``, whose definitions it imports: the template's
small_cnn with the same seed, the digits split, 32 samples per rank per step, SGD 0.1 / 0.9
Nesterov, weight decay on weights only, the per-step cosine schedule. The training loader is a
plain ``DataLoader(shuffle=True)``, which Lightning re-creates with a ``DistributedSampler``
(seed 0, as bare's), so the batches are bare's.

The rest is lightning-hydra-template's pattern (``ashleve/lightning-hydra-template``): a
LightningModule with torchmetrics accuracy for train/val/test, validation of the test split every
epoch (after Lightning's 2-batch sanity check), ``ModelCheckpoint(monitor="val/acc",
save_last=True)`` and ``EarlyStopping(patience=100)``, Lightning's default progress bar and model
summary, then ``trainer.test`` on the final weights. ``--logger none`` is ``logger=False``;
``--logger wandb`` a ``WandbLogger(offline=True)``. Under torchrun, ``Trainer(strategy="ddp",
devices=LOCAL_WORLD_SIZE, num_nodes=...)`` reads the ranks from the environment (its
``TorchElasticEnvironment``) and starts no processes itself; gloo on CPU.

``--out`` (``{rank}`` replaced by the rank) gets what ``trainer.test`` reported (accuracy and the
summed counts, all ranks together) and the test indices this rank evaluated: the exactness row.
"""

from __future__ import annotations

import json
import os

import bare_ddp
import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassAccuracy

EVAL_BATCH = 256  # per rank, the template's loader.eval_batch_size


class DigitsModule(L.LightningModule):
    def __init__(self, args, info) -> None:
        super().__init__()
        self.args = args
        self.net = bare_ddp.build_model(args, info)
        classes = info.num_classes
        self.train_acc, self.val_acc, self.test_acc = (
            MulticlassAccuracy(num_classes=classes, average="micro") for _ in range(3)
        )
        self.test_indices: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _step(self, batch):
        x, y, _ = batch
        logits = self(x)
        return F.cross_entropy(logits, y), logits.argmax(1), y

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss, preds, y = self._step(batch)
        self.train_acc(preds, y)
        self.log("train/loss", loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        loss, preds, y = self._step(batch)
        self.val_acc(preds, y)
        self.log("val/loss", loss, on_step=False, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def test_step(self, batch, batch_idx: int) -> None:
        loss, preds, y = self._step(batch)
        self.test_acc(preds, y)
        self.log("test/loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("test/acc", self.test_acc, on_step=False, on_epoch=True)
        # the counts behind test/acc, summed over steps and ranks (what a user would report)
        correct = (preds == y).sum().float()
        count = torch.tensor(float(len(y)))
        self.log("test/correct", correct, on_epoch=True, reduce_fx="sum", sync_dist=True)
        self.log("test/count", count, on_epoch=True, reduce_fx="sum", sync_dist=True)
        self.test_indices += batch[2].tolist()

    def configure_optimizers(self):
        optimizer = bare_ddp.build_optimizer(self.net, self.args)
        # epochs x len(loader) once Lightning has sharded the loader: bare's total
        scheduler = bare_ddp.cosine(optimizer, self.trainer.estimated_stepping_batches)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def main() -> None:
    p = bare_ddp.parser(__doc__.splitlines()[0])
    p.add_argument("--logger", choices=["none", "wandb"], default="none")
    p.add_argument("--root", default="lightning_logs", help="Trainer(default_root_dir=...)")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))

    splits = bare_ddp.build_data(args)
    train = DataLoader(splits.train, batch_size=args.batch_size, shuffle=True)
    val = DataLoader(splits.test, batch_size=EVAL_BATCH)
    model = DigitsModule(args, splits.info)

    if args.logger == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        logger = WandbLogger(project="ddp-template-peers", save_dir=args.root, offline=True)
    else:
        logger = False
    trainer = L.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=local,
        num_nodes=world // local,
        max_epochs=args.epochs,
        logger=logger,
        default_root_dir=args.root,
        callbacks=[
            ModelCheckpoint(
                dirpath=os.path.join(args.root, "checkpoints"),
                filename="epoch_{epoch:03d}",
                monitor="val/acc",
                mode="max",
                save_last=True,
                auto_insert_metric_name=False,
            ),
            EarlyStopping(monitor="val/acc", mode="max", patience=100),
        ],
    )
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val)
    tested = trainer.test(model, dataloaders=DataLoader(splits.test, batch_size=EVAL_BATCH))
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "test": tested[0],
        "test_size": len(splits.test),
        "test_indices": model.test_indices,
    }
    if args.out:
        with open(args.out.replace("{rank}", str(trainer.global_rank)), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
