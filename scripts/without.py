"""Prove the optional wing optional: delete a folder of ``src/ddp_template/optional/`` with its
YAMLs and its tests, in a copy of the repository, then run the default job and the remaining
tests there.

    python scripts/without.py                  # each folder alone, then all seven at once
    python scripts/without.py gpt live         # only these cases (each alone)
    python scripts/without.py --all            # only the case "all seven at once"
    python scripts/without.py -- -m "not slow" # pytest's arguments after --

Every case runs the default job, collects every remaining test module (each must still import),
then runs pytest with the arguments given (none: the whole remaining suite).

A folder's YAMLs are the ones under ``conf/`` that name its modules (a ``_target_``) or that a
registry names by key (``parallel=fsdp2``, ``fault_tolerance=live``), and every
YAML whose defaults list picks one of those (``experiment=lm_bytes`` picks ``data=corpus`` and
``model=gpt``). Its tests are ``tests/optional/<folder>/``; a test elsewhere that also uses it
says so (``@pytest.mark.needs("gpt")``) and is skipped where it is gone (tests/conftest.py).
The copy is a fresh folder per case holding
the files git tracks (and the untracked ones it does not ignore); the repository itself is never
touched; the copy is made a git repository of its own, as a fresh clone is. Exit 0 when
every case is green; one line per case either way.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
WING = Path("src/ddp_template/optional")
FOLDERS = ("webdataset", "streams", "tokens", "gpt", "fsdp2", "live", "s3")
PYTHON = os.environ.get("PYTHON", sys.executable)


def tracked(root: Path) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [Path(line) for line in out.splitlines() if (root / line).is_file()]


def picks(path: Path) -> set[tuple[str, str]]:
    """The (group, option) pairs a YAML's defaults list picks."""
    node = yaml.safe_load(path.read_text()) or {}
    found = set()
    for entry in node.get("defaults", []) if isinstance(node, dict) else []:
        if isinstance(entry, dict):
            for key, value in entry.items():
                group = key.removeprefix("override").strip().strip("/")
                if isinstance(value, str) and group:
                    found.add((group, value))
    return found


def option(path: Path, conf: Path) -> tuple[str, str]:
    """``conf/model/gpt.yaml`` → ``("model", "gpt")``."""
    relative = path.relative_to(conf)
    return relative.parent.as_posix(), relative.stem


def registered(folders: set[str], conf: Path) -> set[Path]:
    """The options a registry names by key (``parallel.PARALLEL["fsdp2"]`` is the YAML
    ``conf/parallel/fsdp2.yaml``) whose entry lives in one of the folders."""
    sys.path.insert(0, str(ROOT / "src"))
    from ddp_template import parallel, tolerance

    tables = {"parallel": parallel.PARALLEL, "fault_tolerance": tolerance.TOLERANCE}
    return {
        conf / group / f"{key}.yaml"
        for group, table in tables.items()
        for key, reference in table.items()
        if reference.split(".")[2] in folders and (conf / group / f"{key}.yaml").is_file()
    }


def yamls_of(folders: set[str], conf: Path) -> list[Path]:
    """The YAMLs that name the folders' modules or that a registry names by key, and
    (transitively) those picking one of them."""
    names = re.compile(r"ddp_template\.optional\.(" + "|".join(sorted(folders)) + r")\b")
    every = sorted(conf.rglob("*.yaml"))
    gone = {p for p in every if names.search(p.read_text())} | registered(folders, conf)
    while True:
        options = {option(p, conf) for p in gone}
        more = {p for p in every if p not in gone and picks(p) & options}
        if not more:
            return sorted(gone)
        gone |= more


def prepare(folders: set[str], copy: Path) -> list[Path]:
    """Copy the repository into ``copy`` and delete the folders, their YAMLs and their tests
    there; returns what was deleted (relative to the copy)."""
    for relative in tracked(ROOT):
        target = copy / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / relative, target)
    conf = copy / "conf"
    deleted = [copy / WING / f for f in sorted(folders)] + yamls_of(folders, conf)
    deleted += [copy / "tests" / "optional" / f for f in sorted(folders)]
    for path in deleted:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    git = ["git", "-c", "user.name=without", "-c", "user.email=without@localhost"]
    for step in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "without"]):
        subprocess.run([*git, *step], cwd=copy, check=True, capture_output=True)
    return [p.relative_to(copy) for p in deleted]


def run_case(folders: set[str], pytest_args: list[str], keep: bool) -> bool:
    name = "all seven" if len(folders) == len(FOLDERS) else ", ".join(sorted(folders))
    copy = Path(tempfile.mkdtemp(prefix="without-"))
    try:
        deleted = prepare(folders, copy)
        print(f"without {name}: deleted " + " ".join(str(p) for p in deleted), flush=True)
        env = {**os.environ, "PYTHONPATH": str(copy / "src"), "WANDB_MODE": "offline"}
        started = time.monotonic()
        job = subprocess.run(
            [PYTHON, "train.py", "dist.nproc=2"], cwd=copy, env=env, capture_output=True, text=True
        )
        verdicts = job.stdout.count("verdict ok") + job.stderr.count("verdict ok")
        if job.returncode != 0 or verdicts == 0:
            print(f"without {name}: the default job failed (exit {job.returncode})")
            print(job.stderr[-3000:])
            return False
        pytest = [PYTHON, "-m", "pytest", "-p", "no:cacheprovider", "-q"]
        collected = subprocess.run(
            [*pytest, "--collect-only", "tests"], cwd=copy, env=env, capture_output=True, text=True
        )
        if collected.returncode != 0:  # a remaining test module that no longer imports
            print(f"without {name}: the remaining tests do not collect")
            print(collected.stdout[-3000:])
            return False
        tests = subprocess.run(
            [*pytest, *pytest_args],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
        )
        tail = [line for line in tests.stdout.splitlines() if line.strip()][-1:]
        seconds = time.monotonic() - started
        ok = tests.returncode == 0
        print(
            f"without {name}: default job ok ({verdicts} verdicts ok), remaining tests "
            f"{'green' if ok else 'RED'}: {' '.join(tail)} ({seconds:.0f} s)",
            flush=True,
        )
        if not ok:
            print(tests.stdout[-6000:])
        return ok
    finally:
        if keep:
            print(f"kept {copy}")
        else:
            shutil.rmtree(copy, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", metavar="FOLDER", help=", ".join(FOLDERS))
    parser.add_argument("--all", action="store_true", help="only the case: all seven at once")
    parser.add_argument("--keep", action="store_true", help="keep each case's copy")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, pytest_args = parser.parse_args(argv[:cut]), argv[cut + 1 :]
    if unknown := sorted(set(args.folders) - set(FOLDERS)):
        parser.error(f"no optional folder {unknown[0]}; choose from {', '.join(FOLDERS)}")
    if args.all:
        cases = [set(FOLDERS)]
    elif args.folders:
        cases = [{f} for f in args.folders]
    else:
        cases = [{f} for f in FOLDERS] + [set(FOLDERS)]
    results = [run_case(case, pytest_args, args.keep) for case in cases]
    print(f"{sum(results)} of {len(results)} cases green")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
