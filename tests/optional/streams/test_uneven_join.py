"""uneven=join on 2 real gloo ranks, in the engine's own loop (no train.py, no loader): rank 0's
stream ends first and it shadows rank 1's tail. What only the ranks themselves can show: at
the end every rank holds the same weights, optimizer state, LR schedule and EMA (the catch-up
after Join), rank 1's weights are the mean-gradient updates with the tail divided by the
initial world size (DDP's ``divide_by_initial_world_size=True``, checked against a
single-process replay), and a SIGUSR1 to rank 0 while it shadows stops both at one step.
(Through train.py, with a real stream and its audit: tests/test_streams.py.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers import cpu_rank, free_port, join_gloo

from ddp_template.config.schema import DDPConfig, EmaConfig
from ddp_template.engine import Trainer, TrainState, train_one_epoch
from ddp_template.models import small_cnn
from ddp_template.optim import WarmupCosine
from ddp_template.optional.streams.contract import StreamPosition
from ddp_template.optional.streams.join import Joined
from ddp_template.optional.streams.stop import StreamSteps
from ddp_template.parallel import Replicated, build_ddp
from ddp_template.preemption import Preemption
from ddp_template.switches.ema import build_ema
from ddp_template.tasks.classification import Classification

W, B, LR, MOMENTUM, HORIZON = 2, 4, 0.1, 0.9, 20
# scenario: (rank 0's batches, rank 1's), the step after which rank 0 signals itself
SCENARIOS = {"end": ((3, 7), None), "signal": ((3, 12), 5)}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return small_cnn(num_classes=10, in_channels=1, image_size=8)  # BatchNorm: buffers


def batches(rank: int, n: int) -> list[tuple]:
    """``n`` tagged batches as a stream's loader gives them: ((x, y, key), hashes, worker,
    names)."""
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for b in range(n):
        x, y = torch.randn(B, 1, 8, 8, generator=gen), torch.randint(0, 10, (B,), generator=gen)
        keys = torch.arange(b * B, (b + 1) * B) + 1000 * rank
        out.append(((x, y, keys), keys, 0, [str(int(k)) for k in keys]))
    return out


def optimizer_and_schedule(model: torch.nn.Module) -> tuple:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(0, True, HORIZON))


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def run_scenario(rank: int, name: str) -> dict:
    (lengths, signal_at), info = SCENARIOS[name], cpu_rank(rank, W, backend="gloo")
    model = make_model()
    opt, sched = optimizer_and_schedule(model)
    ema = build_ema(EmaConfig(decay=0.5), model, info)  # broadcasts rank 0's buffers each step
    preempt = Preemption(info=info, every=2, run_id="join")
    tr = Trainer(
        model=build_ddp(DDPConfig(), model, info),
        parallel=Replicated(cfg=DDPConfig(), info=info),
        optimizer=opt,
        scheduler=sched,
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        loader=batches(rank, lengths[rank]),
        sampler=StreamPosition(expected=None, world_size=W, batch_size=B, workers=0),
        info=info,
        log_every=1000,
        steps=StreamSteps(length=B * max(lengths), batch_size=B, epochs=1),
        keep_indices=True,
        task=Classification(),
        feed=Joined(info=info, switches={"ema": ema}),
    )

    def on_step(s: TrainState) -> bool:  # train.step_hook's collectives, in its order
        ema.after_step(s)
        if rank == 0 and s.step == signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        return preempt.requested(s.step)

    state = TrainState()
    try:
        stats = train_one_epoch(tr, state, on_step, lambda row, step: None)
    finally:
        preempt.close()
    return {
        "step": state.step,
        "position": state.position,
        "trained": stats.steps,
        "samples": stats.tally.samples,
        "stopped": stats.stopped,
        "params": flat(model.parameters()),
        "momentum": flat(opt.state[p]["momentum_buffer"] for p in model.parameters()),
        "lr": sched.get_last_lr()[0],
        "scheduled": sched.last_epoch,
        "ema": flat(ema.module.state_dict().values()),
        "ema_updates": ema.updates,
    }


def worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    join_gloo(rank, W, port, timeout_s=60)
    try:
        results = {name: run_scenario(rank, name) for name in SCENARIOS}
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def replay(lengths: tuple[int, int], steps: int) -> torch.Tensor:
    """One process: step k's gradient is the sum of the mean losses' gradients of the ranks
    that still have a batch at k, over W (a rank that has joined adds zero)."""
    model = make_model().train()
    opt, sched = optimizer_and_schedule(model)
    data = [batches(r, n) for r, n in enumerate(lengths)]
    for k in range(steps):
        for rank in range(W):
            if k < lengths[rank]:
                (x, y, _), *_ = data[rank][k]
                (F.cross_entropy(model(x), y) / W).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return flat(model.parameters())


def test_a_joined_rank_shadows_the_tail_and_leaves_the_epoch_caught_up(tmp_path: Path) -> None:
    mp.spawn(worker, args=(free_port(), str(tmp_path)), nprocs=W, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(W)]
    for name, ((short, long), signal_at) in SCENARIOS.items():
        r0, r1 = ranks[0][name], ranks[1][name]
        last = long if signal_at is None else 8  # signal after 5: in step 6's check, read at 8
        assert [r0["trained"], r1["trained"]] == [short, last], name
        assert [r0["samples"], r1["samples"]] == [short * B, last * B], name
        for r in (r0, r1):
            assert (r["step"], r["position"], r["scheduled"]) == (last, last * B, last), name
            assert r["stopped"] == (signal_at is not None), name
        for key in ("params", "momentum", "ema"):
            assert torch.equal(r0[key], r1[key]), (name, key)
        assert r0["lr"] == r1["lr"] and r0["ema_updates"] == r1["ema_updates"] == last, name
        expected = replay((short, long), last)
        assert torch.allclose(r1["params"], expected, rtol=1e-5, atol=1e-6), name
