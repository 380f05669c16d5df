"""Spike forensics: a step whose loss jumps names its samples, with their losses, as it happens.

The rule (``spike``): the step's loss over every rank's samples (one all-reduce of two numbers a
step, before the optimizer steps) above ``factor`` x the median of the last ``window`` steps,
once ``after`` steps are in the window; a NaN or infinite loss always. A step that breaks it is
recorded on every rank: each rank's samples of the step with their losses, highest first,
gathered so every rank holds the whole step (``SpikeReport``), which the metrics sink writes to
``rank<r>/spikes.jsonl`` and to W&B (``spikes/samples``). The per-sample losses are the step's
own: its micro-batches run again as training ran them (train mode, each from its RNG state, the
weights before the update; no gradient, the running statistics put back), which is what
``replay --step S --losses <checkpoint of step S-1>`` reproduces from the run directory. With
``spike.skip`` the step's update is skipped (its gradients dropped, the running statistics its
forwards moved put back, the LR schedule still advancing); the samples were read, so the ledger
counts them, and the epoch's verdict names them as skipped by the rule.

The window is a checkpoint part (the same on every rank), so a resumed run judges every later
step as the uninterrupted run does.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ddp_template.amp import autocast
from ddp_template.config.loop import SpikeConfig
from ddp_template.data.contract import batch_len
from ddp_template.distributed import DistInfo, all_reduce_sum, gather_objects
from ddp_template.task import Task


@dataclass(frozen=True)
class SpikeSample:
    rank: int
    index: int
    loss: float


@dataclass(frozen=True)
class SpikeReport:
    """One step that broke the rule: its loss, the reference, and every rank's samples."""

    step: int
    epoch: int
    loss: float
    median: float
    factor: float
    skipped: bool  # its update was skipped (spike.skip)
    samples: tuple[SpikeSample, ...]  # every rank's, the highest loss first

    def line(self, top: int) -> str:
        named = ", ".join(
            f"index {s.index} (rank {s.rank}, loss {s.loss:.4g})" for s in self.samples[:top]
        )
        action = "; its update skipped" if self.skipped else ""
        return (
            f"spike at step {self.step} (epoch {self.epoch}): loss {self.loss:.4g} > "
            f"{self.factor:g} x median {self.median:.4g} of the last steps{action}; highest "
            f"per-sample losses: {named or 'none'}"
        )

    def own(self, rank: int) -> dict[str, Any]:
        """``rank``'s JSONL record: the step and its own samples, highest loss first."""
        mine = [{"index": s.index, "loss": s.loss} for s in self.samples if s.rank == rank]
        head = {k: getattr(self, k) for k in ("step", "epoch", "loss", "median", "skipped")}
        return head | {"samples": mine}


Held = tuple[Any, Any, Any, Any]  # a micro-batch (x, y, idx) and the RNG state before it


def rng_state() -> Any:
    """The generators a forward may draw from (dropout): torch's, and CUDA's where in use."""
    return (
        torch.get_rng_state(),
        torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
    )


def _set_rng(state: Any) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def sample_losses(
    module: nn.Module, task: Task, batches: list[Held], amp_mode: str, device: Any
) -> tuple[np.ndarray, np.ndarray]:
    """The indices and per-sample losses of a step's micro-batches, as its training forward
    computed them: train mode (a micro-batch's own BatchNorm statistics), each micro-batch from
    the RNG state it started from (its dropout), no gradient. The module's buffers (running
    statistics) and the RNG are put back after, so training goes on untouched. Every
    micro-batch runs, an empty one too (SyncBatchNorm's collectives meet on every rank)."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    before = rng_state()
    indices, losses = [], []
    try:
        with torch.no_grad(), autocast(amp_mode, device):
            for x, y, idx, rng in batches:
                if rng is not None:
                    _set_rng(rng)
                output = module(x)
                if batch_len(y):
                    losses.append(task.sample_losses(output, y).float().cpu().numpy())
                    indices.append(np.asarray(idx, dtype=np.int64))
    finally:
        for live, saved in buffers:
            live.copy_(saved)
        _set_rng(before)
    if not indices:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    return np.concatenate(indices), np.concatenate(losses)


@dataclass(kw_only=True)
class Spikes:
    """The rule's window and this step's micro-batches; a checkpoint part (``spike``)."""

    cfg: SpikeConfig
    task: Task
    info: DistInfo
    amp_mode: str
    recent: deque[float] = field(default_factory=deque)  # the last steps' losses
    pending: list[SpikeReport] = field(default_factory=list)  # for the metrics sink
    skips: list[tuple[int, int, list[int]]] = field(default_factory=list)  # epoch, step, idx
    own: int = 0  # this rank's samples of the step judged last
    _held: list[Held] = field(default_factory=list)
    _sums: torch.Tensor | None = None
    _buffers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def hold(self, x: Any, y: Any, idx: Any, module: nn.Module) -> None:
        """A micro-batch of the coming step, before its forward: kept by reference, with the
        RNG state its forward starts from, until the step is judged. With ``spike.skip`` the
        module's buffers (running statistics) as the step found them, to put back if its
        update is skipped."""
        if self.cfg.skip and not self._held:
            self._buffers = [(b, b.detach().clone()) for b in module.buffers()]
        self._held.append((x, y, idx, rng_state()))

    def count(self, loss: torch.Tensor, n: int) -> None:
        """The micro-batch's loss (its mean over ``n`` samples) into the step's sums."""
        if self._sums is None:
            self._sums = torch.zeros(2, dtype=torch.float64, device=self.info.device)
        self._sums[0] += loss.double() * n
        self._sums[1] += n

    def judge(self, module: nn.Module, step: int, epoch: int) -> bool:
        """Step ``step``'s loss over every rank (a collective) against the rule; a spike is
        recorded (another collective, on every rank alike). True: skip its update."""
        sums = self._sums if self._sums is not None else torch.zeros(2, dtype=torch.float64)
        total, count = all_reduce_sum(sums.to(self.info.device), self.info).tolist()
        held, self._held, self._sums = self._held, [], None
        buffers, self._buffers = self._buffers, []
        self.own = sum(len(batch[2]) for batch in held)
        if count == 0:
            return False
        loss = total / count
        finite = math.isfinite(loss)
        judged = len(self.recent) >= self.cfg.after
        fired = not finite or (judged and loss > self.cfg.factor * self.median)
        if fired:
            self._record(module, held, step, epoch, loss)
            if self.cfg.skip:  # the step's forwards moved the running statistics: undone
                for live, saved in buffers:
                    live.copy_(saved)
        if finite:  # a NaN or infinite step is a spike, never the reference
            self.recent.append(loss)
        while len(self.recent) > self.cfg.window:
            self.recent.popleft()
        return fired and self.cfg.skip

    def shadow(self, step: int, epoch: int) -> None:
        """A rank whose stream ended (``uneven=join``) meets the others' collectives of the
        step with no samples of its own."""
        self._held, self._sums, self._buffers = [], None, []
        self.judge(nn.Identity(), step, epoch)

    @property
    def median(self) -> float:
        return statistics.median(self.recent) if self.recent else math.nan

    def _record(
        self, module: nn.Module, held: list[Held], step: int, epoch: int, loss: float
    ) -> None:
        indices, losses = sample_losses(module, self.task, held, self.amp_mode, self.info.device)
        ranks = gather_objects((indices.tolist(), losses.tolist()), self.info)
        samples = [
            SpikeSample(rank=r, index=int(i), loss=float(v))
            for r, (idx, vals) in enumerate(ranks)
            for i, v in zip(idx, vals, strict=True)
        ]
        samples.sort(key=lambda s: -s.loss)
        report = SpikeReport(
            step=step,
            epoch=epoch,
            loss=loss,
            median=self.median,
            factor=float(self.cfg.factor),
            skipped=self.cfg.skip,
            samples=tuple(samples),
        )
        self.pending.append(report)
        if self.cfg.skip:
            self.skips.append((epoch, step, sorted(s.index for s in samples)))

    def take(self) -> list[SpikeReport]:
        """The reports since the last call (the step hook hands them to the metrics sink)."""
        out, self.pending = self.pending, []
        return out

    def notes(self, epoch: int) -> list[str]:
        """The verdict's notes of ``epoch``: each step whose update the rule skipped, with its
        samples (which the ledger counts as read)."""
        self.skips = [s for s in self.skips if s[0] >= epoch]
        return [
            f"step {step}: the update of {len(idx)} samples skipped by the spike rule "
            f"(indices {', '.join(map(str, idx[:20]))}{', …' if len(idx) > 20 else ''})"
            for e, step, idx in self.skips
            if e == epoch
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self.recent), "skips": [list(s) for s in self.skips]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent = deque(float(v) for v in state["recent"])
        self.skips = [(int(e), int(s), list(i)) for e, s, i in state["skips"]]

    def start_fresh(self) -> str:
        return "the spike rule's window starts empty"


def build_spikes(cfg: SpikeConfig, task: Task, info: DistInfo, amp_mode: str) -> Spikes | None:
    """The ``spike`` group's builder: None with ``spike.factor=null``."""
    return Spikes(cfg=cfg, task=task, info=info, amp_mode=amp_mode) if cfg.on else None
