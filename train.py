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

import sys
from typing import NamedTuple

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from ddp_template import boundary, distributed, failures, faults, launch, numerics, run_identity
from ddp_template.amp import build_scaler
from ddp_template.checkpoint import Checkpointer, init_weights, restore, resume_rank0
from ddp_template.config import Config, register_configs
from ddp_template.data.datasets import Splits, build_splits
from ddp_template.data.loader import (
    build_eval_loader,
    build_train_loader,
    build_train_sampler,
    reseed_for_epoch,
)
from ddp_template.data.schedule import StepSchedule
from ddp_template.data.shard_check import epoch_metrics, verify_epoch
from ddp_template.data.transforms import apply_transforms
from ddp_template.ema import build_ema
from ddp_template.engine import (
    EvalResult,
    Trainer,
    TrainState,
    evaluate,
    steps_this_epoch,
    train_one_epoch,
)
from ddp_template.errors import EXIT_CONFIG_ERROR, EXIT_INTERRUPTED, EXIT_PREEMPTED, ConfigError
from ddp_template.logging import RankLogger, log, setup_console
from ddp_template.models import (
    build_model,
    check_batch_statistics,
    convert_syncbn,
    describe_load,
)
from ddp_template.optim import build_optimizer, build_scheduler
from ddp_template.parallel import build_ddp, compile_model
from ddp_template.preemption import Preemption
from ddp_template.profiling import StepProfiler
from ddp_template.shard_plot import draw_shards_async

register_configs()
run_identity.register_resolvers()


class Built(NamedTuple):
    trainer: Trainer
    splits: Splits
    eval_loader: DataLoader  # the test split
    val_loader: DataLoader | None  # data.val_fraction > 0: evaluated each epoch instead
    final_loader: DataLoader  # eval_split's: the split summary.json reports


def build(cfg: Config, info: distributed.DistInfo) -> Built:
    """Data (+augmentation) → sampler → loaders → model (+SyncBN) → EMA → DDP → compile →
    optimizer."""
    splits = apply_transforms(build_splits(cfg.data), cfg.transforms, cfg.seed)
    sampler = build_train_sampler(splits.train, cfg.sampler, seed=cfg.seed, info=info)
    loader = build_train_loader(splits.train, sampler, cfg, info)
    eval_loader = build_eval_loader(splits.eval, cfg, info)
    val_loader = build_eval_loader(splits.val, cfg, info) if splits.val is not None else None
    final_loader = {"test": eval_loader, "val": val_loader}.get(str(cfg.eval_split))
    if final_loader is None:
        final_loader = build_eval_loader(splits.split(str(cfg.eval_split)), cfg, info)
    schedule = StepSchedule(  # optimizer steps: optim.accumulate micro-batches each
        length=sampler.num_samples,
        batch_size=cfg.batch_size,
        epochs=cfg.epochs,
        max_steps_per_epoch=cfg.max_steps_per_epoch,
        drop_last_batch=cfg.sampler.drop_last_batch,
        accumulate=cfg.optim.accumulate,
    )
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = build_model(cfg.model, splits.info)
    check_batch_statistics(model, splits.info, schedule.last_micro_batch)
    if cfg.syncbn.enabled and info.distributed:
        model = convert_syncbn(model, info.device)  # before DDP registers the modules
    if cfg.channels_last:
        numerics.to_channels_last(model)
    model.to(info.device)
    ema = build_ema(cfg.ema, model, info)  # a plain copy: never wrapped, never compiled
    trained = build_ddp(cfg.ddp, model, info)
    if cfg.compile:
        trained = compile_model(trained)  # after DDP, as DDP recommends
    optimizer = build_optimizer(cfg.optim, model)
    trainer = Trainer(
        model=trained,
        optimizer=optimizer,
        scheduler=build_scheduler(cfg.optim, optimizer, schedule.total_steps),
        scaler=build_scaler(cfg.amp, info.device),
        loader=loader,
        sampler=sampler,
        info=info,
        amp_mode=str(cfg.amp.mode),
        grad_clip=cfg.optim.grad_clip,
        log_every=cfg.log_every,
        schedule=schedule,
        ema=ema,
        keep_indices=len(splits.train) <= cfg.shard_report_max_n,
        label_smoothing=cfg.loss.label_smoothing,
    )
    return Built(trainer, splits, eval_loader, val_loader, final_loader)


def resume(cfg: Config, ckpt: Checkpointer) -> TrainState:
    """Continue from the newest valid checkpoint (resume=auto), a given file, or not at all;
    a fresh run may start from another run's weights (init_from)."""
    state = TrainState()
    found = resume_rank0(cfg.resume, ckpt.directory, ckpt.info)
    if found:
        restore(found, ckpt.trainer, state, ckpt.info)
        ckpt.restore_best(found.payload)
        log.info("resumed from %s at epoch %d, step %d", found.path, state.epoch, state.step)
    elif cfg.init_from is not None:
        report = init_weights(
            cfg.init_from,
            ckpt.trainer.module,
            ema=cfg.init_from_ema,
            strict=cfg.init_from_strict,
        )
        log.info("initialised from %s: %s", cfg.init_from, describe_load(report))
    return state


def fit(
    cfg: Config, built: Built, state: TrainState, ckpt: Checkpointer, logger: RankLogger
) -> EvalResult:
    """The epoch loop: set_epoch → train → account for the data → evaluate → checkpoint."""
    tr, info = built.trainer, built.trainer.info
    every = cfg.checkpoint.preempt_check_every
    preempt = Preemption(info=info, every=every, run_id=logger.run.run_id)
    profiler = StepProfiler(cfg=cfg.profiler, run_dir=logger.run.run_dir, info=info)
    classes = built.splits.info.num_classes
    # Each epoch evaluates the validation split when there is one; the test split then once.
    per_epoch, split = (
        (built.val_loader, "val") if built.val_loader else (built.eval_loader, "eval")
    )
    patience = cfg.early_stop.patience

    def after_step(s: TrainState) -> bool:
        logger.step()
        profiler.step()
        faults.maybe_fire(cfg.fault, s.step, info.rank)
        stop = preempt.requested(s.step)  # a signal on any rank stops all at one step
        if stop or ckpt.due(s.step):
            ckpt.save(s)
        return stop

    result = None
    try:
        for epoch in range(state.epoch, cfg.epochs):
            if patience is not None and ckpt.stale_epochs(epoch - 1) >= patience:
                log.info(
                    "early stop before epoch %d: no better %s for %d epochs (best %.6g at "
                    "epoch %d)",
                    epoch,
                    cfg.checkpoint.monitor,
                    patience,
                    ckpt.best_value,
                    ckpt.best_epoch,
                )
                break
            state.epoch, start = epoch, state.position
            tr.sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
            built.splits.set_epoch(epoch)  # augmentation draws from (seed, epoch, index)
            reseed_for_epoch(tr.loader, cfg.seed, info.rank, epoch)
            logger.start_epoch(epoch, steps_this_epoch(tr, state))
            stats = train_one_epoch(tr, state, after_step, logger.log_interval)
            logger.end_epoch()
            metrics = epoch_metrics(stats, tr.sampler, start, epoch)
            logger.log_epoch(metrics, state.step)  # a collective with one W&B run
            report = verify_epoch(stats, tr.sampler, start, metrics, info)  # a collective
            if report is not None:
                logger.log_shard_report(report, epoch, state.step)
            if stats.stopped:
                preempt.stop(state.step, ckpt.last)  # checkpointed: a requeue continues
            result = evaluate(tr.module, per_epoch, info, tr.amp_mode, num_classes=classes)
            logger.log_eval(result, epoch, state.step, split)
            if tr.ema is not None:  # the averaged weights, evaluated as exactly
                ema = evaluate(tr.ema.module, per_epoch, info, tr.amp_mode, num_classes=classes)
                logger.log(_ema_metrics(ema, split), state.step)
            state.epoch, state.position = epoch + 1, 0
            best = ckpt.improves(result.metrics(split), epoch)
            saved = ckpt.save(state, epoch_end=True, best=best)
            for kind, path in (("last", saved.last), ("best", saved.best)):
                logger.log_checkpoint(
                    path, kind=kind, step=state.step, epoch=epoch, metrics=result.metrics(split)
                )
            if epoch + 1 < cfg.epochs and preempt.sync():  # a signal late in the epoch
                preempt.stop(state.step, ckpt.last)
    finally:
        profiler.close()
        preempt.close()
    if result is None or split == "val" or cfg.eval_split != "test":
        # epochs=0, a finished run resumed, a val split, or the final eval on another split
        result = evaluate(tr.module, built.final_loader, info, tr.amp_mode, num_classes=classes)
        if split == "val" and cfg.eval_split == "test":
            logger.log_eval(result, state.epoch, state.step, "eval")
    result.split = str(cfg.eval_split)
    return result


def _ema_metrics(result: EvalResult, split: str) -> dict[str, float]:
    """The EMA's eval under ``<split>/ema_<metric>`` (eval/ema_accuracy, …)."""
    log.info("EMA %s accuracy %.4f, loss %.4f", split, result.accuracy, result.loss)
    return {k.replace("/", "/ema_", 1): v for k, v in result.metrics(split).items()}


def train(cfg: Config, run: run_identity.RunInfo) -> float:
    """One rank's whole run; returns the final eval accuracy (the sweep objective)."""
    numerics.apply(cfg)  # before this rank's first CUDA work
    info = distributed.setup(cfg.backend)
    logger, exit_code = None, 1
    try:
        failures.record_start(run.run_dir, info.rank)  # for a peer that outlives this rank
        setup_console(info, run.run_dir)
        log.info("%s", info.describe())
        log.info("numerics: %s", numerics.describe())
        config = boundary.plain(cfg)
        logger = RankLogger(cfg=cfg.logger, run=run, info=info, config=config)  # W&B starts
        built = build(cfg, info)  # ...while this builds
        ckpt = Checkpointer(
            directory=run.run_dir / "checkpoints",
            cfg=cfg.checkpoint,
            trainer=built.trainer,
            config_yaml=OmegaConf.to_yaml(config),
            info=info,
        )
        state = resume(cfg, ckpt)
        logger.ready()  # every rank's W&B run exists before anyone logs
        logger.log_sizes(built.splits, state.step)
        global_batch = cfg.batch_size * info.world_size * cfg.optim.accumulate
        if info.is_main:
            log.info(
                "effective global batch %d (batch_size x world size x accumulate)", global_batch
            )
            logger.log({"train/global_batch": global_batch}, state.step)
        picture = draw_shards_async(built.trainer.sampler, run.run_dir) if info.is_main else None
        result = fit(cfg, built, state, ckpt, logger)
        logger.finish_run(result, built.splits, state.step, picture)
        exit_code = 0
        return result.accuracy
    except ConfigError as exc:  # one sentence, no traceback: the message says the fix
        log.error("%s", exc)
        exit_code = EXIT_CONFIG_ERROR
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    except Exception as exc:
        failures.record_failure(run.run_dir, info.rank, exc)  # the launcher names the cause
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
            failures.record_exit(run.run_dir, info.rank, exit_code)
            distributed.teardown()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(raw: DictConfig) -> float:
    try:
        cfg = boundary.typed(raw)  # the schema dataclasses, unknown keys refused
        boundary.check(cfg)  # every startup check, before any process or builder
        return launch.launch(train, cfg, run_identity.current_run())
    except ConfigError as exc:
        log.error("%s", exc)
        sys.exit(EXIT_CONFIG_ERROR)


if __name__ == "__main__":
    try:
        distributed.adopt_launcher()  # srun/mpirun ranks join one job, before Hydra's run dir
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    sys.argv = boundary.experiment_spelling(sys.argv)
    main()
