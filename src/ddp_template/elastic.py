"""Resuming at another world size: the ``elastic`` builder decides how the run goes on.

A checkpoint written by W ranks and resumed by W' continues the run (``elastic.on_resize``):
the parts that are the same on every rank load as they are, the per-rank parts are re-dealt
(``load_resized``: the sampler deals the rest of the interrupted epoch, the ledgers of the old
ranks travel with the epoch, each new rank's RNGs start as a fresh rank's). What this module
owns is the optimizer's view: with ``elastic.global_batch=keep`` the global batch
``batch_size x W x accumulate`` stays, so steps per epoch and the LR schedule go on as if
nothing happened; with ``scale`` the per-rank batch stays and the LR schedule is re-derived.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_template import fencing
from ddp_template.checkpoint import Found
from ddp_template.config.choices import GlobalBatch, OnResize
from ddp_template.config.schema import Config, ElasticConfig
from ddp_template.distributed import DistInfo
from ddp_template.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Resize:
    """A resume at another world size: from what to what, at which step, with which batch."""

    world_from: int
    world_to: int
    step: int
    epoch: int
    position: int  # the old ranks' position in the interrupted epoch (0: at an epoch end)
    batch_from: tuple[int, int]  # (batch_size, accumulate) of the checkpoint's run
    batch_to: tuple[int, int]  # (batch_size, accumulate) from here on
    global_batch: str  # keep | scale

    def global_sizes(self) -> tuple[int, int]:
        (b, a), (b2, a2) = self.batch_from, self.batch_to
        return b * self.world_from * a, b2 * self.world_to * a2

    def adjust(self, cfg: Config) -> Config:
        """``cfg`` with this run's per-rank batch and accumulation."""
        batch, accumulate = self.batch_to
        return dataclasses.replace(
            cfg,
            loader=dataclasses.replace(cfg.loader, batch_size=batch),
            optim=dataclasses.replace(cfg.optim, accumulate=accumulate),
        )

    def describe(self) -> str:
        (b, a), (b2, a2) = self.batch_from, self.batch_to
        g, g2 = self.global_sizes()
        where = f"epoch {self.epoch}, " + (
            f"the rest of it after position {self.position} dealt to {self.world_to} "
            + ("rank" if self.world_to == 1 else "ranks")
            if self.position
            else "from its start"
        )
        return (
            f"world size {self.world_from} → {self.world_to} at step {self.step} ({where}); "
            f"global batch {g} → {g2} (elastic.global_batch={self.global_batch}: batch_size "
            f"{b} → {b2}, accumulate {a} → {a2}); each new rank's RNGs start as a fresh rank's"
        )

    def record(self) -> dict[str, Any]:
        """For the W&B config and the logs."""
        g, g2 = self.global_sizes()
        return {
            "world_size_from": self.world_from,
            "world_size": self.world_to,
            "step": self.step,
            "epoch": self.epoch,
            "position": self.position,
            "global_batch_from": g,
            "global_batch": g2,
            "batch_size": self.batch_to[0],
            "accumulate": self.batch_to[1],
        }


def plan_resize(
    cfg: ElasticConfig, *, found: Found | None, run: Config, info: DistInfo, regroup: bool = False
) -> Resize | None:
    """The resize ``found`` asks of this run, or None at the checkpoint's own world size;
    refuses (one sentence) what ``elastic`` does not allow. A live ``regroup`` (the state
    handed over by the ranks that survived) is always one, at any size, whatever
    ``elastic.on_resize`` says of checkpoints on disk: its members are other processes."""
    if found is None or (found.payload["world_size"] == info.world_size and not regroup):
        return None
    path, payload = found
    world = int(payload["world_size"])
    if cfg.on_resize == OnResize.refuse and not regroup:
        raise ConfigError(
            f"checkpoint {path} was written with world size {world} but this run has "
            f"{info.world_size} ranks and elastic.on_resize=refuse; resume with {world} ranks "
            f"(dist.nproc / --nproc-per-node), set elastic.on_resize=continue, or start fresh "
            f"with resume=never."
        )
    progress = payload.get("progress", {})
    if "batch_size" not in progress:
        raise ConfigError(
            f"checkpoint {path} is of the format written before elastic resume (its progress "
            f"part records no batch_size), so it resumes only at its own world size {world}; "
            f"resume with {world} ranks, or start fresh with resume=never."
        )
    before = (int(progress["batch_size"]), int(progress["accumulate"]))
    after = _batch_at(cfg, before, world, info.world_size, run, path)
    return Resize(
        world_from=world,
        world_to=info.world_size,
        step=int(progress["step"]),
        epoch=int(progress["epoch"]),
        position=int(progress["position"]),
        batch_from=before,
        batch_to=after,
        global_batch=str(cfg.global_batch),
    )


def _batch_at(
    cfg: ElasticConfig, before: tuple[int, int], world: int, world_to: int, run: Config, path: Any
) -> tuple[int, int]:
    """(batch_size, accumulate) at ``world_to``: the configured ones (``scale``), or the pair
    keeping the global batch with the largest per-rank batch up to the configured one."""
    if cfg.global_batch == GlobalBatch.scale:
        return run.loader.batch_size, run.optim.accumulate
    batch, accumulate = before
    global_batch = batch * world * accumulate
    if global_batch % world_to:
        raise ConfigError(
            f"checkpoint {path} trained with the global batch {global_batch} (batch_size {batch} "
            f"x {world} ranks x accumulate {accumulate}), which {world_to} ranks cannot keep "
            f"({global_batch} does not divide by {world_to}); set elastic.global_batch=scale to "
            f"keep the per-rank batch and re-derive the LR schedule, or resume with a world "
            f"size that divides {global_batch}."
        )
    per_rank, limit = global_batch // world_to, run.loader.batch_size
    steps = next(a for a in range(1, per_rank + 1) if per_rank % a == 0 and per_rank // a <= limit)
    return per_rank // steps, steps


STRETCHES = "stretches.json"
_SHAPE = ("world_size", "batch_size", "accumulate")


def record_stretch(run_dir: Path, *, cfg: Config, state: Any, world_size: int) -> None:
    """``<run_dir>/stretches.json``: every stretch of the run at one (world size, batch,
    accumulate), from its first step, with the prefixes of its first epoch read before it, so
    ``replay`` answers across a resize. Stretches past the step resumed at (trained, then lost
    with the checkpoint that was not written) are dropped."""
    path = run_dir / STRETCHES
    kept = [s for s in read_stretches(run_dir) if s["first_step"] <= state.step]
    stretch = {
        "first_step": state.step + 1,
        "epoch": state.epoch,
        "position": state.position,
        "world_size": world_size,
        "batch_size": cfg.loader.batch_size,
        "accumulate": cfg.optim.accumulate,
        "prior": [{k: v for k, v in p.items() if k != "ledgers"} for p in state.prior],
    }
    same = bool(kept) and all(kept[-1][k] == stretch[k] for k in _SHAPE)
    rows = kept + ([] if same else [stretch])
    fencing.token("the stretches")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rows, indent=1) + "\n")
    os.replace(tmp, path)


def read_stretches(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / STRETCHES
    return json.loads(path.read_text()) if path.is_file() else []
