"""A token file cut into windows: window ``i`` is the ``block_size + 1`` tokens from offset
``i * stride``, read as ``(x, y, i)`` with ``x`` its first ``block_size`` tokens and ``y`` its
last (the next token at every position). The sampler deals windows, so every window is read
once per epoch; the tokens after the last whole window are the file's tail, named in the
epoch's report. A token id at or above the vocabulary is refused when its window is read."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from ddp_template.data.contract import Batch
from ddp_template.data.identity import array_fingerprint, file_fingerprint
from ddp_template.errors import ConfigError
from ddp_template.optional.tokens.file import TokenFile


class BadToken(ConfigError):
    """A token id outside the vocabulary, found in a window as it is read. Raised in a loader
    worker, torch re-raises it in the rank with the worker's traceback as its message: the
    sentence is taken back out of it, so the rank still says one sentence."""

    def __init__(self, message: str) -> None:
        mark = f"{type(self).__name__}: "
        if message.startswith("Caught ") and mark in message:
            message = message.rsplit(mark, 1)[1].strip()
        super().__init__(message)


@dataclass(frozen=True)
class Cut:
    """How a file of ``tokens`` tokens is cut: ``count`` windows of ``block_size + 1`` tokens,
    one every ``stride``; ``tail`` tokens after the last window's end are in none."""

    tokens: int
    block_size: int
    stride: int

    @property
    def count(self) -> int:
        span = self.block_size + 1
        return 0 if self.tokens < span else (self.tokens - span) // self.stride + 1

    @property
    def covered(self) -> int:
        """The end of the last window (0 for none)."""
        return (self.count - 1) * self.stride + self.block_size + 1 if self.count else 0

    @property
    def tail(self) -> int:
        return self.tokens - self.covered


class Windows(Dataset):
    """The windows of one token file, by index; ``get_batch`` gathers a batch in one read."""

    def __init__(self, file: TokenFile, block_size: int, stride: int) -> None:
        self.file, self.cut = file, Cut(len(file), block_size, stride)

    def __len__(self) -> int:
        return self.cut.count

    def offset(self, i: int) -> int:
        """Window ``i``'s first token."""
        return i * self.cut.stride

    def fingerprint(self) -> str:
        """The token file's bytes (``data.identity.file_fingerprint``) and the cut."""
        cut = (self.cut.block_size, self.cut.stride)
        f = self.file
        read = f.storage.read_range
        return array_fingerprint([file_fingerprint(f.storage.size(f.name), f.name, read), cut])

    def key_of(self, i: int) -> str:
        """Window ``i`` as replay names it: the file and its tokens' range."""
        start = self.offset(i)
        return f"{self.file.name}[{start}:{start + self.cut.block_size + 1}]"

    def _read(self, indices: np.ndarray) -> np.ndarray:
        if len(indices) and not (indices.min() >= 0 and indices.max() < self.cut.count):
            bad = int(indices[(indices < 0) | (indices >= self.cut.count)][0])
            raise IndexError(f"window {bad} is outside {self.file.where} [0, {self.cut.count})")
        rows = self.file.rows(indices * self.cut.stride, self.cut.block_size + 1)
        vocab = self.file.meta.vocab_size
        if rows.size and int(rows.max()) >= vocab:
            r, c = np.argwhere(rows >= vocab)[0]
            i = int(indices[r])
            raise BadToken(
                f"{self.file.where} holds token id {int(rows[r, c])} at offset "
                f"{self.offset(i) + int(c)} (window {i}, {self.key_of(i)}), outside the "
                f"vocabulary 0..{vocab - 1} of its meta.json: the file was written with "
                f"another tokenizer; rewrite it, or set vocab_size to the tokenizer's."
            )
        return rows.astype(np.int64)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        row = torch.from_numpy(self._read(np.array([int(i)], dtype=np.int64))[0])
        return row[:-1], row[1:], int(i)

    def get_batch(self, indices: list[int]) -> Batch:
        index = np.asarray(indices, dtype=np.int64)
        rows = torch.from_numpy(self._read(index))
        return Batch((rows[:, :-1].contiguous(), rows[:, 1:].contiguous(), torch.from_numpy(index)))
