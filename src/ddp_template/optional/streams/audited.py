"""The stream audit without the template's loop: wrap your own DataLoader, read it as before,
and ask for the verdict at each epoch's end.

    loader = audited(DataLoader(stream, batch_size=32, num_workers=2), key="__key__")
    for batch in loader:          # your batches, as your DataLoader gives them
        ...
    report = loader.verdict()     # a collective under torch.distributed; rank 0 prints it

Every item is tagged with its key and its loader worker's id in the worker that reads it, so
the verdict is the one ``train.py`` gives a stream (``data.stream_audit``): duplicates, overlap
between (rank, worker) pairs by symptom, coverage against ``expected`` (a count, keys or a
key-list file) and, across a resume, replayed samples (``state_dict`` / ``load_state_dict``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.utils.data import DataLoader

from ddp_template.ledger.records import EpochReport
from ddp_template.ledger.tally import IndexTally
from ddp_template.optional.streams.contract import Expected, KeySpec, TagCollate, Tagged, is_stream
from ddp_template.optional.streams.verify import key_report
from ddp_template.sinks.console import report_lines


def audited(loader: DataLoader, *, key: KeySpec, expected: Any = None) -> Audited:
    """``loader`` rebuilt over its dataset tagged by ``key`` (a dict field such as ``__key__``
    or ``id``, a tuple position, or a function of the item)."""
    return Audited(loader, key=key, expected=expected)


class Audited:
    """A DataLoader that records which keys each of its workers yielded, per epoch."""

    def __init__(self, loader: DataLoader, *, key: KeySpec, expected: Any = None) -> None:
        if not is_stream(loader.dataset):
            raise TypeError(
                f"audited() reads a DataLoader over an IterableDataset, and this one's dataset "
                f"is {type(loader.dataset).__name__} (map-style); train.py checks map-style data "
                f"against its sampler."
            )
        if loader.batch_size is None:
            raise TypeError(
                "audited() needs the DataLoader to batch (batch_size=N): a pipeline that "
                "batches itself yields no per-sample key to record."
            )
        workers = loader.num_workers
        self.loader = DataLoader(
            Tagged(loader.dataset, key),
            batch_size=loader.batch_size,
            drop_last=loader.drop_last,
            collate_fn=TagCollate(loader.collate_fn),
            num_workers=workers,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            generator=loader.generator,
            prefetch_factor=loader.prefetch_factor if workers else None,
            persistent_workers=loader.persistent_workers,
        )
        self.expected = Expected.of(expected)
        self.workers, self.epoch = max(workers, 1), 0
        self._fresh()

    def _fresh(self) -> None:
        self.tally = IndexTally(keep=True, workers=self.workers)
        self.before: np.ndarray | None = None
        self.seconds = 0.0

    def __iter__(self) -> Iterator[Any]:
        start = time.perf_counter()
        for batch, keys, worker, _ in self.loader:
            self.tally.add(keys.numpy(), worker)
            yield batch
        self.seconds += time.perf_counter() - start

    def state_dict(self) -> dict[str, Any]:
        """What this rank read so far this epoch (8 bytes a sample): checkpoint it beside your
        stream's own state, so the verdict after a resume sees what came before."""
        before = [] if self.before is None else [self.before]
        return {"epoch": self.epoch, "keys": np.concatenate([*before, self.tally.indices()])}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self._fresh()
        self.epoch, self.before = saved["epoch"], saved["keys"]

    def verdict(self, *, echo: bool = True) -> EpochReport:
        """The epoch's report on every rank (rank 0 prints it with ``echo``); starts the next
        epoch's record. A collective when torch.distributed is initialised."""
        own = (self.tally.worker_indices(), self.before, self.seconds)
        rows: list[Any] = [own]  # all_gather_object fills it from a list of None
        if dist.is_available() and dist.is_initialized():
            rows = [None] * dist.get_world_size()
            dist.all_gather_object(rows, own)
        befores = [b for _, b, _ in rows]
        report = key_report(
            [keys for keys, _, _ in rows],
            expected=self.expected,
            before=None
            if all(b is None for b in befores)
            else [b for b in befores if b is not None],
        ).timed([s for *_, s in rows], idle=1.0)
        if echo and (not dist.is_initialized() or dist.get_rank() == 0):
            print("\n".join(report_lines(report, self.epoch)), file=sys.stderr)
        self.epoch += 1
        self._fresh()
        return report
