"""``task=lm``: next-token cross-entropy; the exact per-token loss, perplexity and bits per
byte over every evaluated token (sums of token losses and token counts, all-reduced)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ddp_template.data.contract import DataInfo
from ddp_template.errors import ConfigError
from ddp_template.task import EvalResult, Task


class LanguageModel(Task):
    """The model's output is ``(B, T, vocab_size)`` logits; ``y`` the ``(B, T)`` next tokens.
    A window's loss is the mean over its T tokens; every window holds T, so the mean over a
    batch's windows is the mean over its tokens. ``bpb`` (bits per byte) is the loss in bits
    where a token is one byte (``DataInfo.extra["byte_level"]``, the writer's byte files); for
    another tokenizer a token is not a byte and ``bpb`` is NaN."""

    directions = {"loss": "min", "perplexity": "min", "bpb": "min"}
    monitor = "loss"

    def __init__(self, metrics: Any = None) -> None:
        super().__init__(metrics)
        self.byte_level = False

    def setup(self, info: DataInfo, device: torch.device) -> None:
        super().setup(info, device)
        if "vocab_size" not in info.extra:
            raise ConfigError(
                "task=lm needs the data's vocabulary (DataInfo.extra['vocab_size']): use "
                "data=tokens, or return it from your data factory as "
                "DataInfo(extra={'vocab_size': V}), or pick the task of your data."
            )
        self.byte_level = bool(info.extra.get("byte_level", 0))

    def loss(self, output: Tensor, y: Tensor, reduction: str) -> Tensor:
        tokens = F.cross_entropy(output.flatten(0, 1), y.flatten(), reduction=reduction)
        return tokens / max(1, y.shape[-1]) if reduction == "sum" else tokens

    def sample_losses(self, output: Tensor, y: Tensor) -> Tensor:
        return self.loss(output, y, "none").view(y.shape).mean(dim=-1)  # each window's mean

    def sums(self, device: torch.device) -> Tensor:
        # windows, tokens, the sum of the tokens' losses (nats)
        return torch.zeros(3, dtype=torch.float64, device=device)

    def update(self, sums: Tensor, output: Tensor, y: Tensor) -> None:
        logits = output.flatten(0, 1).float()
        sums[0] += len(y)
        sums[1] += y.numel()
        sums[2] += F.cross_entropy(logits, y.flatten(), reduction="sum").double()
        self.update_extra(output, y)

    def result(self, sums: Tensor) -> EvalResult:
        windows, tokens, nats = int(sums[0].item()), int(sums[1].item()), float(sums[2].item())
        loss = nats / tokens if tokens else float("nan")
        perplexity = math.exp(loss) if tokens else float("nan")
        bpb = loss / math.log(2) if self.byte_level else float("nan")
        values = {"loss": loss, "perplexity": perplexity, "bpb": bpb}
        details: dict[str, Any] = {**values, "count": windows, "tokens": tokens}
        bits = f", bpb {bpb:.4f}" if self.byte_level else ""
        return self.scored(
            EvalResult(
                values=values,
                count=windows,
                details=details,
                headline=f"loss {loss:.4f}{bits} ({windows} windows, {tokens} tokens)",
                line=f"loss {loss:.4f}, perplexity {perplexity:.2f}{bits}",
            )
        )
