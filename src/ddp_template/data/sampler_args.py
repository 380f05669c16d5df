"""What a sampler accepts: strict integers and booleans, and the world it deals over.

torch's sampler stores whatever it gets: ``seed=1.5`` fails only at the first iteration,
``seed=True`` silently shuffles as seed 1, ``shuffle="false"`` shuffles. Here a wrong type is
refused at once with one sentence naming the argument, the value and the fix. numpy integers
count as integers; ``bool`` does not.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch.distributed as dist


def as_int(name: str, value: Any) -> int:
    """``value`` as a Python int, or a TypeError naming ``name``."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{name}={value!r} is a bool, not an integer; pass an int such as {name}={int(value)}."
        )
    if not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{name}={value!r} is a {type(value).__name__}, not an integer; pass an int such as "
            f"{name}={_example(value)}."
        )
    return int(value)


def as_bool(name: str, value: Any) -> bool:
    """``value`` as a Python bool, or a TypeError naming ``name``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{name}={value!r} is a {type(value).__name__}, not a bool; pass {name}=True or "
            f"{name}=False."
        )
    return bool(value)


def as_positions(positions: Any) -> np.ndarray:
    """Integer positions (a Python int, a sequence or an array) as int64, shape kept."""
    array = np.asarray(positions)
    if array.dtype == np.bool_ or (array.size and array.dtype.kind not in "iu"):
        raise TypeError(
            f"positions must be integers, got dtype {array.dtype}; pass ints such as np.arange(k)."
        )
    return array.astype(np.int64)


def _example(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return 0


def resolve_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """World size and rank from the arguments, else from the initialised process group."""
    if num_replicas is None or rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "num_replicas and rank were not given and torch.distributed is not initialised; "
                "pass num_replicas= and rank= or call init_process_group first."
            )
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        rank = dist.get_rank() if rank is None else rank
    num_replicas, rank = as_int("num_replicas", num_replicas), as_int("rank", rank)
    if num_replicas < 1:
        raise ValueError(f"Invalid num_replicas {num_replicas}, it should be >= 1")
    if rank >= num_replicas or rank < 0:
        raise ValueError(
            f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
        )
    return num_replicas, rank
