"""scripts/check_docs.py: the real docs pass; a planted broken link, missing anchor or bad config
key in a documented command fails, naming the file, the line and the target. One full run
(every documented command composed: a few seconds; the copy's run composes only what it
adds, the rest is cached by conf/'s content); the rest tests the parts."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import PY, ROOT

SCRIPT = ROOT / "scripts" / "check_docs.py"


def _checker():
    spec = importlib.util.spec_from_file_location("check_docs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


check_docs = _checker()


@pytest.mark.needs("webdataset", "streams", "tokens", "gpt", "fsdp2", "live")  # the docs show each
def test_the_real_docs_pass(capsys: pytest.CaptureFixture[str]) -> None:
    code = check_docs.main([])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.startswith("check_docs: ") and " train.py commands ok" in out, out


def test_it_runs_from_the_repository_root() -> None:
    done = subprocess.run([PY, str(SCRIPT), "--help"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and "--root" in done.stdout, done.stderr


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The repository's tracked files in a folder of their own: what --root reads (README.md,
    docs/ and conf/, and every file a doc links to)."""
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    for name in listed:
        if (ROOT / name).is_file():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def _plant(path: Path, text: str) -> int:
    """Append a paragraph to path; the line number it starts on."""
    lines = path.read_text().splitlines()
    path.write_text("\n".join([*lines, "", text, ""]))
    return len(lines) + 2


@pytest.mark.needs("webdataset", "streams", "tokens", "gpt", "fsdp2", "live")  # the docs show each
def test_planted_problems_fail_each_named(copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A broken link, a missing anchor, a bad key and a bad option: one line each, exit 1."""
    link = _plant(copy / "README.md", "See [the missing page](docs/nowhere.md).")
    anchor = _plant(copy / "docs" / "running.md", "As [above](sampling.md#no-such-heading) says.")
    command = ".venv/bin/python train.py -m sampler.shufle=true optim.lr=0.1,0.01 \\\n    epochs=1"
    key = _plant(copy / "docs" / "sampling.md", f"```bash\n{command}\n```") + 1
    option = "RUN_ID=x torchrun --nproc-per-node=2 train.py sampler=nope  # a comment"
    opt = _plant(copy / "README.md", f"```bash\n{option}\n```") + 1
    skipped = _plant(copy / "README.md", f"<!-- check_docs: skip -->\n```bash\n{option}\n```")
    assert skipped  # a marked block is not composed: no line for it below

    code = check_docs.main(["--root", str(copy)])
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    assert len(out) == 4, out
    assert f"README.md:{link}: link docs/nowhere.md: no file docs/nowhere.md (from .)" in out
    assert (
        f"docs/running.md:{anchor}: link sampling.md#no-such-heading: "
        "no anchor no-such-heading in docs/sampling.md"
    ) in out
    (bad_key,) = [x for x in out if x.startswith(f"docs/sampling.md:{key}: command ")]
    assert "sampler.shufle=true optim.lr=0.1,0.01 epochs=1:" in bad_key and "shufle" in bad_key
    (bad_option,) = [x for x in out if x.startswith(f"README.md:{opt}: command sampler=nope: ")]
    assert "nope" in bad_option.split(": ", 2)[2]


def test_anchors_explicit_duplicated_and_of_the_same_page(tmp_path: Path) -> None:
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text(
        "# Data kinds\n\n## Notes\n\n## Notes\n\n```bash\n# not a heading\n```\n\n"
        '<a id="here"></a><a name="there"></a>\n\n'
        "[a](#here) [b](#there) [c](#notes-1) [d](#data-kinds) [e](https://x.org/#nothing)\n"
        "`[f](#in-code)` [g](#notes-2) [h](#not-a-heading)\n"
    )
    doc = check_docs.parse(page)
    assert doc.anchors == {"data-kinds", "notes", "notes-1", "here", "there"}
    problems = list(check_docs.link_problems(doc, {page: doc}, tmp_path))
    assert problems == [
        "docs/page.md:14: link #notes-2: no anchor notes-2 in docs/page.md",
        "docs/page.md:14: link #not-a-heading: no anchor not-a-heading in docs/page.md",
    ]


def test_the_skip_mark_marks_the_next_block_only(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- check_docs: skip -->\n```bash\npython train.py a=1\n```\n\n"
        "```bash\npython train.py \\\n  b=2\n```\n"
    )
    doc = check_docs.parse(page)
    assert list(check_docs.commands(doc)) == [
        (3, "python train.py a=1", True),
        (7, "python train.py    b=2", False),
    ]


@pytest.mark.parametrize(
    ("command", "overrides"),
    [
        (".venv/bin/python train.py -m a=1,2 b='range(3,5)' c=x", ["a=1", "b=3", "c=x"]),
        ("srun -n 2 .venv/bin/python train.py epochs=1 | tail", ["epochs=1"]),
        ("python train.py --cfg job d=$X e=<path> f=2", ["f=2"]),
        ("mpirun -np 2 python train.py +g=1 choice_key='choice(a,b)'", ["+g=1", "choice_key=a"]),
    ],
)
def test_the_override_rules(command: str, overrides: list[str]) -> None:
    assert check_docs.first_values(check_docs.overrides(command)) == overrides


@pytest.mark.parametrize(
    "line",
    ["[x][rank0] - resume with: RUN_ID=r python train.py dist.nproc=2", "#  srun python train.py"],
)
def test_log_lines_and_comments_are_not_commands(line: str) -> None:
    assert check_docs.overrides(line) is None


def test_slugs_follow_github() -> None:
    assert check_docs.slug("Language models: token files, `task=lm`, `model=gpt`") == (
        "language-models-token-files-tasklm-modelgpt"
    )
    assert check_docs.slug("Which samples made step S's loss jump") == (
        "which-samples-made-step-ss-loss-jump"
    )
    assert check_docs.slug("Live fault tolerance (experimental): `fault_tolerance=live`") == (
        "live-fault-tolerance-experimental-fault_tolerancelive"
    )
