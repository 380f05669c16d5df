"""ShareSampler under torchdata's stateful protocol and torch's own DistributedSampler tests.

Ported with only the class swapped (each test runs on the original class too, so a case that
passes only for ours would show): torchdata 0.11's ``test/stateful_dataloader/test_sampler.py``
(StatefulDistributedSampler) and PyTorch's DistributedSampler cases
(``test_distributed_sampler_invalid_rank`` and ``test_duplicating_data_with_drop_last`` from
``test/test_dataloader.py``, ``test_DistributedSampler_padding`` from
``torch/testing/_internal/distributed/distributed_test.py``, here on a one-rank gloo group and
on explicit ranks). Then a kill-and-resume through ``StatefulDataLoader`` with 0 and 2 workers.

API differences that remain, and why:
  * ``len(sampler)`` after ``load_state_dict`` is what the next iteration yields (num_samples
    minus the position), not num_samples: the DataLoader's length, and so the template's step
    count after a resume, must count the remaining batches.
  * Arguments are type-checked at construction (``seed=1.5``, ``shuffle="false"``, a bool
    rank are refused in one sentence); torch stores them and fails later, or never.
  * Without ``num_replicas``/``rank`` and no process group: RuntimeError naming the fix, where
    torch raises ValueError from ``dist.get_world_size``.
  * ``permutation="auto"`` switches to the Feistel shuffle at N >= 2**24: a different (equally
    uniform) order than torch's there; ``permutation="randperm"`` keeps torch's at any N.
  * torchdata: ``state_dict`` holds more keys (the sampler's identity, checked on load, and
    ``position``); torchdata's own ``{"yielded": k}`` states load as they are. ``__iter__``
    takes the resume offset and the epoch's permutation when called (as torch's sampler
    does), where torchdata's generator takes them at the first ``next``: a ``load_state_dict``
    between ``iter()`` and the first ``next()`` applies to the following iterator. The
    ``dataset_size=`` keyword of torchdata's main branch (not in 0.11) is not offered: the
    dataset's ``len`` is the size, and ``set_epoch`` to a new epoch also resets ``yielded``.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from ddp_template.data.sampler_modes import SAMPLER_MODES
from ddp_template.data.samplers import ShareSampler

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
STATEFUL = [StatefulDistributedSampler, ShareSampler]
DISTRIBUTED = [DistributedSampler, ShareSampler]


class MockDataset(Dataset):
    def __init__(self, size: int) -> None:
        self.size = size
        self.data = torch.arange(size)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> torch.Tensor:
        return self.data[idx]


@pytest.fixture
def dataset() -> MockDataset:
    return MockDataset(100)


# ------------------------------------------------------------------ torchdata's sampler tests
@pytest.mark.parametrize("cls", STATEFUL)
def test_initialization(cls, dataset) -> None:
    sampler = cls(dataset, num_replicas=10, rank=0, shuffle=False, seed=42, drop_last=False)
    assert sampler.dataset is dataset
    assert (sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed) == (10, 0, False, 42)
    assert sampler.drop_last is False
    assert sampler.yielded == 0 and sampler.next_yielded is None


@pytest.mark.parametrize("cls", STATEFUL)
def test_dataloader_state_dict(cls, dataset) -> None:
    sampler = cls(dataset, num_replicas=1, rank=0, shuffle=False)
    dataloader = StatefulDataLoader(dataset, batch_size=10, sampler=sampler)
    iter_count = 5
    for i, _ in enumerate(dataloader):
        if i == iter_count - 1:
            break
    state_dict = dataloader.state_dict()
    new_sampler = cls(dataset, num_replicas=1, rank=0, shuffle=False)
    new_dataloader = StatefulDataLoader(dataset, batch_size=10, sampler=new_sampler)
    new_dataloader.load_state_dict(state_dict)
    resumed = [data.tolist() for data in new_dataloader]
    full = StatefulDataLoader(dataset, batch_size=10, sampler=sampler)
    assert resumed == [data.tolist() for data in full][iter_count:]


@pytest.mark.parametrize("cls", STATEFUL)
def test_sampler_state_dict(cls, dataset) -> None:
    sampler = cls(dataset, num_replicas=10, rank=0)
    sampler.yielded = 5
    assert sampler.state_dict()["yielded"] == 5


@pytest.mark.parametrize("cls", STATEFUL)
def test_sampler_load_state_dict(cls, dataset) -> None:
    sampler = cls(dataset, num_replicas=10, rank=0)
    sampler.load_state_dict({"yielded": 3})
    assert sampler.next_yielded == 3
    with pytest.raises(ValueError):
        sampler.load_state_dict({"yielded": -1})


@pytest.mark.parametrize("cls", STATEFUL)
def test_sampler_next_yielded(cls, dataset) -> None:
    sampler = cls(dataset, num_replicas=2, rank=0, shuffle=True, seed=42)
    iterator = iter(sampler)
    next(iterator)
    assert sampler.yielded == 1 and sampler.next_yielded is None
    sampler.load_state_dict({"epoch": 0, "yielded": 5})
    assert sampler.next_yielded == 5
    iterator = iter(sampler)
    next(iterator)
    assert sampler.yielded == 6


@pytest.mark.parametrize("cls", STATEFUL)
def test_drop_last_effect(cls, dataset) -> None:
    def indices(drop_last: bool) -> list:
        sampler = cls(dataset, num_replicas=3, rank=0, drop_last=drop_last, shuffle=False)
        return [x for batch in StatefulDataLoader(dataset, sampler=sampler) for x in batch]

    with_drop, without_drop = indices(True), indices(False)
    assert len(with_drop) == len(dataset) // 3
    assert len(without_drop) == math.ceil(len(dataset) / 3)


@pytest.mark.parametrize("cls", STATEFUL)
@pytest.mark.parametrize("shuffle", [True, False])
def test_data_order(cls, dataset, shuffle: bool) -> None:
    sampler = cls(dataset, num_replicas=1, rank=0, shuffle=shuffle)
    sampled = [dataset[i] for i in iter(sampler)]
    assert (sampled != list(range(100))) is shuffle
    loaded = [
        x for batch in StatefulDataLoader(dataset, batch_size=32, sampler=sampler) for x in batch
    ]
    assert loaded == sampled and len(loaded) == len(dataset)


@pytest.mark.parametrize("cls", STATEFUL)
def test_data_distribution_across_replicas(cls, dataset) -> None:
    everything = []
    for rank in range(5):
        sampler = cls(dataset, num_replicas=5, rank=rank, shuffle=False)
        everything += [
            int(x) for batch in StatefulDataLoader(dataset, sampler=sampler) for x in batch
        ]
    assert sorted(everything) == list(range(100))


# ------------------------------------------------------------------ PyTorch's sampler tests
@pytest.mark.parametrize("cls", DISTRIBUTED)
def test_distributed_sampler_invalid_rank(cls) -> None:
    dataset = torch.IntTensor(range(10))
    for rank in (3, -1):
        with pytest.raises(ValueError, match="Invalid rank"):
            cls(dataset, 3, rank)


@pytest.mark.parametrize("cls", DISTRIBUTED)
def test_duplicating_data_with_drop_last(cls) -> None:
    data_set = torch.IntTensor(range(9))
    scanned = torch.cat(
        [
            data
            for i in range(4)
            for data in DataLoader(
                data_set, batch_size=2, drop_last=True, sampler=cls(data_set, 4, i)
            )
        ]
    )
    assert scanned.size() == scanned.unique().size()


def _check_padding(cls, world_size: int, ranks: list[int | None]) -> None:
    """torch's test_DistributedSampler_padding; the all_gather becomes a loop over ranks."""
    size = 100 + world_size + 1
    dataset = [torch.ones(1) * i for i in range(size)]
    tiny_size = max(world_size // 2 - 1, 1)
    tiny = [torch.ones(1) * i for i in range(tiny_size)]
    cases = [
        (
            dataset,
            True,
            math.ceil((size - world_size) / world_size)
            if size % world_size
            else size // world_size,
        ),
        (dataset, False, math.ceil(size / world_size)),
        (tiny, False, math.ceil(tiny_size / world_size)),
    ]
    for data, drop_last, expected in cases:
        counts = set()
        for rank in ranks:
            replicas = None if rank is None else world_size
            sampler = cls(dataset=data, num_replicas=replicas, rank=rank, drop_last=drop_last)
            assert sampler.num_samples == expected
            assert sampler.total_size == sampler.num_samples * world_size
            assert len(list(iter(sampler))) == sampler.num_samples
            counts.add(sampler.num_samples)
        assert len(counts) == 1


@pytest.mark.parametrize("cls", DISTRIBUTED)
@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
def test_distributed_sampler_padding_explicit_ranks(cls, world_size: int) -> None:
    _check_padding(cls, world_size, list(range(world_size)))


@pytest.mark.parametrize("cls", DISTRIBUTED)
@pytest.mark.skipif(dist.is_initialized(), reason="needs its own process group")
def test_distributed_sampler_padding_from_the_process_group(cls) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _check_padding(cls, 1, [None])
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ kill and resume
def _checkpoint(state: dict) -> dict:
    """The state as a checkpoint file holds it: torch.save, then a safe torch.load."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _loader(mode: str, rank: int, workers: int, epoch: int) -> StatefulDataLoader:
    dataset = MockDataset(203)
    shuffle = SAMPLER_MODES[mode].shuffles
    sampler = ShareSampler(dataset, 3, rank, shuffle, 11, mode=mode)
    sampler.set_epoch(epoch)
    return StatefulDataLoader(dataset, batch_size=8, sampler=sampler, num_workers=workers)


def _sampler_states(state: object) -> list[dict]:
    """Every ShareSampler state nested in a StatefulDataLoader state."""
    if not isinstance(state, dict):
        return []
    if "position" in state and "mode" in state:
        return [state]
    return [found for value in state.values() for found in _sampler_states(value)]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", list(SAMPLER_MODES))
def test_stateful_dataloader_kill_and_resume(workers: int, mode: str) -> None:
    """Stop mid-epoch (the loader and its prefetching workers thrown away), resume afresh."""
    full = [int(i) for batch in _loader(mode, 1, 0, epoch=3) for i in batch]
    loader = _loader(mode, 1, workers, epoch=3)
    consumed, iterator = [], iter(loader)
    for _ in range(4):
        consumed += next(iterator).tolist()
    state = _checkpoint(loader.state_dict())
    del iterator, loader
    # The sampler's own count at the batch handed out, not what the workers prefetched:
    assert [s["position"] for s in _sampler_states(state)] == [32]
    resumed = _loader(mode, 1, workers, epoch=3)
    resumed.load_state_dict(state)
    rest = [int(i) for batch in resumed for i in batch]
    assert consumed + rest == full
    assert len(rest) == len(full) - 32
    if mode == "drop_last":
        assert len(set(consumed + rest)) == len(full)  # no index twice


def test_plain_dataloader_prefetches_so_the_loop_passes_its_position() -> None:
    """Why the template passes state_dict(position): a plain DataLoader's workers run ahead."""
    dataset = MockDataset(400)
    sampler = ShareSampler(dataset, 2, 0, seed=1)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2, prefetch_factor=4)
    iterator = iter(loader)
    consumed = [int(i) for _ in range(3) for i in next(iterator)]
    assert sampler.yielded > len(consumed)  # prefetched beyond the loop
    resumed = ShareSampler(dataset, 2, 0, seed=1)
    resumed.load_state_dict(sampler.state_dict(len(consumed)))
    assert consumed + list(resumed) == list(ShareSampler(dataset, 2, 0, seed=1))
    del iterator
