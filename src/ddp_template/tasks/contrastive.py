"""``task=contrastive``: SimCLR's NT-Xent over the **global** batch, exact at any world size.

The worked example of a batch-level task (``batch_level = True``: a sample's loss depends on
every other sample of the batch). What it does, and how each classic DDP bug is kept out:

- **Two views.** Training reads :class:`Views` (``training_data``): sample ``i`` at epoch ``e``
  is two views, each the template's augmentation (``transforms``, if any) then this task's own
  (a shift of up to ``shift`` pixels, Gaussian noise ``noise``), drawn from torch's RNG seeded by
  ``sample_seed(seed, e, i, view)``: the same tensors on any rank, world size, loader worker or
  resume. The target is ``(index, label)``: the loss reads only the index (which rows are one
  sample); no label is used to train.
- **Negatives with their gradients.** Each rank's projections of the micro-batch are gathered
  from every rank by :class:`_Gather`, an autograd Function whose backward all-reduces the
  gradient of the gathered rows and keeps this rank's (``torch.distributed.all_gather`` alone
  carries no gradient, and a loss against detached negatives trains a different model). Ranks
  may hold different micro-batch sizes (``sampler=exact``'s last, an empty one too): the sizes
  are gathered first and each rank's rows padded to the largest.
- **The weighting, with the engine's.** Each rank's ``loss`` is the mean over *its own*
  samples of each sample's contribution ``l_i`` (the mean of its two views' NT-Xent terms), each
  contrasted against the whole global micro-batch. The engine multiplies it by ``n_r W / N``
  (``EpochSteps.weight``: the rank's share of the step's N samples, times W), so rank r
  backpropagates ``(W/N) Σ_{i on r} l_i``; the gather's backward sums every rank's gradient of
  the rows it gathered, so rank r's own rows receive ``W ∂L/∂z_r`` where ``L = (1/N) Σ_i l_i``
  is the global loss; DDP averages over the W ranks: ``∂L/∂θ`` exactly, the gradient of 1
  process with the whole batch. No engine hook is needed: the engine's weights already mean
  "each sample's contribution, averaged over the step's real samples".
- **No sample is its own negative.** A padded duplicate (``sampler=padded``'s 11 → 12: the same
  dataset index on two ranks) is *masked*: for an anchor, every row of the same dataset index
  other than its own other view is out of the softmax's denominator and is no positive either
  (each copy's one positive is its own other view). Each copy stays an anchor, weighted like any
  sample, as padded sampling trains a duplicate twice under every task.
- **Without gradient** (the start-up probe, spike forensics, ``replay --losses``), ``loss`` and
  ``sample_losses`` gather nothing: the batch they are given is the global batch (replay passes
  the step's micro-batch of every rank joined; a spike's report has its own rank's).
- **Evaluation** needs no labels in training: leave-one-out nearest-class-mean accuracy on the
  representation ``h`` (L2-normalised) of the evaluated split. ``update`` adds each class's
  count to ``sums`` (all-reduced by ``evaluate``) and keeps this rank's ``h``; ``result`` (every
  rank calls it) all-reduces each class's sum of ``h``, scores each kept sample against the
  class means without it (its own class's mean is ``(S_c - h_i) / (n_c - 1)``) and all-reduces
  the count of correct ones: the same number at any world size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

from ddp_template.data.contract import DataInfo, MapData, Splits
from ddp_template.data.transforms import Augmented, sample_seed
from ddp_template.errors import ConfigError
from ddp_template.task import EvalResult, Task

VIEWS = 2


class _Gather(torch.autograd.Function):
    """All ranks' rows (each rank's padded to ``most``), concatenated in rank order; the
    backward all-reduces the gradient of all of them and returns this rank's rows'."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, most: int) -> Tensor:
        ctx.n, ctx.most = len(rows), most
        padded = rows.new_zeros((most, *rows.shape[1:]))
        padded[: len(rows)] = rows
        parts = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, padded.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)  # every rank's loss reaches every rank's rows
        start = dist.get_rank() * ctx.most
        return grad[start : start + ctx.n], None


def gathered() -> bool:
    """Whether ``loss`` contrasts against every rank's rows: a training step's (with gradient)
    in a process group of more than one rank."""
    return torch.is_grad_enabled() and dist.is_initialized() and dist.get_world_size() > 1


def gather_batch(z: Tensor, ids: Tensor) -> tuple[Tensor, Tensor, int]:
    """Every rank's ``z`` (with its gradient) and ``ids``, in rank order, and where this
    rank's rows start among them."""
    world, rank = dist.get_world_size(), dist.get_rank()
    size = torch.tensor([len(ids)], dtype=torch.int64, device=ids.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    counts = [int(s) for s in sizes]
    most = max(counts)
    padded = ids.new_full((most,), -1)
    padded[: len(ids)] = ids
    id_parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(id_parts, padded)
    every = cast(Tensor, _Gather.apply(z, most))
    keep = torch.cat([torch.arange(r * most, r * most + c) for r, c in enumerate(counts)])
    keep = keep.to(z.device)
    return every[keep], torch.cat(id_parts)[keep], sum(counts[:rank])


def nt_xent(z: Tensor, ids: Tensor, every: Tensor, every_ids: Tensor, start: int, tau: float):
    """Each local sample's NT-Xent contribution ``(n,)``: the mean over its views of
    ``-log softmax`` of its other view among every row of the global batch, the rows of its
    own dataset index (a padded duplicate) out of the softmax. ``z`` ``(n, 2, D)`` are this
    rank's rows, at ``start`` among ``every`` ``(M, 2, D)``; both L2-normalised."""
    n, m = len(z), len(every)
    anchors = z.reshape(n * VIEWS, z.shape[-1])  # row i*2+v: sample i, view v
    logits = anchors @ every.reshape(m * VIEWS, every.shape[-1]).T / tau  # (2n, 2M)
    same = (ids[:, None] == every_ids[None, :]).repeat_interleave(VIEWS, 0)  # (2n, M)
    same = same.repeat_interleave(VIEWS, 1)  # (2n, 2M): a row of the anchor's dataset index
    row = torch.arange(n * VIEWS, device=z.device)
    positive = (start + row // VIEWS) * VIEWS + (1 - row % VIEWS)  # its own other view
    masked = logits.masked_fill(same, float("-inf"))
    masked[row, positive] = logits[row, positive]
    terms = torch.logsumexp(masked, dim=1) - logits[row, positive]
    return terms.reshape(n, VIEWS).mean(dim=1)


class Views(Dataset):
    """The training split as pairs of views: item ``i`` is ``(views (2, C, H, W), (index,
    label), index)``. Each view is the ``transforms`` group's augmentation (if any) then the
    task's shift and noise, from torch's RNG seeded by (seed, epoch, index, view)."""

    def __init__(self, train: Dataset, seed: int, shift: int, noise: float) -> None:
        if isinstance(train, Augmented):  # its transform runs per view, seeded per view
            self.base, self.transform = cast(Dataset, train.base), train.transform
            self.for_eval = Paired(train.for_eval)
        else:
            self.base, self.transform = train, None
            self.for_eval = Paired(train)
        self.seed, self.shift, self.noise = seed, shift, noise
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()  # as Augmented's

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __len__(self) -> int:
        return len(cast(MapData, self.base))

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, int]:
        x, y, index = cast(MapData, self.base)[i]
        views = [self.view(x, int(index), v) for v in range(VIEWS)]
        return torch.stack(views), torch.tensor([int(index), int(y)]), index

    def view(self, x: Tensor, index: int, v: int) -> Tensor:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed(self.seed, int(self.epoch), index, view=v))
            if self.transform is not None:
                x = self.transform(x)
            s = self.shift
            if s:
                h, w = x.shape[-2:]
                dy, dx = (int(d) for d in torch.randint(0, 2 * s + 1, (2,)))
                x = F.pad(x, (s, s, s, s))[..., dy : dy + h, dx : dx + w]
            if self.noise:
                x = x + self.noise * torch.randn_like(x)
            return x


class Paired(Dataset):
    """The training split without augmentation, shaped as training reads it: two identical
    views and ``(index, label)`` (the probe's samples, ``eval_split=train``)."""

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(cast(MapData, self.base))

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, int]:
        x, y, index = cast(MapData, self.base)[i]
        return torch.stack([x] * VIEWS), torch.tensor([int(index), int(y)]), index


def _labels(y: Tensor) -> Tensor:
    return y[:, 1] if y.ndim == 2 else y  # training's (index, label), else the label


def _all_reduce(t: Tensor) -> None:
    """A sum over the ranks (``result`` runs on every rank, after ``evaluate``'s own)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)


class Contrastive(Task):
    """The model's output is ``(h, z)`` (``model=contrastive``): the representation and its
    projection, each ``(B, 2, ·)`` for training's pairs of views, ``(B, ·)`` for single
    images. ``y`` is ``(index, label)`` per sample in training, the label elsewhere."""

    directions = {"ncm_accuracy": "max"}
    monitor = "ncm_accuracy"
    batch_level = True

    def __init__(
        self,
        temperature: float = 0.5,
        shift: int = 1,
        noise: float = 0.1,
        metrics: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(metrics)
        if temperature <= 0 or shift < 0 or noise < 0:
            raise ConfigError(
                f"task.temperature={temperature} must be > 0, task.shift={shift} and "
                f"task.noise={noise} >= 0; e.g. task.temperature=0.5."
            )
        self.temperature, self.shift, self.noise = temperature, shift, noise
        self.num_classes = 0
        self.kept: list[tuple[Tensor, Tensor]] = []  # this rank's evaluated (h, label)

    def setup(self, info: DataInfo, device: torch.device) -> None:
        super().setup(info, device)
        if not info.num_classes:
            raise ConfigError(
                "task=contrastive evaluates by nearest class mean and needs the data's "
                "num_classes (DataInfo.num_classes); return it from the data factory."
            )
        self.num_classes = info.num_classes

    def training_data(self, splits: Splits, seed: int) -> Splits:
        if splits.kind is not None:
            raise ConfigError(
                "task=contrastive draws two views of each sample by index and needs map-style "
                "training data; use a data option without a kind of its own (e.g. data=digits)."
            )
        return replace(splits, train=Views(splits.train, seed, self.shift, self.noise))

    def _parts(self, output: Any, y: Tensor) -> tuple[Tensor, Tensor]:
        _, z = output
        if z.ndim != 3 or y.ndim != 2:
            raise ConfigError(
                f"task=contrastive trains on pairs of views: the model's projection must be "
                f"(B, 2, D) and the target (B, 2) (index, label), here {tuple(z.shape)} and "
                f"{tuple(y.shape)}; train with model=contrastive on the task's training data."
            )
        return F.normalize(z.float(), dim=-1), y[:, 0]

    def loss(self, output: Any, y: Tensor, reduction: str) -> Tensor:
        z, ids = self._parts(output, y)
        if gathered():
            every, every_ids, start = gather_batch(z, ids)
        else:
            every, every_ids, start = z, ids, 0
        per_sample = nt_xent(z, ids, every, every_ids, start, self.temperature)
        return per_sample.sum() if reduction == "sum" else per_sample.mean()

    def sample_losses(self, output: Any, y: Tensor) -> Tensor:
        z, ids = self._parts(output, y)
        return nt_xent(z, ids, z, ids, 0, self.temperature)

    def begin(self) -> None:
        super().begin()
        self.kept = []

    def sums(self, device: torch.device) -> Tensor:
        # samples, then each class's count (its sum of representations: ``result``'s)
        return torch.zeros(1 + self.num_classes, dtype=torch.float64, device=device)

    def update(self, sums: Tensor, output: Any, y: Tensor) -> None:
        h, _ = output
        h = h[:, 0] if h.ndim == 3 else h  # a pair's views are identical without augmentation
        labels = _labels(y)
        sums[0] += len(labels)
        sums[1:] += torch.bincount(labels, minlength=self.num_classes)[: self.num_classes]
        self.kept.append((F.normalize(h.double().flatten(1), dim=1), labels))
        self.update_extra(output, y)

    def result(self, sums: Tensor) -> EvalResult:
        c, count, counts = self.num_classes, int(sums[0].item()), sums[1:]
        correct = torch.zeros(1, dtype=torch.float64, device=sums.device)
        if self.kept:  # every rank kept at least an empty batch (evaluate)
            totals = sums.new_zeros((c, self.kept[0][0].shape[1]))
            for h, labels in self.kept:
                totals.index_add_(0, labels, h)
            _all_reduce(totals)  # each class's sum of representations, over every rank
            for h, labels in self.kept:
                own = F.one_hot(labels, c).double()  # (n, c): the sample left out of its class
                left = counts[None] - own
                means = (totals[None] - own[..., None] * h[:, None]) / left.clamp(min=1)[..., None]
                scores = torch.einsum("nf,ncf->nc", h, F.normalize(means, dim=2))
                scores = scores.masked_fill(left == 0, float("-inf"))
                correct += (scores.argmax(dim=1) == labels).sum()
        _all_reduce(correct)
        hits = int(correct.item())
        accuracy = hits / count if count else 0.0
        values: dict[str, float] = {"ncm_accuracy": accuracy, "correct": hits}
        details: dict[str, Any] = {"ncm_accuracy": accuracy, "correct": hits, "count": count}
        return self.scored(
            EvalResult(
                values=values,
                count=count,
                details=details,
                headline=f"ncm_accuracy {accuracy:.4f} ({hits}/{count})",
                line=f"ncm_accuracy {accuracy:.4f}",
            )
        )
