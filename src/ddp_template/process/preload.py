"""What a fork server imports before its first fork, so that every process it forks starts
with those modules instead of importing them itself (seconds of CPU each on a small machine).

multiprocessing's own ``"__main__"`` preload does not take effect here (Python 3.11's
``ForkServer`` never passes the main script's path on), so each fork would still import all
that the main script imports: the modules are named instead.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

PACKAGES = (__name__.split(".")[0], "hydra", "omegaconf")  # what train.py imports, but torch
FORK_SERVER = f"{PACKAGES[0]}.process.server_init"  # only a fork server imports it, first


def loaded_modules(*first: str) -> list[str]:
    """``FORK_SERVER``, ``first``, then every module of ``PACKAGES`` this process has imported
    (a copy of the names: another thread may be importing)."""
    head = [FORK_SERVER, *(name for name in first if name != FORK_SERVER)]
    ours = sorted(name for name in list(sys.modules) if name.split(".")[0] in PACKAGES)
    return [*head, *(name for name in ours if name not in head)]


def modules_of(obj: Any) -> list[str]:
    """The modules a process must import to unpickle ``obj`` (a loader worker its dataset:
    torchvision's transforms, a forker's own module), found by pickling it once without its
    tensor and array data."""
    import numpy as np
    import torch

    found: set[str] = set()

    class _Collect(pickle.Pickler):
        def reducer_override(self, value: Any) -> Any:
            kind = value if isinstance(value, type) else type(value)
            found.add(getattr(value, "__module__", None) or kind.__module__)
            if isinstance(value, torch.Tensor | np.ndarray):
                return int, ()  # the module is known; the data would only be copied
            return NotImplemented

    class _Discard:
        def write(self, chunk: bytes) -> int:
            return len(chunk)

    try:
        _Collect(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception:  # not picklable as is: the worker's own start will say so
        return []
    return sorted(m for m in found if isinstance(m, str) and m in sys.modules)
