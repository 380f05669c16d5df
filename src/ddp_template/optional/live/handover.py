"""The state a regrouped group continues from: an in-memory checkpoint of the old world size.

A step commits once its gradient all-reduce has completed: a completed all-reduce holds every
member's contribution, so if any survivor completed step S, every sample of S trained. The
regroup orders that survivor first (the new rank 0, the furthest on); a survivor one step
behind (its all-reduce broke) adds the micro-batches it held for S to its ledger, and every
survivor's weights, optimizer, LR schedule, scaler, EMA and step become rank 0's. A step no
survivor completed is uncommitted: its micro-batches leave every ledger and its samples stay in
the epoch's rest, which the new group deals among itself (the elastic-resume path, as from a
checkpoint of the old world size). A lost rank's ledger is derived from the deal (the positions
its list held up to the committed step), since its own tally died with it; the report says so.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ddp_template.checkpoint import Found
from ddp_template.distributed import DistInfo, broadcast_object, gather_objects
from ddp_template.ledger.records import SavedLedger
from ddp_template.ledger.tally import IndexTally, join_ledgers
from ddp_template.optional.live import keys
from ddp_template.tolerance import Held

log = logging.getLogger(__name__)


class Claim(NamedTuple):
    """What a member brings to a regroup: its rank in the old group and its per-rank parts at
    the committed step (None: a replacement, or a survivor whose state is not there)."""

    old_rank: int | None
    parts: dict[str, Any] | None
    dropped: int  # samples of an uncommitted step it had read (back to the epoch's rest)


def handover(held: Held | None, info: DistInfo, target: int) -> Found:
    """Every member's claim gathered; rank 0 (a survivor at ``target``, the committed step)
    makes the checkpoint every member restores (collectives of the new group)."""
    claims = gather_objects(_claim(held, target), info)
    payload = None
    if info.is_main:
        assert held is not None  # the regroup orders a survivor first
        payload, derived = _payload(held, claims)
        dropped = sum(c.dropped for c in claims)
        state = held.state
        keys.record(
            os.environ[keys.RECORD_VAR],
            event="regrouped",
            step=target,
            epoch=state.epoch,
            position=state.position,
            world_from=held.trainer.info.world_size,
            world_to=info.world_size,
            uncommitted_samples=dropped,
            derived_ranks=derived,
        )
        log.warning(
            "regrouped at step %d: %d ranks → %d; %s; %s",
            target,
            held.trainer.info.world_size,
            info.world_size,
            f"{dropped} samples of an uncommitted step back to the epoch's rest"
            if dropped
            else "no step uncommitted",
            f"the ledgers of lost ranks {derived} derived from the deal"
            if derived
            else "no rank lost",
        )
    payload = broadcast_object(payload, info)
    return Found(Path(f"<regroup at step {target}>"), payload)


def _claim(held: Held | None, target: int) -> Claim:
    if held is None:
        return Claim(None, None, 0)
    state, tr = held.state, held.trainer
    if state.step == target - 1 and state.held:  # its part of the step rank 0 completed
        for batch in state.held:
            state.tally.add(*batch)
        state.position = tr.steps.next_boundary(state.position)
        state.step += 1
        state.held.clear()
    dropped = sum(len(batch[0]) for batch in state.held)
    state.held.clear()
    if state.step != target:
        return Claim(tr.info.rank, None, dropped)
    parts = {name: part.state_dict() for name, part in held.ckpt.rank_parts.items()}
    return Claim(tr.info.rank, parts, dropped)


def _payload(held: Held, claims: list[Claim]) -> tuple[dict[str, Any], list[int]]:
    """Rank 0's checkpoint payload: its own parts, and every old rank's per-rank parts (a lost
    one's ledger derived from the deal); the old ranks whose ledger was derived."""
    observed = {c.old_rank: c.parts for c in claims if c.parts is not None}
    mine = observed[held.trainer.info.rank]
    world = held.trainer.info.world_size
    derived = [r for r in range(world) if r not in observed]
    ranks = [
        observed[r] if r in observed else {**mine, "ledger": derived_ledger(held, r)}
        for r in range(world)
    ]
    return held.ckpt.payload(ranks=ranks), derived


def derived_ledger(held: Held, rank: int) -> SavedLedger:
    """``rank``'s ledger of this deal's part of the epoch, up to the committed position:
    the micro-batches its list held, as the loop would have read them."""
    state, tr = held.state, held.trainer
    sampler, steps = tr.sampler, tr.steps
    workers, first = sampler.worker_lanes(0)
    tally = IndexTally(workers=workers, first_worker=first)
    size = steps.batch_size
    for k in range(steps.steps_done(state.position)):
        start, stop = steps.span(k)
        for lo in range(start, stop, size):
            n = steps.held(rank, lo, min(lo + size, stop))
            if n:
                tally.add(sampler.index_at(np.arange(lo, lo + n, dtype=np.int64), rank=rank))
    if not state.position:
        return SavedLedger(epoch=state.epoch, position=0, samples=0, derived=True)
    joined = join_ledgers(None, tally)
    return SavedLedger(epoch=state.epoch, position=state.position, **joined, derived=True)
