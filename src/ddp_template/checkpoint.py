"""Atomic checkpoints of named stateful parts, and resume: the newest valid one, restored
bit-identically.

A checkpoint holds everything an uninterrupted run would still have in memory, as named parts,
each with its own ``state_dict``/``load_state_dict`` (the torchtitan way): the parts that are
the same on every rank are saved from rank 0, the per-rank parts are gathered from every
rank. Restoring all of them makes a resumed run bit-identical to one that was never stopped. A
part refuses a saved state it cannot take in one sentence (``Misfit``);
this module knows none of them by name. Files go to ``checkpoint.folder`` (default
``<run dir>/checkpoints``; a local path or an ``s3://`` prefix: ``storage``), each published
atomically (a local file written to a temporary name, flushed and renamed over the old one; an
object in one upload), so a crash mid-write never replaces a good checkpoint with half a file.

Where each rank holds a slice of the weights (``parallel=fsdp2``), those parts (``sliced``) go
through torch.distributed.checkpoint (DCP) instead: one file per rank in
``slices/<name>/`` (a new name each save), complete once DCP's metadata, written last, is in
place; only then is a ``.pt`` file naming it (``"slices"``) published. DCP lays them out again on
load, at this run's world size, whatever it was at save. A directory no checkpoint names is
deleted.

``checkpoint.async_save=true``: ``save`` copies to CPU memory at the step boundary what the next
step's forward and backward can change (the buffers) and every small part (DCP's stager, pinned
on CUDA, its buffers reused from save to save), and returns; each rank's writer thread then
copies the steppers' (torch.optim's objects') parameters and state (only their ``step``
changes them: that step waits for the copy, a step pre-hook; under FSDP2 each rank's slices),
writes the sliced parts (DCP, on a gloo group of its own) and, on rank 0, publishes the files in
the same order and the same atomic way while training goes on. One save is in flight at most:
the next ``save`` waits for it, and so do ``close`` (the end of ``fit``, a preemption stop, an
exception) and ``restore``.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from ddp_template import fencing, storage
from ddp_template.config.schema import CheckpointConfig
from ddp_template.distributed import DistInfo, broadcast_object, gather_objects
from ddp_template.errors import ConfigError
from ddp_template.storage import Storage

log = logging.getLogger("ddp_template")
FORMAT_VERSION = 4  # 4: stretch_steps, the data_info part
# the file's keys besides parts
RECORD = ("format", "config", "world_size", "ranks", "chain", "slices")
SLICES = "slices"  # the folder, beside the .pt files, of the sliced parts' DCP directories


class Stateful(Protocol):
    """A checkpoint part. ``load_state_dict`` raises ``errors.Misfit`` (one sentence) for a
    saved state it cannot take; a part that can start without one has ``start_fresh() -> str``
    (what it did, for the log)."""

    def state_dict(self) -> Mapping[str, Any]: ...  # a dict, or a TypedDict (SavedLedger)

    def load_state_dict(self, state: Any) -> None: ...  # what its state_dict returned


Hook = Callable[[dict[str, Any]], None]
Location = str | Path  # a checkpoint file: a local path or an object's URL (s3://…)


def save_atomic(payload: dict[str, Any], path: Location, written: Hook | None = None) -> None:
    """``payload`` published at ``path`` (a file or an object), atomically; ``written(payload)``
    runs once its bytes are written, before they are published (a test's fault:
    ``fault.phase=write``). Under a live membership it carries the writer's fencing token."""

    what = f"the checkpoint {path}"
    held = fencing.token(what)  # fault_tolerance=live: the membership it is written in
    if held is not None:
        payload = {**payload, "fence": held._asdict()}

    def fill(f: IO[bytes]) -> None:
        torch.save(payload, f)

    def before() -> None:
        if written is not None:
            written(payload)
        fencing.token(what)  # still a member as it is published: its bytes took their time

    folder, name = storage.parent(path)
    folder.publish(name, fill, before)


class _InFlight:
    """The one asynchronous save of this process still being written: this rank's writer
    thread, which first copies the steppers' tensors (``stage``: ``staged`` is set once they
    are copied, or the copy failed), then writes this rank's slices (DCP) and, on rank 0,
    publishes the files (``write``), with the error met. ``stalled``: the seconds the training
    thread waited for ``staged`` before a stepper's step."""

    def __init__(
        self, write: Callable[[], None] | None, stage: Callable[[], None] | None = None
    ) -> None:
        self.errors = list[BaseException]()
        self.staged, self.stalled = threading.Event(), 0.0
        self.thread = None
        if write is None:
            self.staged.set()
            return
        self.thread = threading.Thread(
            target=self._run, args=(stage, write), name="checkpoint-writer", daemon=True
        )
        self.thread.start()

    def _run(self, stage: Callable[[], None] | None, write: Callable[[], None]) -> None:
        try:
            if WRITER_NICE and hasattr(os, "setpriority"):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
            try:
                if stage is not None:
                    stage()
            finally:
                self.staged.set()  # a stepper's step may go on (a failed copy: raised later)
            write()
        except BaseException as exc:  # met by the next wait, on the training thread
            self.errors.append(exc)

    def wait_staged(self) -> None:
        if not self.staged.is_set():
            t0 = time.perf_counter()
            self.staged.wait()
            self.stalled += time.perf_counter() - t0

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
        if self.errors:
            raise self.errors[0]


# The writer thread's niceness (Linux: per thread; 0: as training's). A nicer writer yields the
# cores to training when they are contended; not measurably better on the 2-core machine of
# benchmarks/async_checkpoint_results.md, so off.
WRITER_NICE = 0

# At most one save in flight per process (a live regroup builds a new Checkpointer: its first
# save still waits for the last one's).
_IN_FLIGHT: list[_InFlight] = []


# What a stepper has (torch.optim's interface): its parameters, its state, a step pre-hook.
STEPPER = ("param_groups", "state", "register_step_pre_hook")


def _before_step(stepper: Any, args: Any, kwargs: Any) -> None:
    """A stepper's step pre-hook (checkpoint.async_save): the step waits until the save in
    flight has copied the tensors it is about to change."""
    for flight in _IN_FLIGHT:
        flight.wait_staged()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor, or this rank's slice of a DTensor (``parallel=fsdp2``)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _laid_out(copy: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The copy of ``like``'s (local) data, laid out as ``like`` is (a DTensor: as its slice)."""
    if not isinstance(like, DTensor):
        return copy
    return DTensor.from_local(
        copy,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


class _Later(NamedTuple):
    """A staged payload's place of a stepper's tensor, copied by the writer thread."""

    slot: int


def _defer(obj: Any, deferred: set[int], later: list[torch.Tensor], seen: dict) -> Any:
    """``obj``'s structure copied, each tensor whose storage is in ``deferred`` replaced by a
    ``_Later`` (one per tensor view: a tied weight stays one) and appended to ``later``."""
    if isinstance(obj, torch.Tensor):
        local = _local(obj)
        if local.untyped_storage().data_ptr() not in deferred:
            return obj
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), obj.shape, obj.stride())
        if key not in seen:
            seen[key] = len(later)
            later.append(obj)
        return _Later(seen[key])
    if isinstance(obj, dict):
        new = copy.copy(obj)  # its type and attributes (a state_dict's _metadata)
        for k, v in obj.items():
            new[k] = _defer(v, deferred, later, seen)
        return new
    if isinstance(obj, list | tuple) and not isinstance(obj, _Later):
        items = [_defer(v, deferred, later, seen) for v in obj]
        if isinstance(obj, list):
            return items
        if all(a is b for a, b in zip(items, obj, strict=True)):
            return obj
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _fill(obj: Any, copies: list[torch.Tensor]) -> Any:
    """``_defer``'s places filled with the copies, in place where the container allows."""
    if isinstance(obj, _Later):
        return copies[obj.slot]
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = _fill(v, copies)
        return obj
    if isinstance(obj, list):
        obj[:] = [_fill(v, copies) for v in obj]
        return obj
    if isinstance(obj, tuple):
        items = [_fill(v, copies) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def wait_in_flight() -> None:
    """Return once this process's asynchronous save (if any) is written and published; its
    error (disk full, …) is raised here."""
    while _IN_FLIGHT:
        _IN_FLIGHT.pop().wait()


RESUME_FIX = "pass another file with resume=<path>, or resume=never to start fresh"


def load(path: Location, fix: str = RESUME_FIX) -> dict[str, Any]:
    """Load with ``weights_only=True``: a checkpoint file cannot run code."""
    folder, name = storage.parent(path)
    try:
        with folder.open(name) as f:
            payload = torch.load(f, map_location="cpu", weights_only=True)
    except ConfigError:
        raise  # the object store's own sentence (a missing bucket, refused credentials)
    except Exception as exc:
        raise ConfigError(
            f"checkpoint {path} cannot be read ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:100]}); it is damaged or not a checkpoint of this "
            f"template: {fix}."
        ) from None
    if not isinstance(payload, dict) or "format" not in payload:
        raise ConfigError(f"checkpoint {path} is not a checkpoint of this template; {fix}.")
    if payload["format"] != FORMAT_VERSION:
        raise ConfigError(
            f"checkpoint {path} has format {payload['format']}, which this version of the "
            f"template no longer reads (it reads format {FORMAT_VERSION}); {fix}."
        )
    if "slices" in payload and not folder.exists(f"{slices_of(payload)}/.metadata"):
        raise ConfigError(
            f"checkpoint {path} names the sliced weights in "
            f"{folder.where(slices_of(payload))}, which are missing or incomplete; {fix}."
        )
    return payload


def slices_of(payload: dict[str, Any]) -> str:
    """The DCP directory of a checkpoint's sliced parts, by name in the checkpoint's folder."""
    return f"{SLICES}/{payload['slices']}"


def _slice_metadata(folder: Storage, name: str) -> dict[str, Any]:
    """What a DCP directory holds, by flattened key (``<part>.<key>…``)."""
    return folder.dcp_reader(name).read_metadata().state_dict_metadata


def whole(path: Location, payload: dict[str, Any], *keys: str) -> dict[str, torch.Tensor] | None:
    """The tensors under ``keys`` of a checkpoint (a part's name, then keys inside its state),
    whole, by name: from the file, or read from its slices (every rank's, no process group);
    None where the checkpoint holds none."""
    if "slices" not in payload or keys[0] in payload:
        state: Any = payload
        for key in keys:
            state = state.get(key) if isinstance(state, dict) else None
        return state
    folder, name = storage.parent(path)[0], slices_of(payload)
    prefix = ".".join(keys) + "."
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in _slice_metadata(folder, name).items()
        if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)
    }
    if not state:
        return None
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=folder.dcp_reader(name), no_dist=True)
    return {k.removeprefix(prefix): v for k, v in state.items()}


class Found(NamedTuple):
    """A checkpoint chosen for resuming, already loaded."""

    path: Location
    payload: dict[str, Any]


class Saved(NamedTuple):
    """What one ``Checkpointer.save`` wrote (on rank 0; the same answer on every rank)."""

    last: str | None
    copies: dict[str, str]  # by kind (the file name's stem): the copies this save wrote
    slices: str | None = None  # the DCP directory every one of them names (sliced parts)


def _epoch_number(name: str) -> int:
    m = re.fullmatch(r"epoch_(\d+)\.pt", name)
    return int(m.group(1)) if m else -1


def folder_of(cfg: CheckpointConfig, run_dir: Path) -> str:
    """Where a run's checkpoints go and ``resume=auto`` looks: ``checkpoint.folder``, else
    ``<run dir>/checkpoints``."""
    return cfg.folder or str(run_dir / "checkpoints")


@dataclass(kw_only=True)
class Checkpointer:
    """Built once with the parts it saves; rank 0 writes and every rank contributes its own
    parts (``save`` is a collective: call it on all ranks)."""

    directory: Location  # checkpoint.folder: a local folder or an object store's prefix
    cfg: CheckpointConfig
    parts: dict[str, Stateful]  # the same on every rank: rank 0's are saved
    rank_parts: dict[str, Stateful] = field(default_factory=dict)  # each rank's, gathered
    sliced: dict[str, Stateful] = field(default_factory=dict)  # each rank's slice, through DCP
    config_yaml: str  # the resolved config, stored for the record
    info: DistInfo
    # The checkpoint's provenance chain, made from the rest of its payload (provenance.Chain).
    seal: Callable[[dict[str, Any]], Any] | None = None
    # Rank 0, between writing last.pt's temporary file and publishing it (fault.phase=write).
    before_publish: Hook | None = None
    _named: dict[str, str | None] | None = None  # each checkpoint file's slices, once read
    _stager: DefaultStager | None = None  # checkpoint.async_save: the CPU copies, reused
    _group: Any = None  # checkpoint.async_save with sliced parts: DCP's own gloo group
    _later: list[torch.Tensor] = field(default_factory=list)  # the steppers' tensors' copies
    _stream: Any = None  # CUDA: the stream the steppers' tensors are copied on
    _hooks: list[Any] = field(default_factory=list)  # the steppers' step pre-hooks
    _folder: Storage = field(init=False)

    def __post_init__(self) -> None:
        self._folder = storage.at(self.directory)
        if self.cfg.enabled and self.cfg.async_save:  # a stepper's step waits for the copy
            self._hooks = [o.register_step_pre_hook(_before_step) for o in self._steppers()]

    def _steppers(self) -> list[Any]:
        """The steppers among the parts and what each part holds: torch.optim's objects, by
        their interface (``STEPPER``; FSDP2's part of slices holds one, so does the LR
        schedule: each found once). Only their ``step`` changes their tensors and their
        parameters, so these are copied after ``save`` returns, before that step."""
        found = {}
        for part in (*self.parts.values(), *self.sliced.values()):
            for held in (part, *getattr(part, "__dict__", {}).values()):
                if all(hasattr(held, name) for name in STEPPER):
                    found[id(held)] = held
        return list(found.values())

    def _deferred(self) -> set[int]:
        """The storages (their addresses) of the steppers' parameters and state."""
        tensors = [p for o in self._steppers() for g in o.param_groups for p in g["params"]]
        tensors += [
            v
            for o in self._steppers()
            for s in o.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        ]
        return {_local(t).untyped_storage().data_ptr() for t in tensors}

    def payload(self, ranks: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """What a checkpoint holds; ``ranks``: every rank's parts, already gathered (a live
        regroup's, where a lost rank's are derived), else gathered here (a collective)."""
        if ranks is None:
            mine = {name: part.state_dict() for name, part in self.rank_parts.items()}
            ranks = gather_objects(mine, self.info)
        payload = {name: part.state_dict() for name, part in self.parts.items()} | {
            "format": FORMAT_VERSION,
            "config": self.config_yaml,
            "world_size": len(ranks),
            "ranks": ranks,
        }
        if self.seal is not None:
            payload["chain"] = self.seal(payload)
        return payload

    def restore(self, found: Found, *, resized: bool = False) -> None:
        wait_in_flight()  # a live regroup's: the parameters are copied before they are loaded
        _check_layout(bool(self.sliced), found)
        restore(
            found, parts=self.parts, rank_parts=self.rank_parts, info=self.info, resized=resized
        )
        _load_slices(self.sliced, found)

    @property
    def last(self) -> str | None:
        """The newest checkpoint's location (None with checkpoint.enabled=false)."""
        return self._folder.where(LAST) if self.cfg.enabled else None

    def _saved(self, copies: tuple[str, ...], slices: str | None) -> Saved:
        where = self._folder.where
        return Saved(
            where(LAST),
            {Path(name).stem: where(name) for name in copies},
            None if slices is None else where(slices),
        )

    def save(self, *, epochs_done: int | None = None, copies: tuple[str, ...] = ()) -> Saved:
        """last.pt (at an epoch end also epoch_<epochs_done>.pt), plus a copy under each name
        in ``copies`` (a selected epoch's), each written atomically."""
        if not self.cfg.enabled:
            return Saved(None, {})
        if self.cfg.async_save:
            return self._save_async(copies, epochs_done)
        payload = self.payload()
        if self.sliced:
            payload["slices"] = self._save_slices()
        if self.info.is_main:
            self._publish(payload, copies, epochs_done)
        if self.info.distributed:
            dist.barrier()  # nobody runs ahead (or exits) before the file is in place
        return self._saved(copies, slices_of(payload) if self.sliced else None)

    def _publish(
        self, payload: dict[str, Any], copies: tuple[str, ...], epochs_done: int | None
    ) -> None:
        """Rank 0: every file of one checkpoint written atomically, then the old ones pruned."""
        kept = epochs_done is not None and self.cfg.keep > 0
        files = [LAST, *copies, *([f"epoch_{epochs_done}.pt"] if kept else [])]
        for k, name in enumerate(files):
            save_atomic(payload, self._folder.where(name), self.before_publish if k == 0 else None)
        if kept:
            self._prune()
        if self.sliced:
            self._prune_slices(payload["slices"], files)

    def _save_async(self, copies: tuple[str, ...], epochs_done: int | None) -> Saved:
        """checkpoint.async_save: the state of this step copied to CPU memory, all but the
        steppers' tensors now (a collective, as the synchronous save), those by each rank's
        writer thread before the next step of a stepper, which then writes (DCP, each rank's
        slices) and publishes (rank 0) while training goes on."""
        wait_in_flight()  # one in flight at most: the last one is published first
        if self._stager is None:
            cuda = self.info.device.type == "cuda"
            self._stager = DefaultStager(StagingOptions(cuda, False, False, False))
        payload = self.payload()
        deferred, later, seen = self._deferred(), list[torch.Tensor](), dict[Any, int]()
        staged: dict[str, Any] = {}
        slices = None
        if self.sliced:
            name = broadcast_object(uuid.uuid4().hex[:12] if self.info.is_main else None, self.info)
            payload["slices"] = name
            slices = slices_of(payload)
            if self._group is None and self.info.distributed:  # a collective: every rank, once
                self._group = dist.new_group(backend="gloo")  # not the training's group
            state = {n: part.state_dict() for n, part in self.sliced.items()}
            staged["slices"] = self._stager.stage(_defer(state, deferred, later, seen))
        if self.info.is_main:
            staged["file"] = self._stager.stage(_defer(payload, deferred, later, seen))
        if staged:
            write = self._write_async(staged, slices, copies, epochs_done)
            _IN_FLIGHT.append(_InFlight(write, self._copy_later(later, list(staged.values()))))
        else:
            _IN_FLIGHT.append(_InFlight(None))
        return self._saved(copies, slices)

    def _write_async(
        self,
        staged: dict[str, Any],
        slices: str | None,
        copies: tuple[str, ...],
        epochs_done: int | None,
    ) -> Callable[[], None]:
        """The writer thread's second task: this rank's slices (DCP, a collective of the writer
        threads on their own gloo group; it returns once every rank's and the metadata are in
        place); then rank 0's files, which name them."""

        def write() -> None:
            if slices is not None:
                dcp.save(
                    staged["slices"],
                    storage_writer=self._folder.dcp_writer(slices),
                    process_group=self._group,
                    no_dist=not self.info.distributed,
                )
            if "file" in staged:
                self._publish(staged["file"], copies, epochs_done)

        return write

    def _copy_later(self, later: list[torch.Tensor], staged: list[Any]) -> Callable[[], None]:
        """The writer thread's first task: the steppers' tensors (each rank's slice of a
        DTensor) copied into CPU buffers kept from save to save (pinned, on a stream of their
        own, on CUDA) and put in ``staged``; the steppers' next step waits for it
        (``_before_step``), so nothing later leaks in. ``Tensor.copy_`` releases the GIL."""
        cuda = self.info.device.type == "cuda"
        if cuda and later:
            self._stream = self._stream or torch.cuda.Stream(self.info.device)
            self._stream.wait_stream(torch.cuda.current_stream(self.info.device))  # step S's
        sources = [_local(t) for t in later]
        for k, t in enumerate(sources):
            if k == len(self._later):
                self._later.append(torch.empty(0))
            old = self._later[k]
            if old.shape != t.shape or old.dtype != t.dtype:
                self._later[k] = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
        copies = self._later[: len(later)]

        def stage() -> None:
            with torch.no_grad(), torch.cuda.stream(self._stream) if cuda else nullcontext():
                for dst, src in zip(copies, sources, strict=True):
                    dst.copy_(src, non_blocking=cuda)
            if cuda and later:
                self._stream.synchronize()
            filled = [_laid_out(c, t) for c, t in zip(copies, later, strict=True)]
            for tree in staged:
                _fill(tree, filled)

        return stage

    def wait(self) -> None:
        """The save in flight (checkpoint.async_save) written and published, on this rank."""
        wait_in_flight()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        self.close(broken=isinstance(exc, Exception))  # a failed collective: no barrier

    def close(self, *, broken: bool = False) -> None:
        """The end of training (the loop's end, a preemption stop, an exception): the save in
        flight written and published, then (a clean end) every rank past that point together.
        After a failed collective (``broken``) a write of slices is dropped (it needs every
        rank's writer thread; the next launch deletes its directory); rank 0's file is finished."""
        if not self.cfg.async_save:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if broken and self.sliced:
            log.warning("a checkpoint write in flight was dropped: the ranks' group broke")
            _IN_FLIGHT.clear()
        else:
            try:
                wait_in_flight()
            except Exception:
                if not broken:
                    raise
                log.exception("the checkpoint write in flight failed")
        if not broken and self.info.distributed:
            dist.barrier()  # nobody exits before the file is in place

    def _save_slices(self) -> str:
        """Every rank's slices into a new DCP directory (a collective); its name."""
        name = broadcast_object(uuid.uuid4().hex[:12] if self.info.is_main else None, self.info)
        state = {n: part.state_dict() for n, part in self.sliced.items()}
        # dcp.save returns on every rank once the metadata, written last, is in place.
        dcp.save(state, storage_writer=self._folder.dcp_writer(f"{SLICES}/{name}"))
        return name

    def _prune_slices(self, name: str, files: list[str]) -> None:
        """Delete the slice directories no checkpoint names (and any a crash left half-written):
        what the files name is read once a launch, then kept as this launch writes them."""
        folder = self._folder
        if self._named is None:
            self._named = {
                f: load(folder.where(f)).get("slices") for f in folder.names() if f.endswith(".pt")
            }
        self._named.update({f: name for f in files})
        present = set(folder.names())
        self._named = {f: n for f, n in self._named.items() if f in present}
        kept = set(self._named.values())
        for held in folder.names(SLICES):
            if held not in kept:
                folder.remove(f"{SLICES}/{held}")

    def due(self, step: int) -> bool:
        every = self.cfg.every_steps
        return self.cfg.enabled and every > 0 and step % every == 0

    def _prune(self) -> None:
        names = self._folder.names()
        epochs = sorted((f for f in names if _epoch_number(f) >= 0), key=_epoch_number)
        for old in epochs[: max(0, len(epochs) - self.cfg.keep)]:
            self._folder.remove(old)


LAST = "last.pt"


def candidates(directory: Location) -> list[str]:
    """Checkpoints in a folder, newest first: last.pt, then epoch_<k>.pt by k descending."""
    folder = storage.at(directory)
    names = folder.names()
    epochs = sorted((f for f in names if _epoch_number(f) >= 0), key=_epoch_number, reverse=True)
    return [folder.where(f) for f in ([LAST] if LAST in names else []) + epochs]


def checkpoint_file(location: Location, *, said: str, fix: str) -> str:
    """``location`` as a checkpoint file that exists (a path or an object's URL), else one
    sentence: ``said`` (``resume=``, ``checkpoint ``), the location, ``fix``."""
    folder, name = storage.parent(location, key=said.rstrip("= "))
    if not name or not folder.exists(name):
        raise ConfigError(f"{said}{location} does not exist; {fix}.")
    return folder.where(name)


def find_resume(resume: str, directory: Location) -> Found | None:
    """The checkpoint to resume from, already loaded; damaged ones are reported and skipped.

    ``never``: start fresh. ``auto``: the newest valid checkpoint in ``directory`` (the
    run's checkpoint.folder), or none. Anything else is a file that must load. Nothing is ever
    deleted here.
    """
    if resume == "never":
        return None
    if resume != "auto":
        fix = "give a checkpoint path, resume=auto or resume=never"
        path = checkpoint_file(os.path.expanduser(resume), said="resume=", fix=fix)
        return Found(path, load(path))
    for path in candidates(directory):
        try:
            return Found(path, load(path))
        except ConfigError as exc:
            log.warning("%s Trying an older checkpoint.", exc)
    return None


def restore(
    found: Found,
    *,
    parts: dict[str, Stateful],
    rank_parts: dict[str, Stateful],
    info: DistInfo,
    resized: bool = False,
) -> None:
    """Put every part back where it was, in order; refuse a checkpoint this run cannot continue
    (another world size, unless ``resized``, before anything is touched).

    ``resized`` (elastic resume at another world size): a part with ``load_resized(saved, *,
    world_size)`` takes its saved state through it (a per-rank part: every old rank's, as a
    list); a per-rank part without one is refused, since it cannot be re-dealt."""
    path, payload = found
    world = payload["world_size"]
    same = {k: v for k, v in payload.items() if k not in RECORD}
    if world == info.world_size and not resized:
        _load_parts(parts, same, path)
        _load_parts(rank_parts, payload["ranks"][info.rank], path)
        return
    if not resized:
        raise ConfigError(
            f"checkpoint {path} was written with world size {world} but this run has "
            f"{info.world_size} ranks; resume with {world} ranks (dist.nproc / "
            f"--nproc-per-node), or start fresh with resume=never."
        )
    ranks = payload["ranks"]
    _load_parts(parts, same, path, world=world)
    by_part = {k: [r[k] for r in ranks] for k in ranks[0]}
    _load_parts(rank_parts, by_part, path, world=world, per_rank=True)


def _load_parts(
    parts: dict[str, Stateful],
    saved: dict[str, Any],
    path: Location,
    *,
    world: int | None = None,
    per_rank: bool = False,
) -> None:
    """``world``: the saved states are another world size's (``per_rank``: a list of them)."""
    for name in saved.keys() - parts.keys():
        log.info("checkpoint %s holds a %s part, which this run has not: not restored", path, name)
    for name, part in parts.items():
        if name in saved:
            try:
                if world is None:
                    part.load_state_dict(saved[name])
                elif hasattr(part, "load_resized"):
                    part.load_resized(saved[name], world_size=world)
                elif per_rank:
                    raise ConfigError(
                        f"checkpoint {path}: its per-rank {name} part cannot be re-dealt to "
                        f"another world size; resume with {world} ranks, or start fresh with "
                        f"resume=never."
                    )
                else:
                    part.load_state_dict(saved[name])
            except ValueError as exc:  # errors.Misfit, or a part's own ValueError
                raise ConfigError(f"checkpoint {path}: {exc}") from None
        elif hasattr(part, "start_fresh"):
            log.info("checkpoint %s holds no %s part: %s", path, name, part.start_fresh())
        else:
            raise ConfigError(
                f"checkpoint {path} holds no {name} part, which this run needs; resume with "
                f"the config it was written with, or start fresh with resume=never."
            )


def _check_layout(sliced: bool, found: Found) -> None:
    """A checkpoint of whole weights resumes only whole, one of slices only sliced."""
    path, payload = found
    if sliced == ("slices" in payload):
        return
    held, written = (
        ("sliced", "parallel=fsdp2") if "slices" in payload else ("whole", "parallel=ddp")
    )
    raise ConfigError(
        f"checkpoint {path} holds {held} weights (written with {written}) and this run lays "
        f"them out otherwise; resume with {written}, or start this run from its weights with "
        f"resume=never finetune.init_from={path}."
    )


def _load_slices(parts: dict[str, Stateful], found: Found) -> None:
    """The sliced parts from their DCP directory, laid out at this run's world size."""
    if not parts:
        return
    path, payload = found
    folder, where = storage.parent(path)[0], slices_of(payload)
    saved = {key.split(".", 1)[0] for key in _slice_metadata(folder, where)}
    state = {name: part.state_dict() for name, part in parts.items() if name in saved}
    # A collective: every rank reads what its slices need.
    dcp.load(state, storage_reader=folder.dcp_reader(where))
    _load_parts(parts, state, path)


def resume_rank0(resume: str, directory: Location, info: DistInfo) -> Found | None:
    """Rank 0 picks the checkpoint and every rank loads that same file (no split decisions)."""
    found = find_resume(resume, directory) if info.is_main else None
    chosen = broadcast_object(str(found.path) if found else None, info)
    if chosen is None:
        return None
    if found is not None:
        return found
    return Found(chosen, load(chosen))
