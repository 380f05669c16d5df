"""Every by-name registry loads through ``registry.load``: the entries that exist load, and one
whose optional folder a forker deleted is refused in one sentence naming the setting and the fix
(never a ``ModuleNotFoundError``), while a library missing inside a module keeps its own error."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from ddp_template import parallel, registry, switches, tolerance
from ddp_template.errors import ConfigError
from ddp_template.process import preload


def test_every_registry_entry_loads() -> None:
    references = [
        *switches.SWITCHES.values(),
        *parallel.PARALLEL.values(),
        *tolerance.TOLERANCE.values(),
        tolerance.SUPERVISOR,
        preload.FORK_SERVER,
    ]
    for reference in references:
        module, attribute = registry.split(reference)
        if importlib.util.find_spec(module.rsplit(".", 1)[0]) is None:
            continue  # its optional folder deleted: refused in one sentence (below)
        loaded = registry.load(reference, key="k=v", fix="set k=w.")
        assert callable(loaded) if attribute else loaded.__name__ == module, reference


def test_a_deleted_folder_is_refused_in_one_sentence() -> None:
    with pytest.raises(ConfigError) as err:
        registry.load(
            "ddp_template.optional.gone.layout:build", key="parallel=gone", fix="set parallel=ddp."
        )
    message = str(err.value)
    assert message == (
        "parallel=gone needs ddp_template.optional.gone.layout, which this copy of the template "
        "does not have (its folder was deleted); set parallel=ddp."
    )


def test_a_missing_library_inside_a_module_keeps_its_own_error(tmp_path, monkeypatch) -> None:
    (tmp_path / "needs_a_library.py").write_text("import no_such_library_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as err:
        registry.load("needs_a_library:build", key="k=v", fix="set k=w.")
    assert err.value.name == "no_such_library_here"
    sys.modules.pop("needs_a_library", None)
