"""The built-in corpus of ``experiment=lm_bytes``: English-like text generated from a small
grammar by a seeded generator, so every machine has the same bytes offline (its sha256 is
pinned in the tests), with structure a small model learns in minutes: sentences of a fixed
vocabulary and sums that are always right."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

from ddp_template.data.contract import Splits
from ddp_template.optional.tokens.file import META
from ddp_template.optional.tokens.splits import tokens
from ddp_template.optional.tokens.writer import write_text


def _words(line: str, sep: str = " ") -> tuple[str, ...]:
    return tuple(line.split(sep))


ADJECTIVES = _words("quick lazy small brave quiet green old bright sleepy clever tall kind")
NOUNS = _words("fox dog cat bird child farmer king river moon ship teacher robot")
VERBS = _words("sees follows helps finds carries watches calls paints meets visits")
PLACES = _words("forest market garden harbor castle village library mountain kitchen bridge")
PREPOSITIONS = _words("near behind inside beyond under above")
TIMES = _words("at dawn|in the evening|after the rain|every morning|at night|before lunch", "|")


def _sentence(rng: random.Random) -> str:
    def thing() -> str:
        return f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"

    kind = rng.random()
    if kind < 0.5:
        where = f"{rng.choice(PREPOSITIONS)} the {rng.choice(PLACES)}"
        return f"{thing()} {rng.choice(VERBS)} {thing()} {where}."
    if kind < 0.75:
        return f"{rng.choice(TIMES)}, {thing()} goes to the {rng.choice(PLACES)}."
    a, b = rng.randrange(100), rng.randrange(100)
    return f"{a} plus {b} is {a + b}."


def text(size: int, seed: int = 0) -> str:
    """``size`` characters (ASCII: bytes) of paragraphs of 3 to 6 sentences."""
    rng, parts, total = random.Random(seed), [], 0
    while total < size:
        sentences = [_sentence(rng) for _ in range(rng.randint(3, 6))]
        paragraph = " ".join(s[0].upper() + s[1:] for s in sentences) + "\n\n"
        parts.append(paragraph)
        total += len(paragraph)
    return "".join(parts)[:size]


def corpus(
    path: str,
    size: int = 1_000_000,
    seed: int = 0,
    test_fraction: float = 0.1,
    block_size: int = 128,
    stride: int | None = None,
) -> Splits:
    """The ``data=corpus`` factory: the generated text as byte-level token files in ``path``
    (written on first use: every rank writes the same bytes to its own temporary directory and
    the first rename wins), read as ``data=tokens`` reads them."""
    directory = Path(path)
    if not (directory / META).is_file():
        tmp = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
        write_text(text(size, seed), tmp, test_fraction)
        try:
            tmp.rename(directory)
        except OSError:  # another rank's rename came first: the same bytes are there
            shutil.rmtree(tmp, ignore_errors=True)
    return tokens(str(directory), block_size=block_size, stride=stride)
