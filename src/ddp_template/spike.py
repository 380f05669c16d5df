"""Spike forensics: a step whose loss, gradient or input jumps names its samples as it happens.

The rule (``spike``), on every rank, about its own part of the step, for each signal it
watches (``spike.watch``): the signal above ``factor`` x the median of its last ``window``
steps, once ``after`` steps are in the window (the input's: one); a NaN or infinite one
always. The signals:
``loss``, the rank's loss over its samples of the step; ``grad_norm``, the norm of the step's
gradient as the optimizer is about to apply it (DDP has averaged it over the ranks: every rank
sees the same norm; FSDP2: the rank's slice); ``input``, the largest RMS of one sample's input
(its floating tensors) among the rank's samples of the step: what a poisoned sample moves when
BatchNorm, normalising the batch in train mode, hides it from the loss. No collective and one
read on the host a step (the signals stacked: on CUDA it waits for the step's backward, as the
loss's read always did): a poisoned sample lifts the loss of the rank that read it W times more
than the loss over every rank. A rank whose rule fires records its samples of the step with
their losses and input RMS, highest first by the signal that fired (the loss where it did; the
input where it did; else the loss) (``SpikeReport``), which the metrics sink writes to
``rank<r>/spikes.jsonl``, the console and W&B (``spikes/samples``). The per-sample losses are
the step's own: its micro-batches run again as training ran them (train mode, each from its
RNG state, the weights before the update; no gradient, the running statistics put back), which
is what ``replay --step S --losses <checkpoint of step S-1>`` reproduces from the run
directory; ``replay --step S --inputs`` gives each sample's input RMS.

With ``spike.skip`` the ranks agree on every step (one all-reduce of the ranks' verdicts a step,
before the optimizer steps; a stream's joined ranks shadow it, ``streams.join``): when any rank's
rule fires, every rank records its samples, gathered into one report of the whole step (so do
they with ``syncbn=on`` or ``parallel=fsdp2``, whose forward is itself a collective: a step
re-runs on every rank or on none), and the step's update is skipped (its gradients dropped,
the running statistics its forwards moved put back, the LR schedule still advancing). The
samples were read, so the
ledger counts them, and the epoch's verdict names them as skipped by the rule.

Each rank's windows are a per-rank checkpoint part, so a resumed run judges every later step as
the uninterrupted run does (at another world size each new rank's window starts empty).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ddp_template.amp import autocast
from ddp_template.config.loop import SpikeConfig
from ddp_template.data.contract import batch_len
from ddp_template.distributed import DistInfo, all_reduce_sum, gather_objects
from ddp_template.task import Task

SIGNALS = ("loss", "grad_norm", "input")  # what the rule can watch (spike.watch)


@dataclass(frozen=True)
class SpikeSample:
    rank: int
    index: int
    loss: float
    input: float = math.nan  # the RMS of its input (its floating tensors)


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
    signals: tuple[str, ...] = ("loss",)  # which of this rank's signals fired
    # every watched signal of this rank's step: its value and its window's median
    measured: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def by(self) -> str:
        """What the samples are ranked by: the loss, or each sample's input RMS where the
        input fired and the loss did not."""
        return "input" if "input" in self.signals and "loss" not in self.signals else "loss"

    def line(self, top: int) -> str:
        by = self.by
        named = ", ".join(
            f"index {s.index} (rank {s.rank}, loss {s.loss:.4g}"
            + (f", input RMS {s.input:.4g})" if math.isfinite(s.input) else ")")
            for s in self.samples[:top]
        )
        action = "; its update skipped" if self.skipped else ""
        if not self.fired:
            judged = f"another rank's rule fired (its own loss {self.loss:.4g})"
        else:
            judged = "; ".join(self._judged(signal) for signal in self.signals)
        highest = "per-sample losses" if by == "loss" else "per-sample input RMS"
        return (
            f"spike at step {self.step} (epoch {self.epoch}), rank {self.rank}: {judged}"
            f"{action}; highest {highest}: {named or 'none'}"
        )

    def _judged(self, signal: str) -> str:
        value, median = self.measured.get(signal, (self.loss, self.median))
        name = {"loss": "loss", "grad_norm": "gradient norm", "input": "input RMS"}[signal]
        if not math.isfinite(value):
            return f"{name} {value} (not finite)"
        return f"{name} {value:.4g} > {self.factor:g} x median {median:.4g} of its last steps"

    def own(self) -> dict[str, Any]:
        """The recording rank's JSONL record: the step, which signals fired (each watched
        signal's value and median) and its own samples, highest first."""
        mine = [
            {"index": s.index, "loss": s.loss}
            | ({"input": s.input} if math.isfinite(s.input) else {})
            for s in self.samples
            if s.rank == self.rank
        ]
        keys = ("step", "epoch", "loss", "median", "fired", "skipped")
        return (
            {k: getattr(self, k) for k in keys}
            | {"signals": list(self.signals), "by": self.by}
            | {"measured": {k: {"value": v, "median": m} for k, (v, m) in self.measured.items()}}
            | {"samples": mine}
        )


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


def input_rms(x: Any) -> torch.Tensor | None:
    """Each sample's RMS over the floating tensors of a micro-batch's input (float32, on their
    device, asynchronously); None where the input holds none (token ids)."""
    leaves = [
        t
        for t in tree_leaves(x)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0
    ]
    if not leaves:
        return None
    n = leaves[0].shape[0]
    same = [t.detach() for t in leaves if t.shape[0] == n]
    if n == 0:
        return torch.zeros(0, device=same[0].device)
    squares = sum(t.float().reshape(n, -1).square().sum(dim=1) for t in same)
    size = sum(t.numel() // n for t in same)
    return (torch.as_tensor(squares) / max(size, 1)).sqrt()


def largest_rms(x: Any) -> torch.Tensor | None:
    """The largest RMS of one sample's input in a micro-batch (0-dim, float32, on the device,
    not read): one norm per sample and a max for a plain floating tensor; ``input_rms`` for
    nested inputs. None where it holds no floating tensor or no sample."""
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() > 0:
        if not x.shape[0] or not x.numel():
            return None
        flat = x.detach().reshape(x.shape[0], -1)
        norms = torch.linalg.vector_norm(flat, dim=1, dtype=torch.float32)
        return norms.max() / math.sqrt(flat.shape[1])
    rms = input_rms(x)
    return rms.max() if rms is not None and rms.numel() else None


def grad_norm(
    module: nn.Module, scaler: Any = None, params: list[nn.Parameter] | None = None
) -> torch.Tensor | None:
    """The norm of the gradient the optimizer is about to apply (0-dim, float32, on the device,
    not read): the module's gradients as they stand (DDP: averaged over the ranks; FSDP2: this
    rank's slice), divided by the GradScaler's scale where one is on. None where nothing has a
    gradient. ``params``: the module's parameters, listed once (walking the module each step
    costs more than the norm)."""
    params = list(module.parameters()) if params is None else params
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    # FSDP2's DTensor slices: their local parts
    local = [
        g if type(g) is torch.Tensor else getattr(g, "to_local", lambda g=g: g)() for g in grads
    ]
    first = local[0]
    if all(g.dtype == first.dtype and g.device == first.device for g in local):
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(local))).float()
    else:  # mixed devices or dtypes
        norm = torch.nn.utils.get_total_norm(local).float()
    if scaler is not None and scaler.is_enabled():  # its scale as a tensor: no wait
        norm = norm / scaler.scale(torch.ones((), device=norm.device))
    return norm


@dataclass(kw_only=True)
class Spikes:
    """This rank's rule: a window per signal and this step's micro-batches; a per-rank
    checkpoint part (``spike``)."""

    cfg: SpikeConfig
    task: Task
    info: DistInfo
    amp_mode: str
    # Every rank judges each step with the others (one all-reduce of the verdicts): to skip an
    # update all or none, and where the model's forward is itself a collective (SyncBN), so a
    # spike's step re-runs on every rank or on none.
    together: bool = False
    # this rank's last steps' values of each signal: its loss (always kept: the reports' median)
    # and each other watched signal
    windows: dict[str, deque[float]] = field(default_factory=dict)
    pending: list[SpikeReport] = field(default_factory=list)  # for the metrics sink
    skips: list[tuple[int, int, list[int]]] = field(default_factory=list)  # epoch, step, idx
    own: int = 0  # this rank's samples of the step judged last
    _held: list[Held] = field(default_factory=list)
    _losses: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # this step's
    _inputs: list[torch.Tensor] = field(default_factory=list)  # this step's per-sample RMS
    _buffers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _params: tuple[nn.Module, list[nn.Parameter]] | None = None  # the judged module's

    def __post_init__(self) -> None:
        for signal in ("loss", *self.cfg.watch):
            self.windows.setdefault(str(signal), deque())

    @property
    def recent(self) -> deque[float]:
        """This rank's last steps' losses."""
        return self.windows["loss"]

    def hold(self, x: Any, y: Any, idx: Any, module: nn.Module) -> None:
        """A micro-batch of the coming step, before its forward: kept by reference, with the
        RNG state its forward starts from, until the step is judged; with ``input`` watched,
        each sample's input RMS (on the device). With ``spike.skip`` the module's buffers
        (running statistics) as the step found them, to put back if its update is skipped."""
        if self.cfg.skip and not self._held:
            self._buffers = [(b, b.detach().clone()) for b in module.buffers()]
        self._held.append((x, y, idx, rng_state()))
        if "input" in self.cfg.watch:
            largest = largest_rms(x)
            if largest is not None:
                self._inputs.append(largest)

    def count(self, loss: torch.Tensor, n: int) -> None:
        """The micro-batch's loss (its mean over ``n`` samples), read when the step is judged."""
        self._losses.append((loss.detach(), n))

    def judge(self, module: nn.Module, step: int, epoch: int, scaler: Any = None) -> bool:
        """This rank's signals of step ``step`` against its rule (``scaler``: the GradScaler
        the gradients are scaled by); with ``spike.skip`` the ranks' verdicts all-reduced (a
        collective). A spike is recorded. True: skip the update."""
        held, self._held = self._held, []
        losses, self._losses = self._losses, []
        inputs, self._inputs = self._inputs, []
        buffers, self._buffers = self._buffers, []
        self.own = sum(len(batch[2]) for batch in held)
        values = self._read(module, losses, inputs, scaler)
        fired_on = tuple(str(s) for s in self.cfg.watch if s in values and self._breaks(s, values))
        fired = bool(fired_on)
        agreed = fired
        if self.together:  # one verdict for the step, on every rank
            votes = torch.tensor([float(fired)], device=self.info.device)
            agreed = bool(all_reduce_sum(votes, self.info).item())
        if agreed:
            measured = {k: (v, self._median(k)) for k, v in values.items()}
            self._record(module, held, step, epoch, measured, fired_on)
            if self.cfg.skip:  # the step's forwards moved the running statistics: undone
                for live, saved in buffers:
                    live.copy_(saved)
        for signal, value in values.items():  # a NaN or infinite value is never the reference
            window = self.windows[signal]
            if math.isfinite(value):
                window.append(value)
            while len(window) > self.cfg.window:
                window.popleft()
        return agreed and self.cfg.skip

    def _read(
        self,
        module: nn.Module,
        losses: list[tuple[torch.Tensor, int]],
        inputs: list[torch.Tensor],
        scaler: Any,
    ) -> dict[str, float]:
        """The step's signals, read on the host at once (one wait for the device); none where
        this rank had no samples."""
        count = sum(n for _, n in losses)
        if not count:
            return {}
        parts = [loss.float() for loss, _ in losses]
        norm = None
        if "grad_norm" in self.cfg.watch:
            if self._params is None or self._params[0] is not module:  # listed once
                self._params = (module, list(module.parameters()))
            norm = grad_norm(module, scaler, self._params[1])
        extras = [("grad_norm", norm)] if norm is not None else []
        host = torch.stack([*parts, *(v for _, v in extras), *inputs]).tolist()
        each, rest = host[: len(losses)], host[len(losses) :]
        loss = sum(v * n for v, (_, n) in zip(each, losses, strict=True) if n) / count
        values = {"loss": loss} | {name: rest[k] for k, (name, _) in enumerate(extras)}
        if inputs:
            values["input"] = max(rest[len(extras) :])
        return values

    def _breaks(self, signal: str, values: dict[str, float]) -> bool:
        """Whether ``signal``'s value breaks the rule: above ``factor`` x its window's median
        (once ``after`` steps are in it: the first steps' loss and gradient are noisy; the
        input's from the second step on), or not finite."""
        value = values[signal]
        if not math.isfinite(value):
            return True
        factor = self.cfg.factor
        assert factor is not None  # build_spikes builds none with spike.factor=null
        window = self.windows[signal]
        after = 1 if signal == "input" else self.cfg.after  # training does not move the data
        return len(window) >= after and value > factor * statistics.median(window)

    def shadow(self, step: int, epoch: int) -> None:
        """A rank whose stream ended (under torch's Join) meets the others' collectives of the
        step (judged together: the verdicts, and a spike's gather) with no samples of its own."""
        self._held, self._losses, self._inputs, self._buffers = [], [], [], []
        if self.together:
            self.judge(nn.Identity(), step, epoch)

    def _median(self, signal: str) -> float:
        window = self.windows[signal]
        return statistics.median(window) if window else math.nan

    @property
    def median(self) -> float:
        return self._median("loss")

    def _record(
        self,
        module: nn.Module,
        held: list[Held],
        step: int,
        epoch: int,
        measured: dict[str, tuple[float, float]],
        signals: tuple[str, ...],
    ) -> None:
        indices, losses = sample_losses(module, self.task, held, self.amp_mode, self.info.device)
        inputs = held_rms(held, len(indices))
        mine = (indices.tolist(), losses.tolist(), inputs.tolist())
        ranks = gather_objects(mine, self.info) if self.together else None  # the whole step
        rows = enumerate(ranks) if ranks is not None else [(self.info.rank, mine)]
        samples = [
            SpikeSample(rank=r, index=int(i), loss=float(v), input=float(u))
            for r, (idx, vals, ins) in rows
            for i, v, u in zip(idx, vals, ins, strict=True)
        ]
        report = SpikeReport(
            step=step,
            epoch=epoch,
            rank=self.info.rank,
            loss=measured.get("loss", (0.0, math.nan))[0],
            median=self.median,
            factor=float(self.cfg.factor or math.nan),  # never None here: judge fired
            fired=bool(signals),
            skipped=self.cfg.skip,
            samples=(),
            signals=signals,
            measured=measured,
        )
        by = report.by
        samples.sort(key=lambda s: _highest(getattr(s, by)))
        self.pending.append(replace(report, samples=tuple(samples)))
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
        others = {k: list(w) for k, w in self.windows.items() if k != "loss"}
        return {"recent": list(self.recent), "windows": others} | {
            "skips": [list(s) for s in self.skips]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's windows (one written before the rule watched more than the loss: the
        other signals' windows start empty)."""
        saved = {"loss": state["recent"], **state.get("windows", {})}
        for signal, window in self.windows.items():
            window.clear()
            window.extend(float(v) for v in saved.get(signal, ()))
        self.skips = [(int(e), int(s), list(i)) for e, s, i in state["skips"]]

    def load_resized(self, saved: list[dict[str, Any]], *, world_size: int) -> None:
        """At another world size no rank continues an old rank's window: each starts empty
        (the rule judges again after ``spike.after`` steps); the skipped steps' notes, the same
        on every old rank, carry on."""
        for window in self.windows.values():
            window.clear()
        self.skips = [(int(e), int(s), list(i)) for e, s, i in saved[0]["skips"]]

    def start_fresh(self) -> str:
        return "the spike rule's window starts empty"


def held_rms(held: list[Held], n: int) -> np.ndarray:
    """The per-sample input RMS of a step's non-empty micro-batches, in order (NaN where an
    input holds no floating tensor)."""
    parts = []
    for x, y, _, _ in held:
        if batch_len(y):
            rms = input_rms(x)
            parts.append(rms.cpu().numpy() if rms is not None else np.full(batch_len(y), np.nan))
    out = np.concatenate(parts).astype(np.float64) if parts else np.zeros(0)
    return out if len(out) == n else np.full(n, np.nan)


def _highest(value: float) -> tuple[bool, float]:
    """A sort key, highest first, a NaN before everything (a NaN loss is the culprit)."""
    return (not math.isnan(value), -value)


def build_spikes(
    cfg: SpikeConfig, task: Task, info: DistInfo, amp_mode: str, *, collective: bool
) -> Spikes | None:
    """The ``spike`` group's builder: None with ``spike.factor=null``; the ranks judge together
    with ``spike.skip``, or where the forward is a ``collective`` (SyncBN, FSDP2)."""
    if not cfg.on:
        return None
    together = info.distributed and (cfg.skip or collective)
    return Spikes(cfg=cfg, task=task, info=info, amp_mode=amp_mode, together=together)
