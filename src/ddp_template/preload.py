"""What a fork server imports before its first fork, so that every process it forks starts
with those modules instead of importing them itself (seconds of CPU each on a small machine).

multiprocessing's own ``"__main__"`` preload does not take effect here (Python 3.11's
``ForkServer`` never passes the main script's path on), so each fork would still import all
that the main script imports: the modules are named instead.
"""

from __future__ import annotations

import sys

PACKAGES = (__name__.split(".")[0], "hydra", "omegaconf")  # what train.py imports, but torch


def loaded_modules(*first: str) -> list[str]:
    """``first``, then every module of ``PACKAGES`` this process has imported (a copy of the
    names: another thread may be importing)."""
    ours = sorted(name for name in list(sys.modules) if name.split(".")[0] in PACKAGES)
    return [*first, *(name for name in ours if name not in first)]
