"""Exact evaluation, and which split is evaluated when, of which weights, under which names.

``evaluate`` sums correct counts and losses over unpadded shards and all-reduces the sums, so a
run on any number of ranks reports the single-process numbers. ``Evaluation`` is the epoch end's
part of it: the validation split each epoch when there is one (else the test split), the EMA
copy beside the model, and once at the end the split ``eval_split`` names (what summary.json
reports).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ddp_template.amp import autocast
from ddp_template.distributed import DistInfo, all_reduce_sum

log = logging.getLogger("ddp_template")

TOP_K = 5  # test/top5, for data with at least this many classes


@dataclass
class EvalResult:
    """Exact counts over the whole split (summed over ranks, never averaged ratios)."""

    correct: int
    count: int
    loss_sum: float
    top5_correct: int | None = None  # None with fewer than TOP_K classes
    class_correct: list[int] = field(default_factory=list)
    class_count: list[int] = field(default_factory=list)
    split: str = "test"  # which split summary.json's eval_* keys describe (eval_split)

    @property
    def accuracy(self) -> float:
        return self.correct / self.count if self.count else 0.0

    @property
    def loss(self) -> float:
        return self.loss_sum / self.count if self.count else float("nan")

    @property
    def top5(self) -> float | None:
        if self.top5_correct is None:
            return None
        return self.top5_correct / self.count if self.count else 0.0

    @property
    def class_accuracy(self) -> list[float | None]:
        return [
            c / n if n else None for c, n in zip(self.class_correct, self.class_count, strict=True)
        ]

    def metrics(self, prefix: str) -> dict[str, float]:
        """The per-epoch keys: <prefix>/accuracy, /loss, /correct and /top5 (>= 5 classes)."""
        out = {
            f"{prefix}/accuracy": self.accuracy,
            f"{prefix}/loss": self.loss,
            f"{prefix}/correct": self.correct,
        }
        if self.top5 is not None:
            out[f"{prefix}/top5"] = self.top5
        return out

    def summary(self, prefix: str = "eval") -> dict[str, Any]:
        """summary.json's keys for the final evaluation (``eval_split`` names its split)."""
        out = {
            f"{prefix}_split": self.split,
            f"{prefix}_accuracy": self.accuracy,
            f"{prefix}_correct": self.correct,
            f"{prefix}_count": self.count,
            f"{prefix}_loss": self.loss,
            f"{prefix}_per_class_correct": self.class_correct,
            f"{prefix}_per_class_count": self.class_count,
            f"{prefix}_per_class_accuracy": self.class_accuracy,
        }
        if self.top5 is not None:
            out[f"{prefix}_top5"] = self.top5
            out[f"{prefix}_top5_correct"] = self.top5_correct
        return out


def sync_buffers(module: nn.Module, info: DistInfo) -> None:
    """Give every rank rank 0's buffers (BN running stats).

    DDP broadcasts buffers at the start of each forward, then every rank updates them from its
    own batch; after the last step the ranks' running stats differ. Evaluating rank 0's model
    everywhere makes the distributed result equal the single-process one.
    """
    if info.distributed:
        for buf in module.buffers():
            torch.distributed.broadcast(buf, src=0)


@torch.no_grad()
def evaluate(
    module: nn.Module, loader: Any, info: DistInfo, amp_mode: str, *, num_classes: int
) -> EvalResult:
    """Exact evaluation: unpadded shards, sums all-reduced.

    ``module`` is the unwrapped model: a DDP forward may run collectives (buffer broadcast,
    SyncBN), and ranks with different (or empty) shards would then deadlock or mismatch.
    ``num_classes`` sizes the per-class counts, which a rank with an empty shard cannot infer.
    """
    sync_buffers(module, info)
    was_training = module.training
    module.eval()
    c = num_classes
    # correct, count, loss, top-k correct, then per class: correct (c values), count (c values)
    sums = torch.zeros(4 + 2 * c, dtype=torch.float64, device=info.device)
    for x, y, _ in loader:
        x, y = x.to(info.device, non_blocking=True), y.to(info.device, non_blocking=True)
        with autocast(amp_mode, info.device):
            logits = module(x)
        hit = logits.argmax(dim=1) == y
        sums[0] += hit.sum()
        sums[1] += len(y)
        sums[2] += F.cross_entropy(logits.float(), y, reduction="sum").double()
        if c >= TOP_K:
            top = logits.topk(TOP_K, dim=1).indices
            sums[3] += (top == y[:, None]).any(dim=1).sum()
        sums[4 : 4 + c] += torch.bincount(y[hit], minlength=c)[:c].double()
        sums[4 + c :] += torch.bincount(y, minlength=c)[:c].double()
    all_reduce_sum(sums, info)
    module.train(was_training)
    n = [int(v) for v in sums.tolist()]
    return EvalResult(
        correct=n[0],
        count=n[1],
        loss_sum=float(sums[2].item()),
        top5_correct=n[3] if c >= TOP_K else None,
        class_correct=n[4 : 4 + c],
        class_count=n[4 + c :],
    )


TEST, VAL, TRAIN = "test", "val", "train"
# The metric prefix of each split: <prefix>/accuracy, /loss, /correct, /top5.
PREFIXES = {TEST: "test", VAL: "val", TRAIN: "train"}


class Split(NamedTuple):
    name: str  # test, val or train
    loader: DataLoader


@dataclass(kw_only=True)
class Evaluation:
    """The split evaluated each epoch (and the EMA on it), and the final one."""

    model: nn.Module  # unwrapped: an evaluation runs no DDP collective
    ema: Any  # an ema.EMA whose averaged module is evaluated beside the model, or None
    each_epoch: Split
    final: Split
    info: DistInfo
    amp_mode: str
    num_classes: int
    last: EvalResult | None = None  # the latest epoch's, while the model has not changed since

    @property
    def prefix(self) -> str:
        return PREFIXES[self.each_epoch.name]

    def _run(self, module: nn.Module, split: Split) -> EvalResult:
        return evaluate(
            module, split.loader, self.info, self.amp_mode, num_classes=self.num_classes
        )

    def epoch(self, epoch: int, step: int, logger: Any) -> dict[str, float]:
        """Evaluate the epoch's model (and EMA), log both; the metrics selection reads."""
        self.last = self._run(self.model, self.each_epoch)
        logger.log_eval(self.last, epoch, step, self.prefix)
        if self.ema is not None:  # the averaged weights, evaluated as exactly
            ema = self._run(self.ema.module, self.each_epoch)
            log.info("EMA %s accuracy %.4f, loss %.4f", self.prefix, ema.accuracy, ema.loss)
            named = {k.replace("/", "/ema_", 1): v for k, v in ema.metrics(self.prefix).items()}
            logger.log(named, step)
        return self.last.metrics(self.prefix)

    def at_end(self, epoch: int, step: int, logger: Any) -> EvalResult:
        """The final split's result: the last epoch's when it is that split, else evaluated now
        (epochs=0, a finished run resumed, a val split each epoch, eval_split=train)."""
        same = self.last is not None and self.final.name == self.each_epoch.name
        result = self.last if same else self._run(self.model, self.final)
        if self.final.name == TEST and self.each_epoch.name != TEST:
            logger.log_eval(result, epoch, step, PREFIXES[TEST])
        result.split = self.final.name
        return result


def build_evaluation(
    *,
    final: str,
    splits: Any,
    loader: Callable[[Dataset], DataLoader],
    model: nn.Module,
    ema: Any,
    info: DistInfo,
    amp_mode: str,
) -> Evaluation:
    """``eval_split``'s builder: ``loader`` makes an evaluation loader of a dataset."""
    each = VAL if splits.val is not None else TEST
    loaders = {each: loader(splits.split(each))}
    if final not in loaders:
        loaders[final] = loader(splits.split(final))
    return Evaluation(
        model=model,
        ema=ema,
        each_epoch=Split(each, loaders[each]),
        final=Split(final, loaders[final]),
        info=info,
        amp_mode=amp_mode,
        num_classes=splits.info.num_classes,
    )
