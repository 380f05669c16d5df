"""Fault injection (``fault.*``): testing aids for resume, preemption and elastic restarts.

Off by default. ``fault.crash_at_step=K fault.rank=R`` makes rank R raise after optimizer step
K; with ``fault.signal=SIGTERM`` (or SIGUSR1, SIGKILL…) it sends itself that signal instead, or
with ``fault.scope=process_group`` sends it to its whole process group, as a terminal's Ctrl-C
does (the launcher, every rank on this node and their loader workers), or with
``fault.scope=node`` to the launcher that started it as well (torchrun's agent: a lost node).
``fault.hold=true`` makes the rank stop after step K until a signal comes instead, as a rank
still busy when torchrun's membership changes (its agent's SIGTERM then stops the run there,
checkpointed, like any preemption); ``fault.spin=true`` makes it spin in a Python loop for
good, its threads alive (a rank stuck outside any collective). ``fault.attempt`` limits it to
one elastic restart attempt, so the restarted group can finish (under
``fault_tolerance=live``: to one membership).
"""

from __future__ import annotations

import os
import signal
from typing import Any

from ddp_template.config.schema import FaultConfig
from ddp_template.tolerance import MEMBERSHIP_VAR


def _attempt() -> int:
    """The elastic restart attempt, or under ``fault_tolerance=live`` the membership (each
    regroup is the live counterpart of a restart: a fault strikes in one membership only)."""
    live = os.environ.get(MEMBERSHIP_VAR)
    return int(live if live is not None else os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _due(fault: FaultConfig, step: int, rank: int) -> bool:
    """Step ``step`` of ``rank`` is where the fault strikes (first or again), on its attempt."""
    if fault.crash_at_step is None or rank != fault.rank:
        return False
    if step == fault.again_at_step:
        return True
    return step == fault.crash_at_step and _attempt() == fault.attempt


def maybe_fire(fault: FaultConfig, step: int, rank: int, phase: str = "step") -> None:
    """Called on every rank after every optimizer step (``phase`` step), as an evaluation
    starts and as a checkpoint starts (at the step it follows)."""
    if fault.phase == phase and _due(fault, step, rank):
        _strike(fault, step, rank)


def _strike(fault: FaultConfig, step: int, rank: int) -> None:
    if fault.spin:
        while True:  # stuck: its threads (a live heartbeat) go on
            sum(range(1000))
    if fault.hold:
        signal.pause()  # returns once a handler has run (preemption's: the stop is agreed next)
        return
    if fault.signal is not None:
        sig = getattr(signal, str(fault.signal))
        if fault.scope == "node":
            os.kill(os.getppid(), sig)
        if fault.scope == "rank":
            os.kill(os.getpid(), sig)
        else:
            os.killpg(os.getpgid(0), sig)
        return
    raise RuntimeError(f"fault injected: rank {rank} crashes after step {step}")


def arm(fault: FaultConfig, trainer: Any, state: Any) -> None:
    """``fault.phase=allreduce``: the fault strikes inside step ``crash_at_step``'s gradient
    all-reduce on ``fault.rank``, once its own all-reduce is under way (a DDP communication
    hook: the default all-reduce, then the fault)."""
    if fault.phase != "allreduce" or fault.crash_at_step is None or trainer.ddp is None:
        return
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(process_group, bucket):  # unannotated: DDP checks a hook's annotations
        future = allreduce_hook(process_group, bucket)
        if _due(fault, state.step + 1, trainer.info.rank):
            _strike(fault, state.step + 1, trainer.info.rank)
        return future

    trainer.ddp.register_comm_hook(None, hook)
