"""Which samples did every rank train on at step S? Reconstructed, not logged.

    python -m ddp_template.replay <run_dir> --step S            # each rank's batch at step S
    python -m ddp_template.replay <run_dir> --step S --json     # one JSON object per rank
    python -m ddp_template.replay <run_dir> --step S --save batch.pt   # the tensors too
    python -m ddp_template.replay <run_dir> --step S --losses ckpt.pt  # each sample's loss
    python -m ddp_template.replay <run_dir> --step S --inputs   # each sample's input RMS
    python -m ddp_template.replay <run_dir> --index I           # every step that read sample I

The data order is a function of the run's config: the sampler (mode, permutation, seed),
N, the world size W, batch_size, optim.accumulate (a step's batch is all of its micro-batches),
max_steps_per_epoch and sampler.drop_last_batch. This reads
them from ``<run_dir>/.hydra/config.yaml`` (W from ``summary.json``, ``rank0/metrics.jsonl``
or ``checkpoints/last.pt``), builds each rank's sampler with the training's own builder and
evaluates only the step's positions: O(batch) time and memory at any N (randperm, used below
N = 2^24 unless configured otherwise, costs its O(N) permutation as in training). Steps are
numbered as the logs number them (the first optimizer step is 1); a resumed run keeps the
numbering, because it resumes at the exact position it stopped at. A run resumed at another
world size records its stretches (``stretches.json``: from which step it ran at which world size,
batch and accumulation, and which prefixes of that epoch came before), and each step is
replayed in its own stretch's deal. ``--index`` is O(1) per
epoch for Feistel or unshuffled runs and O(N) per epoch for randperm, refused beyond
``INDEX_MAX_RANDPERM`` permuted elements in all (minutes of work).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.utils.data import Dataset, default_collate

from ddp_template.checkpoint import checkpoint_file, whole
from ddp_template.checkpoint import load as load_checkpoint
from ddp_template.config import boundary
from ddp_template.config.schema import Config
from ddp_template.data.contract import MapData, Splits
from ddp_template.data.epoch_steps import EpochSteps
from ddp_template.data.sampler_modes import SAMPLER_MODES
from ddp_template.data.samplers import ShareSampler
from ddp_template.data.transforms import apply_transforms
from ddp_template.distributed import DistInfo
from ddp_template.elastic import read_stretches
from ddp_template.errors import ConfigError, Misfit, command
from ddp_template.kind import DataKind, kind_of
from ddp_template.models import build_model, weights_part
from ddp_template.rng import RngState
from ddp_template.spike import held_rms, sample_losses
from ddp_template.splits import build_splits
from ddp_template.task import build_task

INDEX_MAX_RANDPERM = 2**28  # N x epochs for --index under randperm: ~10 s on a 2-core CPU


@dataclass(frozen=True, kw_only=True)
class Piece:
    """One epoch (or the part of it) one stretch of the run trained: steps ``first_step`` on
    are its epoch's steps ``first_k`` on, ``steps`` of them, by ``sampler`` (rank 0's)."""

    epoch: int
    first_step: int
    first_k: int
    steps: int
    world_size: int
    sampler: ShareSampler
    epoch_steps: EpochSteps

    def span(self) -> tuple[int, int]:
        """The positions of every rank's list this piece read."""
        first, last = self.first_k, self.first_k + self.steps - 1
        return self.epoch_steps.span(first)[0], self.epoch_steps.span(last)[1]


@dataclass(frozen=True, kw_only=True)
class Run:
    """What the data order of a finished (or running) run depends on."""

    run_dir: Path
    cfg: Config
    world_size: int  # the first stretch's
    splits: Splits  # the run's data, built from its config
    kind: DataKind  # the training data's kind: it builds the sampler
    epoch_steps: EpochSteps  # the first stretch's epochs
    pieces: tuple[Piece, ...] = ()

    @property
    def train(self) -> Dataset:
        return self.splits.train

    def sampler(self, rank: int, world_size: int | None = None) -> ShareSampler:
        """Rank ``rank``'s training sampler, built exactly as ``train.py`` builds it."""
        world = world_size or self.world_size
        info = DistInfo(
            rank=rank,
            local_rank=rank,
            world_size=world,
            local_world_size=world,
            backend=None,
            device=torch.device("cpu"),
            host="replay",
        )
        cfg = self.cfg
        sampler = self.kind.sampler(
            self.train, cfg.sampler, seed=cfg.seed, info=info, loader=cfg.loader
        )
        return cast(ShareSampler, sampler)  # replay reads planned data

    @property
    def total_steps(self) -> int:
        last = self.pieces[-1] if self.pieces else None
        return last.first_step + last.steps - 1 if last else 0


def load_run(run_dir: Path, world_size: int | None = None) -> Run:
    """The run in ``run_dir``; ``world_size`` only for a directory that records none."""
    if not run_dir.is_dir():
        raise ConfigError(f"run dir {run_dir} does not exist; pass the directory of a run.")
    cfg = _config(run_dir)
    stretches = read_stretches(run_dir)
    world = _world_size(run_dir, world_size, stretches)
    splits = build_splits(cfg.data)
    train = cast(MapData, splits.train)  # replay: planned data
    rule = SAMPLER_MODES[str(cfg.sampler.mode)]
    epoch_steps = EpochSteps.of_run(
        cfg,
        length=rule.length(len(train), world),
        rank_lengths=tuple(rule.rank_length(len(train), r, world) for r in range(world)),
    )
    run = Run(
        run_dir=run_dir,
        cfg=cfg,
        world_size=world,
        splits=splits,
        kind=kind_of(splits),
        epoch_steps=epoch_steps,
    )
    first = {"first_step": 1, "epoch": 0, "position": 0, "world_size": world, "prior": []}
    first |= {"batch_size": cfg.loader.batch_size, "accumulate": cfg.optim.accumulate}
    return dataclasses.replace(run, pieces=tuple(_pieces(run, stretches or [first])))


def _pieces(run: Run, stretches: list[dict[str, Any]]) -> list[Piece]:
    """Every stretch's epochs, each the steps it trained before the next stretch began."""
    pieces = []
    for i, stretch in enumerate(stretches):
        end = stretches[i + 1]["first_step"] if i + 1 < len(stretches) else None
        loader = dataclasses.replace(run.cfg.loader, batch_size=stretch["batch_size"])
        optim = dataclasses.replace(run.cfg.optim, accumulate=stretch["accumulate"])
        cfg = dataclasses.replace(run.cfg, loader=loader, optim=optim)
        step, epoch, prior, position = (
            stretch["first_step"],
            stretch["epoch"],
            stretch["prior"],
            stretch["position"],
        )
        while epoch < cfg.epochs and (end is None or step < end):
            sampler = run.sampler(0, stretch["world_size"])
            sampler.set_epoch(epoch)
            if prior:
                sampler.continue_epoch(epoch, prior)
            steps_before = sum(p["steps"] for p in prior)
            epoch_steps = EpochSteps.of_sampler(cfg, sampler, steps_before=steps_before)
            first_k = epoch_steps.steps_done(position)
            steps = epoch_steps.from_step(step - 1, position).steps_left(position)  # max_steps
            steps = steps if end is None else min(steps, end - step)
            if steps > 0:
                piece = Piece(
                    epoch=epoch,
                    first_step=step,
                    first_k=first_k,
                    steps=steps,
                    world_size=stretch["world_size"],
                    sampler=sampler,
                    epoch_steps=epoch_steps,
                )
                pieces.append(piece)
            step, epoch, prior, position = step + steps, epoch + 1, [], 0
    return pieces


def _config(run_dir: Path) -> Config:
    """The run's composed config (written by rank 0), typed against this template's schema."""
    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        raise ConfigError(
            f"{path} is missing; replay needs the config rank 0 wrote there (pass the run's "
            f"own directory, not its checkpoints/ or rank<r>/ folder)."
        )
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path))
    except OmegaConfBaseException as exc:
        first = str(exc).splitlines()[0][:120]
        raise ConfigError(
            f"{path} does not fit this template's config schema ({first}); replay the run "
            f"with the template version that wrote it."
        ) from None
    assert isinstance(merged, DictConfig)  # a structured Config merged: a DictConfig
    return boundary.typed(merged)


def _world_size(run_dir: Path, given: int | None, stretches: list[dict[str, Any]]) -> int:
    """The (first stretch's) world size: recorded, or ``given`` for a run dir without one."""
    recorded = stretches[0]["world_size"] if stretches else _recorded_world_size(run_dir)
    sizes = " → ".join(str(s["world_size"]) for s in stretches) or str(recorded)
    if given is None:
        if recorded is None:
            raise ConfigError(
                f"run dir {run_dir} records no world size (no summary.json, rank0/metrics.jsonl "
                f"or checkpoints/last.pt); pass --world-size W."
            )
        return recorded
    if given < 1:
        raise ConfigError(f"--world-size {given} is not a number of ranks; pass 1 or more.")
    if recorded is not None and given != recorded:
        raise ConfigError(
            f"--world-size {given} contradicts the {sizes} ranks run dir {run_dir} records; "
            f"drop --world-size."
        )
    return given


def _recorded_world_size(run_dir: Path) -> int | None:
    """W from summary.json, else rank 0's first metrics line, else the last checkpoint."""
    summary = run_dir / "summary.json"
    if summary.is_file() and "world_size" in (recorded := json.loads(summary.read_text())):
        return int(recorded["world_size"])
    metrics = run_dir / "rank0" / "metrics.jsonl"
    if metrics.is_file():
        with open(metrics) as lines:
            for line in lines:
                row = json.loads(line) if line.strip() else {}
                if "data/world_size" in row:
                    return int(row["data/world_size"])
    checkpoint = run_dir / "checkpoints" / "last.pt"
    return int(load_checkpoint(checkpoint)["world_size"]) if checkpoint.is_file() else None


def piece_of(run: Run, step: int) -> Piece:
    """The piece of the run that trained optimizer step ``step``."""
    for piece in run.pieces:
        if piece.first_step <= step < piece.first_step + piece.steps:
            return piece
    if not run.pieces:
        raise ConfigError(
            f"step={step} does not exist: this run trains no step ({run.cfg.epochs} epochs)."
        )
    raise ConfigError(
        f"step={step} is outside this run's steps [1, {run.total_steps}]; pass a step in that "
        f"range."
    )


def step_rows(run: Run, step: int) -> list[dict[str, Any]]:
    """Each rank's epoch, position and dataset indices at optimizer step ``step``."""
    piece = piece_of(run, step)
    epoch_steps, sampler = piece.epoch_steps, piece.sampler  # index_at takes the rank
    start, stop = epoch_steps.span(piece.first_k + step - piece.first_step)
    rows = []
    for rank in range(piece.world_size):
        positions = np.arange(start, stop, dtype=np.int64)[: epoch_steps.held(rank, start, stop)]
        indices = sampler.index_at(positions, rank)  # `exact`: a shorter list may end here
        row: dict[str, Any] = {"step": step, "rank": rank, "epoch": piece.epoch, "position": start}
        row["world_size"] = piece.world_size
        row["indices"] = indices.tolist()
        if hasattr(run.train, "key_of"):  # sharded data: each sample's __key__ too
            row["keys"] = [run.train.key_of(i) for i in row["indices"]]
        rows.append(row)
    return rows


def index_hits(run: Run, index: int) -> list[dict[str, int]]:
    """Every (epoch, step, rank, position) at which dataset index ``index`` was trained on."""
    n = len(cast(MapData, run.train))
    if not 0 <= index < n:
        raise ConfigError(f"--index {index} is outside the training set [0, {n}); pass 0..{n - 1}.")
    sampler = run.sampler(0)
    work = n * len(run.pieces)
    if sampler.shuffle and sampler.permutation == "randperm" and work > INDEX_MAX_RANDPERM:
        raise ConfigError(
            f"--index on this run permutes N x epochs = {work:,} indices with randperm (more than "
            f"{INDEX_MAX_RANDPERM:,}, minutes of work); use --step, or replay a feistel run."
        )
    hits = []
    for piece in run.pieces:
        ranks, positions = piece.sampler.locate(index)
        lo, hi = piece.span()
        read = (positions >= lo) & (positions < hi)
        steps = piece.first_step + positions[read] // piece.epoch_steps.step_size - piece.first_k
        for rank, position, step in zip(ranks[read], positions[read], steps, strict=True):
            hit = {"epoch": piece.epoch, "step": int(step), "rank": int(rank)}
            hits.append(hit | {"position": int(position), "world_size": piece.world_size})
    return [hit | {"index": index} for hit in sorted(hits, key=lambda h: (h["step"], h["rank"]))]


def save_batch(run: Run, rows: list[dict[str, Any]], path: Path) -> Path:
    """Write the step's batch tensors (x, y, index per rank), loaded through the data config."""
    ranks = []
    for row in rows:
        x, y, index = default_collate([run.train[i] for i in row["indices"]])
        ranks.append({"rank": row["rank"], "x": x, "y": y, "index": index})
    first = rows[0]
    payload = {"step": first["step"], "epoch": first["epoch"], "position": first["position"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload | {"ranks": ranks}, path)
    return path


def step_losses(run: Run, rows: list[dict[str, Any]], checkpoint: str) -> str:
    """Each rank's per-sample losses at the step (``row["losses"]``, aligned with its indices)
    as spike forensics computes them (``spike.sample_losses``): the checkpoint's weights, the
    rank's RNG state from it, the rank's micro-batches in train mode. Exact with a checkpoint of
    the step before (what the step ran with); returns what the checkpoint is, for the reader."""
    checkpoint = checkpoint_file(checkpoint, said="--losses ", fix="pass a checkpoint of this run")
    payload = load_checkpoint(checkpoint, fix="pass a checkpoint of this run with --losses")
    cfg, first = run.cfg, rows[0]
    task = build_task(cfg.task)
    task.setup(run.splits.info, torch.device("cpu"))
    splits = task.training_data(apply_transforms(run.splits, cfg.transforms, cfg.seed), cfg.seed)
    splits.set_epoch(first["epoch"])
    model = build_model(cfg.model, splits.info)
    try:
        weights_part(model).load_state_dict(whole(checkpoint, payload, "model") or {})
    except Misfit as exc:
        raise ConfigError(f"--losses {checkpoint}: {exc}") from None
    model.train()
    size = piece_of(run, first["step"]).epoch_steps.batch_size
    ranks = payload["ranks"] if payload["world_size"] == first["world_size"] else None
    if task.batch_level:  # a sample's loss is against the step's micro-batch of every rank
        _global_losses(model, task, splits.train, rows, size, str(cfg.amp.mode))
        rows = []
    for row in rows:
        if ranks is not None:  # the RNG this rank's forwards drew from (dropout)
            RngState().load_state_dict(ranks[row["rank"]]["rng"])
        chunks = [row["indices"][i : i + size] for i in range(0, len(row["indices"]), size)]
        batches = [(*default_collate([splits.train[i] for i in c])[:2], c, None) for c in chunks]
        _, losses = sample_losses(model, task, batches, str(cfg.amp.mode), torch.device("cpu"))
        row["losses"] = losses.tolist()
    at = payload["progress"]["step"]
    exact = "the step before: the weights step" if at == first["step"] - 1 else "not the step"
    return f"losses with the weights of step {at} ({exact} {first['step']} ran with)"


def step_inputs(run: Run, rows: list[dict[str, Any]]) -> None:
    """Each rank's per-sample input RMS at the step (``row["inputs"]``, aligned with its
    indices) as spike forensics computes them (``spike.input_rms``): no checkpoint needed, the
    inputs are the data's (the run's transforms, the step's epoch)."""
    splits = apply_transforms(run.splits, run.cfg.transforms, run.cfg.seed)
    splits.set_epoch(rows[0]["epoch"])
    for row in rows:
        batches = [(*_one(splits, i), [i], None) for i in row["indices"]]
        row["inputs"] = held_rms(batches, len(row["indices"])).tolist()


def _one(splits: Any, index: int) -> tuple[Any, Any]:
    x, y, _ = default_collate([splits.train[index]])
    return x, y


def _global_losses(
    model: Any, task: Any, train: Any, rows: list[dict[str, Any]], size: int, amp: str
) -> None:
    """A batch-level task's (``task=contrastive``): micro-batch ``k`` of the step is every
    rank's ``k``-th, joined in rank order as the training's gather joined them, and each
    sample's loss is its contribution against all of them (``task.sample_losses``)."""
    chunks = [[r["indices"][i : i + size] for i in range(0, len(r["indices"]), size)] for r in rows]
    for row in rows:
        row["losses"] = []
    for k in range(max((len(c) for c in chunks), default=0)):
        joined = [(row, c[k]) for row, c in zip(rows, chunks, strict=True) if k < len(c)]
        every = [i for _, c in joined for i in c]
        x, y = default_collate([train[i] for i in every])[:2]
        _, losses = sample_losses(model, task, [(x, y, every, None)], amp, torch.device("cpu"))
        at = 0
        for row, c in joined:
            row["losses"] += losses[at : at + len(c)].tolist()
            at += len(c)


def _print_step(run: Run, rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return
    first = rows[0]
    piece = piece_of(run, first["step"])
    k = piece.first_k + first["step"] - piece.first_step + 1
    rest = " of the rest after a resize" if piece.sampler.prior else ""
    print(
        f"{run.run_dir}: step {first['step']} of {run.total_steps} = epoch {first['epoch']}, "
        f"step {k} of {piece.epoch_steps.steps_per_epoch}{rest}; {piece.world_size} ranks, "
        f"batch_size {piece.epoch_steps.batch_size} x accumulate {piece.epoch_steps.accumulate}"
    )
    for row in rows:
        print(f"rank {row['rank']}: epoch {row['epoch']}, position {row['position']}: ", end="")
        print(" ".join(map(str, row["indices"])) or "none (sampler=exact: its list has ended)")
        if "losses" in row:
            ranked = sorted(zip(row["losses"], row["indices"], strict=True), reverse=True)
            print("  losses, highest first: " + " ".join(f"{i}:{v:.4g}" for v, i in ranked))
        if "inputs" in row:
            ranked = sorted(zip(row["inputs"], row["indices"], strict=True), reverse=True)
            print("  input RMS, highest first: " + " ".join(f"{i}:{v:.4g}" for v, i in ranked))


def _print_hits(index: int, hits: list[dict[str, int]], as_json: bool) -> None:
    if as_json:
        for hit in hits:
            print(json.dumps(hit))
        return
    print(f"index {index}: trained on {len(hits)} time(s)")
    for h in hits:
        print(f"epoch {h['epoch']}, step {h['step']}, rank {h['rank']}, position {h['position']}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_template.replay",
        description="Reconstruct which samples each rank trained on, from a run's config.",
    )
    parser.add_argument("run_dir", type=Path, help="the run directory (holds .hydra/)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--step", type=int, help="optimizer step, 1-based as the logs count")
    what.add_argument("--index", type=int, help="list every step that trained on this sample")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--save", type=Path, help="with --step: write the batch tensors here")
    parser.add_argument(
        "--losses",
        metavar="CHECKPOINT",
        help="with --step: each sample's loss, with this checkpoint's weights (exact: step S-1's)",
    )
    parser.add_argument(
        "--inputs",
        action="store_true",
        help="with --step: each sample's input RMS (what spike.watch=input judges)",
    )
    parser.add_argument("--world-size", type=int, help="only for a run dir that records none")
    return parser


@command
def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    for flag in ("save", "losses", "inputs"):
        if getattr(args, flag) not in (None, False) and args.step is None:
            raise ConfigError(f"--{flag} needs --step S; pass the step it is about.")
    run = load_run(args.run_dir, args.world_size)
    if args.index is not None:
        _print_hits(args.index, index_hits(run, args.index), args.json)
        return
    rows = step_rows(run, args.step)
    if args.losses is not None:
        print(step_losses(run, rows, args.losses), file=sys.stderr)
    if args.inputs:
        step_inputs(run, rows)
    _print_step(run, rows, args.json)
    if args.save is not None:
        path = save_batch(run, rows, args.save)
        print(f"saved {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
