"""Spike forensics: a step whose loss jumps names its samples, with their losses, as it happens.

The rule (``spike``), on every rank, about its own part of the step: the rank's loss over its
samples of the step above ``factor`` x the median of its last ``window`` steps, once ``after``
steps are in the window; a NaN or infinite loss always. No collective: a poisoned sample lifts
the loss of the rank that read it W times more than the loss over every rank, and each rank
reads its loss on the host anyway (CPU; on CUDA the read waits for the step's backward). A rank
whose rule fires records its samples of the step with their losses, highest first
(``SpikeReport``), which the metrics sink writes to ``rank<r>/spikes.jsonl``, the console and
W&B (``spikes/samples``). The per-sample losses are the step's own: its micro-batches run again
as training ran them (train mode, each from its RNG state, the weights before the update; no
gradient, the running statistics put back), which is what ``replay --step S --losses
<checkpoint of step S-1>`` reproduces from the run directory.

With ``spike.skip`` the ranks agree on every step (one all-reduce of the ranks' verdicts a step,
before the optimizer steps; a stream's joined ranks shadow it, ``streams.join``): when any rank's
rule fires, every rank records its samples, gathered into one report of the whole step (so do
they with ``syncbn=on`` or ``parallel=fsdp2``, whose forward is itself a collective: a step
re-runs on every rank or on none), and the step's update is skipped (its gradients dropped,
the running statistics its forwards moved put back, the LR schedule still advancing). The
samples were read, so the
ledger counts them, and the epoch's verdict names them as skipped by the rule.

Each rank's window is a per-rank checkpoint part, so a resumed run judges every later step as
the uninterrupted run does (at another world size each new rank's window starts empty).
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
    """One step that broke the rule, as one rank recorded it: its loss over that rank's
    samples, the rank's reference, and the samples (every rank's where the ranks agreed on
    skipping the step), the highest loss first."""

    step: int
    epoch: int
    rank: int  # who recorded it
    loss: float  # this rank's loss of the step
    median: float  # of this rank's window
    factor: float
    fired: bool  # this rank's own rule fired (spike.skip: else another rank's did)
    skipped: bool  # its update was skipped (spike.skip)
    samples: tuple[SpikeSample, ...]

    def line(self, top: int) -> str:
        named = ", ".join(
            f"index {s.index} (rank {s.rank}, loss {s.loss:.4g})" for s in self.samples[:top]
        )
        action = "; its update skipped" if self.skipped else ""
        if not self.fired:
            judged = f"another rank's rule fired (its own loss {self.loss:.4g})"
        elif not math.isfinite(self.loss):
            judged = f"loss {self.loss} (not finite)"
        else:
            judged = (
                f"loss {self.loss:.4g} > {self.factor:g} x median {self.median:.4g} of its "
                f"last steps"
            )
        return (
            f"spike at step {self.step} (epoch {self.epoch}), rank {self.rank}: {judged}"
            f"{action}; highest per-sample losses: {named or 'none'}"
        )

    def own(self) -> dict[str, Any]:
        """The recording rank's JSONL record: the step and its own samples, highest first."""
        mine = [{"index": s.index, "loss": s.loss} for s in self.samples if s.rank == self.rank]
        keys = ("step", "epoch", "loss", "median", "fired", "skipped")
        return {k: getattr(self, k) for k in keys} | {"samples": mine}


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
    """This rank's rule: its window and this step's micro-batches; a per-rank checkpoint part
    (``spike``)."""

    cfg: SpikeConfig
    task: Task
    info: DistInfo
    amp_mode: str
    # Every rank judges each step with the others (one all-reduce of the verdicts): to skip an
    # update all or none, and where the model's forward is itself a collective (SyncBN), so a
    # spike's step re-runs on every rank or on none.
    together: bool = False
    recent: deque[float] = field(default_factory=deque)  # this rank's last steps' losses
    pending: list[SpikeReport] = field(default_factory=list)  # for the metrics sink
    skips: list[tuple[int, int, list[int]]] = field(default_factory=list)  # epoch, step, idx
    own: int = 0  # this rank's samples of the step judged last
    _held: list[Held] = field(default_factory=list)
    _losses: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # this step's
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
        """The micro-batch's loss (its mean over ``n`` samples), read when the step is judged."""
        self._losses.append((loss.detach(), n))

    def judge(self, module: nn.Module, step: int, epoch: int) -> bool:
        """This rank's loss of step ``step`` against its rule; with ``spike.skip`` the ranks'
        verdicts all-reduced (a collective). A spike is recorded. True: skip the update."""
        total = sum(loss.item() * n for loss, n in self._losses if n)
        count = sum(n for _, n in self._losses)
        held, self._held, self._losses = self._held, [], []
        buffers, self._buffers = self._buffers, []
        self.own = sum(len(batch[2]) for batch in held)
        loss = total / count if count else 0.0
        finite = math.isfinite(loss)
        judged = len(self.recent) >= self.cfg.after
        factor = self.cfg.factor
        assert factor is not None  # build_spikes builds none with spike.factor=null
        fired = count > 0 and (not finite or (judged and loss > factor * self.median))
        agreed = fired
        if self.together:  # one verdict for the step, on every rank
            votes = torch.tensor([float(fired)], device=self.info.device)
            agreed = bool(all_reduce_sum(votes, self.info).item())
        if agreed:
            self._record(module, held, step, epoch, loss, fired)
            if self.cfg.skip:  # the step's forwards moved the running statistics: undone
                for live, saved in buffers:
                    live.copy_(saved)
        if count and finite:  # a NaN or infinite step is a spike, never the reference
            self.recent.append(loss)
        while len(self.recent) > self.cfg.window:
            self.recent.popleft()
        return agreed and self.cfg.skip

    def shadow(self, step: int, epoch: int) -> None:
        """A rank whose stream ended (under torch's Join) meets the others' collectives of the
        step (judged together: the verdicts, and a spike's gather) with no samples of its own."""
        self._held, self._losses, self._buffers = [], [], []
        if self.together:
            self.judge(nn.Identity(), step, epoch)

    @property
    def median(self) -> float:
        return statistics.median(self.recent) if self.recent else math.nan

    def _record(
        self, module: nn.Module, held: list[Held], step: int, epoch: int, loss: float, fired: bool
    ) -> None:
        indices, losses = sample_losses(module, self.task, held, self.amp_mode, self.info.device)
        mine = (indices.tolist(), losses.tolist())
        ranks = gather_objects(mine, self.info) if self.together else None  # the whole step
        rows = enumerate(ranks) if ranks is not None else [(self.info.rank, mine)]
        samples = [
            SpikeSample(rank=r, index=int(i), loss=float(v))
            for r, (idx, vals) in rows
            for i, v in zip(idx, vals, strict=True)
        ]
        samples.sort(key=lambda s: -s.loss)
        report = SpikeReport(
            step=step,
            epoch=epoch,
            rank=self.info.rank,
            loss=loss,
            median=self.median,
            factor=float(self.cfg.factor or math.nan),  # never None here: judge fired
            fired=fired,
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

    def load_resized(self, saved: list[dict[str, Any]], *, world_size: int) -> None:
        """At another world size no rank continues an old rank's window: each starts empty
        (the rule judges again after ``spike.after`` steps); the skipped steps' notes, the same
        on every old rank, carry on."""
        self.recent = deque()
        self.skips = [(int(e), int(s), list(i)) for e, s, i in saved[0]["skips"]]

    def start_fresh(self) -> str:
        return "the spike rule's window starts empty"


def build_spikes(
    cfg: SpikeConfig, task: Task, info: DistInfo, amp_mode: str, *, collective: bool
) -> Spikes | None:
    """The ``spike`` group's builder: None with ``spike.factor=null``; the ranks judge together
    with ``spike.skip``, or where the forward is a ``collective`` (SyncBN, FSDP2)."""
    if not cfg.on:
        return None
    together = info.distributed and (cfg.skip or collective)
    return Spikes(cfg=cfg, task=task, info=info, amp_mode=amp_mode, together=together)
