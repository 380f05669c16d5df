"""What a rank's death does: the ``fault_tolerance`` builder.

Its ``run`` drives the run's memberships (``train.train``'s build → fit part).
``fault_tolerance=off`` (the default) is the restart path: a failed collective ends the
process, the launcher ends the group, and a restart resumes from the last checkpoint at any
world size (``elastic``). ``fault_tolerance=live`` survives it in place: the optional folder
``ddp_template.optional.live`` (named here by string, imported only when chosen) regroups the
survivors and hands them the state of the one furthest on, as an in-memory checkpoint of the old
world size, which the elastic-resume path continues exactly like a checkpoint from disk.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar

import torch

from ddp_template import distributed
from ddp_template.checkpoint import Found
from ddp_template.config.schema import BackendConfig, FaultToleranceConfig
from ddp_template.distributed import DistInfo
from ddp_template.registry import load

log = logging.getLogger(__name__)

# mode -> "module:builder"; the builder takes (FaultToleranceConfig, BackendConfig).
TOLERANCE = {"live": "ddp_template.optional.live.membership:build_live"}
SUPERVISOR = "ddp_template.optional.live.supervisor:supervise"  # the live launcher (launch.py)


class Start(NamedTuple):
    info: DistInfo
    found: Found | None  # a replacement's state, handed over by the survivors it joined


class Held(NamedTuple):
    """What a survivor held when its group broke: the run's parts, as a checkpoint names them."""

    ckpt: Any  # checkpoint.Checkpointer
    state: Any  # engine.TrainState
    trainer: Any  # engine.Trainer


class Membership(Protocol):
    """One membership's run as the seam drives it (``train.Session``)."""

    def fit(self) -> Any:
        """Train to the end (raises where the group breaks)."""

    def held(self) -> Held:
        """What this rank holds when its group broke."""


M = TypeVar("M", bound=Membership)
Begin = Callable[[DistInfo, Found | None, bool], M]  # (info, found, regroup): a membership's


class Tolerance(Protocol):
    def setup(self) -> Start:
        """Join the process group (a replacement: once admitted, with the state handed over)."""

    def boundary(self, step: int) -> None:
        """After every optimizer step on every rank; raises to regroup (a replacement waits)."""

    def run(self, begin: Begin[M], info: DistInfo, found: Found | None, regroup: bool) -> M:
        """The run's memberships, each begun by ``begin`` and fitted (off: one; live: one per
        regroup, each continuing from the state the last handed over); the last, fitted."""


class Restart:
    """``fault_tolerance=off``: nothing is survived in place; the launcher restarts."""

    def __init__(self, backend: BackendConfig) -> None:
        self.backend = backend

    def setup(self) -> Start:
        return Start(distributed.setup(self.backend), None)

    def boundary(self, step: int) -> None:
        return None

    def run(self, begin: Begin[M], info: DistInfo, found: Found | None, regroup: bool) -> M:
        """One membership: a failure ends the process, and the launcher's restart resumes."""
        membership = begin(info, found, regroup)
        membership.fit()
        return membership


def reconfigurable() -> str | None:
    """Why this torch cannot regroup a gloo process group in place, or None if it can."""
    dist = torch.distributed
    missing = [
        name
        for name in ("_reconfigure", "_get_reconfigure_handle", "_supports_reconfigure")
        if not hasattr(dist, name)
    ]
    if missing:
        return f"torch {torch.__version__} has no torch.distributed.{missing[0]}"
    return None


def fallback_line(why: str) -> str:
    return (
        f"fault_tolerance=live is unavailable ({why}: no reconfigurable gloo process group); "
        f"this run uses the restart path: a lost rank ends the group and dist.max_restarts "
        f"resumes it from the last checkpoint."
    )


def build_tolerance(cfg: FaultToleranceConfig, backend: BackendConfig) -> Tolerance:
    """The ``fault_tolerance`` group's builder (in each rank)."""
    if cfg.mode == "off" or not live_launch():
        return Restart(backend)
    key = f"fault_tolerance={cfg.mode}"
    return load(TOLERANCE[str(cfg.mode)], key=key, fix="set fault_tolerance=off.")(cfg, backend)


LIVE_VAR = "DDP_TEMPLATE_LIVE"  # set by the live launcher for its ranks
INCARNATION_VAR = (
    "DDP_TEMPLATE_INCARNATION"  # a live slot's process: 0 first, k the k-th replacement
)
MEMBERSHIP_VAR = "DDP_TEMPLATE_MEMBERSHIP"  # the live membership a process trains in (0 first)


def live_launch() -> bool:
    """Whether this rank was started by the live launcher (else it has no store to regroup by:
    the launcher fell back to the restart path)."""
    return os.environ.get(LIVE_VAR) == "1"
