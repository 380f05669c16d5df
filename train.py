"""Train a model on any task with DistributedDataParallel, every rank's data accounted for.

    python train.py                                   # one process
    python train.py dist.nproc=2                      # two ranks, started in-process
    torchrun --standalone --nproc-per-node=2 train.py # two ranks under torchrun

The classic recipe — init the process group, deal each rank its share with a distributed
sampler, wrap the model in DDP, loop over epochs calling ``set_epoch`` — each step one builder
named after the config group it reads (docs/ARCHITECTURE.md maps them).
"""

from __future__ import annotations

import gc

gc.disable()  # no GC passes over the millions of objects torch's import allocates

import sys
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, cast

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from ddp_template import checks, distributed, fault_injection, launch, numerics, run_identity
from ddp_template.amp import build_scaler
from ddp_template.checkpoint import Checkpointer, Found, folder_of, resume_rank0
from ddp_template.checkpoint_parts import named_parts
from ddp_template.config import boundary
from ddp_template.config.schema import Config, register_configs
from ddp_template.data.contract import MapData, Splits, first_input
from ddp_template.data.identity import DataIdentity, identify
from ddp_template.data.loader import build_eval_loader
from ddp_template.data.transforms import apply_transforms
from ddp_template.data.workers import reseed_for_epoch
from ddp_template.elastic import Resize, plan_resize, record_stretch
from ddp_template.ending import Ending
from ddp_template.engine import EpochStats, StepHook, Trainer, TrainState, train_one_epoch
from ddp_template.errors import EXIT_CONFIG_ERROR, ConfigError, unanimous
from ddp_template.evaluation import Evaluation, build_evaluation
from ddp_template.finetune import init_weights
from ddp_template.kind import DataKind, kind_of
from ddp_template.ledger.verify import continuity, epoch_metrics
from ddp_template.models import build_model, check_batch_statistics, convert_syncbn, describe_load
from ddp_template.optim import build_optimizer, build_scheduler, set_horizon
from ddp_template.parallel import build_parallel, compile_model
from ddp_template.preemption import Preemption
from ddp_template.probe import probe
from ddp_template.process import exit_records, quick_exit
from ddp_template.profiling import StepProfiler
from ddp_template.provenance import Chain, build_chain
from ddp_template.selection import Selection, build_selection
from ddp_template.sinks.console import say_refusal, setup_console
from ddp_template.sinks.metrics import RankLogger, log
from ddp_template.sinks.share_plot import draw_shares_async
from ddp_template.spike import build_spikes
from ddp_template.splits import build_splits
from ddp_template.switches import Switch, build_switches
from ddp_template.task import EvalResult, build_task, objective, register_sweep_direction
from ddp_template.tolerance import Begin, Held, Tolerance, build_tolerance

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
    switches: dict[str, Switch]  # the research-loop switches that are on, by name


def build(cfg: Config, info: distributed.DistInfo, *, fresh: bool = True) -> Built:
    """Data (+its identity) → task (+augmentation, the task's training data) → sampler →
    loaders → model (+a fresh run's finetune weights, +SyncBN) → switches (EMA) → DDP or FSDP2
    → compile → optimizer (+the spike rule) → evaluation."""
    splits = build_splits(cfg.data)
    kind = kind_of(splits)  # map-style, or the kind its factory chose (tar shards, a stream)
    kind.check(cfg, splits)  # the run's options this kind cannot honour (after a resize too)
    # The data's identity (provenance), before augmentation wraps it: rank 0's, read once.
    data = distributed.broadcast_object(identify(splits) if info.is_main else None, info)
    task = build_task(cfg.task)  # what is learned: the loss, the evaluation's sums and metrics
    task.setup(splits.info, info.device)  # its training data: the splits, or its own (views)
    splits = task.training_data(apply_transforms(splits, cfg.transforms, cfg.seed), cfg.seed)
    sampler = kind.sampler(splits.train, cfg.sampler, seed=cfg.seed, info=info, loader=cfg.loader)
    loader = kind.loader(
        splits.train,
        sampler,
        cfg.loader,
        seed=cfg.seed,
        drop_last=cfg.sampler.drop_last_batch,
        info=info,
    )
    steps = kind.steps(cfg, sampler)  # optim.accumulate micro-batches each
    parallel = build_parallel(cfg.parallel, cfg.ddp, info, amp=str(cfg.amp.mode))
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = build_model(cfg.model, splits.info)
    if fresh and cfg.finetune.init_from is not None:  # before the layout slices the weights
        report = init_weights(cfg.finetune, model)
        log.info("initialised from %s: %s", cfg.finetune.init_from, describe_load(report))
    check_batch_statistics(model, lambda: first_input(splits.train), steps.last_micro_batch)
    if cfg.syncbn.enabled and info.distributed:
        model = convert_syncbn(model, info.device)  # before DDP registers the modules
    if cfg.numerics.channels_last:
        numerics.to_channels_last(model)
    model.to(info.device)
    probe(task, model, splits, info, cfg.model._target_)  # the task meets the model: one sentence
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
        scheduler=build_scheduler(cfg.optim, optimizer, steps.total_steps),
        scaler=build_scaler(cfg.amp, info.device),
        loader=loader,
        sampler=sampler,
        info=info,
        amp_mode=amp_mode,
        grad_clip=cfg.optim.grad_clip,
        log_every=cfg.log_every,
        steps=steps,
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
        every_steps=cfg.eval_every_steps,
    )
    selection = build_selection(cfg.selection, task)
    return Built(kind, data, trainer, splits, evaluation, selection, switches)


@dataclass
class Session:
    """One membership's run (the whole run, but under fault_tolerance=live): what resume,
    begin, fit and the step hook share."""

    cfg: Config  # the config in force: after a resize, its batch and accumulation from here on
    run: run_identity.RunInfo
    plain: dict[str, Any]  # the config as the logs, the chain and the checkpoints record it
    logger: RankLogger
    tolerance: Tolerance
    built: Built
    found: Found | None  # the checkpoint (or the state handed over) it continues
    resize: Resize | None
    state: TrainState = field(default_factory=TrainState)
    chain: Chain = field(init=False)
    ckpt: Checkpointer = field(init=False)
    picture: Any = None  # the shares picture's drawing thread (rank 0, where drawn)
    result: EvalResult | None = None

    def fit(self) -> None:
        self.result = fit(self)

    def held(self) -> Held:
        return Held(self.ckpt, self.state, self.built.trainer)


def checkpointer(s: Session) -> Checkpointer:
    """The checkpoint's named parts (``named_parts``: restored in their order, each refusing
    its own misfit), the chain sealed over them."""
    tr, b = s.built.trainer, s.built
    return Checkpointer(
        **named_parts(tr, s.state, b.switches, b.selection, b.splits.info)._asdict(),
        directory=folder_of(s.cfg.checkpoint, s.run.run_dir),
        cfg=s.cfg.checkpoint,
        config_yaml=OmegaConf.to_yaml(s.plain),
        info=tr.info,
        seal=s.chain.seal,
        before_publish=lambda p: fault_injection.maybe_fire(  # fault.phase=write (tests)
            s.cfg.fault, p["progress"]["step"], tr.info.rank, "write"
        ),
    )


def resume(s: Session) -> str | None:
    """Continue from the checkpoint found (resume=auto: the newest valid one; or a given
    file), at its world size or, re-dealt, at this one, once its chain proves it continues
    this run; else a fresh run, maybe from another run's weights (finetune.init_from).
    Returns the resume's line (which run and link, what was skipped or repeated)."""
    found, state, tr = s.found, s.state, s.built.trainer
    if not found:  # a fresh run (build took finetune.init_from's weights)
        return None
    with unanimous():  # every rank decides alike from the one checkpoint
        link = s.chain.check(found.path, found.payload, tr.info.world_size)
        s.ckpt.restore(found, resized=s.resize is not None)  # after the chain, not before
    log.info("resumed from %s at epoch %d, step %d", found.path, state.epoch, state.step)
    if s.resize is not None:
        log.info("%s", s.resize.describe())
    if s.resize is not None and s.resize.global_batch == "scale":  # the LR schedule: the rest
        rest = s.built.kind.steps(s.cfg, tr.sampler, steps_before=state.steps_before)
        later = max(0, s.cfg.epochs - state.epoch - 1) * tr.steps.steps_per_epoch
        set_horizon(tr.scheduler, rest.horizon(state.step, state.position, later))
    skipped, repeated = continuity(tr.sampler, state, tr.info)  # else a refusal
    return s.chain.describe(link, state.step, skipped, repeated)


def fit(s: Session) -> EvalResult:
    """The epoch loop: set_epoch → train → account for the data → evaluate → select →
    checkpoint → log → stop?"""
    cfg, tr, state, ckpt, logger = s.cfg, s.built.trainer, s.state, s.ckpt, s.logger
    preempt = Preemption(
        info=tr.info, every=cfg.checkpoint.preempt_check_every, run_id=s.run.run_id
    )
    profiler = StepProfiler(cfg=cfg.profiler, run_dir=s.run.run_dir, info=tr.info)
    on_step = step_hook(s, preempt, profiler)
    with ckpt, preempt, profiler:  # closed on every path: the agreement, then a save in flight
        for epoch in range(state.epoch, cfg.epochs):
            if s.built.selection.stops_before(epoch) or tr.steps.ended(state.step, state.position):
                break  # early stopping, or max_steps reached
            state.epoch, start = epoch, state.position
            set_epoch(s)
            logger.start_epoch(epoch, tr.steps.steps_left(state.position))
            stats = train_one_epoch(tr, state, on_step, logger.log_interval)
            if stats.stopped and tr.feed.saves_stop_at_end:  # once Join caught every rank up
                ckpt.save()
            logger.end_epoch()
            account(s, stats, start)
            if stats.stopped:
                preempt.stop(state.step, ckpt.last)  # checkpointed: a requeue continues
            fault_injection.maybe_fire(cfg.fault, state.step, tr.info.rank, "evaluation")
            metrics = s.built.evaluation.epoch(epoch, state.step, logger)
            state.epoch, state.position, state.prior = epoch + 1, 0, []
            copies = s.built.selection.copies(s.built.selection.observe(metrics, epoch))
            saved = ckpt.save(epochs_done=state.epoch, copies=copies)
            if cfg.logger.log_checkpoints != "none":
                ckpt.wait()  # an artifact of the file published (checkpoint.async_save)
            at: dict[str, Any] = {"step": state.step, "epoch": epoch, "metrics": metrics}
            for kind, path in {"last": saved.last, **saved.copies}.items():
                logger.log_checkpoint(path, kind=kind, slices=saved.slices, **at)
            if epoch + 1 < cfg.epochs and preempt.sync():  # a signal late in the epoch
                preempt.stop(state.step, ckpt.last)
    return s.built.evaluation.at_end(state.epoch, state.step, logger)


def set_epoch(s: Session) -> None:
    tr, state = s.built.trainer, s.state
    tr.sampler.set_epoch(state.epoch)  # a new shuffle every epoch, the same on every rank
    steps = s.built.kind.steps(s.cfg, tr.sampler, steps_before=state.steps_before)  # the rest
    tr.steps = steps.from_step(state.step, state.position)  # where max_steps falls in it
    s.built.splits.set_epoch(state.epoch)  # augmentation draws from (seed, epoch, index)
    reseed_for_epoch(tr.loader, s.cfg.seed, tr.info.rank, state.epoch)


def account(s: Session, stats: EpochStats, start: int) -> None:
    """Log this rank's epoch (joined with the part read before a resume) and check every
    rank's data: against the sampler mode, or a stream's by its keys."""
    tr, state, logger = s.built.trainer, s.state, s.logger
    metrics = epoch_metrics(stats, tr.sampler, start, state.epoch, carried=state.carried)
    logger.log_epoch(metrics, state.step)  # a collective with one W&B run
    if tr.spikes is not None:
        logger.log_spikes(state.step)  # the epoch's spikes to one W&B run: a collective there
    report = s.built.kind.verify(stats, tr, state, start, metrics)  # a collective
    if report is not None:
        if tr.spikes is not None:  # samples whose update the spike rule skipped, by name
            report = replace(report, verdict=report.verdict.noted(tr.spikes.notes(state.epoch)))
        logger.log_share_report(report, state.epoch, state.step)


def step_hook(s: Session, preempt: Preemption, profiler: StepProfiler) -> StepHook:
    """After every optimizer step: the switches, logs (a spike's report), faults, a replacement's
    admission (fault_tolerance=live), preemption, eval_every_steps' evaluation, checkpoints."""
    cfg, tr, ckpt, logger = s.cfg, s.built.trainer, s.ckpt, s.logger
    switches, rank, spikes = list(s.built.switches.values()), tr.info.rank, tr.spikes
    # A feed that shadows steps (a stream under torch's Join): the stop's checkpoint in fit.
    save_on_stop = not tr.feed.saves_stop_at_end

    def after_step(state: TrainState) -> bool:
        for switch in switches:
            switch.after_step(state)
        for report in spikes.take() if spikes is not None else ():
            logger.log_spike(report, state.step, cfg.spike.top)
        logger.step()
        profiler.step()
        fault_injection.maybe_fire(cfg.fault, state.step, rank)
        s.tolerance.boundary(state.step)
        stop = preempt.requested(state.step)  # a signal on any rank stops all at one step
        ends = tr.steps.steps_left(state.position) == 0  # the epoch's end evaluates
        evaluated = s.built.evaluation.at_step(state.epoch, state.step, ends, logger)
        if (stop and save_on_stop) or ckpt.due(state.step) or evaluated:
            fault_injection.maybe_fire(cfg.fault, state.step, rank, "checkpoint")
            ckpt.save()
        return stop

    return after_step


def begin(s: Session) -> None:
    """Resume (or start fresh), record the stretch, and say what the run is about to do; rank
    0 starts drawing the shares picture."""
    cfg, info, state, logger = s.cfg, s.built.trainer.info, s.state, s.logger
    line = resume(s)
    if info.is_main:
        record_stretch(s.run.run_dir, cfg=cfg, state=state, world_size=info.world_size)
    logger.ready()  # every rank's W&B run exists before anyone logs
    if line:
        logger.log_resume(line, state.step)
    if s.resize:
        logger.log({f"elastic/{k}": v for k, v in s.resize.record().items()}, state.step)
    logger.log_sizes(s.built.splits, state.step)
    logger.log_global_batch(cfg.loader.batch_size, cfg.optim.accumulate, state.step)
    if cfg.share_picture and info.is_main and s.built.kind.pictured:
        s.picture = draw_shares_async(s.built.trainer.sampler, s.run.run_dir)


def membership(
    cfg: Config, run: run_identity.RunInfo, tolerance: Tolerance, ending: Ending
) -> Begin[Session]:
    """What begins each membership from the state it continues (a checkpoint, or the state
    the survivors handed over): plan the resize → build → checkpointer → resume → begin."""

    def begun(info: distributed.DistInfo, found: Found | None, regroup: bool) -> Session:
        setup_console(info, run.run_dir)  # a regroup may have moved rank 0's duties
        with unanimous():  # every rank decides alike from the one checkpoint
            resize = plan_resize(cfg.elastic, found=found, run=cfg, info=info, regroup=regroup)
        now = resize.adjust(cfg) if resize else cfg  # its batch and accumulation from here on
        plain = boundary.plain(now) | ({"resize": resize.record()} if resize else {})
        if ending.logger is None:
            ending.logger = RankLogger(cfg=now.logger, run=run, info=info, config=plain)  # W&B
        ending.info = info
        ending.logger.regroup(info)  # this process's place among the (regrouped) ranks
        built = build(now, info, fresh=found is None)
        s = Session(now, run, plain, ending.logger, tolerance, built, found, resize)
        s.chain = build_chain(now, plain=plain, run=run.run_id, data=built.data)
        s.ckpt = checkpointer(s)
        begin(s)
        fault_injection.arm(now.fault, built.trainer, s.state)
        return s

    return begun


def train(cfg: Config, run: run_identity.RunInfo) -> float:
    """One rank's whole run; returns the sweep's objective: the task's monitored metric on the
    split evaluated each epoch (the validation split when there is one)."""
    numerics.apply(cfg.numerics)  # before this rank's first CUDA work
    tolerance = build_tolerance(cfg.fault_tolerance, cfg.backend)  # off: the restart path
    info, found = tolerance.setup()  # live: a replacement joins with the state handed over
    # The exit code, and on every path: the logs flushed, the exit recorded, the group torn down
    with Ending(run.run_dir, info, cfg.backend) as ending:
        exit_records.record_start(run.run_dir, info.rank, info.address)  # for peers outliving it
        setup_console(info, run.run_dir)
        log.info("%s", info.describe())
        log.info("numerics: %s", numerics.describe())
        regroup = found is not None  # handed over: continued like a checkpoint of the old group
        if not regroup:
            found = resume_rank0(cfg.resume, folder_of(cfg.checkpoint, run.run_dir), info)
        s = tolerance.run(membership(cfg, run, tolerance, ending), info, found, regroup)
        s.logger.finish_run(s.result, s.built.splits, s.state.step, s.picture)
        name, _ = objective(s.built.trainer.task, s.cfg.selection.monitor, s.cfg.selection.mode)
        return s.built.evaluation.latest().values[name]


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
