"""A forker's denoising autoencoder, with the mistakes issue 52 met (tests/test_probe.py).

The data: noisy 8x8 images ``x`` ``(1, 8, 8)`` and their clean originals ``y`` ``(1, 8, 8)``.
``Denoise`` scores an output of the target's shape; the models are the right one and the
mistaken ones (a lost channel dimension, a flattened output, a tuple).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddp_template.data.contract import DataInfo, IndexedTensors, Splits
from ddp_template.task import EvalResult, Task


def noisy(size: int = 64, test_size: int = 16, seed: int = 0) -> Splits:
    gen = torch.Generator().manual_seed(seed)

    def split(n: int) -> IndexedTensors:
        clean = torch.rand(n, 1, 8, 8, generator=gen)
        return IndexedTensors(clean + 0.1 * torch.randn(n, 1, 8, 8, generator=gen), clean)

    return Splits(split(size), split(test_size), DataInfo(in_channels=1, image_size=8))


class Denoise(Task):
    """MSE of an output shaped like its target; the evaluation's sums: samples, squared error."""

    directions: ClassVar = {"mse": "min"}
    monitor: ClassVar[str] = "mse"

    def loss(self, output: Tensor, y: Tensor, reduction: str) -> Tensor:
        return (
            F.mse_loss(output, y, reduction="mean")
            if reduction == "mean"
            else self._each(output, y).sum()
        )

    @staticmethod
    def _each(output: Tensor, y: Tensor) -> Tensor:
        return (output - y).square().flatten(1).mean(dim=1)

    def sums(self, device: torch.device) -> Tensor:
        return torch.zeros(2, dtype=torch.float64, device=device)

    def update(self, sums: Tensor, output: Tensor, y: Tensor) -> None:
        sums[0] += len(y)
        sums[1] += self._each(output.double(), y.double()).sum()

    def result(self, sums: Tensor) -> EvalResult:
        n = int(sums[0])
        mse = float(sums[1]) / n if n else float("nan")
        return EvalResult(values={"mse": mse}, count=n, headline=f"mse {mse:.4f}", line="")


class VectorLoss(Denoise):
    """A loss returning each sample's value instead of their mean."""

    def loss(self, output: Tensor, y: Tensor, reduction: str) -> Tensor:
        return self._each(output, y)


class BatchMean(Denoise):
    """A mean of the batch's per-sample ratios in the evaluation sums: not additive."""

    def update(self, sums: Tensor, output: Tensor, y: Tensor) -> None:
        sums[0] += len(y)
        sums[1] += self._each(output.double(), y.double()).mean()


class Contrastive(BatchMean):
    """The same, declared batch-level: the probe leaves its exactness alone."""

    batch_level: ClassVar[bool] = True

    def loss(self, output: Tensor, y: Tensor, reduction: str) -> Tensor:
        return (output - output.mean(dim=0)).square().mean() + F.mse_loss(output, y)


class _Net(nn.Module):
    def __init__(self, in_channels: int, mistake: str) -> None:
        super().__init__()
        self.conv, self.mistake = nn.Conv2d(in_channels, 1, 3, padding=1), mistake

    def forward(self, x: Tensor) -> Any:
        out = self.conv(x)
        if self.mistake == "squeezed":
            return out.squeeze(1)  # (B, 8, 8): the channel dimension lost
        if self.mistake == "flat":
            return out.flatten(1)  # (B, 64)
        if self.mistake == "pair":
            return out, x
        if self.mistake == "first":
            return out[:1]  # the batch dimension cut
        return out


def denoiser(in_channels: int, mistake: str = "none") -> nn.Module:
    return _Net(in_channels, mistake)
