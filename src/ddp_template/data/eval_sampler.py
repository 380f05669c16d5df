"""Exact evaluation shares: contiguous and unpadded, so no sample is evaluated twice."""

from __future__ import annotations

from collections.abc import Iterator, Sized

from torch.utils.data import Sampler

from ddp_template.data.sampler_args import resolve_world


class EvalShareSampler(Sampler[int]):
    """Exact evaluation shares: contiguous, unpadded, every index exactly once.

    Rank r gets range(r*N//W, (r+1)*N//W), so share sizes differ by at most one and some are
    empty when N < W; summing metrics over ranks then equals the single-process result.
    """

    def __init__(
        self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None
    ) -> None:
        self.num_replicas, self.rank = resolve_world(num_replicas, rank)
        self.dataset = dataset
        self.dataset_size = len(dataset)
        self.start = self.rank * self.dataset_size // self.num_replicas
        self.stop = (self.rank + 1) * self.dataset_size // self.num_replicas

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))
