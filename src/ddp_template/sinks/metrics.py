"""The metrics sink: console and file, per-rank JSONL, and W&B in the chosen runs (logger.runs).

Every rank writes ``<run_dir>/rank<r>/metrics.jsonl`` (always). With ``logger=wandb`` the same
keys go to W&B: one run per rank grouped by the run id (``per_rank``), or one run for the job
(``main``, ``shared``) holding rank 0's rows plus every rank's per-epoch numbers as
``<key>/rank<r>`` (see ``wandb_run``). W&B trouble never stops training: a failed start falls back
to offline, then to JSONL only.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ddp_template import fencing
from ddp_template.config.schema import LoggerConfig, LoggerName, WandbRuns
from ddp_template.distributed import DistInfo, barrier, gather_objects
from ddp_template.ledger.records import EpochReport, PriorLine, RankLine, WorkerLine
from ddp_template.run_identity import RunInfo
from ddp_template.sinks.console import report_lines, split_sizes, write_summary
from ddp_template.sinks.wandb_run import Runs, choose_runs, start_wandb, wandb_id
from ddp_template.spike import SpikeReport
from ddp_template.storage import is_url, name_of

log = logging.getLogger("ddp_template")


class RankLogger:
    """One rank's metrics sink (JSONL + optional W&B)."""

    def __init__(
        self, *, cfg: LoggerConfig, run: RunInfo, info: DistInfo, config: dict[str, Any]
    ) -> None:
        """``config`` is the whole run's config as plain containers (W&B's run config)."""
        self.info, self.run, self.cfg, self.config = info, run, cfg, config
        self.rank_dir = run.run_dir / f"rank{info.rank}"
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.rank_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        self._wandb: Any = None
        self._wandb_thread: threading.Thread | None = None
        self.bar: Any = None
        self.runs: Runs | None = None
        self._epoch_ranks: list[dict[str, Any]] | None = None  # one run: rank 0's last gather
        self._spikes: list[list[dict[str, Any]]] = []  # this epoch's spike samples, per report
        self._alerted: set[str] = set()
        if cfg.name != LoggerName.wandb:
            return
        self.runs = choose_runs(cfg, info.world_size)
        if info.is_main:
            log.info("W&B runs %s (%s)", self.runs.name, self.runs.reason)
            if self.runs.fallback:
                log.warning("logger.runs=shared falls back to main: %s", self.runs.fallback)
        if self.runs.starts_run(info) and not self._joins_later:
            # W&B's import and service start take ~1 s: overlap them with building the data,
            # model and DDP; the first use of ``self.wandb`` waits for it.
            self._wandb_thread = threading.Thread(
                target=self._start_wandb, name="wandb-init", daemon=True
            )
            self._wandb_thread.start()

    def regroup(self, info: DistInfo) -> None:
        """fault_tolerance=live: this process's place in the regrouped ranks (its files and
        its W&B run stay its own; rank 0's duties move to the new rank 0)."""
        self.info = info

    @property
    def _joins_later(self) -> bool:
        """A shared-mode worker joins the primary's run only once it exists (in ``ready``)."""
        runs = self.runs
        return runs is not None and runs.name == WandbRuns.shared and not self.info.is_main

    @property
    def _history(self) -> bool:
        """Whether this rank's rows go to W&B."""
        return self.runs is not None and self.runs.logs_history(self.info)

    def wait_ready(self) -> None:
        """Wait until this rank's W&B run has started (or given up)."""
        if self._wandb_thread is not None:
            self._wandb_thread.join()
            self._wandb_thread = None

    def ready(self) -> None:
        """A collective: when it returns, every rank's W&B run exists, so nobody logs early."""
        self.wait_ready()
        barrier(self.info)
        if self._joins_later:
            self._start_wandb()

    @property
    def wandb(self) -> Any:
        """The W&B run (None with logger=none or when W&B could not start)."""
        self.wait_ready()
        return self._wandb

    def _start_wandb(self) -> None:
        assert self.runs is not None
        self._wandb = start_wandb(
            self.cfg, self.runs, run=self.run, info=self.info, config=self.config
        )

    @property
    def wandb_id(self) -> str | None:
        return self.wandb.id if self.wandb is not None else None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._log_wandb(self._write({"step": step, **metrics}))

    def _write(self, row: dict[str, Any]) -> dict[str, Any]:
        """One row of this rank's metrics.jsonl, with its writer's fencing token (live)."""
        row = fencing.stamped(row, "a metrics row")
        self.jsonl.write(json.dumps(row) + "\n")
        return row

    def _log_wandb(self, row: dict[str, Any]) -> None:
        if self._history and self.wandb is not None:
            self.wandb.log(row)

    def log_epoch(self, metrics: dict[str, Any], step: int) -> None:
        """This rank's per-epoch numbers. With one W&B run (main, shared) a collective: every
        rank's numbers reach rank 0 and its run as ``<key>/rank<r>``."""
        self.log(metrics, step)
        if self.runs is None or not self.runs.one_run:
            return
        mine = {k: v for k, v in metrics.items() if k != "epoch"}
        ranks = gather_objects(mine, self.info)
        if self.info.is_main:
            self._epoch_ranks = ranks
            row = {f"{k}/rank{r}": v for r, m in enumerate(ranks) for k, v in m.items()}
            self._log_wandb({"step": step, "epoch": metrics["epoch"], **row})

    def log_resume(self, line: str, step: int) -> None:
        """Rank 0: the resume's provenance line on the console, in the JSONL and in the W&B
        run's summary (``resume``)."""
        if not self.info.is_main:
            return
        log.info("%s", line)
        self._write({"step": step, "resume": line})
        if self.wandb is not None:
            self.wandb.summary["resume"] = line

    def log_spike(self, report: SpikeReport, step: int, top: int) -> None:
        """A step the spike rule caught, as this rank recorded it: its own samples to
        ``rank<r>/spikes.jsonl`` (with the signals that fired), the console line, the signals'
        values (``spikes/loss``, ``spikes/grad_norm``, ``spikes/input``, ``spikes/fired_<signal>``)
        and the report's samples to this rank's W&B run (``spikes/samples``; with one W&B run,
        ``log_spikes`` gathers them there)."""
        with open(self.rank_dir / "spikes.jsonl", "a") as f:
            f.write(json.dumps(fencing.stamped(report.own(), "a spike row")) + "\n")
        if report.fired or self.info.is_main:  # agreed skips: rank 0 speaks for the others
            log.warning("%s", report.line(top))
        values = {f"spikes/{k}": v for k, (v, _) in report.measured.items() if k != "loss"}
        fired = {f"spikes/fired_{k}": 1 for k in report.signals}
        self.log(
            {"spikes/loss": report.loss, "spikes/median": report.median} | values | fired, step
        )
        rows = [{"step": step, **asdict(s)} for s in report.samples]
        if self.runs is not None and self.runs.one_run:  # each rank's own, gathered later
            self._spikes.append([r for r in rows if r["rank"] == self.info.rank])
        else:
            self.log_table("spikes/samples", rows, step)

    def log_spikes(self, step: int) -> None:
        """With one W&B run (``main``, ``shared``): the epoch's spike samples of every rank to
        it (a collective at the epoch's end; nothing to gather is gathered as nothing)."""
        if self.runs is None or not self.runs.one_run:
            return
        ranks = gather_objects([row for rows in self._spikes for row in rows], self.info)
        self._spikes = []
        rows = sorted((r for rows in ranks for r in rows), key=lambda r: -r["loss"])
        if self.info.is_main:
            self.log_table("spikes/samples", rows, step)

    def log_sizes(self, splits: Any, step: int) -> None:
        """Rank 0 records the dataset sizes once, next to its eval metrics."""
        if self.info.is_main:
            sizes = split_sizes(splits) | {"world_size": self.info.world_size}
            self.log({f"data/{k}": v for k, v in sizes.items()}, step)

    def log_global_batch(self, batch_size: int, accumulate: int, step: int) -> None:
        """Rank 0 says and records the effective global batch once."""
        if self.info.is_main:
            n = batch_size * self.info.world_size * accumulate
            log.info("effective global batch %d (batch_size x world size x accumulate)", n)
            self.log({"train/global_batch": n}, step)

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
        if self.cfg.step_lines and self.info.is_main:  # logger.step_lines
            log.info("%s", step_line(metrics, step))
        if self.bar is not None:
            self.bar.set_postfix(
                step=step,
                loss=f"{metrics.get('train/loss', float('nan')):.4f}",
                sps=f"{metrics['perf/interval_samples_per_s']:.0f}",
            )

    def end_epoch(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def log_table(self, key: str, rows: list[dict[str, Any]], step: int) -> None:
        if self._history and self.wandb is not None and rows:
            import wandb

            columns = list(rows[0])
            header: list[str | int] = [*columns]  # W&B's stub: str | int names
            table = wandb.Table(columns=header, data=[[r[c] for c in columns] for r in rows])
            self.wandb.log({key: table, "step": step})

    def log_image(self, key: str, path: Path) -> None:
        if self._history and self.wandb is not None and path.exists():
            import wandb

            self.wandb.log({key: wandb.Image(str(path))})

    def finish_run(self, result: Any, splits: Any, steps: int, picture: Any) -> None:
        """Rank 0: the shares picture to W&B, summary.json, and the closing lines."""
        if picture is not None:
            picture.join()
            self.log_image("shares/picture", self.run.run_dir / "shares.png")
        if not self.info.is_main:
            return
        path = write_summary(
            self.run.run_dir,
            {
                **result.summary(),
                **split_sizes(splits),
                "world_size": self.info.world_size,
                "steps": steps,
                "run_id": self.run.run_id,
            },
        )
        log.info("final %s %s — run dir %s", result.split, result.headline, self.run.run_dir)
        log.info("summary: %s", path)

    def log_eval(self, result: Any, epoch: int, step: int, split: str) -> None:
        """``<split>/<metric>`` for each of the task's metrics."""
        self.log({**result.metrics(split), "epoch": epoch}, step)
        log.info("epoch %d: %s %s", epoch, split, result.line)

    def log_share_report(self, report: EpochReport, epoch: int, step: int) -> None:
        """Rank 0: the verdict, coverage and step-time spread as keys, a table and a console
        block; a warning when any rank saw data its sampler mode does not define."""
        summary = {
            "shares/verdict_ok": int(report.verdict.ok),
            "shares/total_samples": report.total_samples,
            "perf/step_s_max_over_min": report.step_s_max_over_min,
            "perf/slowest_rank": report.slowest_rank,
        }
        c = report.coverage
        counts = {
            "coverage": c.fraction if c else None,
            "overlap": c.overlap if c else None,
            "repeats": c.repeats if c else None,
            "unread": report.unread_samples,
            "replayed": report.replayed,
        }
        summary |= {f"shares/{key}": n for key, n in counts.items() if n is not None}
        self.log(summary, step)
        rows = table_rows(report.ranks)
        if self._epoch_ranks is not None:  # one run: every rank's epoch numbers in its row
            rows = [{**row, **self._epoch_ranks[row["rank"]]} for row in rows]
        self.log_table("shares/report", rows, step)
        if report.workers:  # sharded data: every (rank, loader worker)
            self.log_table("shares/workers", table_rows(report.workers), step)
        if report.prior:  # resumed at another world size: the old ranks' prefix
            self.log_table("shares/prior", table_rows(report.prior), step)
        log.info("\n".join(report_lines(report, epoch)))
        if not report.verdict.ok:
            hint = report.hint or (
                "a rank saw data its sampler mode does not define (wrong seed on one rank? "
                "missing set_epoch? custom sampler?)"
            )
            log.warning("SHARE MISMATCH in epoch %d: %s — %s", epoch, report.verdict, hint)
            self._alert_once("SHARE MISMATCH", f"epoch {epoch}: {report.verdict}")
        ratio, limit = report.step_s_max_over_min, self.cfg.straggler_alert
        if limit is not None and ratio > limit:
            text = (
                f"epoch {epoch}: rank {report.slowest_rank}'s step time is {ratio:.2f}x the "
                f"fastest rank's (logger.straggler_alert={limit})"
            )
            log.warning("STRAGGLER in %s", text)
            self._alert_once("STRAGGLER", text)

    def _alert_once(self, title: str, text: str) -> None:
        """A W&B alert (mail/Slack when online), at most once per title and run."""
        if title in self._alerted or not self._history or self.wandb is None:
            return
        self._alerted.add(title)
        import wandb

        try:
            self.wandb.alert(title=title, text=text, level=wandb.AlertLevel.WARN)  # type: ignore[attr-defined]  # exported lazily
        except Exception as exc:  # W&B must never stop training
            log.warning("W&B alert %r failed (%s)", title, exc)

    def log_checkpoint(
        self,
        path: str | None,
        *,
        kind: str,
        step: int,
        epoch: int,
        metrics: dict[str, Any],
        rewritten: bool = True,
        slices: str | None = None,
    ) -> None:
        """Rank 0: checkpoint ``path`` as a new version of the run's ``model`` artifact, when
        ``logger.log_checkpoints`` is ``kind`` (last, best) and the file was ``rewritten`` at
        this epoch's end. Aliases ``kind`` and ``epoch-<e>``; metadata step, epoch, metrics.
        A sliced checkpoint's DCP directory (``slices``) goes with it, where the file finds it.
        Offline, W&B keeps a copy of the file until ``wandb sync`` uploads it; a checkpoint in
        an object store (``s3://``) is logged as a reference to it, never copied."""
        if kind != self.cfg.log_checkpoints or not rewritten or path is None:
            return
        if not (self.info.is_main and self._history and self.wandb is not None):
            return
        import wandb

        try:
            artifact = wandb.Artifact(
                name=f"checkpoint-{wandb_id(self.run.run_id)}",
                type="model",
                metadata={"kind": kind, "step": step, "epoch": epoch, **metrics},
            )
            named = {name_of(path): path} | (
                {f"slices/{name_of(slices)}": slices} if slices else {}
            )
            for name, where in named.items():
                if is_url(where):
                    artifact.add_reference(where, name=name, checksum=False)
                elif Path(where).is_dir():
                    artifact.add_dir(where, name=name)
                else:
                    artifact.add_file(where, name=name)
            self.wandb.log_artifact(artifact, aliases=[kind, f"epoch-{epoch}"])
        except Exception as exc:  # W&B must never stop training
            log.warning("W&B could not log checkpoint %s (%s)", path, exc)

    def finish(self, exit_code: int = 0) -> None:
        """Close the JSONL and the W&B run; called on every exit path."""
        self.end_epoch()
        if not self.jsonl.closed:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code=exit_code)
            self._wandb = None


def step_line(metrics: dict[str, Any], step: int) -> str:
    """An interval's row as one line, as nanoGPT prints its ``iter`` lines: this rank's loss
    and samples/s over the interval, the LR and grad norm at its last step, its ms per step."""
    return (
        f"step {step}: loss {metrics.get('train/loss', float('nan')):.4f}, "
        f"lr {metrics['train/lr']:.3e}, grad norm {metrics['train/grad_norm']:.3f}, "
        f"{metrics['perf/interval_samples_per_s']:.0f} samples/s, "
        f"{metrics['perf/interval_step_ms']:.1f} ms/step"
    )


def table_rows(lines: Sequence[RankLine | WorkerLine | PriorLine]) -> list[dict[str, Any]]:
    """A report's lines as W&B table rows, a column per field it has (planned data's worker
    lines have no ``duplicates``)."""
    return [{k: v for k, v in asdict(line).items() if v is not None} for line in lines]
