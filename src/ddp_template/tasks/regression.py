"""``task=regression``: mean squared error; MSE, MAE and R², exact over the ranks (from sums of
residuals, of y and of y², never from per-rank ratios)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ddp_template.data.contract import DataInfo
from ddp_template.errors import ConfigError
from ddp_template.task import EvalResult, Task


class Regression(Task):
    """The model's output is ``(B, out_features)`` values; ``y`` the targets, of the same
    number of values per sample (``(B,)`` for one output is taken as ``(B, 1)``). A sample's
    loss is its squared error averaged over its outputs; R² is scikit-learn's default for
    several outputs, the mean of each output's R²."""

    directions = {"mse": "min", "mae": "min", "r2": "max"}
    monitor = "mse"

    def __init__(self, metrics: Mapping[str, Any] | None = None) -> None:
        super().__init__(metrics)
        self.outputs = 0

    def setup(self, info: DataInfo, device: torch.device) -> None:
        super().setup(info, device)
        if not info.out_features:
            raise ConfigError(
                "task=regression needs the data's number of targets per sample "
                "(DataInfo.out_features); return it from the data factory, e.g. "
                "DataInfo(in_features=10, out_features=1), or pick the task of your data."
            )
        self.outputs = info.out_features

    @staticmethod
    def _pair(output: Tensor, y: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``output`` and ``y`` in ``dtype`` (or wider), both shaped ``(B, outputs)``."""
        output = output.to(torch.promote_types(output.dtype, dtype))
        output = output[:, None] if output.ndim == 1 else output.flatten(1)
        return output, y.reshape(output.shape).to(output.dtype)

    def loss(self, output: Tensor, y: Tensor, reduction: str) -> Tensor:
        output, y = self._pair(output, y, torch.float32)
        per_sample = (output - y).square().mean(dim=1)
        return per_sample.sum() if reduction == "sum" else per_sample.mean()

    def sums(self, device: torch.device) -> Tensor:
        # samples, sum |residual|, then per output: sum residual², sum y, sum y²
        return torch.zeros(2 + 3 * self.outputs, dtype=torch.float64, device=device)

    def update(self, sums: Tensor, output: Tensor, y: Tensor) -> None:
        k = self.outputs
        pred, target = self._pair(output, y, torch.float64)
        residual = pred - target
        sums[0] += len(residual)
        sums[1] += residual.abs().sum()
        sums[2 : 2 + k] += residual.square().sum(dim=0)
        sums[2 + k : 2 + 2 * k] += target.sum(dim=0)
        sums[2 + 2 * k :] += target.square().sum(dim=0)
        self.update_extra(output, y)

    def metric_inputs(self, output: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """``(B,)`` preds and targets for one output (torchmetrics' single-output shape),
        ``(B, outputs)`` for several."""
        shape = (len(output),) if self.outputs == 1 else (len(output), self.outputs)
        return output.float().reshape(shape), y.float().reshape(shape)

    def result(self, sums: Tensor) -> EvalResult:
        k = self.outputs
        count = int(sums[0].item())
        values_n = count * k
        sse, y_sum, y2_sum = sums[2 : 2 + k], sums[2 + k : 2 + 2 * k], sums[2 + 2 * k :]
        mse = mae = r2 = float("nan")
        if count:
            mse, mae = float(sse.sum() / values_n), float(sums[1] / values_n)
        if count > 1:
            # Σ(y - ȳ)² = Σy² - (Σy)²/n: the total sum of squares, from sums every rank adds to
            total = y2_sum - y_sum.square() / count
            r2 = float((1.0 - sse / total).mean())
        values = {"mse": mse, "mae": mae, "r2": r2}
        details: dict[str, Any] = {**values, "count": count}
        return self.scored(
            EvalResult(
                values=values,
                count=count,
                details=details,
                headline=f"mse {mse:.4f}, r2 {r2:.4f} ({count} samples)",
                line=f"mse {mse:.4f}, mae {mae:.4f}, r2 {r2:.4f}",
            )
        )
