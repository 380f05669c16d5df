"""docs/ARCHITECTURE.md's module map holds against the real imports, so it cannot go stale.

Every module of ``src/ddp_template`` (and ``train.py``) is parsed with ``ast``, not imported:
its imports of the package, at module level and inside functions, must be exactly what the
"may import" column of its row lists (in italics: only inside a function), every module has a
row and every row a module. Then the layering rules themselves: the core never imports the
optional wing (``optional/``) by name, no module imports a switch or ``train.py``, every by-name
registry's entries exist, the import graph has no cycle, and neither has the graph of rooms (a
folder, or a module at the package root): the rooms stack as floors, and no import points up.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "ddp_template"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
WING = "optional"  # the folder of folders a forker may delete, each with its YAMLs and tests
OPTIONAL = frozenset({"webdataset", "streams", "tokens", "gpt", "fsdp2", "live", "s3"})
TRAIN = "train"  # train.py's name in the map (it lives beside src/, not in the package)
CELL = re.compile(r"(?<!\\)\|")  # a table's cell border (``\|`` is a pipe inside a cell)
NAME = re.compile(r"(\*?)`([^`]+)`(\*?)")  # `module`, or *`module`*: only inside a function


def module_name(path: Path) -> str:
    """``kind.py`` → ``kind``; ``switches/__init__.py`` → ``switches``."""
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


def optional_folder(module: str) -> str | None:
    """``optional.webdataset.plan`` → ``webdataset``; a core module → None."""
    parts = module.split(".")
    return parts[1] if parts[0] == WING and len(parts) > 1 else None


def absent(module: str) -> bool:
    """A module of an optional folder a forker deleted: its rows may stay."""
    folder = optional_folder(module)
    return folder is not None and not (PKG / WING / folder).is_dir()


def test_the_wing_holds_exactly_the_optional_folders() -> None:
    """What README and ARCHITECTURE call optional is what ``optional/`` holds (or held)."""
    present = {p.name for p in (PKG / WING).iterdir() if (p / "__init__.py").is_file()}
    assert present <= OPTIONAL, sorted(present - OPTIONAL)


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


def test_the_core_never_imports_the_optional_wing() -> None:
    """A data kind is chosen by its factory (``Splits(kind=...)``), a model by its YAML, a layout
    or a tolerance by a registry's string, so deleting an optional folder leaves every other
    module importable."""
    offenders = [
        f"{module} imports {target}"
        for module, targets in real_imports().items()
        if optional_folder(module) is None
        for target in targets
        if target.split(".")[0] == WING
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


REFERENCE = re.compile(r"ddp_template(\.\w+)+(:\w+)?")  # an entry point: module[:attribute]
REGISTRIES = {  # every by-name registry: module → the names it assigns
    "switches": ("SWITCHES",),
    "parallel": ("PARALLEL",),
    "tolerance": ("TOLERANCE", "SUPERVISOR"),
    "process.preload": ("FORK_SERVER",),
    "storage": ("SCHEMES",),
}


def named(reference: str) -> str | None:
    """Why ``ddp_template.<module>[:<attribute>]`` names nothing, or None."""
    module, _, attribute = reference.removeprefix("ddp_template.").partition(":")
    path = sources().get(module)
    if path is None:
        return f"{reference}: no module {module}"
    top = ast.parse(path.read_text()).body
    defined = {n.name for n in top if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return None if not attribute or attribute in defined else f"{reference}: no {attribute}"


def entries(path: Path, name: str) -> list[str]:
    """The string entries a module's assignment ``name = ...`` holds (a dict's values, a string,
    or an f-string's text with ``{PACKAGES[0]}`` read as ``ddp_template``)."""
    (node,) = [
        n.value
        for n in ast.parse(path.read_text()).body
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        and name == ast.unparse(n.targets[0] if isinstance(n, ast.Assign) else n.target)
    ]
    if isinstance(node, ast.JoinedStr):
        return [ast.unparse(node)[2:-1].replace("{PACKAGES[0]}", "ddp_template")]
    found = ast.literal_eval(node)
    return list(found.values()) if isinstance(found, dict) else [found]


def test_every_registry_entry_is_one_format_and_exists() -> None:
    """Every by-name registry writes Python's entry-point reference (``module:attribute``, or a
    module), and each entry names what exists, unless its optional folder was deleted: then
    ``registry.load`` refuses it in one sentence (tests/test_registry.py)."""
    problems = []
    for module, names in REGISTRIES.items():
        for name in names:
            for reference in entries(sources()[module], name):
                where = f"{module}.{name}: {reference!r}"
                if not REFERENCE.fullmatch(reference):
                    problems.append(f"{where} is not 'ddp_template.module:attribute'")
                elif not absent(reference.removeprefix("ddp_template.").partition(":")[0]) and (
                    why := named(reference)
                ):
                    problems.append(f"{where}: {why}")
    assert not problems, problems


def cycle_in(graph: dict[str, list[str]]) -> list[str] | None:
    """One cycle of a directed graph (as the path that closes it), or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for target in graph.get(node, ()):
            if found := visit(target, [*path, node]):
                return found
        done.add(node)
        return None

    for node in sorted(graph):
        if found := visit(node, []):
            return found
    return None


def room(module: str) -> str:
    """The room a module lives in: its folder (an optional one: ``optional/<folder>``), or the
    module itself at the package root."""
    parts = module.split(".")
    if parts[0] == WING and len(parts) > 2:
        return ".".join(parts[:2])
    return parts[0] if len(parts) > 1 else module


def rooms() -> dict[str, list[str]]:
    """Room → the rooms its modules import (itself left out)."""
    graph: dict[str, set[str]] = {}
    for module, targets in real_imports().items():
        graph.setdefault(room(module), set()).update(
            room(t) for t in targets if t in sources() and room(t) != room(module)
        )
    return {r: sorted(ts) for r, ts in graph.items()}


def test_the_rooms_stack_as_floors() -> None:
    """An import that points up a floor closes a loop between rooms (folders, root modules):
    ``data/`` importing ``engine`` while ``engine`` imports ``data/`` makes them one tangle."""
    found = cycle_in(rooms())
    assert found is None, "an import points up a floor, closing " + " → ".join(found)


def test_the_floor_test_fails_on_a_planted_upward_import() -> None:
    """The rule above can fail: ``data/`` importing the recipe's ``engine`` (which imports
    ``data/``) is caught."""
    graph = rooms()
    assert "data" in graph["engine"]
    planted = graph | {"data": [*graph["data"], "engine"]}
    assert cycle_in(planted) is not None


def test_the_import_graph_has_no_cycle() -> None:
    graph = {
        m: sorted(t for t in targets if t in sources()) for m, targets in real_imports().items()
    }
    found = cycle_in(graph)
    assert found is None, "an import cycle: " + " → ".join(found)


OWNS_MAX = 120  # characters: one clause a row; the detail lives in the sections below the map


def test_each_owns_cell_is_one_clause() -> None:
    """The map is read at a glance: each row's "owns" cell one short clause."""
    lines = DOC.read_text().splitlines()
    start = lines.index("## Module map")
    long = []
    for number, line in enumerate(lines[start + 1 :], start + 2):
        if line.startswith("## "):
            break
        cells = [c.strip() for c in CELL.split(line)]
        if len(cells) >= 5 and re.fullmatch(r"`[\w/]+\.py`", cells[1]) and len(cells[2]) > OWNS_MAX:
            long.append(f"ARCHITECTURE.md:{number}: {cells[1]} owns {len(cells[2])} characters")
    assert not long, f"owns cells over {OWNS_MAX} characters: {long}"
