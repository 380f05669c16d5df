"""``task=classification``: cross-entropy over class logits; accuracy, top-5 and per-class
counts, exact over the ranks (summed, never averaged ratios)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ddp_template.data.contract import DataInfo
from ddp_template.errors import ConfigError
from ddp_template.task import EvalResult, Task

TOP_K = 5  # <split>/top5, for data with at least this many classes


class Classification(Task):
    """The model's output is ``(B, num_classes)`` logits; ``y`` the class indices."""

    directions = {"accuracy": "max", "loss": "min", "top5": "max"}
    monitor = "accuracy"

    def __init__(self, label_smoothing: float = 0.0, metrics: Mapping[str, Any] | None = None):
        super().__init__(metrics)
        if not 0.0 <= label_smoothing < 1.0:
            raise ConfigError(
                f"task.label_smoothing={label_smoothing} must be in [0, 1); e.g. "
                f"task.label_smoothing=0.1."
            )
        self.label_smoothing = label_smoothing  # the training loss only: <split>/loss is plain
        self.num_classes = 0

    def setup(self, info: DataInfo, device: torch.device) -> None:
        super().setup(info, device)
        if not info.num_classes:
            raise ConfigError(
                "task=classification needs the data's num_classes (DataInfo.num_classes); "
                "return it from the data factory, or pick the task of your data."
            )
        self.num_classes = info.num_classes

    def loss(self, output: Tensor, y: Tensor, reduction: str) -> Tensor:
        return F.cross_entropy(output, y, label_smoothing=self.label_smoothing, reduction=reduction)

    def sample_losses(self, output: Tensor, y: Tensor) -> Tensor:
        return self.loss(output, y, "none")

    def metric_inputs(self, output: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        # Probabilities, not logits: torchmetrics would softmax a batch only when some value lies
        # outside [0, 1], a guess that could differ between the batches of 1 and of W ranks.
        return output.float().softmax(dim=1), y

    def sums(self, device: torch.device) -> Tensor:
        # correct, count, loss, top-k correct, then per class: correct (c values), count (c)
        return torch.zeros(4 + 2 * self.num_classes, dtype=torch.float64, device=device)

    def update(self, sums: Tensor, output: Tensor, y: Tensor) -> None:
        c = self.num_classes
        hit = output.argmax(dim=1) == y
        sums[0] += hit.sum()
        sums[1] += len(y)
        sums[2] += F.cross_entropy(output.float(), y, reduction="sum").double()
        if c >= TOP_K:
            top = output.topk(TOP_K, dim=1).indices
            sums[3] += (top == y[:, None]).any(dim=1).sum()
        sums[4 : 4 + c] += torch.bincount(y[hit], minlength=c)[:c].double()
        sums[4 + c :] += torch.bincount(y, minlength=c)[:c].double()
        self.update_extra(output, y)

    def result(self, sums: Tensor) -> EvalResult:
        c = self.num_classes
        # The counts are whole; the loss may be NaN (a diverged model) and is reported as such.
        n = [int(v) if i != 2 else 0 for i, v in enumerate(sums.tolist())]
        correct, count, loss_sum = n[0], n[1], float(sums[2].item())
        accuracy = correct / count if count else 0.0
        loss = loss_sum / count if count else float("nan")
        class_correct, class_count = n[4 : 4 + c], n[4 + c :]
        values: dict[str, float] = {"accuracy": accuracy, "loss": loss, "correct": correct}
        details: dict[str, Any] = {
            "accuracy": accuracy,
            "correct": correct,
            "count": count,
            "loss": loss,
            "per_class_correct": class_correct,
            "per_class_count": class_count,
            "per_class_accuracy": [
                k / m if m else None for k, m in zip(class_correct, class_count, strict=True)
            ],
        }
        if c >= TOP_K:
            values["top5"] = details["top5"] = n[3] / count if count else 0.0
            details["top5_correct"] = n[3]
        return self.scored(
            EvalResult(
                values=values,
                count=count,
                details=details,
                headline=f"accuracy {accuracy:.4f} ({correct}/{count})",
                line=f"accuracy {accuracy:.4f}, loss {loss:.4f}",
            )
        )
