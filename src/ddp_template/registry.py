"""By-name registries: what the core reaches only through a string, so the folder it names may go.

Every registry — ``switches.SWITCHES``, ``parallel.PARALLEL``, ``tolerance.TOLERANCE``,
``tolerance.SUPERVISOR``, ``process.preload.FORK_SERVER`` — writes its entries in one format,
Python's entry-point reference: ``package.module:attribute`` (or ``package.module`` for a module
itself). ``load`` imports one; an entry whose folder a forker deleted is refused in one sentence
that names the config key and the fix, never a ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib
from typing import Any

from ddp_template.errors import ConfigError


def split(reference: str) -> tuple[str, str]:
    """``"a.b:c"`` → ``("a.b", "c")``; ``"a.b"`` → ``("a.b", "")``."""
    module, _, attribute = reference.partition(":")
    return module, attribute


def load(reference: str, *, key: str, fix: str) -> Any:
    """The object ``reference`` names; ``key`` is the setting that chose it (``parallel=fsdp2``)
    and ``fix`` what to set instead, for the sentence that refuses a deleted folder."""
    module, attribute = split(reference)
    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module.startswith(exc.name):
            raise  # a library the module needs is missing, not the module: its own message
        raise ConfigError(
            f"{key} needs {module}, which this copy of the template does not have (its folder "
            f"was deleted); {fix}"
        ) from None
    return getattr(found, attribute) if attribute else found
