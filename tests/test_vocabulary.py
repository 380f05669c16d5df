"""The code's words hold docs/ARCHITECTURE.md's Vocabulary: one word, one thing.

Reads ``src/ddp_template/**/*.py`` and ``train.py`` as text (identifiers, strings, comments) and
finds each rule's word wherever it stands, also inside identifiers (``_shard``, ``PriorSegment``,
``save_layout_png``): a word is a run of letters cut at ``_``, digits and camel-case humps, so
``segmentation`` is another word than ``segment``. An occurrence passes where its file is one of
the rule's own places, or where one of the rule's allowances (a regex, each with its reason)
covers it; every other occurrence is a misuse, named with its file and line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "ddp_template"

_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+")  # a run of letters, camel humps cut


@dataclass(frozen=True)
class Rule:
    """``words`` (lower case) mean ``meaning`` and nothing else."""

    name: str
    words: frozenset[str]
    meaning: str
    # Files (relative to the repository root; a trailing "/" is a folder) where the word is at
    # home: path -> why.
    places: dict[str, str] = field(default_factory=dict)
    # Regexes whose match covers an occurrence anywhere: pattern -> why it is allowed.
    allowed: dict[str, str] = field(default_factory=dict)


RULES = (
    Rule(
        "shard",
        frozenset({"shard", "shards", "sharded", "sharding", "unsharded", "reshard"}),
        "a WebDataset tar file (a rank's part of the data is its share; of a parameter, a slice)",
        places={
            "src/ddp_template/optional/webdataset/": "the WebDataset kind: its tar shards",
        },
        allowed={
            r"\bfully_shard\b": "torch.distributed.fsdp's API (FSDP2's wrapping function)",
            r"\breshard_after_forward\b": "fully_shard's keyword (and parallel.*'s, passed on)",
            r"\btar[\s-]+shards?\b": "the WebDataset meaning, named as such",
            r"\bsharded\s+data\b": "data held in WebDataset tar shards (data=webdataset)",
            r"\bwebdataset\.kind\.Sharded\b": "the WebDataset kind's class, by its full name",
        },
    ),
    Rule(
        "layout",
        frozenset({"layout", "layouts"}),
        "how the model is laid out over the ranks (parallel: DDP's replicas, FSDP2's slices)",
        places={
            "src/ddp_template/parallel.py": "the layout seam itself",
            "src/ddp_template/optional/fsdp2/": "parallel=fsdp2, a layout",
            "src/ddp_template/checkpoint.py": "a checkpoint's weights held whole or sliced",
            "src/ddp_template/export.py": "the exported weights, held whole or sliced",
            "src/ddp_template/finetune.py": "weights from a checkpoint of either layout",
            "train.py": "the recipe builds the layout (parallel)",
        },
        allowed={
            r"\blayout=\"constrained\"": "matplotlib's Figure keyword",
        },
    ),
    Rule(
        "segment",
        frozenset({"segment", "segments"}),
        "a launch that wrote checkpoints, a link of the provenance chain (a run's stretch at "
        "one world size, batch and accumulate is a stretch; what a survivor holds is Held)",
        places={
            "src/ddp_template/provenance.py": "the chain: one link per segment",
        },
    ),
    Rule(
        "schedule",
        frozenset({"schedule", "schedules", "scheduled"}),
        "the learning-rate schedule (an epoch's step arithmetic is EpochSteps)",
        places={
            "src/ddp_template/optim.py": "the LR schedule's builder",
        },
        allowed={
            r"\b(?:LR|learning-rate)[\s#]+schedules?\b": "the LR schedule, named as such",
            r"\boptim\.schedule\b": "the LR schedule's config key",
            r"\bSchedule\b": "the optim.schedule choice (config/choices.py), by its class",
            r"\bschedule:\s+Schedule\b": "OptimConfig's field, the optim.schedule key",
            r"\bimport\s+ProfilerActivity,\s+profile,\s+schedule\b": "torch.profiler's API",
            r"\bschedule=schedule\(wait=": "torch.profiler.profile's keyword and function",
        },
    ),
)
BY_NAME = {rule.name: rule for rule in RULES}

# The engine's ``Trainer.schedule`` (EpochSteps) is being renamed on branch ``recipe`` (to
# ``Trainer.steps``), with train.py and engine.py themselves; until it lands these are its uses.


@dataclass(frozen=True)
class Misuse:
    path: str
    line: int
    word: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.word!r} in {self.text.strip()!r}"


def sources() -> dict[str, str]:
    """Every file the rules hold: the package and the recipe, path -> text."""
    files = sorted(PACKAGE.rglob("*.py")) + [ROOT / "train.py"]
    return {f.relative_to(ROOT).as_posix(): f.read_text() for f in files}


def _at_home(rule: Rule, path: str) -> bool:
    return any(path == p or (p.endswith("/") and path.startswith(p)) for p in rule.places)


def misuses(rule: Rule, files: dict[str, str]) -> list[Misuse]:
    """Every occurrence of ``rule``'s words outside its places and its allowances."""
    found = []
    for path, text in files.items():
        if _at_home(rule, path):
            continue
        covered = [m.span() for pattern in rule.allowed for m in re.finditer(pattern, text)]
        for m in _WORD.finditer(text):
            if m.group().lower() not in rule.words:
                continue
            if any(lo <= m.start() and m.end() <= hi for lo, hi in covered):
                continue
            line = text.count("\n", 0, m.start()) + 1
            found.append(Misuse(path, line, m.group(), text.splitlines()[line - 1]))
    return found


def _report(found: list[Misuse], rule: Rule) -> str:
    lines = "\n".join(f"  {m}" for m in found)
    return f"'{rule.name}' means {rule.meaning}; used for another thing:\n{lines}"


@pytest.mark.parametrize("name", ["shard", "layout", "segment"])
def test_one_word_one_thing(name: str) -> None:
    rule = BY_NAME[name]
    found = misuses(rule, sources())
    assert not found, _report(found, rule)


@pytest.mark.needs(
    "webdataset", "streams", "tokens", "gpt", "fsdp2", "live"
)  # allowances used there
def test_every_place_and_allowance_is_used() -> None:
    """An allow-list entry no text needs is a stale one."""
    files = sources()
    for rule in RULES:
        for place in rule.places:
            assert any(_at_home(rule, p) for p in files), f"{rule.name}: no file {place}"
            home = [t for p, t in files.items() if _at_home(rule, p)]
            assert any(w.group().lower() in rule.words for t in home for w in _WORD.finditer(t)), (
                f"{rule.name}: {place} does not use the word"
            )
        for pattern in rule.allowed:
            assert any(re.search(pattern, t) for t in files.values()), (
                f"{rule.name}: nothing needs the allowance {pattern!r}"
            )


PLANTED = [
    ("shard", "src/ddp_template/sinks/metrics.py", 'log.warning("SHARD MISMATCH")'),
    ("shard", "src/ddp_template/evaluation.py", "# each rank evaluates its unpadded shard"),
    ("shard", "src/ddp_template/data/samplers.py", "def _shard_of(rank): ..."),
    pytest.param(
        "shard",
        "src/ddp_template/optional/fsdp2/layout.py",
        "class FullySharded: ...",
        marks=pytest.mark.needs("fsdp2"),
    ),
    ("layout", "src/ddp_template/sinks/wandb_run.py", "def choose_layout(cfg): ..."),
    ("layout", "src/ddp_template/sinks/share_plot.py", "class ShareLayout: ..."),
    ("segment", "src/ddp_template/elastic.py", 'SEGMENTS = "segments.json"'),
    ("segment", "src/ddp_template/tolerance.py", "class Segment(NamedTuple): ..."),
    ("segment", "src/ddp_template/ledger/records.py", "class PriorSegment(_Prefix): ..."),
    ("schedule", "src/ddp_template/replay.py", "    schedule: EpochSteps"),
    ("schedule", "src/ddp_template/checkpoint_parts.py", "s, schedule = 1, 2"),
]


@pytest.mark.parametrize(("name", "path", "line"), PLANTED)
def test_a_planted_misuse_is_caught(name: str, path: str, line: str) -> None:
    """The real text with one misuse added: the rule names exactly that line."""
    files = sources()
    files[path] = files[path] + line + "\n"
    found = {(m.path, m.text) for m in misuses(BY_NAME[name], files)}
    assert found == {(path, line)}


def test_allowed_words_and_other_words_pass() -> None:
    """What the rules must not catch: the allowances, and words that only look alike."""
    text = (
        "fully_shard(module, reshard_after_forward=True)  # torch's\n"
        "# tar shards, tar-shard, sharded data, optional.webdataset.kind.Sharded\n"
        "task = Segmentation()  # segmentation is another word\n"
        "optim.schedule, the LR schedule, the LR\n# schedule, learning-rate schedule\n"
        "scheduler.step()  # the LR scheduler is another word\n"
        'Figure(layout="constrained")\n'
    )
    files = {"src/ddp_template/x.py": text}
    assert all(not misuses(rule, files) for rule in RULES)


def test_the_words_are_cut_at_identifiers() -> None:
    cut = [w.group() for w in _WORD.finditer("PriorSegment save_layout_png _shard HTTPShard x2")]
    assert cut == ["Prior", "Segment", "save", "layout", "png", "shard", "HTTP", "Shard", "x"]
