"""Rank-aware logs: console and file, per-rank JSONL, and one W&B run per rank.

Every rank writes ``<run_dir>/rank<r>/metrics.jsonl`` (always) and, with ``logger=wandb``,
its own W&B run in ``<run_dir>/rank<r>/wandb`` grouped by the run id. The same keys go to both.
W&B trouble never stops training: a failed start falls back to offline, then to JSONL only.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ddp_template.distributed import DistInfo
from ddp_template.launch import RunInfo

log = logging.getLogger("ddp_template")


def setup_console(info: DistInfo, run_dir: Path) -> None:
    """Rank 0 talks; other ranks only warn. Each rank also logs to its file in the run dir.

    Under Hydra (torchrun, single process) the file handler already exists; in-process
    workers start without Hydra's logging, so they get the same layout here.
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


def wandb_id(run_id: str, rank: int) -> str:
    """Deterministic per-rank W&B id: a resumed run continues the same W&B runs."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", f"{run_id}-rank{rank}")[-120:]


class RankLogger:
    """One rank's metrics sink (JSONL + optional W&B)."""

    def __init__(self, cfg: DictConfig, run: RunInfo, info: DistInfo) -> None:
        self.info, self.run = info, run
        self.rank_dir = run.run_dir / f"rank{info.rank}"
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.rank_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        self._wandb: Any = None
        self._wandb_thread: threading.Thread | None = None
        self.bar: Any = None
        if cfg.logger.name == "wandb":
            # W&B's import and service start take ~1 s: overlap them with building the data,
            # model and DDP; the first use of ``self.wandb`` waits for it.
            self._wandb_thread = threading.Thread(
                target=self._start_wandb, args=(cfg,), name="wandb-init", daemon=True
            )
            self._wandb_thread.start()

    def wait_ready(self) -> None:
        """Wait until W&B has started (or given up)."""
        if self._wandb_thread is not None:
            self._wandb_thread.join()
            self._wandb_thread = None

    @property
    def wandb(self) -> Any:
        """The W&B run (None with logger=none or when W&B could not start)."""
        self.wait_ready()
        return self._wandb

    def _wandb_kwargs(self, cfg: DictConfig) -> dict[str, Any]:
        info, run = self.info, self.run
        config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        config.update(
            rank=info.rank,
            local_rank=info.local_rank,
            world_size=info.world_size,
            host=info.host,
            backend=info.backend or "none",
            sampler=str(cfg.sampler.mode.value),
        )
        return dict(
            project=cfg.logger.project,
            entity=cfg.logger.entity,
            tags=list(cfg.logger.tags),
            group=run.run_id,
            job_type="main" if info.is_main else "worker",
            name=f"{run.run_id}-rank{info.rank}",
            id=wandb_id(run.run_id, info.rank),
            resume="allow",
            dir=str(self.rank_dir),
            config=config,
        )

    def _start_wandb(self, cfg: DictConfig) -> None:
        import wandb

        kwargs = self._wandb_kwargs(cfg)
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True)
        mode = str(cfg.logger.mode.value)
        error: Exception | None = None
        for attempt in [mode] + (["offline"] if mode != "offline" else []):
            try:
                wb = wandb.init(mode=attempt, settings=settings, **kwargs)
            except Exception as exc:  # W&B must never stop training
                error = exc
                continue
            if error is not None:
                log.warning(
                    "W&B (%s) failed to start on rank %d (%s); logging offline instead",
                    mode,
                    self.info.rank,
                    str(error).splitlines()[0],
                )
            wb.define_metric("step")
            wb.define_metric("*", step_metric="step")
            self._wandb = wb
            return
        log.warning(
            "W&B failed to start on rank %d (%s); metrics go to metrics.jsonl only",
            self.info.rank,
            error,
        )

    @property
    def wandb_id(self) -> str | None:
        return self.wandb.id if self.wandb is not None else None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": step, **metrics}
        self.jsonl.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log(row)

    def log_sizes(self, splits: Any, step: int) -> None:
        """Rank 0 records the dataset sizes once, next to its eval metrics."""
        if self.info.is_main:
            self.log(
                {
                    "data/train_size": len(splits.train),
                    "data/eval_size": len(splits.eval),
                    "data/world_size": self.info.world_size,
                },
                step,
            )

    def start_epoch(self, epoch: int, total: int) -> None:
        """Rank 0's progress bar (epoch, step, samples/s, loss); other ranks stay quiet."""
        if self.info.is_main:
            from tqdm import tqdm

            # disable=None: a bar on a terminal, nothing in a redirected log or CI output.
            self.bar = tqdm(
                total=total,
                desc=f"epoch {epoch}",
                unit="step",
                mininterval=1.0,
                dynamic_ncols=True,
                leave=False,
                disable=None,
            )

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def log_interval(self, metrics: dict[str, Any], step: int) -> None:
        self.log(metrics, step)
        if self.bar is not None:
            self.bar.set_postfix(
                step=step,
                loss=f"{metrics['train/loss']:.4f}",
                sps=f"{metrics['perf/interval_samples_per_s']:.0f}",
            )

    def end_epoch(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def log_table(self, key: str, rows: list[dict[str, Any]], step: int) -> None:
        if self.wandb is not None and rows:
            import wandb

            columns = list(rows[0])
            table = wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])
            self.wandb.log({key: table, "step": step})

    def log_image(self, key: str, path: Path) -> None:
        if self.wandb is not None and path.exists():
            import wandb

            self.wandb.log({key: wandb.Image(str(path))})

    def finish_run(self, result: Any, splits: Any, steps: int, picture: Any) -> None:
        """Rank 0: the shard picture to W&B, summary.json, and the closing lines."""
        if picture is not None:
            picture.join()
            self.log_image("shards/layout", self.run.run_dir / "shards.png")
        if not self.info.is_main:
            return
        path = write_summary(
            self.run.run_dir,
            {
                "eval_accuracy": result.accuracy,
                "eval_correct": result.correct,
                "eval_count": result.count,
                "eval_loss": result.loss,
                "train_size": len(splits.train),
                "eval_size": len(splits.eval),
                "world_size": self.info.world_size,
                "steps": steps,
                "run_id": self.run.run_id,
            },
        )
        log.info(
            "final test accuracy %.4f (%d/%d) — run dir %s",
            result.accuracy,
            result.correct,
            result.count,
            self.run.run_dir,
        )
        log.info("summary: %s", path)

    def finish(self, exit_code: int = 0) -> None:
        """Close the JSONL and the W&B run; called on every exit path."""
        self.end_epoch()
        if not self.jsonl.closed:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code=exit_code)
            self._wandb = None


def log_eval(logger: RankLogger, result: Any, epoch: int, step: int) -> None:
    logger.log(
        {
            "eval/accuracy": result.accuracy,
            "eval/loss": result.loss,
            "eval/correct": result.correct,
            "epoch": epoch,
        },
        step,
    )
    log.info("epoch %d: eval accuracy %.4f, loss %.4f", epoch, result.accuracy, result.loss)


def _epoch_observed(stats: Any, metrics: dict[str, Any], start: int) -> dict[str, Any]:
    """What rank 0 needs from this rank to check its shard (indices only for small N)."""
    obs = {
        "samples": stats.tally.samples,
        "duplicates": metrics["data/duplicates"],
        "fingerprint": stats.tally.fp,
        "step_s": metrics["perf/step_s"],
        "start": start,
    }
    if stats.tally.keep:
        obs["indices"] = stats.tally.indices()
    return obs


def report_epoch(
    logger: RankLogger, sampler: Any, stats: Any, start: int, epoch: int, step: int
) -> dict[str, Any] | None:
    """Log this rank's epoch accounting; rank 0 also gathers every rank's and checks them.

    ``start`` is the sampler position the epoch began at (non-zero after a mid-epoch resume).
    Returns the shard report on rank 0 (None elsewhere). A collective: call on every rank.
    """
    from ddp_template.data.accounting import expected_fingerprint, fingerprint_hex, shard_report
    from ddp_template.distributed import gather_objects

    end = start + stats.tally.samples
    duplicates = sampler.padding_in_prefix(end) - sampler.padding_in_prefix(start)
    metrics = {
        "epoch": epoch,
        **stats.as_metrics(duplicates),
        "data/fingerprint": fingerprint_hex(stats.tally.fp),
    }
    logger.log(metrics, step)
    observed = gather_objects(_epoch_observed(stats, metrics, start), logger.info)
    if not logger.info.is_main:
        return None
    expected = [
        expected_fingerprint(sampler, r, o["start"], o["samples"]) for r, o in enumerate(observed)
    ]
    report = shard_report(sampler.mode, sampler.dataset_size, observed, expected)
    _log_report(logger, report, observed, epoch, step)
    return report


def _log_report(
    logger: RankLogger,
    report: dict[str, Any],
    observed: list[dict[str, Any]],
    epoch: int,
    step: int,
) -> None:
    step_times = [o["step_s"] for o in observed]
    slowest = max(range(len(step_times)), key=step_times.__getitem__)
    fastest = min(step_times)
    spread = step_times[slowest] / fastest if fastest > 0 else float("nan")
    summary = {
        "shards/verdict_ok": int(report["verdict"] == "ok"),
        "shards/total_samples": report["total_samples"],
        "perf/step_s_max_over_min": spread,
        "perf/slowest_rank": slowest,
    }
    for key in ("coverage", "overlap", "repeats"):
        if key in report:
            summary[f"shards/{key}"] = report[key]
    logger.log(summary, step)
    logger.log_table("shards/report", report["ranks"], step)
    lines = [
        f"epoch {epoch} shards ({report['mode']}, N={report['dataset_size']}): "
        f"verdict {report['verdict']}"
    ]
    lines += [
        f"  rank {r['rank']}: {r['samples']} samples, {r['duplicates']} padded, "
        f"fingerprint {r['fingerprint']}{'' if r['matches'] else '  <-- MISMATCH'}"
        for r in report["ranks"]
    ]
    if "coverage" in report:
        lines.append(
            f"  coverage {report['coverage']:.4f} ({report['covered']} unique), "
            f"overlap {report['overlap']}, step time max/min {spread:.2f} "
            f"(slowest rank {slowest})"
        )
    log.info("\n".join(lines))
    if report["verdict"] != "ok":
        log.warning(
            "SHARD MISMATCH in epoch %d: %s — a rank saw data its sampler mode does not "
            "define (wrong seed on one rank? missing set_epoch? custom sampler?)",
            epoch,
            report["verdict"],
        )


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Rank 0's final metrics, written atomically so a reader never sees half a file."""
    path = run_dir / "summary.json"
    tmp = path.with_name("summary.json.tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(path)
    return path


PICTURE_MAX_N = 2_000_000  # above this, drawing every rank's shard would cost O(N) at start


def draw_shards_async(sampler: Any, run_dir: Path) -> Any:
    """Draw ``shards.png`` for the first epoch in a background thread (rank 0 only).

    matplotlib costs about a second to import and draw; a thread keeps that off the path to the
    first optimizer step. Returns the thread (join it before logging the image) or None.
    """
    if sampler.dataset_size > PICTURE_MAX_N:
        log.info("shards.png skipped: N=%d > %d", sampler.dataset_size, PICTURE_MAX_N)
        return None

    def draw() -> None:
        from ddp_template.data.samplers import ShardSampler
        from ddp_template.shard_plot import layout_from_sampler, save_layout_png

        layout = layout_from_sampler(
            ShardSampler,
            sampler.dataset_size,
            sampler.num_replicas,
            sampler.mode,
            sampler.shuffle,
            sampler.seed,
            sampler.epoch,
            sampler.permutation,
        )
        save_layout_png(run_dir / "shards.png", layout)

    thread = threading.Thread(target=draw, name="shards-png", daemon=True)
    thread.start()
    return thread
