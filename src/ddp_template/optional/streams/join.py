"""``data.uneven=join``: every rank of a stream trains on all of its data, under torch's ``Join``.

A rank whose stream has ended *joins*: it waits in the exit of ``Join([ddp, shadow])`` and,
for every step the others still run, shadows their collectives in the order they issue them
(a group's collectives must meet in the same order on every rank):

1. DDP's join hook: the forward's notify (Join's own all-reduce of how many ranks still have
   data: this mode's per-step agreement), the buffer broadcast, one all-reduce per gradient
   bucket, the joined rank adding zeros;
2. :class:`StepShadow`'s: the spike rule's all-reduce of the step's loss (``spike``), then the
   step hook itself, run on the joined rank for each step it shadows
   (counted from its own last step, one per DDP forward, hence ``optim.accumulate=1``), so
   whatever the hook issues — the EMA's buffer broadcast, the preemption agreement every
   ``checkpoint.preempt_check_every`` steps (with the joined rank's own signal flag) — meets
   its partners at the same step number. A signal during the tail thus stops every rank at
   one agreed step; the checkpoint of that stop is written after ``Join`` (``train.fit``),
   once the joined ranks have caught up.

When every rank has joined, DDP broadcasts the last joiner's weights and buffers, and
:class:`StepShadow` the rest of what a joined rank let go stale — the optimizer's state, the LR
schedule, the GradScaler, the switches (the EMA) — so every rank leaves the epoch as one.

Gradient scale in the tail: DDP's ``divide_by_initial_world_size=True`` (its default, kept)
divides each bucket's sum by the launch's world size W. A tail step where W' < W ranks still
have data therefore moves the weights by W'/W of a full step at the same learning rate, and
each of its samples weighs 1/(W x batch_size), as in every other step. ``False`` would divide
by W' (a tail step as if trained at W' ranks: its samples weighing W/W' more).

Not shadowed, so refused (:func:`check_join`, from ``Streamed.check``): SyncBatchNorm's
all-reduce in every forward, ``optim.accumulate > 1`` (several forwards a step would miscount
the steps shadowed), ``parallel=fsdp2`` (its all-gathers in every forward) and
``fault_tolerance=live`` (it cannot regroup inside Join).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ddp_template.config.schema import Config
from ddp_template.distributed import DistInfo
from ddp_template.errors import require


@dataclass(kw_only=True)
class Joined:
    """``Trainer.feed`` under ``data.uneven=join``: each rank's whole stream, its end shadowed."""

    info: DistInfo
    workers: int = 1
    # A joined rank's optimizer is stale until Join's end: a stop's checkpoint waits for it.
    saves_stop_at_end: ClassVar[bool] = True
    switches: dict[str, Any] = field(default_factory=dict)  # stale on a joined rank: caught up
    unread: list[tuple[int, list[str]]] = field(default_factory=list)  # per worker: none

    def micro_batches(self, tr: Any, position: int) -> Iterator[tuple[tuple, float, bool]]:
        """Every batch of this rank's stream as ``((x, y, keys, worker), 1.0, True)`` (one a
        step), up to ``max_steps_per_epoch`` (and the run's ``max_steps``)."""
        self.unread = [(0, []) for _ in range(self.workers)]
        loader, steps = tr.loader, tr.steps
        it, k, cap = iter(loader), steps.steps_done(position), steps.cap
        while cap is None or k < cap:
            batch = next(it, None)
            if batch is None:
                return
            (x, y, _), keys, worker, _names = batch
            k += 1
            yield (x, y, keys, worker), 1.0, True

    def tail(
        self, trainer: Any, state: Any, on_step: Callable[[Any], bool]
    ) -> AbstractContextManager[StepShadow | None]:
        """What the epoch's loop runs inside: ``Join`` over DDP and the step hook (one rank:
        nothing to shadow)."""
        if trainer.ddp is None:
            return nullcontext()
        held = {
            "optimizer": trainer.optimizer,
            "scheduler": trainer.scheduler,
            "scaler": trainer.scaler,
            **self.switches,
        }
        shadow = StepShadow(trainer=trainer, state=state, on_step=on_step, held=held)
        return _joined(trainer.ddp, shadow)


def check_join(cfg: Config) -> None:
    """What ``data.uneven=join`` cannot shadow: torch's ``Join`` matches DDP's own collectives
    and the step hook's, once per step (the config in force: after a resize, its accumulate)."""
    require(
        not cfg.syncbn.enabled,
        "syncbn.enabled=true cannot run with data.uneven=join (SyncBatchNorm all-reduces in "
        "every forward, which torch's Join does not shadow: a rank whose stream ended would hang "
        "the others); set syncbn=off or data.uneven=stop.",
    )
    acc = cfg.optim.accumulate
    require(
        acc == 1,
        f"optim.accumulate={acc} cannot run with data.uneven=join (a joined rank shadows one "
        f"forward per optimizer step, and {acc} micro-batches a step would miscount the steps "
        f"it shadows); set optim.accumulate=1 or data.uneven=stop.",
    )
    require(
        str(cfg.parallel.name) != "fsdp2",
        "data.uneven=join cannot run with parallel=fsdp2 (torch's Join shadows DDP's "
        "all-reduce, not FSDP2's all-gathers in every forward); set data.uneven=stop or "
        "parallel=ddp.",
    )
    require(
        str(cfg.fault_tolerance.mode) != "live",
        "fault_tolerance=live cannot regroup inside torch's Join (data.uneven=join); use "
        "data.uneven=stop, or fault_tolerance=off.",
    )


@contextmanager
def _joined(ddp: Any, shadow: StepShadow) -> Iterator[StepShadow]:
    with Join([ddp, shadow], divide_by_initial_world_size=True):
        yield shadow


class StepShadow(Joinable):
    """The step hook as a ``Joinable``: on a joined rank, run for every step it shadows; at the
    end, the last joiner's training state broadcast to the ranks that joined early."""

    def __init__(
        self,
        *,
        trainer: Any,
        state: Any,
        on_step: Callable[[Any], bool],
        held: dict[str, Any],
    ) -> None:
        super().__init__()
        self.trainer, self.state, self.on_step, self.held = trainer, state, on_step, held
        self.stopped = False  # the step hook asked to stop at a shadowed step

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _ShadowHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.trainer.ddp.device

    @property
    def join_process_group(self) -> Any:
        return self.trainer.ddp.process_group  # Join wants one group for all its joinables

    def step(self) -> None:
        """The step the others just ran (its DDP collectives already shadowed)."""
        s = self.state
        if self.trainer.spikes is not None:  # the spike rule's all-reduce of the step's loss
            self.trainer.spikes.shadow(s.step + 1, s.epoch)
        s.position = self.trainer.steps.next_boundary(s.position)
        s.step += 1
        self.stopped |= bool(self.on_step(s))

    def catch_up(self, is_last_joiner: bool) -> None:
        """The last joiner's state on the ranks that joined early (after DDP's weights)."""
        group, rank = self.join_process_group, dist.get_rank()
        votes = torch.tensor(
            [rank if is_last_joiner else -1, int(not is_last_joiner)], device=self.join_device
        )
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
        src, anyone_early = int(votes[0]), bool(votes[1])
        if not anyone_early:  # every rank ran every step: nothing went stale
            return
        box = [self._state() if rank == src else None]
        dist.broadcast_object_list(box, src=src, group=group)
        if is_last_joiner:  # it ran every step itself
            return
        theirs = box[0]
        assert theirs is not None  # rank src's state, broadcast
        if theirs["step"] != self.state.step:
            raise RuntimeError(
                f"rank {rank} shadowed up to step {self.state.step} but rank {src} ended at "
                f"step {theirs['step']}: a step of the tail was not shadowed once"
            )
        for name, part in self.held.items():  # the optimizer before its LR schedule
            part.load_state_dict(theirs["parts"][name])

    def _state(self) -> dict[str, Any]:
        parts = {name: _on_cpu(part.state_dict()) for name, part in self.held.items()}
        return {"step": self.state.step, "parts": parts}


class _ShadowHook(JoinHook):
    def __init__(self, shadow: StepShadow) -> None:
        self.shadow = shadow

    def main_hook(self) -> None:
        self.shadow.step()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.shadow.catch_up(is_last_joiner)


def _on_cpu(obj: Any) -> Any:
    """``obj`` with its tensors on the CPU, in new containers (a state_dict holds live ones):
    pickled CUDA tensors would land on the sender's GPU index."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        out: Any = type(obj)((k, _on_cpu(v)) for k, v in obj.items())  # an OrderedDict too
        if hasattr(obj, "_metadata"):  # a module's state_dict: its version numbers
            out._metadata = obj._metadata
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_on_cpu(v) for v in obj)
    return obj
