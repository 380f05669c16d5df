"""The epoch-end shard check across real ranks: one 2-process gloo job, no mocks.

Each rank resumes its real ShareSampler mid-epoch, reads part of its list into an IndexTally
(as the training loop does) and calls ``verify_epoch``, the collective ``train.fit`` calls; rank
0 hands the report to ``RankLogger.log_share_report``. In some scenarios one rank is given a
wrong shard, and the warning it logs, the report and the bytes each gather carried are saved
for the tests below.
"""

from __future__ import annotations

import itertools
import logging
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import cpu_rank, free_port, join_gloo

WORLD = 2
N = 1001
START, COUNT, BATCH = 30, 400, 10  # resumed at position 30, capped after 400 samples


def read_epoch(sampler: Any, *, keep: bool, skip_batch: bool) -> Any:
    """What the training loop tallies: COUNT indices from START, in batches of BATCH; with
    ``skip_batch`` the loader loses one batch and reads one more at the end instead."""
    from ddp_template.engine import EpochStats
    from ddp_template.ledger.tally import IndexTally

    sampler.load_state_dict(sampler.state_dict(position=START))
    read = list(itertools.islice(iter(sampler), COUNT + BATCH))
    read = read[:40] + read[40 + BATCH :] if skip_batch else read[:COUNT]
    stats = EpochStats(IndexTally(keep=keep))
    for lo in range(0, len(read), BATCH):
        stats.tally.add(np.array(read[lo : lo + BATCH]))
    return stats


SCENARIOS = {  # name: (seed of each rank's sampler, rank 1's loader skips a batch, indices kept)
    "clean": ((0, 0), False, True),
    "wrong_seed": ((0, 7), False, True),
    "skipped_batch": ((0, 0), True, False),
}


def run_scenario(name: str, info: Any, logger: Any, captured: list[str]) -> dict[str, Any]:
    from ddp_template.data.samplers import ShareSampler
    from ddp_template.ledger import verify as shard_check

    seeds, skip, keep = SCENARIOS[name]
    sampler = ShareSampler(range(N), WORLD, info.rank, seed=seeds[info.rank], mode="padded")
    sampler.set_epoch(2)
    stats = read_epoch(sampler, keep=keep, skip_batch=skip and info.rank == 1)
    metrics = shard_check.epoch_metrics(stats, sampler, START, 2)
    sent: list[int] = []
    gather = shard_check.gather_objects

    def measured(obj: Any, dist_info: Any) -> list[Any]:
        sent.append(len(pickle.dumps(obj)))
        return gather(obj, dist_info)

    shard_check.gather_objects = measured
    try:
        report = shard_check.verify_epoch(stats, sampler, START, metrics, info)
    finally:
        shard_check.gather_objects = gather
    del captured[:]
    if report is not None:
        logger.log_share_report(report, epoch=2, step=1)
    return {"report": report, "sent": sent, "warnings": list(captured)}


def worker(rank: int, port: int, out_dir: str) -> None:
    from ddp_template.config.schema import LoggerConfig, LoggerName
    from ddp_template.run_identity import RunInfo
    from ddp_template.sinks.metrics import RankLogger

    torch.set_num_threads(1)
    join_gloo(rank, WORLD, port, timeout_s=60)
    info = cpu_rank(rank, WORLD, backend="gloo")
    captured: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: captured.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ddp_template").addHandler(handler)
    logger = RankLogger(
        cfg=LoggerConfig(name=LoggerName.none),
        run=RunInfo(run_id="shard-check", run_dir=Path(out_dir)),
        info=info,
        config={},
    )
    try:
        results = {name: run_scenario(name, info, logger, captured) for name in SCENARIOS}
        (Path(out_dir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
    finally:
        logger.finish()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("shard_check")
    mp.spawn(worker, args=(free_port(), str(out_dir)), nprocs=WORLD, join=True)
    return [pickle.loads((out_dir / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]


def test_a_clean_epoch_exchanges_rows_only_and_is_exact(ranks: list[dict[str, Any]]) -> None:
    from ddp_template.data.samplers import ShareSampler

    clean = [r["clean"] for r in ranks]
    report = clean[0]["report"]
    assert str(report.verdict) == "ok" and clean[1]["report"] is None
    assert not clean[0]["warnings"]
    assert [len(c["sent"]) for c in clean] == [1, 1] and max(clean[0]["sent"]) < 1024
    truth = ShareSampler(range(N), WORLD, 0, seed=0, mode="padded")
    truth.set_epoch(2)
    lists = [truth.rank_indices(r)[START : START + COUNT] for r in range(WORLD)]
    union = np.unique(np.concatenate(lists))
    assert report.coverage.covered == len(union) and report.coverage.fraction == len(union) / N
    assert report.coverage.repeats == WORLD * COUNT - len(union)
    assert report.total_samples == WORLD * COUNT


@pytest.mark.parametrize(
    "scenario,problem",
    [
        ("wrong_seed", "rank 1's sampler defines another padded epoch than the others"),
        ("skipped_batch", "rank 1 saw indices that differ from its padded share"),
    ],
)
def test_a_wrong_shard_on_one_rank_is_a_shard_mismatch(
    ranks: list[dict[str, Any]], scenario: str, problem: str
) -> None:
    got = ranks[0][scenario]
    assert str(got["report"].verdict) == f"MISMATCH: {problem}"
    assert [r.matches for r in got["report"].ranks] == [True, False]
    (warning,) = got["warnings"]
    assert warning.startswith("SHARE MISMATCH in epoch 2: MISMATCH: " + problem)
    assert not ranks[1][scenario]["warnings"]  # the report and its warning are rank 0's


def test_after_a_mismatch_the_kept_lists_are_gathered(ranks: list[dict[str, Any]]) -> None:
    wrong_seed, skipped = ranks[0]["wrong_seed"], ranks[0]["skipped_batch"]
    assert len(wrong_seed["sent"]) == 2 and wrong_seed["sent"][1] > 8 * COUNT  # the index list
    assert wrong_seed["report"].coverage.overlap > 0  # two seeds: samples read by both ranks
    assert len(skipped["sent"]) == 1 and skipped["report"].coverage is None  # none were kept
