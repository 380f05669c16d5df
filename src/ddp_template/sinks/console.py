"""The human-readable side of the logs: each rank's console and log file, the share report's
lines, the split sizes, and summary.json."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from ddp_template import fencing
from ddp_template.distributed import DistInfo
from ddp_template.errors import Unanimous
from ddp_template.ledger.records import EpochReport

log = logging.getLogger("ddp_template")


def setup_console(info: DistInfo, run_dir: Path) -> None:
    """Rank 0 talks; other ranks only warn. Each rank also logs to its file in the run dir.

    Under Hydra (torchrun, single process) the file handler already exists; in-process
    workers start without Hydra's logging, so they get the same format here.
    """
    root = logging.getLogger()
    if not any(isinstance(h, logging.FileHandler) for h in root.handlers):
        name = "train.log" if info.is_main else f"rank{info.rank}.log"
        run_dir.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(run_dir / name)
        fmt = f"[%(asctime)s][rank{info.rank}][%(levelname)s] - %(message)s"
        handler.setFormatter(logging.Formatter(fmt))
        root.addHandler(handler)
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(logging.Formatter(fmt))
        root.addHandler(console)
        root.setLevel(logging.INFO)
    for h in root.handlers:
        if not isinstance(h, logging.FileHandler):
            h.setLevel(logging.INFO if info.is_main else logging.WARNING)


def say_refusal(exc: Exception, rank: int) -> None:
    """A refusal (one sentence). One every rank meets alike (``errors.Unanimous``) is said
    once, by ``rank`` 0, and the other ranks write it to their own log files; any other (data
    only one rank reads, a mid-run read) by each rank that meets it."""
    if rank == 0 or not isinstance(exc, Unanimous):
        log.error("%s", exc)
        return
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s", (str(exc),), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


DERIVED = " (derived from the deal: the rank was lost)"


def report_lines(report: EpochReport, epoch: int) -> list[str]:
    lines = [
        f"epoch {epoch} shares ({report.mode}, N={report.dataset_size}): verdict {report.verdict}"
    ]
    repeated = "read twice" if report.mode == "stream" else "padded"  # a stream has no pads
    lines += [
        f"  rank {r.rank}: {r.samples} samples, {r.duplicates} {repeated}, "
        f"fingerprint {r.fingerprint}{'' if r.matches else '  <-- MISMATCH'}"
        for r in report.ranks
    ]
    lines += [
        f"    rank {w.rank} worker {w.worker}: {w.samples} samples, "
        f"fingerprint {w.fingerprint}{'' if w.matches else '  <-- MISMATCH'}"
        for w in report.workers
    ]
    lines += [
        f"  before the resize, rank {p.rank} of {p.world_size}: {p.samples} samples, "
        f"fingerprint {p.fingerprint}{DERIVED if p.derived else ''}"
        f"{'' if p.matches else '  <-- MISMATCH'}"
        for p in report.prior
    ]
    for tail, names in (("pads", report.pads), ("drops", report.drops), ("unread", report.unread)):
        if names:
            lines.append(f"  {tail}: {', '.join(names[:20])}")
    c = report.coverage
    if c is not None and c.fraction is not None:
        lines.append(
            f"  coverage {c.fraction:.4f} ({c.covered} unique), "
            f"overlap {c.overlap}, step time max/min {report.step_s_max_over_min:.2f} "
            f"(slowest rank {report.slowest_rank})"
        )
    return lines


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Rank 0's final metrics, written atomically so a reader never sees half a file."""
    path = run_dir / "summary.json"
    tmp = path.with_name("summary.json.tmp")
    tmp.write_text(json.dumps(fencing.stamped(summary, "the summary"), indent=2) + "\n")
    tmp.replace(path)
    return path


def split_sizes(splits: Any) -> dict[str, int]:
    """The size of every split (0 for no validation split; a stream's only where it has one)."""
    val = len(splits.val) if splits.val is not None else 0
    sizes = {"test_size": len(splits.test), "val_size": val}
    return (
        sizes
        if not hasattr(splits.train, "__len__")
        else {"train_size": len(splits.train), **sizes}
    )
