"""The start-up probe: the task and the model meet on a few real samples before the first step.

Once per build, before the model is laid out over the ranks: rank 0 runs the model (eval mode,
no gradient, the RNG untouched) on the first :data:`SAMPLES` training samples and asks the task
what the engine and the evaluation will ask it (``loss``, ``sums``, ``update``); every rank
meets its verdict alike. A forker's mistake that torch would turn into a traceback deep in the
engine, or worse into a silent number (an output that broadcasts against its target), is
refused in one sentence naming the task's or the model's file, the shapes and the fix:

- the model returns a tuple or dict where the task reads a tensor, or an output whose batch
  dimension or shape cannot meet the target;
- ``loss`` returns no scalar (a per-sample vector);
- exactness: the batch's ``loss`` is not the mean (``reduction="sum"``: the sum) of each
  sample's alone, or its ``update`` does not add up to each sample's alone — what the engine's
  exact weights and the evaluation's all-reduced sums rest on (``task.py``).

A task whose loss is batch-level by design (a contrastive loss, say) sets ``batch_level = True``
on its class and skips the exactness part (the other checks stay).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import os
import warnings
from collections.abc import Sized
from typing import Any

import torch
from hydra.utils import get_method
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.data import default_collate

from ddp_template.data.contract import Splits, batch_len, to_device
from ddp_template.distributed import DistInfo, broadcast_object
from ddp_template.errors import ConfigError, Unanimous
from ddp_template.task import Task

SAMPLES = 4  # training samples the probe runs
RTOL, ATOL = 1e-4, 1e-6  # float32 sums of a few samples in another order
FIX = 'docs/forking.md "Add a model" lists what each task reads'


def probe(task: Task, model: nn.Module, splits: Splits, info: DistInfo, target: str = "") -> None:
    """Refuse (``Unanimous``, one sentence) a task and model that do not fit, before the first
    step: rank 0 probes on ``info.device``, every rank raises its verdict. ``target``: the
    model YAML's ``_target_`` (named in the sentence)."""
    verdict = None
    if info.is_main:
        try:
            check_fit(task, model, splits, info.device, target)
        except ConfigError as exc:
            verdict = str(exc)
    verdict = broadcast_object(verdict, info)
    if verdict is not None:
        raise Unanimous(verdict)


def check_fit(
    task: Task, model: nn.Module, splits: Splits, device: torch.device, target: str = ""
) -> None:
    """The probe itself, on this process: ``ConfigError`` for the first misfit found."""
    x, y = first_samples(splits)
    if batch_len(y) == 0:
        return
    x, y = to_device(x, device), to_device(y, device)
    who = Who(task, model, target)
    was_training = model.training
    extra, task.extra = task.extra, {}  # the torchmetrics: on the device, with their own state
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's broadcast warning: the probe says more
            model.eval()
            try:
                output = model(x)
            except ConfigError:
                raise
            except Exception as exc:
                raise ConfigError(
                    f"{who.model} fails on a batch of the data's inputs (x {shape(x)}): "
                    f"{first_line(exc)}; make it take the input the data gives ({FIX})."
                ) from None
            _check(task, output, y, who)
    finally:
        task.extra = extra
        model.train(was_training)


class Who:
    """The names a sentence gives: the task's class and file, the model's factory and file
    (looked up only for a sentence)."""

    def __init__(self, task: Task, model: nn.Module, target: str) -> None:
        self._task, self._model, self._target = type(task), type(model), target

    @functools.cached_property
    def task(self) -> str:
        return f"task {self._task.__name__} ({where(self._task, self._task.__module__)})"

    @functools.cached_property
    def model(self) -> str:
        if not self._target:
            return f"model {self._model.__name__} ({where(self._model, '?')})"
        try:
            return f"model._target_={self._target} ({where(get_method(self._target), '?')})"
        except Exception:
            return f"model._target_={self._target}"


def where(obj: Any, fallback: str) -> str:
    """The file that defines ``obj``, relative to the working directory where it is under it."""
    try:
        path = inspect.getsourcefile(obj) or fallback
    except TypeError:
        return fallback
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def first_samples(splits: Splits) -> tuple[Any, Any]:
    """The first :data:`SAMPLES` training samples as one batch ``(x, y)`` (without
    augmentation); the test split's where the training data is a stream (read once)."""
    data: Any = splits.split("train")
    if not (isinstance(data, Sized) and hasattr(data, "__getitem__")):
        data = splits.test
    if isinstance(data, Sized) and hasattr(data, "__getitem__"):
        items = [data[i] for i in range(min(SAMPLES, len(data)))]
    else:
        items = list(itertools.islice(iter(data), SAMPLES))
    if not items:
        return torch.zeros(0), torch.zeros(0)
    x, y, *_ = default_collate(items)
    return x, y


def _check(task: Task, output: Any, y: Any, who: Who) -> None:
    n = batch_len(y)
    pair = f"output {shape(output)} and target {shape(y)}"
    if not isinstance(output, Tensor) and isinstance(y, Tensor):
        try:
            task.loss(output, y, "mean")
        except Exception as exc:
            raise ConfigError(
                f"{who.model} returns {shape(output)} where {who.task} expects a tensor "
                f"({first_line(exc)}); return the tensor the task reads, e.g. `return "
                f"logits` rather than `return logits, features` ({FIX})."
            ) from None
    if batch_len(output) != n:
        raise ConfigError(
            f"{who.model} returns {shape(output)} for a batch of {n} samples (target "
            f"{shape(y)}): its first dimension must be the batch's; keep the batch dimension "
            f"first and whole ({FIX})."
        )
    losses = {}
    for reduction in ("mean", "sum"):
        losses[reduction] = _loss(task, output, y, reduction, who, pair)
    _check_update(task, task.sums(y_device(y)), output, y, who, pair)
    if getattr(task, "batch_level", False) or n < 2:
        return
    alone = [_loss(task, *_sample(output, y, i), "mean", who, pair) for i in range(n)]
    mean, total = sum(alone) / n, sum(alone)
    for reduction, want in (("mean", mean), ("sum", total)):
        got = losses[reduction]
        if not close(got, want):
            why = f"{pair} broadcast" if _broadcast(output, y) else f"{pair}"
            combined = "the mean" if reduction == "mean" else "the sum"
            raise ConfigError(
                f"{who.task}: loss(output, y, {reduction!r}) of {n} samples together is "
                f"{got:.6g}, not {combined} of their losses one by one ({want:.6g}): {why}; "
                f"{_fix(output, y, who)}, or declare a batch-level loss with `batch_level = True` "
                f'on the task class (docs/forking.md "Tasks").'
            )
    together = task.sums(y_device(y))
    task.update(together, output, y)
    apart = task.sums(y_device(y))
    for i in range(n):
        task.update(apart, *_sample(output, y, i))
    if not torch.allclose(together, apart, rtol=RTOL, atol=ATOL, equal_nan=True):
        k = int((together - apart).abs().nan_to_num(float("inf")).argmax())
        raise ConfigError(
            f"{who.task}: update(sums, output, y) of {n} samples together gives sums[{k}] = "
            f"{float(together[k]):.6g}, not the sum of their updates one by one "
            f"({float(apart[k]):.6g}), with {pair}; add each sample's counts and sums "
            f"(never a batch's mean or ratio), or with `batch_level = True` on the task class "
            f'the probe skips it (docs/forking.md "Tasks").'
        )


def _loss(task: Task, output: Any, y: Any, reduction: str, who: Who, pair: str) -> float:
    try:
        loss = task.loss(output, y, reduction)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"{who.task} cannot score the output of {who.model}: loss(output, y, {reduction!r}) "
            f"with {pair} fails ({first_line(exc)}); {_fix(output, y, who)} ({FIX})."
        ) from None
    if not isinstance(loss, Tensor) or loss.numel() != 1 or loss.ndim != 0:
        got = f"shape {shape(loss)}" if isinstance(loss, Tensor) else type(loss).__name__
        raise ConfigError(
            f"{who.task}: loss(output, y, {reduction!r}) returns {got}, not a scalar tensor, "
            f"with {pair}; return the mean over the batch's samples (their sum for "
            f"reduction='sum'), e.g. `per_sample.mean()` (docs/forking.md \"Tasks\")."
        )
    return float(loss)


def _check_update(task: Task, sums: Tensor, output: Any, y: Any, who: Who, pair: str) -> None:
    try:
        task.update(sums, output, y)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"{who.task}: update(sums, output, y) fails with {pair} ({first_line(exc)}); "
            f"{_fix(output, y, who)} ({FIX})."
        ) from None


def _fix(output: Any, y: Any, who: Who) -> str:
    if isinstance(output, Tensor) and isinstance(y, Tensor) and output.numel() == y.numel():
        return f"make {who.model} return the target's shape {shape(y)}, or reshape it in loss"
    return f"make {who.model} return what the task reads for this target"


def _broadcast(output: Any, y: Any) -> bool:
    """Whether ``output`` and ``y`` are tensors of different shapes that broadcast."""
    if not (isinstance(output, Tensor) and isinstance(y, Tensor)) or output.shape == y.shape:
        return False
    try:
        torch.broadcast_shapes(output.shape, y.shape)
    except RuntimeError:
        return False
    return True


def _sample(output: Any, y: Any, i: int) -> tuple[Any, Any]:
    def alone(t: Any) -> Any:
        return t[i : i + 1] if isinstance(t, Tensor) else t

    return tree_map(alone, output), tree_map(alone, y)


def y_device(y: Any) -> torch.device:
    leaves = [t for t in tree_leaves(y) if isinstance(t, Tensor)]
    return leaves[0].device if leaves else torch.device("cpu")


def close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= ATOL + RTOL * abs(b)


def shape(obj: Any) -> str:
    """``(8, 1, 8, 8)``; a tuple's or dict's parts in brackets."""
    if isinstance(obj, Tensor):
        return "(" + ", ".join(map(str, obj.shape)) + (",)" if obj.ndim == 1 else ")")
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)} [{', '.join(shape(o) for o in obj)}]"
    if isinstance(obj, dict):
        inner = ", ".join(f"{k}: {shape(v)}" for k, v in obj.items())
        return f"a dict of {len(obj)} {{{inner}}}"
    return type(obj).__name__


def first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:160]}"
