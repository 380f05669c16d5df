"""This rank's random number generators (torch, CUDA, Python, numpy) as a checkpoint part.

The states are plain bytes and ints: they travel through ``all_gather_object`` to rank 0 and
load under ``weights_only=True``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class RngState:
    def state_dict(self) -> dict[str, Any]:
        np_state = np.random.get_state(legacy=True)  # the default, said: the tuple
        assert isinstance(np_state, tuple)  # (a dict only for a bit generator not MT19937)
        py_version, py_state, _ = random.getstate()
        state = {
            "torch": torch.get_rng_state().numpy().tobytes(),
            "python": list(py_state),
            "python_version": py_version,
            "numpy": np_state[1].tobytes(),
            "numpy_pos": int(np_state[2]),
        }
        # is_initialized, not is_available: a gloo rank on a GPU host must not create a CUDA
        # context.
        if torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
        return state

    def load_resized(self, saved: list[dict[str, Any]], *, world_size: int) -> None:
        """At another world size no rank continues an old rank's streams: this rank keeps the
        ones it started with, as a fresh rank would."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(_bytes_tensor(state["torch"]))
        random.setstate((state["python_version"], tuple(state["python"]), None))
        np_keys = np.frombuffer(state["numpy"], dtype=np.uint32).copy()
        np.random.set_state(("MT19937", np_keys, state["numpy_pos"], 0, 0.0))
        if "cuda" in state and torch.cuda.is_initialized():
            torch.cuda.set_rng_state(_bytes_tensor(state["cuda"]))
