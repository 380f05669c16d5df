"""Exact evaluation, and which split is evaluated when, of which weights, under which names.

``evaluate`` adds up the task's sums (``task.Task``) over unpadded shares and all-reduces them,
so a run on any number of ranks reports the single-process numbers. Where a forward is a
collective (``parallel=fsdp2`` all-gathers each unit's parameters), every rank runs as many
forwards as the rank with the most batches: the others' extra forwards are of empty batches,
their outputs dropped. ``Evaluation`` is the epoch
end's part of it: the validation split each epoch when there is one (else the test split), and
every ``eval_every_steps`` optimizer steps, the EMA copy beside the model, and once at the end
the split ``eval_split`` names (what summary.json reports).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from ddp_template.amp import autocast
from ddp_template.data.contract import empty_batch, to_device
from ddp_template.distributed import DistInfo, all_reduce_max, all_reduce_sum
from ddp_template.task import EvalResult, Task

log = logging.getLogger("ddp_template")


def sync_buffers(module: nn.Module, info: DistInfo) -> None:
    """Give every rank rank 0's buffers (BN running stats).

    DDP broadcasts buffers at the start of each forward, then every rank updates them from its
    own batch; after the last step the ranks' running stats differ. Evaluating rank 0's model
    everywhere makes the distributed result equal the single-process one.
    """
    if info.distributed:
        for buf in module.buffers():
            torch.distributed.broadcast(buf, src=0)


@torch.no_grad()
def evaluate(
    module: nn.Module,
    loader: Any,
    info: DistInfo,
    amp_mode: str,
    task: Task,
    *,
    lockstep: bool = False,
) -> EvalResult:
    """Exact evaluation: unpadded shares, the task's sums all-reduced.

    ``module`` is the unwrapped model: a DDP forward may run collectives (buffer broadcast,
    SyncBN), and ranks with different (or empty) shares would then deadlock or mismatch. A rank
    whose share is empty still updates the task with one empty batch, so a torchmetrics state
    it concatenates has a (zero-length) tensor to sync like every other rank's. ``lockstep``:
    every rank runs as many forwards (the most any rank's share needs).
    """
    sync_buffers(module, info)
    was_training = module.training
    module.eval()
    task.begin()
    sums = task.sums(info.device)
    most = all_reduce_max(max(len(loader), 1), info) if lockstep else 0  # before any forward
    seen, last = 0, None
    for last in loader:
        _update(module, task, sums, last[0], last[1], info, amp_mode)
        seen += 1
    if not seen and len(loader.dataset):
        x, y, _ = empty_batch(loader, None)
        _update(module, task, sums, x, y, info, amp_mode)
        seen = 1
    for _ in range(seen, most):  # forwards that only meet the other ranks' collectives
        x, _, _ = empty_batch(loader, last)
        with autocast(amp_mode, info.device):
            module(to_device(x, info.device))
    all_reduce_sum(sums, info)
    module.train(was_training)
    return task.result(sums)


def _update(
    module: nn.Module, task: Task, sums: Tensor, x: Any, y: Any, info: DistInfo, amp_mode: str
) -> None:
    x, y = to_device(x, info.device), to_device(y, info.device)
    with autocast(amp_mode, info.device):
        output = module(x)
    task.update(sums, output, y)


TEST, VAL, TRAIN = "test", "val", "train"
# The metric prefix of each split: <prefix>/<the task's metric>.
PREFIXES = {TEST: "test", VAL: "val", TRAIN: "train"}


class Split(NamedTuple):
    name: str  # test, val or train
    loader: DataLoader


@dataclass(kw_only=True)
class Evaluation:
    """The split evaluated each epoch (and the EMA on it), and the final one."""

    model: nn.Module  # unwrapped: an evaluation runs no DDP collective
    ema: Any  # an ema.EMA whose averaged module is evaluated beside the model, or None
    each_epoch: Split
    final: Split
    info: DistInfo
    amp_mode: str
    task: Task
    lockstep: bool = False  # every forward a collective (FSDP2): every rank runs as many
    every_steps: int = 0  # eval_every_steps: also every N optimizer steps (0: epoch ends only)
    last: EvalResult | None = None  # the latest epoch's, while the model has not changed since
    final_result: EvalResult | None = None  # at_end's

    @property
    def prefix(self) -> str:
        return PREFIXES[self.each_epoch.name]

    def _run(self, module: nn.Module, split: Split) -> EvalResult:
        return evaluate(
            module, split.loader, self.info, self.amp_mode, self.task, lockstep=self.lockstep
        )

    def epoch(self, epoch: int, step: int, logger: Any) -> dict[str, float]:
        """Evaluate the epoch's model (and EMA), log both; the metrics selection reads."""
        self.last = self._run(self.model, self.each_epoch)
        logger.log_eval(self.last, epoch, step, self.prefix)
        self._ema(step, logger)
        return self.last.metrics(self.prefix)

    def at_step(self, epoch: int, step: int, ends_epoch: bool, logger: Any) -> bool:
        """``eval_every_steps``: at every N-th optimizer step the model (and EMA) evaluated as
        exactly as at an epoch's end and logged at the step, but not at an epoch's last step
        (its end evaluates). True where it evaluated (the step hook checkpoints there too)."""
        if not self.every_steps or step % self.every_steps or ends_epoch:
            return False
        result = self._run(self.model, self.each_epoch)
        logger.log({**result.metrics(self.prefix), "epoch": epoch}, step)
        log.info("step %d: %s %s", step, self.prefix, result.line)
        self._ema(step, logger)
        return True

    def _ema(self, step: int, logger: Any) -> None:
        if self.ema is not None:  # the averaged weights, evaluated as exactly
            ema = self._run(self.ema.module, self.each_epoch)
            log.info("EMA %s %s", self.prefix, ema.line)
            named = {k.replace("/", "/ema_", 1): v for k, v in ema.metrics(self.prefix).items()}
            logger.log(named, step)

    def latest(self) -> EvalResult:
        """The split evaluated each epoch, as last evaluated (the sweep's objective); the final
        split's after ``at_end`` when no epoch was evaluated."""
        result = self.last if self.last is not None else self.final_result
        if result is None:
            raise RuntimeError("Evaluation.latest() before any evaluation (no epoch's, no at_end)")
        return result

    def at_end(self, epoch: int, step: int, logger: Any) -> EvalResult:
        """The final split's result: the last epoch's when it is that split, else evaluated now
        (epochs=0, a finished run resumed, a val split each epoch, eval_split=train)."""
        same = self.last is not None and self.final.name == self.each_epoch.name
        result = self.last if same and self.last is not None else self._run(self.model, self.final)
        if self.final.name == TEST and self.each_epoch.name != TEST:
            logger.log_eval(result, epoch, step, PREFIXES[TEST])
        result.split = self.final.name
        self.final_result = result
        return result


def build_evaluation(
    *,
    final: str,
    splits: Any,
    loader: Callable[[Dataset], DataLoader],
    model: nn.Module,
    ema: Any,
    info: DistInfo,
    amp_mode: str,
    task: Task,
    lockstep: bool,
    every_steps: int = 0,
) -> Evaluation:
    """``eval_split``'s builder: ``loader`` makes an evaluation loader of a dataset."""
    each = VAL if splits.val is not None else TEST
    loaders = {each: loader(splits.split(each))}
    if final not in loaders:
        loaders[final] = loader(splits.split(final))
    return Evaluation(
        model=model,
        ema=ema,
        each_epoch=Split(each, loaders[each]),
        final=Split(final, loaders[final]),
        info=info,
        amp_mode=amp_mode,
        task=task,
        lockstep=lockstep,
        every_steps=every_steps,
    )
