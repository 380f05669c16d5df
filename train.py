"""Train a classifier with DistributedDataParallel, every rank's data accounted for.

    python train.py                                   # one process
    python train.py dist.nproc=2                      # two ranks, started in-process
    torchrun --standalone --nproc-per-node=2 train.py # two ranks under torchrun

The recipe is the classic one — init the process group, shard the data with a distributed
sampler, wrap the model in DDP, loop over epochs calling ``set_epoch`` — and each step is one
builder from ``src/ddp_template`` named after the config group it reads.
"""

from __future__ import annotations

import sys

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_template import checkpoint, distributed, faults, launch
from ddp_template.config import register_configs
from ddp_template.data.datasets import build_splits, check_sizes
from ddp_template.data.loader import (
    build_eval_loader,
    build_train_loader,
    build_train_sampler,
    reseed_for_epoch,
)
from ddp_template.engine import (
    EvalResult,
    Trainer,
    TrainState,
    check_amp,
    evaluate,
    make_scaler,
    steps_this_epoch,
    train_one_epoch,
)
from ddp_template.errors import EXIT_CONFIG_ERROR, EXIT_PREEMPTED, ConfigError
from ddp_template.logging import (
    RankLogger,
    draw_shards_async,
    log,
    log_eval,
    report_epoch,
    setup_console,
)
from ddp_template.models import build_model, convert_syncbn
from ddp_template.optim import build_optimizer, build_scheduler

register_configs()
launch.register_resolvers()


def build(cfg: DictConfig, info: distributed.DistInfo) -> tuple[Trainer, object]:
    """Data → sampler → loaders → model (+SyncBN) → DDP → optimizer: the classic recipe."""
    check_amp(cfg.amp.mode.value, info.device)
    faults.check(cfg.fault)
    splits = build_splits(cfg.data)
    check_sizes(splits, info.world_size, cfg.sampler.mode == "drop_last")
    sampler = build_train_sampler(splits.train, cfg, info)
    loader = build_train_loader(splits.train, sampler, cfg, info)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = build_model(cfg.model, splits.info)
    if cfg.syncbn.enabled and info.distributed:
        model = convert_syncbn(model, info.device)  # before DDP registers the modules
    model.to(info.device)
    ddp = (
        DDP(model, device_ids=[info.local_rank] if info.device.type == "cuda" else None)
        if info.distributed
        else model
    )
    optimizer = build_optimizer(cfg.optim, model)
    steps = cfg.epochs * min(len(loader), cfg.max_steps_per_epoch or len(loader))
    keep = len(splits.train) <= cfg.shard_report_max_n
    tr = Trainer(
        ddp,
        optimizer,
        build_scheduler(cfg.optim, optimizer, steps),
        make_scaler(cfg.amp, info.device),
        loader,
        sampler,
        info,
        cfg.amp.mode.value,
        cfg.optim.grad_clip,
        cfg.log_every,
        cfg.max_steps_per_epoch,
        keep,
    )
    return tr, splits


def resume(
    cfg: DictConfig, run: launch.RunInfo, tr: Trainer, info: distributed.DistInfo
) -> tuple[TrainState, checkpoint.Checkpointer]:
    """Continue from the newest valid checkpoint (resume=auto), a given file, or not at all."""
    state = TrainState()
    ckpt = checkpoint.Checkpointer(
        run.run_dir / "checkpoints",
        cfg.checkpoint.every_steps,
        cfg.checkpoint.keep,
        cfg.checkpoint.enabled,
        info,
    )
    found = checkpoint.resume_rank0(cfg.resume, ckpt.directory, info)
    if found:
        checkpoint.restore(found[1], found[0], tr, state, info)
        log.info("resumed from %s at epoch %d, step %d", found[0], state.epoch, state.step)
    return state, ckpt


def fit(
    cfg: DictConfig,
    tr: Trainer,
    state: TrainState,
    ckpt: checkpoint.Checkpointer,
    logger: RankLogger,
    eval_loader: object,
) -> EvalResult:
    """The epoch loop: set_epoch → train → account for the data → evaluate → checkpoint."""
    info = tr.info
    preempt = checkpoint.Preemption(info, cfg.checkpoint.preempt_check_every)
    fault = OmegaConf.to_object(cfg.fault)  # read per step: a plain object, not a DictConfig

    def after_step(s: TrainState) -> bool:
        logger.step()
        faults.maybe_fire(fault, s.step, info.rank)
        stop = preempt.requested(s.step)  # SIGTERM/SIGUSR1 on any rank stops all at one step
        if stop or ckpt.due(s.step):
            ckpt.save(tr, s, cfg, logger.wandb_id)
        return stop

    result = None
    try:
        for epoch in range(state.epoch, cfg.epochs):
            state.epoch, start = epoch, state.position
            tr.sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
            reseed_for_epoch(tr.loader, cfg.seed, info.rank, epoch)
            logger.start_epoch(epoch, steps_this_epoch(tr, state))
            stats = train_one_epoch(tr, state, after_step, logger.log_interval)
            logger.end_epoch()
            report_epoch(logger, tr.sampler, stats, start, epoch, state.step)
            if stats.stopped:
                raise SystemExit(EXIT_PREEMPTED)  # checkpointed: a requeue continues
            result = evaluate(tr.module, eval_loader, info, tr.amp_mode)
            log_eval(logger, result, epoch, state.step)
            state.epoch, state.position = epoch + 1, 0
            ckpt.save(tr, state, cfg, logger.wandb_id, epoch_end=True)
            if epoch + 1 < cfg.epochs and preempt.sync():  # a signal late in the epoch
                raise SystemExit(EXIT_PREEMPTED)
    finally:
        preempt.close()
    # epochs=0, or a finished run resumed: evaluate the model as it is.
    return result if result is not None else evaluate(tr.module, eval_loader, info, tr.amp_mode)


def train(cfg: DictConfig, run: launch.RunInfo) -> float:
    """One rank's whole run; returns the final eval accuracy (the sweep objective)."""
    info = distributed.setup(cfg.backend.name.value, cfg.backend.timeout_s)
    setup_console(info, run.run_dir)
    logger, exit_code = None, 1
    try:
        logger = RankLogger(cfg, run, info)  # W&B starts in the background meanwhile
        tr, splits = build(cfg, info)
        eval_loader = build_eval_loader(splits.eval, cfg, info)
        state, ckpt = resume(cfg, run, tr, info)
        logger.wait_ready()  # this rank's W&B run...
        distributed.barrier(info)  # ...and every rank's exist before anyone logs
        logger.log_sizes(splits, state.step)
        picture = draw_shards_async(tr.sampler, run.run_dir) if info.is_main else None
        result = fit(cfg, tr, state, ckpt, logger, eval_loader)
        logger.finish_run(result, splits, state.step, picture)
        exit_code = 0
        return result.accuracy
    except ConfigError as exc:  # one sentence, no traceback: the message says the fix
        log.error("%s", exc)
        exit_code = EXIT_CONFIG_ERROR
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else 1
        raise
    finally:
        if logger is not None:
            logger.finish(exit_code)
        distributed.teardown()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    try:
        return launch.launch(train, cfg, launch.current_run())
    except ConfigError as exc:
        log.error("%s", exc)
        sys.exit(EXIT_CONFIG_ERROR)


if __name__ == "__main__":
    main()
