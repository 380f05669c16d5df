"""The template's loaders fetch a whole batch from in-memory datasets (``BatchFetch`` →
``get_batch``): the same tensors, dtypes and indices as one ``__getitem__`` per sample and
torch's default collate; the datasets themselves keep torch's plain protocol."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from ddp_template.data.builtin import synthetic
from ddp_template.data.contract import Batch, BatchFetch, IndexedSubset, IndexedTensors, collate


def _batches(dataset: Dataset, collate_fn=None) -> list:
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(3)).tolist()
    return list(DataLoader(dataset, batch_size=7, sampler=order, collate_fn=collate_fn))


def _assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        for u, v in zip(a, b, strict=True):
            assert u.dtype == v.dtype and torch.equal(u, v)


@pytest.mark.parametrize("label_dtype", [torch.int64, torch.int32])
def test_batched_fetch_equals_one_by_one(label_dtype: torch.dtype) -> None:
    x = torch.randn(40, 1, 4, 4)
    y = torch.arange(40, dtype=label_dtype) % 3
    tensors = IndexedTensors(x, y)
    subset = IndexedSubset(tensors, np.arange(40)[::-2].copy())
    for dataset in (tensors, subset):
        got = _batches(BatchFetch(dataset), collate)
        assert all(isinstance(b, Batch) for b in got)  # the batched path really ran
        one_by_one = _batches(dataset)  # a plain DataLoader: per sample, default collate
        assert not any(isinstance(b, Batch) for b in one_by_one)
        _assert_same(got, one_by_one)


def test_datasets_without_batched_fetch_keep_the_per_sample_path() -> None:
    generated = synthetic(size=30, test_size=8, image_size=4).train
    subset = IndexedSubset(generated, np.arange(30)[5:])
    for dataset in (generated, subset):
        got = _batches(BatchFetch(dataset), collate)
        assert not any(isinstance(b, Batch) for b in got)
        _assert_same(got, _batches(dataset, default_collate))
