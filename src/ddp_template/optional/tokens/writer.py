"""Token files from text:
``python -m ddp_template.optional.tokens.writer write --text FILE --out DIR``
tokenizes at the byte level (one token per UTF-8 byte, vocabulary 256: no tokenizer) and
writes ``train.bin`` and ``val.bin`` (the last ``--val-fraction`` of the bytes) and
``meta.json``. Ids of your own tokenizer: ``write_tokens`` (README "Token files")."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ddp_template.errors import ConfigError, command
from ddp_template.optional.tokens.file import BYTES, TokenMeta, write_tokens


def write_text(text: str, out: Path, val_fraction: float = 0.1) -> TokenMeta:
    """``text``'s UTF-8 bytes as ``out/train.bin`` and ``out/val.bin``."""
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(
            f"--val-fraction {val_fraction} must be in (0, 1): the share of the text that "
            f"becomes val.bin; e.g. --val-fraction 0.1."
        )
    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    cut = len(ids) - round(len(ids) * val_fraction)
    meta = TokenMeta("uint16", 256, BYTES, {})
    meta = write_tokens(out, "train.bin", ids[:cut], meta)
    return write_tokens(out, "val.bin", ids[cut:], meta)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_template.optional.tokens.writer",
        description="Write byte-level token files (data=tokens) from a text file.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help="a text file's bytes as train.bin and val.bin")
    write.add_argument("--text", type=Path, required=True, help="a UTF-8 text file")
    write.add_argument("--out", type=Path, required=True, help="the directory to write")
    write.add_argument("--val-fraction", type=float, default=0.1, help="the last share: val.bin")
    return parser


@command
def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if not args.text.is_file():
        raise ConfigError(f"--text {args.text}: no such file; pass a UTF-8 text file.")
    raw = args.text.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"--text {args.text} is not UTF-8 (byte {exc.start}); convert it, e.g. with "
            f"iconv -t UTF-8."
        ) from None
    meta = write_text(text, args.out, args.val_fraction)
    counts = ", ".join(f"{name} {n:,} tokens" for name, n in meta.tokens.items())
    print(f"wrote {args.out}: {counts} (byte-level, vocab_size {meta.vocab_size})")


if __name__ == "__main__":
    sys.exit(main())
