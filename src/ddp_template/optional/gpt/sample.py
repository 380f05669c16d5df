"""Continue a prompt with a language model a run trained (``data=tokens``, e.g. ``model=gpt``).

    python -m ddp_template.optional.gpt.sample <run_dir>/checkpoints/last.pt --prompt "Once upon"
    python -m ddp_template.optional.gpt.sample CKPT --prompt-ids 464,2068 --tokens 50   # not bytes

The model is built from the config the checkpoint holds and what its data told the model
(``DataInfo.extra``: ``vocab_size``, ``block_size``, ``byte_level``, recorded in the checkpoint:
nothing but the file is read, and nothing is written), then loaded with the checkpoint's
weights. Byte-level token files
take the prompt as text and print text (UTF-8, undecodable bytes replaced); other tokenizers
take and print token ids. Sampling: temperature (0: greedy) and top-k, seeded by ``--seed``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from ddp_template.checkpoint import checkpoint_file, whole
from ddp_template.checkpoint import load as load_checkpoint
from ddp_template.data.contract import DataInfo, DataRecord
from ddp_template.errors import ConfigError, command
from ddp_template.models import build_model
from ddp_template.splits import build_splits

WRAPPERS = ("_orig_mod.", "module.")  # torch.compile's and DDP's key prefixes
FIX = "pass a checkpoint a run wrote, e.g. <run_dir>/checkpoints/last.pt or best.pt"


@torch.inference_mode()
def generate(
    model: nn.Module,
    ids: torch.Tensor,
    steps: int,
    *,
    block_size: int,
    temperature: float = 0.8,
    top_k: int | None = 40,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``ids`` ``(B, T)`` followed by ``steps`` sampled tokens, each seeing at most the last
    ``block_size``; ``temperature=0`` takes the most likely token."""
    for _ in range(steps):
        logits = model(ids[:, -block_size:])[:, -1, :].float()
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def load_model(ckpt: str | Path) -> tuple[nn.Module, DataInfo]:
    """The model of ``ckpt``'s run with its weights (eval mode) and what its data told it:
    the run's config and ``DataInfo`` are the ones the checkpoint holds."""
    ckpt = checkpoint_file(ckpt, said="checkpoint ", fix=FIX)
    payload = load_checkpoint(ckpt, fix=FIX)
    if ("model" not in payload and "slices" not in payload) or not payload.get("config"):
        raise ConfigError(f"checkpoint {ckpt} holds no model weights or no config; {FIX}.")
    cfg = OmegaConf.create(payload["config"])
    # What the data told the model, as the run recorded it: the checkpoint alone, no data (a
    # checkpoint written before the record: its data rebuilt from the run's config).
    recorded = payload.get("data_info")
    info = DataRecord.read(recorded) if recorded is not None else build_splits(cfg.data).info
    if "vocab_size" not in info.extra:
        raise ConfigError(
            f"the run of {ckpt} trained on data._target_={cfg.data.get('_target_')}, whose "
            f"data gives no vocabulary (DataInfo.extra['vocab_size']); sample a run of a "
            f"language model, e.g. data=tokens task=lm."
        )
    model = build_model(cfg.model, info)
    try:
        model.load_state_dict(_unwrapped(whole(ckpt, payload, "model") or {}))
    except RuntimeError as exc:
        raise ConfigError(
            f"checkpoint {ckpt} does not fit the model its run's config builds "
            f"({' '.join(str(exc).split())[:160]}); {FIX}."
        ) from None
    return model.eval(), info


def _unwrapped(state: dict[str, Any]) -> dict[str, Any]:
    """The state dict without torch.compile's or DDP's key prefixes (the template saves the
    plain module's; a state dict saved from a wrapper has them)."""
    prefix = next((p for p in WRAPPERS if state and all(k.startswith(p) for k in state)), None)
    if prefix is None:
        return state
    return _unwrapped({k.removeprefix(prefix): v for k, v in state.items()})


def prompt_ids(info: DataInfo, text: str | None, ids: str | None) -> list[int]:
    """The prompt as token ids: ``text`` as UTF-8 bytes (byte-level files only), or ``ids``
    (``1,2,3``); by default a newline (bytes) and otherwise refused."""
    if ids is not None:
        try:
            out = [int(i) for i in ids.split(",") if i.strip()]
        except ValueError:
            raise ConfigError(
                f"--prompt-ids {ids} is not a list of token ids; pass integers separated by "
                f"commas, e.g. --prompt-ids 464,2068."
            ) from None
        vocab = info.extra["vocab_size"]
        bad = [i for i in out if not 0 <= i < vocab]
        if bad or not out:
            raise ConfigError(
                f"--prompt-ids {ids} holds {bad or 'no ids'}, not ids of the vocabulary "
                f"0..{vocab - 1}; pass at least one id in that range."
            )
        return out
    if not info.extra.get("byte_level"):
        raise ConfigError(
            "--prompt text needs byte-level token files, but this run's tokens are not bytes; "
            "pass the prompt as token ids with --prompt-ids 1,2,3."
        )
    encoded = list((text if text is not None else "\n").encode("utf-8"))
    if not encoded:
        raise ConfigError('--prompt "" is empty; pass at least one character, e.g. --prompt "\\n".')
    return encoded


def sample(
    ckpt: Path,
    *,
    prompt: str | None = None,
    prompt_ids_text: str | None = None,
    tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
) -> str:
    """The prompt and ``tokens`` sampled tokens after it: text for byte-level files, else the
    ids separated by commas."""
    if tokens < 0 or temperature < 0 or (top_k is not None and top_k < 0):
        raise ConfigError(
            f"--tokens {tokens}, --temperature {temperature} and --top-k {top_k} must all be "
            f">= 0; pass non-negative values (--top-k 0: no top-k)."
        )
    model, info = load_model(ckpt)
    start = prompt_ids(info, prompt, prompt_ids_text)
    block_size = int(getattr(model, "block_size", info.extra.get("block_size", 0)))
    generator = torch.Generator().manual_seed(seed)
    out = generate(
        model,
        torch.tensor([start], dtype=torch.long),
        tokens,
        block_size=block_size,
        temperature=temperature,
        top_k=top_k,
        generator=generator,
    )[0].tolist()
    if info.extra.get("byte_level"):
        return bytes(out).decode("utf-8", errors="replace")
    return ",".join(map(str, out))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_template.optional.gpt.sample",
        description="Continue a prompt with a language model a run trained on token files.",
    )
    parser.add_argument("ckpt", help="<run_dir>/checkpoints/last.pt or best.pt (or s3://…)")
    given = parser.add_mutually_exclusive_group()
    given.add_argument("--prompt", help='text (byte-level token files only); default "\\n"')
    given.add_argument("--prompt-ids", help="token ids separated by commas: 464,2068")
    parser.add_argument("--tokens", type=int, default=200, help="tokens to sample")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=40, help="0: sample from all tokens")
    parser.add_argument("--seed", type=int, default=0)
    return parser


@command
def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    text = sample(
        args.ckpt,
        prompt=args.prompt,
        prompt_ids_text=args.prompt_ids,
        tokens=args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    print(text)


if __name__ == "__main__":
    sys.exit(main())
