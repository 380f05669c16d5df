"""Train a classifier with DistributedDataParallel, every rank's data accounted for.

    python train.py                                   # one process
    python train.py dist.nproc=2                      # two ranks, started in-process
    torchrun --standalone --nproc-per-node=2 train.py # two ranks under torchrun

The recipe is the classic one — init the process group, shard the data with a distributed
sampler, wrap the model in DDP, loop over epochs calling ``set_epoch`` — and each step is one
builder from ``src/ddp_template`` named after the config group it reads. docs/ARCHITECTURE.md
maps the modules.
"""

from __future__ import annotations

import gc

gc.disable()  # no GC passes over the millions of objects torch's import allocates

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple, cast

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from ddp_template import checks, distributed, fault_injection, launch, numerics, run_identity
from ddp_template.amp import build_scaler, scaler_part
from ddp_template.checkpoint import Checkpointer, Found, resume_rank0
from ddp_template.checkpoint_parts import Ledger, Progress, SamplerPosition
from ddp_template.config import boundary
from ddp_template.config.schema import Config, register_configs
from ddp_template.data.contract import MapData, Splits, first_input
from ddp_template.data.identity import DataIdentity, identify
from ddp_template.data.loader import build_eval_loader
from ddp_template.data.transforms import apply_transforms
from ddp_template.data.workers import reseed_for_epoch
from ddp_template.elastic import Resize, plan_resize, record_segment
from ddp_template.engine import (
    EpochStats,
    StepHook,
    Trainer,
    TrainState,
    steps_this_epoch,
    train_one_epoch,
)
from ddp_template.errors import (
    EXIT_CONFIG_ERROR,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    ConfigError,
    Unanimous,
    unanimous,
)
from ddp_template.evaluation import Evaluation, build_evaluation
from ddp_template.finetune import init_weights
from ddp_template.kind import DataKind, kind_of
from ddp_template.ledger.verify import epoch_metrics, resumed_prefix
from ddp_template.models import (
    build_model,
    check_batch_statistics,
    convert_syncbn,
    describe_load,
    weights_part,
)
from ddp_template.optim import build_optimizer, build_scheduler, set_horizon
from ddp_template.parallel import build_parallel, compile_model
from ddp_template.preemption import Preemption
from ddp_template.process import exit_records, quick_exit
from ddp_template.profiling import StepProfiler
from ddp_template.provenance import Chain, Link, build_chain
from ddp_template.rng import RngState
from ddp_template.selection import Selection, build_selection
from ddp_template.sinks.console import say_refusal, setup_console
from ddp_template.sinks.metrics import RankLogger, log
from ddp_template.sinks.share_plot import draw_shares_async
from ddp_template.spike import build_spikes
from ddp_template.splits import build_splits
from ddp_template.switches import build_switches
from ddp_template.task import EvalResult, build_task, objective, register_sweep_direction
from ddp_template.tolerance import Segment, Tolerance, build_tolerance

gc.freeze()  # what was imported lives as long as the process: out of every later pass
gc.enable()

if __name__ != "__mp_main__":  # a forked rank or loader worker re-runs this file to unpickle
    register_configs()
    run_identity.register_resolvers()
    register_sweep_direction()


class Built(NamedTuple):
    kind: DataKind  # the training data's kind: map-style, or as its factory chose (data.kind)
    data: DataIdentity  # its length and content fingerprint, for the provenance chain
    trainer: Trainer
    splits: Splits
    evaluation: Evaluation
    selection: Selection
    switches: dict[str, Any]  # the research-loop switches that are on, by name


def build(cfg: Config, info: distributed.DistInfo, *, fresh: bool = True) -> Built:
    """Data (+its identity, +augmentation) → sampler → loaders → task → model (+a fresh run's
    finetune weights, +SyncBN) → switches (EMA) → DDP or FSDP2 → compile → optimizer (+the
    spike rule) → evaluation."""
    splits = build_splits(cfg.data)
    kind = kind_of(splits)  # map-style, or the kind its factory chose (tar shards, a stream)
    kind.check(cfg, splits)  # the run's options this kind cannot honour
    # The data's identity (provenance), before augmentation wraps it: rank 0's, read once.
    data = distributed.broadcast_object(identify(splits) if info.is_main else None, info)
    splits = apply_transforms(splits, cfg.transforms, cfg.seed)
    sampler = kind.sampler(splits.train, cfg.sampler, seed=cfg.seed, info=info, loader=cfg.loader)
    loader = kind.loader(
        splits.train,
        sampler,
        cfg.loader,
        seed=cfg.seed,
        drop_last=cfg.sampler.drop_last_batch,
        info=info,
    )
    schedule = kind.steps(cfg, sampler)  # optim.accumulate micro-batches each
    task = build_task(cfg.task)  # what is learned: the loss, the evaluation's sums and metrics
    task.setup(splits.info, info.device)
    parallel = build_parallel(cfg.parallel, cfg.ddp, info, amp=str(cfg.amp.mode))
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = build_model(cfg.model, splits.info)
    if fresh and cfg.finetune.init_from is not None:  # before the layout slices the weights
        report = init_weights(cfg.finetune, model)
        log.info("initialised from %s: %s", cfg.finetune.init_from, describe_load(report))
    check_batch_statistics(model, lambda: first_input(splits.train), schedule.last_micro_batch)
    if cfg.syncbn.enabled and info.distributed:
        model = convert_syncbn(model, info.device)  # before DDP registers the modules
    if cfg.numerics.channels_last:
        numerics.to_channels_last(model)
    model.to(info.device)
    switches = build_switches(cfg, model, info, parallel.mirror)  # laid out, never compiled
    trained = parallel.wrap(model)  # DDP wraps the model; FSDP2 slices it in place
    log.info("%s", parallel.describe())
    if cfg.compile:
        trained = compile_model(trained)  # after the layout (DDP: as DDP recommends)
    optimizer = build_optimizer(cfg.optim, model)
    amp_mode = parallel.autocast(str(cfg.amp.mode))  # FSDP2: bf16 is its policy's
    trainer = Trainer(
        model=trained,
        optimizer=optimizer,
        scheduler=build_scheduler(cfg.optim, optimizer, schedule.total_steps),
        scaler=build_scaler(cfg.amp, info.device),
        loader=loader,
        sampler=sampler,
        info=info,
        amp_mode=amp_mode,
        grad_clip=cfg.optim.grad_clip,
        log_every=cfg.log_every,
        schedule=schedule,
        keep_indices=sampler.dataset_size <= cfg.share_report_max_n,
        task=task,
        parallel=parallel,
        feed=kind.feed(cfg, info, switches),  # how batches come and the epoch ends
        spikes=build_spikes(
            cfg.spike, task, info, amp_mode, collective=cfg.syncbn.enabled or parallel.sliced
        ),
    )
    evaluation = build_evaluation(
        final=str(cfg.eval_split),
        splits=splits,
        loader=lambda dataset: build_eval_loader(cast(MapData, dataset), cfg.loader, info),
        model=model,
        ema=switches.get("ema"),
        info=info,
        amp_mode=amp_mode,
        task=task,
        lockstep=parallel.sliced,  # every forward a collective: every rank runs as many
    )
    selection = build_selection(cfg.selection, task)
    return Built(kind, data, trainer, splits, evaluation, selection, switches)


def checkpointer(
    cfg: Config, built: Built, state: TrainState, chain: Chain, run_dir: Path, yaml: str
) -> Checkpointer:
    """The checkpoint's named parts: restored in this order, each refusing its own misfit;
    the chain sealed over them."""
    tr = built.trainer
    weights = {
        "model": weights_part(tr.module),
        "optimizer": tr.parallel.optimizer_part(tr.module, tr.optimizer),
        **built.switches,
    }
    parts = {
        "progress": Progress(state=state, trainer=tr),
        **({} if tr.parallel.sliced else weights),
        "scheduler": tr.scheduler,
        "scaler": scaler_part(tr.scaler),
        "selection": built.selection,
    }
    return Checkpointer(
        directory=run_dir / "checkpoints",
        cfg=cfg.checkpoint,
        parts=parts,
        sliced=weights if tr.parallel.sliced else {},  # each rank's slices, through DCP
        rank_parts={
            "sampler": SamplerPosition(sampler=tr.sampler, state=state),
            "rng": RngState(),
            "ledger": Ledger(state=state),
            **({"spike": tr.spikes} if tr.spikes is not None else {}),
        },
        config_yaml=yaml,
        info=tr.info,
        seal=chain.seal,
        before_publish=lambda p: fault_injection.maybe_fire(
            cfg.fault, p["progress"]["step"], tr.info.rank, "write"
        ),
    )


def resume(
    cfg: Config,
    built: Built,
    ckpt: Checkpointer,
    chain: Chain,
    state: TrainState,
    found: Found | None,
    resize: Resize | None,
) -> str | None:
    """Continue from the checkpoint found (resume=auto: the newest valid one; or a given
    file), at its world size or, re-dealt, at this one, once its chain proves it continues
    this run; else a fresh run, maybe from another run's weights (finetune.init_from).
    Returns the resume's line (which run and link, what was skipped or repeated)."""
    tr, info = built.trainer, built.trainer.info
    if not found:  # a fresh run (build took finetune.init_from's weights)
        return None
    with unanimous():  # every rank decides alike from the one checkpoint
        link = chain.check(found.path, found.payload, info.world_size)  # before any part moves
        ckpt.restore(found, resized=resize is not None)
    log.info("resumed from %s at epoch %d, step %d", found.path, state.epoch, state.step)
    if resize is not None:
        log.info("%s", resize.describe())
        if resize.global_batch == "scale":
            rescale_horizon(cfg, built, state)
    return continuity(chain, link, tr, state)


def rescale_horizon(cfg: Config, built: Built, state: TrainState) -> None:
    """The LR schedule over the steps left at this world size (elastic.global_batch=scale)."""
    tr = built.trainer
    rest = built.kind.steps(cfg, tr.sampler, steps_before=state.steps_before)
    left = rest.steps_per_epoch - rest.steps_done(state.position)
    assert tr.schedule is not None  # build's
    later = max(0, cfg.epochs - state.epoch - 1) * tr.schedule.steps_per_epoch
    set_horizon(tr.scheduler, state.step + left + later)


def continuity(chain: Chain, link: Link | None, tr: Trainer, state: TrainState) -> str:
    """The epoch read before the resume against what the restored sampler puts there, on every
    rank (a collective): the samples skipped and repeated, or a refusal."""
    # A stream resumes only at an epoch's end (position 0, no prefix): nothing to prove.
    mine = resumed_prefix(tr.sampler, state.position, state.carried, state.prior, rank=tr.info.rank)
    rows = distributed.gather_objects(mine, tr.info)
    wrong = [w for _, _, ws in rows for w in ws]
    if wrong:  # every rank holds the same rows: a refusal they all meet
        raise Unanimous(
            f"resume at step {state.step}: {wrong[0]}, so it would skip and repeat samples; "
            f"resume with the template version and config that wrote the checkpoint, or start "
            f"fresh with resume=never."
        )
    skipped, repeated = sum(r[0] for r in rows), sum(r[1] for r in rows)
    return chain.describe(link, state.step, skipped, repeated)


def fit(
    cfg: Config,
    built: Built,
    state: TrainState,
    ckpt: Checkpointer,
    logger: RankLogger,
    tolerance: Tolerance,
) -> EvalResult:
    """The epoch loop: set_epoch → train → account for the data → evaluate → select →
    checkpoint → log → stop?"""
    tr, info, selection = built.trainer, built.trainer.info, built.selection
    every = cfg.checkpoint.preempt_check_every
    preempt = Preemption(info=info, every=every, run_id=logger.run.run_id)
    profiler = StepProfiler(cfg=cfg.profiler, run_dir=logger.run.run_dir, info=info)
    on_step = step_hook(cfg, built, ckpt, logger, preempt, profiler, tolerance)
    broken = False
    try:
        for epoch in range(state.epoch, cfg.epochs):
            if selection.stops_before(epoch):
                break
            state.epoch, start = epoch, state.position
            set_epoch(cfg, built, state)
            logger.start_epoch(epoch, steps_this_epoch(tr, state))
            stats = train_one_epoch(tr, state, on_step, logger.log_interval)
            if stats.stopped and cfg.uneven == "join":  # saved once Join caught every rank up
                ckpt.save()
            logger.end_epoch()
            account(built, stats, state, start, logger)
            if stats.stopped:
                preempt.stop(state.step, ckpt.last)  # checkpointed: a requeue continues
            fault_injection.maybe_fire(cfg.fault, state.step, info.rank, "evaluation")
            metrics = built.evaluation.epoch(epoch, state.step, logger)
            state.epoch, state.position, state.prior = epoch + 1, 0, []
            copies = selection.copies(selection.observe(metrics, epoch))
            saved = ckpt.save(epochs_done=state.epoch, copies=copies)
            if cfg.logger.log_checkpoints != "none":
                ckpt.wait()  # an artifact of the file published (checkpoint.async_save)
            for kind, path in {"last": saved.last, **saved.copies}.items():
                logger.log_checkpoint(
                    path,
                    kind=kind,
                    step=state.step,
                    epoch=epoch,
                    metrics=metrics,
                    slices=saved.slices,
                )
            if epoch + 1 < cfg.epochs and preempt.sync():  # a signal late in the epoch
                preempt.stop(state.step, ckpt.last)
    except Exception:
        broken = True  # a failed collective: the agreement in flight is not waited for
        raise
    finally:
        profiler.close()
        preempt.close(broken=broken)
        ckpt.close(broken=broken)  # checkpoint.async_save: the write in flight published
    return built.evaluation.at_end(state.epoch, state.step, logger)


def set_epoch(cfg: Config, built: Built, state: TrainState) -> None:
    tr, epoch = built.trainer, state.epoch
    tr.sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
    # the epoch's steps (after an elastic resume: the rest of it)
    tr.schedule = built.kind.steps(cfg, tr.sampler, steps_before=state.steps_before)
    built.splits.set_epoch(epoch)  # augmentation draws from (seed, epoch, index)
    reseed_for_epoch(tr.loader, cfg.seed, tr.info.rank, epoch)


def account(
    built: Built, stats: EpochStats, state: TrainState, start: int, logger: RankLogger
) -> None:
    """Log this rank's epoch (joined with the part read before a resume) and check every
    rank's data: against the sampler mode, or a stream's by its keys."""
    tr, epoch, step = built.trainer, state.epoch, state.step
    metrics = epoch_metrics(stats, tr.sampler, start, epoch, carried=state.carried)
    logger.log_epoch(metrics, step)  # a collective with one W&B run
    if tr.spikes is not None:
        logger.log_spikes(step)  # the epoch's spikes to one W&B run: a collective there
    report = built.kind.verify(stats, tr, state, start, metrics)  # a collective
    if report is not None:
        if tr.spikes is not None:  # samples whose update the spike rule skipped, by name
            report = replace(report, verdict=report.verdict.noted(tr.spikes.notes(epoch)))
        logger.log_share_report(report, epoch, step)


def step_hook(
    cfg: Config,
    built: Built,
    ckpt: Checkpointer,
    logger: RankLogger,
    preempt: Preemption,
    profiler: StepProfiler,
    tolerance: Tolerance,
) -> StepHook:
    """After every optimizer step: the switches, the logs (a spike's report), faults, a
    replacement's admission (fault_tolerance=live), preemption, checkpoints."""
    switches, tr = list(built.switches.values()), built.trainer
    rank, spikes = tr.info.rank, tr.spikes
    # uneven=join: a rank that joined runs this hook for each step it shadows, its optimizer
    # state stale until Join's end, so a stop's checkpoint waits for fit (after Join).
    save_on_stop = cfg.uneven != "join"

    def after_step(s: TrainState) -> bool:
        for switch in switches:
            switch.after_step(s)
        for report in spikes.take() if spikes is not None else ():
            logger.log_spike(report, s.step, cfg.spike.top)
        logger.step()
        profiler.step()
        fault_injection.maybe_fire(cfg.fault, s.step, rank)
        tolerance.boundary(s.step)
        stop = preempt.requested(s.step)  # a signal on any rank stops all at one step
        if (stop and save_on_stop) or ckpt.due(s.step):
            fault_injection.maybe_fire(cfg.fault, s.step, rank, "checkpoint")
            ckpt.save()
        return stop

    return after_step


def begin(
    cfg: Config,
    run: run_identity.RunInfo,
    built: Built,
    ckpt: Checkpointer,
    chain: Chain,
    state: TrainState,
    found: Found | None,
    resize: Resize | None,
    logger: RankLogger,
) -> Any:
    """Resume (or start fresh), record the segment, and say what the run is about to do;
    returns the shares picture's drawing thread (rank 0, where drawn)."""
    info = built.trainer.info
    line = resume(cfg, built, ckpt, chain, state, found, resize)
    if info.is_main:
        record_segment(run.run_dir, cfg=cfg, state=state, world_size=info.world_size)
    logger.ready()  # every rank's W&B run exists before anyone logs
    if line:
        logger.log_resume(line, state.step)
    if resize:
        logger.log({f"elastic/{k}": v for k, v in resize.record().items()}, state.step)
    logger.log_sizes(built.splits, state.step)
    global_batch = cfg.loader.batch_size * info.world_size * cfg.optim.accumulate
    if info.is_main:
        log.info("effective global batch %d (batch_size x world size x accumulate)", global_batch)
        logger.log({"train/global_batch": global_batch}, state.step)
    draws = cfg.share_picture and info.is_main and built.kind.pictured
    return draw_shares_async(built.trainer.sampler, run.run_dir) if draws else None


def train(cfg: Config, run: run_identity.RunInfo) -> float:
    """One rank's whole run; returns the sweep's objective: the task's monitored metric on the
    split evaluated each epoch (the validation split when there is one)."""
    numerics.apply(cfg.numerics)  # before this rank's first CUDA work
    tolerance = build_tolerance(cfg.fault_tolerance, cfg.backend)  # off: the restart path
    info, found = tolerance.setup()  # live: a replacement joins with the state handed over
    logger, exit_code = None, 1
    try:
        exit_records.record_start(run.run_dir, info.rank)  # for a peer that outlives this rank
        setup_console(info, run.run_dir)
        log.info("%s", info.describe())
        log.info("numerics: %s", numerics.describe())
        regroup = found is not None  # handed over: continued like a checkpoint of the old group
        if not regroup:
            found = resume_rank0(cfg.resume, run.run_dir / "checkpoints", info)
        while True:  # fault_tolerance=live: once per membership, each continuing the last
            with unanimous():  # every rank decides alike from the one checkpoint
                resize = plan_resize(cfg.elastic, found=found, run=cfg, info=info, regroup=regroup)
            now = resize.adjust(cfg) if resize else cfg  # its batch and accumulation from here on
            checks.check_join(now)  # uneven=join vs the accumulation a resize chose
            config = boundary.plain(now) | ({"resize": resize.record()} if resize else {})
            if logger is None:
                logger = RankLogger(cfg=now.logger, run=run, info=info, config=config)  # W&B
            else:
                logger.regroup(info)
            built = build(now, info, fresh=found is None)  # ...while this builds
            state = TrainState()
            chain = build_chain(now, plain=config, run=run.run_id, data=built.data)
            ckpt = checkpointer(now, built, state, chain, run.run_dir, OmegaConf.to_yaml(config))
            picture = begin(now, run, built, ckpt, chain, state, found, resize, logger)
            fault_injection.arm(now.fault, built.trainer, state)
            try:
                result = fit(now, built, state, ckpt, logger, tolerance)
                break
            except Exception as exc:  # live: a lost rank (or a replacement) regroups the ranks
                regrouped = tolerance.recover(exc, state.step)
                if regrouped is None:
                    raise
                found = tolerance.handover(Segment(ckpt, state, built.trainer), regrouped)
                info, regroup = regrouped, True
                setup_console(info, run.run_dir)
        logger.finish_run(result, built.splits, state.step, picture)
        exit_code = 0
        name, _ = objective(built.trainer.task, now.selection.monitor, now.selection.mode)
        return built.evaluation.latest().values[name]
    except ConfigError as exc:  # one sentence, no traceback: the message says the fix
        say_refusal(exc, info.rank)  # one every rank met alike: rank 0 says it
        exit_code = EXIT_CONFIG_ERROR
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    except Exception as exc:
        exit_records.record_failure(run.run_dir, info.rank, exc)  # the launcher names the cause
        raise
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else 1
        raise
    finally:
        try:
            if logger is not None:
                logger.finish(exit_code)
            if exit_code in (EXIT_PREEMPTED, EXIT_INTERRUPTED):
                # An agreed stop: a launcher ends the other ranks at the first non-zero exit, so
                # no rank leaves before every rank has flushed its logs and W&B run.
                distributed.barrier(info)
        finally:
            # Whatever failed above: a process that exits with its gloo group alive can abort
            # in the interpreter's shutdown ("terminate called without an active exception").
            exit_records.record_exit(run.run_dir, info.rank, exit_code)
            distributed.teardown()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(raw: DictConfig) -> float:
    try:
        with unanimous():  # under torchrun every process of a node checks the same config
            cfg = boundary.typed(raw)  # the schema dataclasses, unknown keys refused
            checks.check(cfg)  # every startup check, before any process or builder
        return launch.launch(train, cfg, run_identity.current_run())
    except ConfigError as exc:  # a node's refusal: its first process says it
        say_refusal(exc, distributed.env_local_rank())
        sys.exit(EXIT_CONFIG_ERROR)


if __name__ == "__main__":
    try:
        distributed.adopt_launcher()  # srun/mpirun ranks join one job, before Hydra's run dir
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    sys.argv = boundary.experiment_spelling(sys.argv)
    quick_exit.run(main)  # main's exit status, without Python's teardown of torch (~0.5 s)
