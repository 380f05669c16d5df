"""data=tokens: a token file cut into windows, every window read once per epoch.

In-process: the cut's arithmetic (every token in a window but the named tail), windows equal
to the file's slices one at a time and batched, the writer's files and the built-in corpus
(its sha256 pinned), and every refusal of bad input as one sentence naming the file and the
fix, a bad token id found when its window is read (in a loader worker too). Real runs are in
tests/lm/.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, run_env
from torch.utils.data import DataLoader

from ddp_template.data.contract import BatchFetch, collate
from ddp_template.errors import EXIT_CONFIG_ERROR, ConfigError
from ddp_template.optional.tokens.corpus import text
from ddp_template.optional.tokens.file import BYTES, META, TokenFile, TokenMeta, write_tokens
from ddp_template.optional.tokens.kind import Windowed
from ddp_template.optional.tokens.splits import tokens
from ddp_template.optional.tokens.windows import BadToken, Cut

CORPUS_SHA256 = "eacb314e2dabb6351c0b7477f874b47c8c96b9c21db606665c442ea89ca48a9c"


def one_sentence(exc: pytest.ExceptionInfo, *parts: str) -> None:
    message = str(exc.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, (part, message)


def token_dir(tmp_path: Path, train: np.ndarray, val: np.ndarray, vocab: int = 50) -> Path:
    meta = TokenMeta("uint16", vocab, "toy", {})
    meta = write_tokens(tmp_path, "train.bin", train, meta)
    write_tokens(tmp_path, "val.bin", val, meta)
    return tmp_path


# ------------------------------------------------------------------------------ the cut
@pytest.mark.parametrize("n,block,stride", [(100, 8, 8), (101, 8, 8), (100, 8, 3), (100, 8, 9)])
def test_every_token_is_in_a_window_but_the_named_tail(n: int, block: int, stride: int) -> None:
    cut = Cut(n, block, stride)
    starts = np.arange(cut.count) * stride
    assert starts[-1] + block + 1 <= n < starts[-1] + stride + block + 1  # no room for one more
    covered = np.zeros(n, bool)
    for s in starts:
        covered[s : s + block + 1] = True
    assert covered[: cut.covered].all() and not covered[cut.covered :].any()
    assert cut.tail == n - cut.covered == (~covered).sum()
    assert Cut(block, block, stride).count == 0 and Cut(block + 1, block, stride).count == 1


def test_windows_are_the_files_slices_one_at_a_time_and_batched(tmp_path: Path) -> None:
    ids = np.random.default_rng(0).integers(0, 50, 1000)
    splits = tokens(str(token_dir(tmp_path, ids, ids[:100])), block_size=16, stride=10)
    train = splits.train
    assert len(train) == (1000 - 17) // 10 + 1 == 99 and len(splits.test) == 9
    for i in (0, 1, 57, 98):
        x, y, index = train[i]
        assert index == i and x.dtype == y.dtype == torch.int64
        assert x.tolist() == ids[10 * i : 10 * i + 16].tolist()
        assert y.tolist() == ids[10 * i + 1 : 10 * i + 17].tolist()
    picked = [98, 3, 3, 40]
    batch = collate(BatchFetch(train).__getitems__(picked))
    one = collate([train[i] for i in picked])
    for got, want in zip(batch, one, strict=True):
        assert torch.equal(got, want)
    assert train.key_of(3) == "train.bin[30:47]"
    assert splits.info.extra == {"vocab_size": 50, "block_size": 16}
    kind = splits.kind
    assert isinstance(kind, Windowed) and kind.cut == Cut(1000, 16, 10)
    assert kind.tail() == "train.bin[997:1000] (3 tokens after the last whole window)"


def test_the_writer_round_trips_text_and_the_corpus_is_pinned(tmp_path: Path) -> None:
    corpus = text(2_000_000)
    assert hashlib.sha256(corpus.encode()).hexdigest() == CORPUS_SHA256
    sample = "héllo wörld — bytes\n" * 50
    src = tmp_path / "in.txt"
    src.write_text(sample, encoding="utf-8")
    cmd = [sys.executable, "-m", "ddp_template.optional.tokens.writer", "write", "--text", str(src)]
    out = tmp_path / "out"
    proc = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((out / META).read_text())
    raw = sample.encode()
    cut = len(raw) - round(len(raw) * 0.1)
    assert meta["tokens"] == {"train.bin": cut, "val.bin": len(raw) - cut}
    assert (meta["dtype"], meta["vocab_size"], meta["tokenizer"]) == ("uint16", 256, BYTES)
    both = np.concatenate([TokenFile.open(out, n, n).ids for n in ("train.bin", "val.bin")])
    assert bytes(both.astype(np.uint8)).decode() == sample
    assert tokens(str(out), block_size=8).info.extra["byte_level"] == 1
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    bad = [*cmd[:-1], str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "x")]
    proc = subprocess.run(bad, capture_output=True, text=True, cwd=ROOT, env=run_env())
    assert proc.returncode == EXIT_CONFIG_ERROR and "is not UTF-8" in proc.stderr
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- bad input
def test_each_bad_token_file_is_refused_in_one_sentence_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        tokens(str(tmp_path / "nowhere"))
    one_sentence(exc, "data.path=", "is not a directory", "writer write")
    with pytest.raises(ConfigError) as exc:
        tokens(str(tmp_path))
    one_sentence(exc, "data.train=train.bin", "no token file", "writer write")
    d = token_dir(tmp_path / "d", np.arange(40) % 50, np.arange(40) % 50)
    with pytest.raises(ConfigError) as exc:
        tokens(str(d), test="other.bin")
    one_sentence(exc, "data.test=other.bin", "no token file")
    with (d / "train.bin").open("ab") as f:
        f.write(b"\x01")  # 81 bytes: not whole uint16 tokens
    with pytest.raises(ConfigError) as exc:
        tokens(str(d))
    one_sentence(exc, str(d / "train.bin"), "81 bytes, not a whole number of uint16 tokens")
    (d / "train.bin").write_bytes(np.arange(50, dtype="<u2").tobytes())  # 50 tokens, meta: 40
    with pytest.raises(ConfigError) as exc:
        tokens(str(d))
    one_sentence(exc, "says train.bin holds 40 tokens", "holds 50", "rewrite both")
    (d / META).unlink()
    with pytest.raises(ConfigError) as exc:
        tokens(str(d))
    one_sentence(exc, "has no meta.json", "writer write")
    for meta, said in (
        (
            '{"dtype": "int8", "vocab_size": 50, "tokens": {}}',
            ("gives dtype 'int8'", "uint16 or uint32"),
        ),
        (
            '{"dtype": "uint16", "vocab_size": 70000, "tokens": {}}',
            ("vocab_size 70000", "use dtype uint32"),
        ),
        ("{not json", ("is not token metadata",)),
    ):
        (d / META).write_text(meta)
        with pytest.raises(ConfigError) as exc:
            tokens(str(d))
        one_sentence(exc, *said)


def test_bad_cuts_and_options_are_refused(tmp_path: Path) -> None:
    d = token_dir(tmp_path, np.arange(40) % 50, np.arange(20) % 50)
    for kwargs, said in (
        ({"block_size": 0}, "data.block_size=0 must be >= 1"),
        ({"block_size": 8, "stride": 10}, "data.stride=10 must be in 1..block_size + 1 = 9"),
        ({"block_size": 20}, "data.test=val.bin holds 20 tokens, fewer than one window"),
    ):
        with pytest.raises(ConfigError) as exc:
            tokens(str(d), **kwargs)
        one_sentence(exc, said)
    splits = tokens(str(d), block_size=8)
    with pytest.raises(ConfigError) as exc:
        splits.kind.accept(splits, val_fraction=0.1, target="t")
    one_sentence(exc, "data.val_fraction=0.1", "overlapping", "data.test")


@pytest.mark.parametrize("workers", [0, 1])
def test_a_token_id_outside_the_vocabulary_is_refused_when_read_naming_its_window(
    tmp_path: Path, workers: int
) -> None:
    """Written past the writer (a file of another tokenizer under this meta.json): found in
    the window that reads it, in one sentence, also from a loader worker."""
    ids = np.arange(200) % 50
    d = token_dir(tmp_path, ids, ids[:50])
    raw = np.fromfile(d / "train.bin", dtype="<u2")
    raw[123] = 50
    raw.tofile(d / "train.bin")
    train = tokens(str(d), block_size=16).train
    train[6]  # tokens 96..112: clean
    loader = DataLoader(BatchFetch(train), batch_size=4, num_workers=workers, collate_fn=collate)
    with pytest.raises(BadToken) as exc:
        list(loader)
    one_sentence(exc, str(d / "train.bin"), "token id 50 at offset 123", "window 7")
    assert "train.bin[112:129]" in str(exc.value) and "vocabulary 0..49" in str(exc.value)
