"""A small decoder-only transformer (``model=gpt``), nanoGPT's: token and learned position
embeddings, pre-LayerNorm blocks of causal self-attention and a 4x GELU MLP, a final LayerNorm
and a head tied to the token embedding. ``(B, T)`` token ids → ``(B, T, vocab_size)`` logits.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from ddp_template.errors import ConfigError


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            part.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
            for part in self.c_attn(x).split(c, dim=2)
        )
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, c)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Build it with :func:`gpt`, which checks the sizes."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        dropout: float,
        bias: bool,
    ) -> None:
        super().__init__()
        self.vocab_size, self.block_size = vocab_size, block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(_init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ConfigError(
                f"a sequence of {t} tokens is longer than model.block_size={self.block_size}; "
                f"feed at most block_size tokens, or build the model with a larger "
                f"model.block_size."
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def gpt(
    vocab_size: int | None = None,
    block_size: int | None = None,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 128,
    dropout: float = 0.0,
    bias: bool = False,
) -> nn.Module:
    """A :class:`GPT`; ``vocab_size`` and ``block_size`` are the data's (``data=tokens``)."""
    if vocab_size is None or block_size is None:
        raise ConfigError(
            f"model=gpt needs the data's vocab_size and block_size (here {vocab_size} and "
            f"{block_size}): data=tokens sets them, or set model.vocab_size and "
            f"model.block_size."
        )
    sizes = {
        "vocab_size": vocab_size,
        "block_size": block_size,
        "n_layer": n_layer,
        "n_head": n_head,
        "n_embd": n_embd,
    }
    for key, value in sizes.items():
        if value < 1:
            raise ConfigError(f"model.{key}={value} must be >= 1; set a positive size.")
    if n_embd % n_head:
        raise ConfigError(
            f"model.n_embd={n_embd} is not divisible by model.n_head={n_head}; make n_embd a "
            f"multiple of n_head."
        )
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(
            f"model.dropout={dropout} is outside [0, 1); set a probability such as 0.0 or 0.1."
        )
    return GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias)
