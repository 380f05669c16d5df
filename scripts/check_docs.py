"""Check the docs: every relative link resolves and every documented train.py command composes.

    python scripts/check_docs.py [--root DIR]

Reads ``README.md`` and ``docs/*.md`` under the repository root (``--root``, default: this
script's repository) and checks two things:

1. **Links.** Every ``[text](target)`` outside code: a relative ``path`` must exist (relative to
   the linking file), a ``#anchor`` must be a heading of the target file (GitHub's slugs:
   lowercase, punctuation but ``-`` and ``_`` dropped, spaces to ``-``, a repeated slug gets
   ``-1``, ``-2``, ...) or an explicit ``<a id=...>`` / ``<a name=...>``. ``http(s):`` and
   ``mailto:`` links are not fetched.
2. **Commands.** Every line of a fenced code block that runs ``train.py`` (``python train.py``,
   ``.venv/bin/python train.py``, ``torchrun ... train.py``, ``srun ... train.py``, ``mpirun``
   or ``horovodrun ... train.py``; leading ``VAR=value`` assignments and a ``$`` prompt allowed;
   a line ending in ``\\`` continues) has its Hydra overrides composed with ``conf/`` and the
   registered schemas, so a mistyped key or option fails. The rules:

   - flags (``-m``, ``--cfg job``, ``--help``, ...) are not overrides and are dropped;
   - a sweep (``a,b``, ``range(...)``, ``choice(...)``, ``glob(...)``) is composed with its
     first value; one whose first value cannot be taken (an empty range) is dropped;
   - an override whose value holds a shell variable (``$X``) or a ``<placeholder>`` is dropped;
   - everything after ``|``, ``&&``, ``||``, ``;`` or a redirection ends the command;
   - a block preceded by the line ``<!-- check_docs: skip -->`` is not composed (the forking
     page's commands use the options it tells you to create); those commands are counted.

Prints one line per problem (``README.md:12: link docs/x.md#y: no anchor y in docs/x.md``) and
exits 1, or prints a count line and exits 0.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SKIP_MARK = "<!-- check_docs: skip -->"
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(
    r"(?<!\\)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^()\s<>]*)>?(?:\s+\"[^\"]*\")?\s*\)"
)
ANCHOR_TAG = re.compile(r"<a\s+[^>]*?(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.I)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LAUNCHERS = ("python", "python3", "torchrun", "srun", "mpirun", "horovodrun")
STOP = {"|", "||", "&&", ";", "&", ">", ">>", "2>", "2>&1", "<"}
VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-dir", "-cd"}
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# (conf/'s content, overrides) -> Hydra's message or None: a second run in one process (the
# tests) composes only what the first did not.
COMPOSED: dict[tuple[str, tuple[str, ...]], str | None] = {}


@dataclass
class Doc:
    path: Path
    lines: list[str]
    prose: str = ""  # the text with code blocks and code spans blanked (offsets kept)
    anchors: set[str] = field(default_factory=set)
    blocks: list[tuple[int, list[str], bool]] = field(default_factory=list)  # start, lines, skip


def slug(text: str) -> str:
    """GitHub's anchor of a heading's text: markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def parse(path: Path) -> Doc:
    doc = Doc(path, path.read_text(encoding="utf-8").splitlines())
    prose: list[str] = []
    seen: dict[str, int] = {}
    fence: str | None = None
    start, body, skip = 0, [], False
    for number, line in enumerate(doc.lines, 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence, start, body = match.group(1), number, []
            previous = [x.strip() for x in doc.lines[: number - 1] if x.strip()]
            skip = bool(previous) and previous[-1] == SKIP_MARK
            prose.append("")
            continue
        if fence is not None:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                doc.blocks.append((start, body, skip))
                fence = None
            else:
                body.append(line)
            prose.append("")
            continue
        prose.append(line)
        heading = HEADING.match(line)
        if heading:
            base = slug(heading.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            doc.anchors.add(base if count == 0 else f"{base}-{count}")
        doc.anchors.update(ANCHOR_TAG.findall(line))
    text = "\n".join(prose)
    doc.prose = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    return doc


def link_problems(doc: Doc, docs: dict[Path, Doc], root: Path) -> Iterator[str]:
    name = doc.path.relative_to(root).as_posix()
    for match in LINK.finditer(doc.prose):
        target = match.group(2)
        number = doc.prose.count("\n", 0, match.start(2)) + 1
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # http(s):, mailto: and the like are not fetched
        where = f"{name}:{number}: link {target}"
        path_part, _, anchor = target.partition("#")
        dest = (doc.path.parent / path_part).resolve() if path_part else doc.path
        if not dest.exists():
            yield f"{where}: no file {path_part} (from {doc.path.parent.relative_to(root) or '.'})"
            continue
        if not anchor:
            continue
        if dest.suffix != ".md" or dest.is_dir():
            yield f"{where}: anchor on a file that is not markdown"
            continue
        other = docs.get(dest) or parse(dest)
        if anchor not in other.anchors:
            shown = dest.relative_to(root).as_posix() if dest.is_relative_to(root) else dest
            yield f"{where}: no anchor {anchor} in {shown}"


def commands(doc: Doc) -> Iterator[tuple[int, str, bool]]:
    """(line number, the command, skipped) for each train.py line of the fenced blocks."""
    for start, body, skip in doc.blocks:
        joined, first = "", 0
        for offset, line in enumerate(body, start + 1):
            if not joined:
                first = offset
            if line.rstrip().endswith("\\"):
                joined += line.rstrip()[:-1] + " "
                continue
            joined += line
            if "train.py" in joined:
                yield first, joined, skip
            joined = ""


def overrides(command: str) -> list[str] | None:
    """The Hydra overrides of a command line, or None when it does not run train.py."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    if words[:1] == ["$"]:
        words = words[1:]
    while words and ENV.match(words[0]):
        words = words[1:]
    if not words or Path(words[0]).name not in LAUNCHERS or "train.py" not in words:
        return None
    runs_python = any(
        Path(w).name in ("python", "python3") for w in words[: words.index("train.py")]
    )
    if not runs_python and Path(words[0]).name != "torchrun":
        return None  # srun/mpirun must start python on train.py
    rest = words[words.index("train.py") + 1 :]
    out: list[str] = []
    flag_value = False
    for word in rest:
        if word in STOP or word.startswith((">", "2>")):
            break
        if flag_value:
            flag_value = False
            continue
        if word.startswith("-"):
            flag_value = word in VALUE_FLAGS
            continue
        out.append(word)
    return out


def first_values(items: list[str]) -> list[str]:
    """The overrides as one run composes them: a sweep by its first value (module docstring)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    out: list[str] = []
    for item in items:
        if "$" in item or re.search(r"<[^<>=]+>", item):
            continue
        try:
            (parsed,) = parser.parse_overrides([item])
        except Exception:
            out.append(item)  # let compose report it
            continue
        if not parsed.is_sweep_override():
            out.append(item)
            continue
        try:
            value = next(iter(parsed.sweep_string_iterator()))
        except Exception:
            continue
        prefix = {"ADD": "+", "FORCE_ADD": "++", "DELETE": "~"}.get(parsed.type.name, "")
        out.append(f"{prefix}{parsed.key_or_group}={value}")
    return out


def conf_digest(conf: Path) -> str:
    """One hash of every file under ``conf/`` (the cache's key: a changed conf composes anew)."""
    digest = hashlib.sha256()
    for path in sorted(conf.rglob("*")):
        if path.is_file():
            name = path.relative_to(conf.parent).as_posix().encode()
            digest.update(name + b"\0" + path.read_bytes())
    return digest.hexdigest()


def compose_problems(docs: list[Doc], root: Path) -> tuple[list[str], int, int]:
    """Problems, commands composed, commands skipped by the mark."""
    src = root / "src"
    if src.is_dir() and str(src) not in sys.path:
        sys.path.insert(0, str(src))
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from ddp_template.config.schema import register_configs

    register_configs()
    problems: list[str] = []
    composed = skipped = 0
    conf_hash = conf_digest(root / "conf")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(root / "conf"), version_base="1.3"):
        for doc in docs:
            name = doc.path.relative_to(root).as_posix()
            for number, command, skip in commands(doc):
                items = overrides(command)
                if items is None:
                    continue
                if skip:
                    skipped += 1
                    continue
                key = (conf_hash, tuple(first_values(items)))
                if key not in COMPOSED:
                    try:
                        compose(config_name="config", overrides=list(key[1]))
                        COMPOSED[key] = None
                    except Exception as error:  # Hydra's own message names the override
                        COMPOSED[key] = " ".join(str(error).split())
                if COMPOSED[key] is not None:
                    problems.append(f"{name}:{number}: command {' '.join(items)}: {COMPOSED[key]}")
                composed += 1
    return problems, composed, skipped


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    args.add_argument("--root", type=Path, default=REPO, help="the repository (default: this one)")
    root = args.parse_args(argv).root.resolve()
    paths = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    docs = {p.resolve(): parse(p) for p in paths if p.is_file()}
    problems = [p for doc in docs.values() for p in link_problems(doc, docs, root)]
    links = sum(len(LINK.findall(doc.prose)) for doc in docs.values())
    composed_problems, composed, skipped = compose_problems(list(docs.values()), root)
    problems += composed_problems
    for problem in problems:
        print(problem)
    if problems:
        return 1
    print(
        f"check_docs: {len(docs)} files, {links} links and {composed} train.py commands ok "
        f"({skipped} marked {SKIP_MARK!r} not composed)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
