"""Atomic checkpoints and resume: the newest valid checkpoint, restored bit-identically.

A checkpoint holds everything an uninterrupted run would still have in memory: weights,
optimizer, schedule, GradScaler, the EMA (``"ema"``), the step and the sampler position within
the epoch, and the RNG states of every rank. Restoring all of it makes a resumed run
bit-identical to one that was never stopped. Files are written to a temporary name, flushed to
disk and renamed over the old one, so a crash mid-write never replaces a good checkpoint with
half a file.
"""

from __future__ import annotations

import logging
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from ddp_template.config import CheckpointConfig
from ddp_template.distributed import DistInfo, broadcast_object, gather_objects
from ddp_template.engine import Trainer, TrainState
from ddp_template.errors import ConfigError
from ddp_template.models import LoadReport, load_matching

log = logging.getLogger("ddp_template")
FORMAT_VERSION = 2


def save_atomic(payload: dict[str, Any], path: Path) -> None:
    """Write to ``<path>.tmp``, fsync, then rename over ``path`` (atomic on POSIX)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


RESUME_FIX = "pass another file with resume=<path>, or resume=never to start fresh"


def load(path: Path, fix: str = RESUME_FIX) -> dict[str, Any]:
    """Load with ``weights_only=True``: a checkpoint file cannot run code."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(
            f"checkpoint {path} cannot be read ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:100]}); it is damaged or not a checkpoint of this "
            f"template: {fix}."
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
        raise ConfigError(
            f"checkpoint {path} is not a format-{FORMAT_VERSION} checkpoint of this template; "
            f"{fix}."
        )
    return payload


def _rng_state() -> dict[str, Any]:
    """This rank's RNG states as plain bytes/ints: they travel through all_gather_object and
    load under ``weights_only=True``."""
    np_state = np.random.get_state()
    py_version, py_state, _ = random.getstate()
    state = {
        "torch": torch.get_rng_state().numpy().tobytes(),
        "python": list(py_state),
        "python_version": py_version,
        "numpy": np_state[1].tobytes(),
        "numpy_pos": int(np_state[2]),
    }
    # is_initialized, not is_available: a gloo rank on a GPU host must not create a CUDA context.
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    return state


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    random.setstate((state["python_version"], tuple(state["python"]), None))
    np_keys = np.frombuffer(state["numpy"], dtype=np.uint32).copy()
    np.random.set_state(("MT19937", np_keys, state["numpy_pos"], 0, 0.0))
    if "cuda" in state and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(_bytes_tensor(state["cuda"]))


class Found(NamedTuple):
    """A checkpoint chosen for resuming, already loaded."""

    path: Path
    payload: dict[str, Any]


class Saved(NamedTuple):
    """What one ``Checkpointer.save`` wrote (on rank 0; the same answer on every rank)."""

    last: Path | None
    best: Path | None  # best.pt, when this save was a new best of checkpoint.monitor


def _epoch_number(path: Path) -> int:
    m = re.fullmatch(r"epoch_(\d+)\.pt", path.name)
    return int(m.group(1)) if m else -1


@dataclass(kw_only=True)
class Checkpointer:
    """Built once with what it saves; rank 0 writes and every rank contributes its RNG state
    and sampler position (``save`` is a collective: call it on all ranks)."""

    directory: Path
    cfg: CheckpointConfig
    trainer: Trainer
    config_yaml: str  # the resolved config, stored for the record
    info: DistInfo
    best_value: float | None = None  # of checkpoint.monitor, over the run's epochs so far
    best_epoch: int | None = None

    def payload(self, state: TrainState) -> dict[str, Any]:
        tr = self.trainer
        mine = {"rng": _rng_state(), "sampler": tr.sampler.state_dict(state.position)}
        ranks = gather_objects(mine, self.info)
        ema = {"ema": tr.ema.state_dict()} if tr.ema is not None else {}
        return ema | {
            "format": FORMAT_VERSION,
            "model": tr.module.state_dict(),
            "optimizer": tr.optimizer.state_dict(),
            "scheduler": tr.scheduler.state_dict(),
            "scaler": tr.scaler.state_dict(),
            "epoch": state.epoch,
            "step": state.step,
            "position": state.position,
            "sampler": [r["sampler"] for r in ranks],
            "rng": [r["rng"] for r in ranks],
            "world_size": self.info.world_size,
            "accumulate": _accumulate(tr),
            "config": self.config_yaml,
            "best": self.best_record(),
        }

    def best_record(self) -> dict[str, Any] | None:
        if self.cfg.monitor is None:
            return None
        return {"monitor": self.cfg.monitor, "value": self.best_value, "epoch": self.best_epoch}

    def restore_best(self, payload: dict[str, Any]) -> None:
        """Resume the best-so-far of a checkpoint that monitored the same metric."""
        record = payload.get("best")
        if record is not None and record["monitor"] == self.cfg.monitor:
            self.best_value, self.best_epoch = record["value"], record["epoch"]

    def improves(self, metrics: dict[str, float], epoch: int) -> bool:
        """Record ``metrics[checkpoint.monitor]`` of ``epoch``; True when it is a new best.
        Every rank holds the same all-reduced metrics, so every rank decides alike."""
        if self.cfg.monitor is None:
            return False
        if self.cfg.monitor not in metrics:
            raise ConfigError(
                f"checkpoint.monitor={self.cfg.monitor} is not logged by this run (it logs "
                f"{sorted(metrics)}); monitor one of those."
            )
        value = float(metrics[self.cfg.monitor])
        best = self.best_value
        better = best is None or (value > best if self.cfg.mode == "max" else value < best)
        if better:
            self.best_value, self.best_epoch = value, epoch
        return better

    def stale_epochs(self, epoch: int) -> int:
        """Epochs up to ``epoch`` since the best one (0 while none is recorded)."""
        return 0 if self.best_epoch is None else epoch - self.best_epoch

    @property
    def last(self) -> Path | None:
        """The newest checkpoint's path (None with checkpoint.enabled=false)."""
        return self.directory / "last.pt" if self.cfg.enabled else None

    def save(self, state: TrainState, epoch_end: bool = False, best: bool = False) -> Saved:
        """last.pt (and epoch_<k>.pt at epoch ends); with ``best`` also best.pt, the same
        payload, written atomically as well."""
        path = self.last
        if path is None:
            return Saved(None, None)
        best_path = self.directory / "best.pt" if best else None
        payload = self.payload(state)
        if self.info.is_main:
            save_atomic(payload, path)
            if epoch_end and self.cfg.keep > 0:
                save_atomic(payload, self.directory / f"epoch_{state.epoch}.pt")
                self._prune()
            if best_path is not None:
                save_atomic(payload, best_path)
        if self.info.distributed:
            dist.barrier()  # nobody runs ahead (or exits) before the file is in place
        return Saved(path, best_path)

    def due(self, step: int) -> bool:
        every = self.cfg.every_steps
        return self.cfg.enabled and every > 0 and step % every == 0

    def _prune(self) -> None:
        epochs = sorted(self.directory.glob("epoch_*.pt"), key=_epoch_number)
        for old in epochs[: max(0, len(epochs) - self.cfg.keep)]:
            old.unlink()


def candidates(directory: Path) -> list[Path]:
    """Checkpoints in a run dir, newest first: last.pt, then epoch_<k>.pt by k descending."""
    epochs = sorted(directory.glob("epoch_*.pt"), key=_epoch_number, reverse=True)
    last = directory / "last.pt"
    return ([last] if last.exists() else []) + epochs


def find_resume(resume: str, directory: Path) -> Found | None:
    """The checkpoint to resume from, already loaded; damaged ones are reported and skipped.

    ``never``: start fresh. ``auto``: the newest valid checkpoint in the run directory, or
    none. Anything else is a path that must load. Nothing is ever deleted here.
    """
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"resume={resume} is not a file; give a checkpoint path, resume=auto or "
                f"resume=never."
            )
        return Found(path, load(path))
    for path in candidates(directory):
        try:
            return Found(path, load(path))
        except ConfigError as exc:
            log.warning("%s Trying an older checkpoint.", exc)
    return None


def check_compatible(payload: dict[str, Any], path: Path, info: DistInfo) -> None:
    if payload["world_size"] != info.world_size:
        raise ConfigError(
            f"checkpoint {path} was written with world size {payload['world_size']} but this run "
            f"has {info.world_size} ranks; resume with {payload['world_size']} ranks "
            f"(dist.nproc / --nproc-per-node), or start fresh with resume=never."
        )


def restore(found: Found, tr: Trainer, state: TrainState, info: DistInfo) -> None:
    """Put every piece back where it was; refuse a checkpoint this run cannot continue."""
    payload, path = found.payload, found.path
    check_compatible(payload, path, info)
    saved_k, k = payload.get("accumulate", 1), _accumulate(tr)
    if saved_k != k:  # a mid-epoch position need not be a step boundary of another K
        raise ConfigError(
            f"checkpoint {path} was written with optim.accumulate={saved_k} but this run has "
            f"optim.accumulate={k}; resume with optim.accumulate={saved_k}, or start a new run "
            f"from its weights with init_from={path}."
        )
    try:
        tr.sampler.load_state_dict(payload["sampler"][info.rank])
    except ValueError as exc:
        raise ConfigError(f"checkpoint {path}: {exc}") from None
    try:
        tr.module.load_state_dict(payload["model"])
    except RuntimeError as exc:
        raise ConfigError(
            f"checkpoint {path} holds a different model ({str(exc).splitlines()[0][:100]}); "
            f"resume with the model config it was written with, or resume=never."
        ) from None
    tr.optimizer.load_state_dict(payload["optimizer"])
    tr.scheduler.load_state_dict(payload["scheduler"])
    try:
        tr.scaler.load_state_dict(payload["scaler"])
    except RuntimeError:
        raise ConfigError(
            f"checkpoint {path} was written with another amp mode (its GradScaler state does not "
            f"fit this run's); resume with the amp mode it was written with, or resume=never."
        ) from None
    _restore_ema(payload, path, tr)
    state.epoch, state.step, state.position = payload["epoch"], payload["step"], payload["position"]
    _set_rng_state(payload["rng"][info.rank])


def _accumulate(tr: Trainer) -> int:
    return tr.schedule.accumulate if tr.schedule is not None else 1


def _restore_ema(payload: dict[str, Any], path: Path, tr: Trainer) -> None:
    """The EMA's weights and counters; a checkpoint without one starts it from the weights."""
    if tr.ema is None:
        if "ema" in payload:
            log.info("checkpoint %s holds an EMA; this run has ema.decay=null: not restored", path)
        return
    if "ema" not in payload:
        tr.ema.load_state_dict({"model": tr.module.state_dict(), "updates": 0})
        log.info("checkpoint %s holds no EMA: the EMA starts from its weights", path)
        return
    tr.ema.load_state_dict(payload["ema"])


def resume_rank0(resume: str, directory: Path, info: DistInfo) -> Found | None:
    """Rank 0 picks the checkpoint and every rank loads that same file (no split decisions)."""
    found = find_resume(resume, directory) if info.is_main else None
    chosen = broadcast_object(str(found.path) if found else None, info)
    if chosen is None:
        return None
    if found is not None:
        return found
    return Found(Path(chosen), load(Path(chosen)))


def init_weights(path_str: str, module: torch.nn.Module, *, ema: bool, strict: bool) -> LoadReport:
    """``init_from``: a checkpoint's model (or EMA) weights into a fresh run's model.

    Only the weights are read, so the checkpoint's world size, sampler mode, optimizer and step
    do not matter. Every rank reads the same file; tensors whose shape differs (a head for
    another number of classes) keep the model's fresh, seeded initialisation.
    """
    path = Path(path_str).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"init_from={path_str} is not a file; give a checkpoint's path, e.g. "
            f"outputs/<run id>/checkpoints/last.pt or best.pt."
        )
    payload = load(path, fix="pass another checkpoint with init_from=<path>")
    if ema:
        if not isinstance(payload.get("ema"), dict) or "model" not in payload["ema"]:
            raise ConfigError(
                f"init_from_ema=true but checkpoint {path} holds no EMA weights (it was written "
                f"without EMA); set init_from_ema=false to take its model weights."
            )
        state = payload["ema"]["model"]
    else:
        state = payload["model"]
    source = f"init_from={path_str}" + (" (EMA)" if ema else "")
    fix = ", or set init_from_strict=false to load only the keys both have"
    return load_matching(module, state, strict=strict, source=source, fix=fix)
