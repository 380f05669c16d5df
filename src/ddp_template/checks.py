"""The startup checks: meaning beyond types, once, before any process group or builder exists.

``check(cfg)`` runs every rule that spans groups or needs the host — the AMP mode on this
device, the backend, the launch, the fault settings, the sizes — and each group's own
``check()`` beside its schema. A refusal is one ``ConfigError`` sentence naming the key, the value
and the fix.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import fields

import torch

from ddp_template import cluster, storage
from ddp_template.amp import check_amp
from ddp_template.config.schema import Config, DDPConfig
from ddp_template.data.sampler_modes import SAMPLER_MODES
from ddp_template.distributed import (
    LAUNCHER_VAR,
    choose_backend,
    cuda_devices,
    launched_by_torchrun,
    node_ranks,
)
from ddp_template.errors import ConfigError, require
from ddp_template.parallel import check_compile
from ddp_template.task import build_task, check_monitor

log = logging.getLogger("ddp_template")


def check(cfg: Config) -> None:
    """Every startup check, before any process group, data, model or W&B run exists."""
    _check_sizes(cfg)
    _check_sampler(cfg)
    _check_finetune(cfg)
    _check_launch(cfg)
    _check_logger(cfg)
    _check_loop(cfg)
    _check_parallel(cfg)
    _check_tolerance(cfg)
    _check_checkpoint(cfg)
    for f in fields(cfg):  # a group's own checks live beside its schema, as its check()
        own = getattr(getattr(cfg, f.name), "check", None)
        if callable(own):
            own()
    require(
        cfg.fault.signal is None or hasattr(signal, str(cfg.fault.signal)),
        f"fault.signal={cfg.fault.signal} is not a signal name; use e.g. SIGTERM or SIGUSR1.",
    )
    require(
        not (cfg.fault.hold and cfg.fault.signal is not None),
        f"fault.hold=true waits for a signal, fault.signal={cfg.fault.signal} sends one: "
        "choose one of them.",
    )
    _check_gpu_host(cfg)
    _warn_tuning_on_test(cfg)


def _warn_tuning_on_test(cfg: Config) -> None:
    """A sweep returns the monitored metric of the split evaluated each epoch: without a
    validation split that is the test split, which a sweep must not tune on."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    sweeping = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    if sweeping and not cfg.data.get("val_fraction", 0.0):
        log.warning(
            "THIS SWEEP TUNES ON THE TEST SPLIT: with no validation split each job returns its "
            "test metric to the sweeper; set data.val_fraction (e.g. 0.2) so it returns val/*, "
            'or return a val split from the data factory (README "Sweeps").'
        )


def _check_gpu_host(cfg: Config) -> None:
    """The backend this node can run, fork with CUDA, and AMP on CPU ranks."""
    local_world, local_rank_given = node_ranks(cfg.dist.nproc)
    backend = choose_backend(cfg.backend.name, local_world, local_rank_given=local_rank_given)
    starts_ranks = cfg.dist.nproc > 1 and not launched_by_torchrun()
    require(
        not (starts_ranks and cfg.dist.start_method == "fork" and cuda_devices() > 0),
        "dist.start_method=fork cannot start ranks on a machine with CUDA (this process has "
        "already initialised CUDA, which a forked rank cannot use); use "
        "dist.start_method=forkserver (the default) or spawn.",
    )
    if cfg.compile:
        check_compile("cuda" if backend.name == "nccl" else "cpu")
    if backend.name != "nccl":
        # On CUDA each rank probes its own GPU when it builds AMP (amp.build_scaler): probing
        # here would create a CUDA context in the launching process.
        check_amp(cfg.amp.mode, torch.device("cpu"))


def _check_sizes(cfg: Config) -> None:
    require(cfg.log_every >= 1, f"log_every={cfg.log_every} must be >= 1; e.g. log_every=10.")
    require(cfg.epochs >= 0, f"epochs={cfg.epochs} must be >= 0 (0 only evaluates).")
    require(cfg.dist.nproc >= 1, f"dist.nproc={cfg.dist.nproc} must be >= 1.")
    require(cfg.dist.max_restarts >= 0, f"dist.max_restarts={cfg.dist.max_restarts} must be >= 0.")
    require(
        cfg.max_steps_per_epoch is None or cfg.max_steps_per_epoch >= 1,
        f"max_steps_per_epoch={cfg.max_steps_per_epoch} must be >= 1 or null.",
    )
    require(
        cfg.max_steps is None or cfg.max_steps >= 1,
        f"max_steps={cfg.max_steps} must be >= 1 or null (null: the run's epochs decide).",
    )
    require(
        cfg.eval_every_steps >= 0,
        f"eval_every_steps={cfg.eval_every_steps} must be >= 0 (0: at epoch ends only).",
    )
    require(
        cfg.optim.lr > 0, f"optim.lr={cfg.optim.lr} must be positive; try optim.lr=0.1 for sgd."
    )
    require(
        cfg.checkpoint.every_steps >= 0 and cfg.checkpoint.keep >= 0,
        "checkpoint.every_steps and checkpoint.keep must be >= 0.",
    )
    require(
        cfg.checkpoint.preempt_check_every >= 1,
        f"checkpoint.preempt_check_every={cfg.checkpoint.preempt_check_every} must be >= 1.",
    )


def _check_tolerance(cfg: Config) -> None:
    """What ``fault_tolerance=live`` needs: the template's launcher (node 0's hosts the ranks'
    store and outlives them; across hosts, one per host), gloo (the one backend torch can
    reconfigure), DDP. ``dist.nnodes`` is the live mode's alone."""
    nodes, node = cfg.dist.nnodes, cfg.dist.node_rank
    require(
        nodes >= 1 and 0 <= node < nodes,
        f"dist.node_rank={node} must be in 0..{nodes - 1} (dist.nnodes={nodes}).",
    )
    live = cfg.fault_tolerance.mode == "live"
    require(
        nodes == 1 or live,
        f"dist.nnodes={nodes} starts the template's launcher once per host, which only "
        f"fault_tolerance=live does; start other multi-node runs under torchrun or srun "
        f'(README "Multi-node"), or set fault_tolerance=live.',
    )
    if not live:
        return
    require(
        nodes == 1 or bool(cfg.fault_tolerance.coordinator),
        f"fault_tolerance=live across dist.nnodes={nodes} hosts needs "
        f"fault_tolerance.coordinator=<host>:<port>, where node 0's launcher runs the membership "
        f"coordinator; e.g. fault_tolerance.coordinator=node0:29400.",
    )
    where = f"dist.nproc={cfg.dist.nproc}" + (f" x dist.nnodes={nodes}" if nodes > 1 else "")
    require(
        not launched_by_torchrun(),
        "fault_tolerance=live needs the template's launcher (python train.py dist.nproc=N): "
        "torchrun, srun and mpirun end every rank when one dies, and only the launcher's own "
        "process can host the ranks' store; launch with dist.nproc, or use "
        "fault_tolerance=off (their restarts resume from the last checkpoint).",
    )
    require(
        cfg.dist.nproc * nodes >= 2,
        f"fault_tolerance=live with {where} has no peer to survive a death; set dist.nproc=2 "
        f"or more, or fault_tolerance=off.",
    )
    require(
        cfg.fault_tolerance.min_members <= cfg.dist.nproc * nodes,
        f"fault_tolerance.min_members={cfg.fault_tolerance.min_members} exceeds {where}; lower it.",
    )
    require(
        str(cfg.backend.name) != "nccl",
        "fault_tolerance=live cannot run on backend=nccl (torch can reconfigure only its gloo "
        "process group); set backend=gloo or backend=auto (gloo on the CPU), or "
        "fault_tolerance=off.",
    )
    require(
        str(cfg.parallel.name) == "ddp",
        f"fault_tolerance=live rebuilds DDP after a regroup and does not re-slice "
        f"parallel={cfg.parallel.name}; use parallel=ddp, or fault_tolerance=off.",
    )


def _check_logger(cfg: Config) -> None:
    """What ``logger.log_checkpoints`` needs of the logger and the checkpoint groups."""
    lg = cfg.logger
    kind = str(lg.log_checkpoints)
    if kind == "none":
        return
    require(
        lg.name == "wandb" and cfg.checkpoint.enabled,
        f"logger.log_checkpoints={kind} needs logger=wandb and checkpoint.enabled=true "
        f"(here logger={lg.name}, checkpoint.enabled={cfg.checkpoint.enabled}); set both or "
        f"drop logger.log_checkpoints.",
    )
    require(
        kind != "best" or cfg.selection.monitor is not None,
        "logger.log_checkpoints=best needs a best checkpoint, which only selection.monitor "
        "keeps; set e.g. selection.monitor=test/accuracy, or use logger.log_checkpoints=last.",
    )


def _check_loop(cfg: Config) -> None:
    """Accumulation, DDP options, the profiler window."""
    acc = cfg.optim.accumulate
    require(acc >= 1, f"optim.accumulate={acc} must be >= 1 (1: no accumulation); e.g. 2.")
    require(
        acc == 1 or not cfg.ddp.static_graph,
        f"ddp.static_graph=true cannot run with optim.accumulate={acc} (DDP's static graph "
        f"fails inside no_sync, where the first {acc - 1} micro-batches of each step run); set "
        f"ddp.static_graph=false or optim.accumulate=1.",
    )
    cap = cfg.ddp.bucket_cap_mb
    require(cap > 0, f"ddp.bucket_cap_mb={cap} must be positive; torch's default is 25.")
    for key in ("wait", "warmup", "active"):
        value, least = getattr(cfg.profiler, key), 1 if key == "active" else 0
        require(value >= least, f"profiler.{key}={value} must be >= {least} (optimizer steps).")


def _check_parallel(cfg: Config) -> None:
    """What ``parallel=fsdp2`` cannot honour: DDP's own options, fp16's loss scaling over
    slices."""
    if cfg.parallel.name != "fsdp2":
        return
    defaults = DDPConfig()
    for f in fields(DDPConfig):
        value = getattr(cfg.ddp, f.name)
        require(
            value == getattr(defaults, f.name),
            f"ddp.{f.name}={value} is an option of DistributedDataParallel, which "
            f"parallel=fsdp2 does not use; drop it, or set parallel=ddp.",
        )
    require(
        cfg.amp.mode != "fp16",
        "amp=fp16 cannot run with parallel=fsdp2 (its loss scaler would skip steps on the "
        "ranks whose own slices overflowed, not on all of them); use amp=bf16 (FSDP2's mixed "
        "precision: bf16 forward, fp32 reduction) or amp=off.",
    )


def _check_launch(cfg: Config) -> None:
    """A launcher already started this rank: dist.nproc must not start more ranks inside it."""
    if cfg.dist.nproc == 1 or not launched_by_torchrun():
        return
    outer = cluster.detect()
    launcher = os.environ.get(LAUNCHER_VAR, outer.launcher)
    require(
        cfg.dist.nproc == outer.local_world_size,
        f"dist.nproc={cfg.dist.nproc} would start ranks inside rank {outer.rank} of "
        f"{outer.world_size} that {launcher} already started ({outer.local_world_size} on this "
        f"node); drop dist.nproc (the launcher starts the ranks) or set it to "
        f"{outer.local_world_size}.",
    )


def _check_sampler(cfg: Config) -> None:
    mode = SAMPLER_MODES[str(cfg.sampler.mode)]
    require(
        mode.shuffles or not cfg.sampler.shuffle,
        f"sampler.shuffle=true contradicts sampler={cfg.sampler.mode} ({mode.summary}); set "
        f"sampler.shuffle=false or pick sampler=padded.",
    )


def _check_checkpoint(cfg: Config) -> None:
    """checkpoint.folder in an object store: reachable with the credentials found, before a run
    trains toward a first save that could not be written (one request)."""
    folder = cfg.checkpoint.folder
    if not folder or not storage.is_url(folder):
        return
    where = storage.at(folder, key="checkpoint.folder")
    try:
        where.names()
    except ConfigError as exc:
        raise ConfigError(f"checkpoint.folder={folder}: {exc}") from None


def _check_finetune(cfg: Config) -> None:
    """The rules that span groups: init_from vs resume, the loss, the validation split, what
    selection monitors."""
    init_from = cfg.finetune.init_from
    require(
        init_from is None or cfg.resume in ("auto", "never"),
        f"finetune.init_from={init_from} and resume={cfg.resume} both name a checkpoint; keep "
        f"resume=<path> to continue that run, or finetune.init_from=<path> to start a new one "
        f"from it.",
    )
    fraction = cfg.data.get("val_fraction", 0.0)
    require(
        0.0 <= fraction < 1.0,
        f"data.val_fraction={fraction} must be in [0, 1); e.g. data.val_fraction=0.1 (0: none).",
    )
    require(
        cfg.eval_split != "val" or fraction > 0,
        "eval_split=val needs a validation split; set data.val_fraction (e.g. 0.1), or "
        "eval_split=test.",
    )
    sel, split = cfg.selection, "val" if fraction > 0 else "test"
    check_monitor(build_task(cfg.task), sel.monitor, split)
    if sel.monitor is None:
        return
    require(
        cfg.checkpoint.enabled or sel.patience is not None,
        f"selection.monitor={sel.monitor} keeps best.pt but checkpoint.enabled=false; set "
        f"checkpoint.enabled=true, or drop selection.monitor.",
    )
