"""``task=segmentation``: per-pixel cross-entropy over ``(B, C, H, W)`` logits; mean IoU, pixel
accuracy and loss, exact over the ranks: every metric comes from summed counts (per-class
intersection and union, correct pixels), never from averaged per-rank or per-sample ratios."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ddp_template.data.contract import DataInfo
from ddp_template.errors import ConfigError
from ddp_template.task import EvalResult, Task

HEAD = 4  # sums: pixels, correct pixels, loss (summed over pixels), samples; then I (C), U (C)


def iou_sums(pred: Tensor, target: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """Per-class intersection and union pixel counts of a predicted and a true mask (any shape)."""
    pred, target = pred.reshape(-1), target.reshape(-1)
    hit = pred == target
    inter = torch.bincount(target[hit], minlength=num_classes)[:num_classes]
    area_pred = torch.bincount(pred, minlength=num_classes)[:num_classes]
    area_true = torch.bincount(target, minlength=num_classes)[:num_classes]
    return inter, area_pred + area_true - inter


def mean_iou(inter: Sequence[float], union: Sequence[float]) -> tuple[float, list[float | None]]:
    """The mean over classes with a non-zero union of I/U, and each class's IoU (None: no pixel
    of that class predicted or true)."""
    per_class = [i / u if u else None for i, u in zip(inter, union, strict=True)]
    present = [v for v in per_class if v is not None]
    return (sum(present) / len(present) if present else 0.0), per_class


class Segmentation(Task):
    """The model's output is ``(B, num_classes, H, W)`` logits; ``y`` the ``(B, H, W)`` int64
    masks (class 0 is whatever the data calls it, e.g. background: it counts like any other)."""

    directions = {"miou": "max", "pixel_accuracy": "max", "loss": "min"}
    monitor = "miou"

    def __init__(self, metrics: Mapping[str, Any] | None = None) -> None:
        super().__init__(metrics)
        self.num_classes = 0

    def setup(self, info: DataInfo, device: torch.device) -> None:
        super().setup(info, device)
        if not info.num_classes or info.num_classes < 2:
            raise ConfigError(
                f"task=segmentation needs the data's per-pixel classes (DataInfo.num_classes >= "
                f"2, here {info.num_classes}); return them from the data factory, e.g. data=shapes."
            )
        self.num_classes = info.num_classes

    def loss(self, output: Tensor, y: Tensor, reduction: str) -> Tensor:
        # Every image has H x W pixels, so the mean over the batch's pixels is the mean over its
        # samples of their per-image means: the engine's per-sample weights stay exact.
        if reduction == "mean":
            return F.cross_entropy(output, y)
        per_pixel = F.cross_entropy(output, y, reduction="none")
        return per_pixel.flatten(1).mean(dim=1).sum()

    def sums(self, device: torch.device) -> Tensor:
        return torch.zeros(HEAD + 2 * self.num_classes, dtype=torch.float64, device=device)

    def update(self, sums: Tensor, output: Tensor, y: Tensor) -> None:
        c = self.num_classes
        pred = output.argmax(dim=1)
        inter, union = iou_sums(pred, y, c)
        sums[0] += y.numel()
        sums[1] += (pred == y).sum()
        sums[2] += F.cross_entropy(output.double(), y, reduction="sum")
        sums[3] += len(y)
        sums[HEAD : HEAD + c] += inter.double()
        sums[HEAD + c :] += union.double()
        self.update_extra(output, y)

    def result(self, sums: Tensor) -> EvalResult:
        c = self.num_classes
        pixels, correct, _, count = (int(v) for v in sums[:HEAD].tolist())
        inter = [int(v) for v in sums[HEAD : HEAD + c].tolist()]
        union = [int(v) for v in sums[HEAD + c :].tolist()]
        miou, per_class = mean_iou(inter, union)
        accuracy = correct / pixels if pixels else 0.0
        loss = float(sums[2].item()) / pixels if pixels else float("nan")
        values: dict[str, float] = {"miou": miou, "pixel_accuracy": accuracy, "loss": loss}
        details: dict[str, Any] = {
            **values,
            "count": count,
            "pixels": pixels,
            "correct_pixels": correct,
            "per_class_iou": per_class,
            "per_class_intersection": inter,
            "per_class_union": union,
        }
        return self.scored(
            EvalResult(
                values=values,
                count=count,
                details=details,
                headline=f"miou {miou:.4f}, pixel accuracy {accuracy:.4f} ({correct}/{pixels} px)",
                line=f"miou {miou:.4f}, pixel_accuracy {accuracy:.4f}, loss {loss:.4f}",
            )
        )
