"""The ``data=tokens`` factory: a directory's token files as windows, read in training by the
:class:`~ddp_template.optional.tokens.kind.Windowed` kind."""

from __future__ import annotations

from pathlib import Path

from ddp_template.data.contract import DataInfo, Splits
from ddp_template.errors import ConfigError
from ddp_template.optional.tokens.file import BYTES, TokenFile
from ddp_template.optional.tokens.kind import Windowed
from ddp_template.optional.tokens.windows import Windows
from ddp_template.storage import is_url


def tokens(
    path: str,
    train: str = "train.bin",
    test: str = "val.bin",
    block_size: int = 256,
    stride: int | None = None,
) -> Splits:
    """Windows of ``block_size + 1`` tokens, one every ``stride`` (default ``block_size``: each
    token is a target once) of ``path/train`` for training and of ``path/test`` for evaluation
    (``path``: a directory, or an ``s3://`` prefix).

    ``DataInfo.extra`` tells the model ``vocab_size`` and ``block_size``, and the task whether
    a token is a byte (``byte_level``: bits per byte)."""
    if block_size < 1:
        raise ConfigError(
            f"data.block_size={block_size} must be >= 1 (tokens of context); e.g. 256."
        )
    stride = block_size if stride is None else stride
    if not 1 <= stride <= block_size + 1:
        raise ConfigError(
            f"data.stride={stride} must be in 1..block_size + 1 = {block_size + 1}: a larger "
            f"stride skips tokens between windows; use data.stride=null (= block_size)."
        )
    if not is_url(path) and not Path(path).is_dir():
        raise ConfigError(
            f"data.path={path} is not a directory; write token files there with python -m "
            f"ddp_template.optional.tokens.writer write --text FILE --out {path}."
        )
    files = [
        TokenFile.open(path, name, key)
        for name, key in ((train, "data.train"), (test, "data.test"))
    ]
    train_windows, test_windows = (Windows(f, block_size, stride) for f in files)
    if len(test_windows) == 0:
        raise ConfigError(
            f"data.test={test} holds {len(files[1])} tokens, fewer than one window of "
            f"data.block_size + 1 = {block_size + 1}; use a longer file or a smaller "
            f"data.block_size."
        )
    meta = files[0].meta
    extra = {"vocab_size": meta.vocab_size, "block_size": block_size}
    info = DataInfo(extra=extra | ({"byte_level": 1} if meta.tokenizer == BYTES else {}))
    kind = Windowed(train, train_windows.cut)
    return Splits(train_windows, test_windows, info, kind=kind)
