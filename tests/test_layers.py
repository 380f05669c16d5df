"""docs/ARCHITECTURE.md's module map holds against the real imports, so it cannot go stale.

Every module of ``src/ddp_template`` (and ``train.py``) is parsed with ``ast``, not imported:
its imports of the package, at module level and inside functions, must be exactly what the
"may import" column of its row lists (in italics: only inside a function), every module has a
row and every row a module. Then the layering rules themselves: the core never imports an
optional folder (``webdataset/``, ``streams/``, ``tokens/``, ``gpt/``) by name, no module imports a
switch or
``train.py``, the modules named by string exist, and the import graph has no cycle.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "ddp_template"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
# Folders a forker may delete, folder and all: the data kinds (any folder with a kind of its own;
# data/kind.py is the seam itself, and map-style data's kind), the GPT (model=gpt) and FSDP2
# (parallel=fsdp2).
KINDS = {p.parent.name for p in PKG.glob("*/kind.py")} - {"data"}
OPTIONAL = frozenset({"webdataset", "streams", "tokens", "gpt", "fsdp2", *KINDS})
TRAIN = "train"  # train.py's name in the map (it lives beside src/, not in the package)
CELL = re.compile(r"(?<!\\)\|")  # a table's cell border (``\|`` is a pipe inside a cell)
NAME = re.compile(r"(\*?)`([^`]+)`(\*?)")  # `module`, or *`module`*: only inside a function


def module_name(path: Path) -> str:
    """``data/kind.py`` → ``data.kind``; ``switches/__init__.py`` → ``switches``."""
    if path == ROOT / "train.py":
        return TRAIN
    parts = path.relative_to(PKG).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def sources() -> dict[str, Path]:
    """Every module the map must list: each file of the package (an empty ``__init__.py``
    holds no code, so no row) and train.py."""
    found = {
        module_name(p): p
        for p in sorted(PKG.rglob("*.py"))
        if p.name != "__init__.py" or p.read_text().strip()
    }
    return found | {TRAIN: ROOT / "train.py"}


@cache
def packages() -> frozenset[str]:
    return frozenset(module_name(p) for p in PKG.rglob("__init__.py"))


def resolve(importer: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The package's modules one import statement imports (``from ddp_template.x import y``
    names ``x.y`` where that is a module, else ``x``)."""
    known = set(sources()) | packages()
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
        return {n.removeprefix("ddp_template.") for n in names if n.startswith("ddp_template.")}
    if node.level:  # relative: from the importer's own package upward
        here = importer.split(".")
        is_package = sources()[importer].name == "__init__.py"
        base = here[: len(here) - node.level + (1 if is_package else 0)]
        module = ".".join([*base, *([node.module] if node.module else [])])
    elif node.module == "ddp_template" or (node.module or "").startswith("ddp_template."):
        module = node.module.removeprefix("ddp_template").removeprefix(".")
    else:
        return set()
    found = set()
    for alias in node.names:
        sub = f"{module}.{alias.name}" if module else alias.name
        found.add(sub if sub in known else module)
    return found - {""}


@cache
def real_imports() -> dict[str, dict[str, bool]]:
    """Per module: each package module it imports → whether only inside a function."""
    graph: dict[str, dict[str, bool]] = {}
    for name, path in sources().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        deferred: dict[str, bool] = {}
        stack: list[tuple[ast.AST, bool]] = [(tree, False)]
        while stack:
            node, in_function = stack.pop()
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in resolve(name, node):
                    deferred[target] = deferred.get(target, True) and in_function
            inside = in_function or isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            stack.extend((child, inside) for child in ast.iter_child_nodes(node))
        graph[name] = deferred
    return graph


@cache
def module_map() -> dict[str, tuple[int, dict[str, bool]]]:
    """The module map's rows: module → (its line in the doc, what it may import → whether in
    italics, i.e. only inside a function). Every table row of the "## Module map" section whose
    first cell is a backticked ``.py`` path: relative to src/ddp_template/, or ``train.py``."""
    lines = DOC.read_text().splitlines()
    start = lines.index("## Module map")
    rows: dict[str, tuple[int, dict[str, bool]]] = {}
    for number, line in enumerate(lines[start + 1 :], start + 2):
        if line.startswith("## "):
            break
        cells = [c.strip() for c in CELL.split(line)]
        first = re.fullmatch(r"`([\w/]+\.py)`", cells[1]) if len(cells) >= 5 else None
        if not first:
            continue
        path = ROOT / first[1] if first[1] == "train.py" else PKG / first[1]
        module = module_name(path)
        assert module not in rows, f"ARCHITECTURE.md:{number}: a second row for {first[1]}"
        column = cells[-2]
        names = {name: bool(a and b) for a, name, b in NAME.findall(column)}
        rest = NAME.sub("", column).replace(",", "").strip()
        assert rest in ("", "—"), (
            f"ARCHITECTURE.md:{number}: the 'may import' cell of {first[1]} holds {rest!r}: "
            f"write only `module` names (dotted, relative to ddp_template), or —"
        )
        rows[module] = (number, names)
    assert rows, f"no module rows found under '## Module map' in {DOC}"
    return rows


def absent(module: str) -> bool:
    """A module of an optional kind whose folder a forker deleted: its rows may stay."""
    top = module.split(".")[0]
    return top in OPTIONAL and not (PKG / top).is_dir()


def test_every_module_has_a_row_and_every_row_a_module() -> None:
    rows, modules = module_map(), sources()
    no_row = sorted(set(modules) - set(rows))
    no_module = sorted(m for m in set(rows) - set(modules) if not absent(m))
    assert not no_row, f"modules without a row in ARCHITECTURE.md's module map: {no_row}"
    assert not no_module, "rows of ARCHITECTURE.md's module map without a module: " + ", ".join(
        f"{m} (line {rows[m][0]})" for m in no_module
    )


def test_the_may_import_column_is_what_each_module_imports() -> None:
    """Per module, the set of package modules it imports equals its row's; an import made
    only inside a function is in italics, one at module level is not."""
    known = set(sources()) | packages()
    problems = []
    for module, (line, listed) in sorted(module_map().items()):
        if module not in sources():
            continue  # test_every_module_has_a_row... says so (or its kind was deleted)
        real = real_imports()[module]
        where = f"{module} (ARCHITECTURE.md:{line})"
        if unknown := sorted(n for n in listed if n not in known and not absent(n)):
            problems.append(f"{where}: lists {unknown}, which name no module")
        if missing := sorted(set(real) - set(listed)):
            problems.append(f"{where}: imports {missing}, missing from its 'may import' cell")
        if extra := sorted(set(listed) - set(real)):
            problems.append(f"{where}: lists {extra}, which it does not import")
        for name in sorted(set(real) & set(listed)):
            if real[name] != listed[name]:
                how = "only inside a function" if real[name] else "at module level"
                style = "*`{0}`*" if real[name] else "`{0}`"
                problems.append(f"{where}: imports {name} {how}: write " + style.format(name))
    assert not problems, "the module map is stale:\n" + "\n".join(problems)


def test_the_core_never_imports_an_optional_kind() -> None:
    """A data kind is chosen by its factory (``Splits(kind=...)``) and a model by its YAML, so
    deleting an optional folder leaves every other module importable."""
    offenders = [
        f"{module} imports {target}"
        for module, targets in real_imports().items()
        if module.split(".")[0] not in OPTIONAL
        for target in targets
        if target.split(".")[0] in OPTIONAL
    ]
    assert not offenders, offenders


def test_no_module_imports_a_switch_or_train_py() -> None:
    """A switch is named by string in ``SWITCHES`` (so one that is off is never imported);
    train.py is the recipe on top, imported by no module of the package."""
    offenders = [
        f"{module} imports {target}"
        for module, targets in real_imports().items()
        for target in targets
        if target == TRAIN or target.startswith("switches.")
    ]
    assert not offenders, offenders


def named_function(dotted: str) -> str | None:
    """Why ``ddp_template.<module>.<function>`` names nothing, or None."""
    module, _, function = dotted.removeprefix("ddp_template.").rpartition(".")
    path = sources().get(module)
    if path is None:
        return f"{dotted}: no module {module}"
    defined = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
    return None if function in defined else f"{dotted}: {module} defines no {function}"


def registry(path: Path, name: str) -> dict[str, str]:
    """The literal dict ``name`` a module assigns (a registry of builders named by string)."""
    (found,) = [
        ast.literal_eval(n.value)
        for n in ast.parse(path.read_text()).body
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        and name in ast.unparse(n.targets[0] if isinstance(n, ast.Assign) else n.target)
    ]
    assert found, f"{name} is empty"
    return found


def test_the_modules_named_by_string_exist() -> None:
    """What is imported by name at run time, where ``ast`` sees no import: every builder in
    ``SWITCHES`` and ``parallel.PARALLEL``, and the module a fork server imports first
    (``preload.FORK_SERVER``)."""
    from ddp_template.process.preload import FORK_SERVER  # the standard library only

    builders = [
        *registry(PKG / "switches" / "__init__.py", "SWITCHES").values(),
        *registry(PKG / "parallel.py", "PARALLEL").values(),
    ]
    present = [
        b
        for b in builders
        if (folder := b.removeprefix("ddp_template.").split(".")[0]) not in OPTIONAL
        or (PKG / folder).is_dir()  # a deleted optional folder's entry may stay
    ]
    problems = [why for builder in present if (why := named_function(builder))]
    server = FORK_SERVER.removeprefix("ddp_template.")
    if server not in sources():
        problems.append(f"preload.FORK_SERVER={FORK_SERVER}: no such module")
    assert not problems, problems


def test_the_import_graph_has_no_cycle() -> None:
    graph = {
        m: sorted(t for t in targets if t in sources()) for m, targets in real_imports().items()
    }
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for target in graph[module]:
            if cycle := visit(target, [*path, module]):
                return cycle
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module, [])
        assert cycle is None, "an import cycle: " + " → ".join(cycle)
