"""Where training stands, as checkpoint parts: the run's epoch, step and position, this
rank's sampler at that position, and this rank's ledger of the epoch so far; ``named_parts``,
every part of a run's checkpoint by name.

At another world size (elastic resume) each part is re-dealt by ``load_resized``: the
progress part turns the old ranks' position into a prefix of the epoch (``state.prior``), the
sampler deals the rest of the epoch, and the old ranks' ledgers travel with that prefix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from ddp_template.amp import scaler_part
from ddp_template.data.contract import DataInfo, DataRecord, Sampler
from ddp_template.data.sampler_state import check_order
from ddp_template.engine import Trainer, TrainState
from ddp_template.errors import Misfit
from ddp_template.ledger.records import PriorStretch, SavedLedger, Tallied
from ddp_template.ledger.tally import join_ledgers
from ddp_template.models import weights_part
from ddp_template.rng import RngState


@dataclass(kw_only=True)
class Progress:
    """``TrainState`` under this run's ``optim.accumulate``; refuses another K's, since a
    mid-epoch position need not be a step boundary of another K (at another world size the
    position becomes a prefix of the epoch instead: ``load_resized``)."""

    state: TrainState
    trainer: Trainer  # its steps: what the position stands for

    def state_dict(self) -> dict[str, Any]:
        s, steps = self.state, self.trainer.steps
        done = steps.steps_done(s.position)
        return {
            "epoch": s.epoch,
            "step": s.step,
            "position": s.position,
            "accumulate": steps.accumulate,
            "batch_size": steps.batch_size,
            "stretch_steps": done,  # steps of the epoch at this world size
            "complete": done >= steps.steps_per_epoch,  # its last step has run
            "prior": s.prior,
        }

    def load_resized(self, saved: dict[str, Any], *, world_size: int) -> None:
        """The checkpoint's position, read by ``world_size`` ranks, as a prefix of the epoch;
        this run deals the rest from position 0."""
        s = self.state
        s.epoch, s.step, s.prior, s.position = saved["epoch"], saved["step"], saved["prior"], 0
        if saved["position"]:
            prefix = PriorStretch(
                world_size=world_size,
                position=saved["position"],
                complete=saved["complete"],
                steps=saved["stretch_steps"],
                batch_size=saved["batch_size"],
                accumulate=saved["accumulate"],
                first_step=saved["step"] - saved["stretch_steps"] + 1,
                ledgers=None,  # the old ranks' (Ledger.load_resized)
            )
            s.prior = [*saved["prior"], prefix]

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        k, mine = saved["accumulate"], self.trainer.steps.accumulate
        if k != mine:
            raise Misfit(
                f"it was written with optim.accumulate={k} but this run has "
                f"optim.accumulate={mine}; resume with optim.accumulate={k}, or start a new "
                f"run from its weights with finetune.init_from=<that checkpoint>."
            )
        self.state.epoch, self.state.step = saved["epoch"], saved["step"]
        self.state.position = saved["position"]
        self.state.prior = saved.get("prior", [])


@dataclass(kw_only=True)
class SamplerPosition:
    """This rank's sampler at ``state.position`` (the sampler refuses its own misfits)."""

    sampler: Sampler
    state: TrainState

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict(self.state.position)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.sampler.load_state_dict(saved)

    def load_resized(self, saved: list[dict[str, Any]], *, world_size: int) -> None:
        """The old ranks' samplers (of one epoch order) → this rank deals the rest of it."""
        check_order(self.sampler, saved[0])
        self.sampler.set_epoch(self.state.epoch)
        if self.state.prior:
            resized: Any = self.sampler  # a prior: planned data's ShareSampler (records as dicts)
            resized.continue_epoch(self.state.epoch, self.state.prior)


@dataclass(kw_only=True)
class Ledger:
    """This rank's tally of the current epoch up to ``state.position`` (counts and fingerprints,
    per loader worker too), so that a resumed epoch's ledger joins the part read before it."""

    state: TrainState

    def state_dict(self) -> SavedLedger:
        s, tally = self.state, self.state.tally
        if tally is None or s.position == 0:
            return SavedLedger(epoch=s.epoch, position=s.position, samples=0)
        carried = s.carried if s.carried and s.carried["epoch"] == s.epoch else None
        return SavedLedger(epoch=s.epoch, position=s.position, **join_ledgers(carried, tally))

    def load_state_dict(self, saved: SavedLedger) -> None:
        if saved["position"] != self.state.position or saved["epoch"] != self.state.epoch:
            raise Misfit(
                f"its ledger stands at epoch {saved['epoch']}, position {saved['position']} but "
                f"the run's progress at epoch {self.state.epoch}, position "
                f"{self.state.position}; the checkpoint is inconsistent: resume from another."
            )
        self.state.carried = saved if saved["samples"] else None

    def load_resized(self, saved: list[SavedLedger], *, world_size: int) -> None:
        """The old ranks' ledgers go with the prefix they read; this rank's starts empty."""
        s = self.state
        self.state.carried = None
        if not s.prior or s.prior[-1]["ledgers"] is not None:
            return
        prefix = s.prior[-1]
        for r, ledger in enumerate(saved):
            if (ledger["epoch"], ledger["position"]) != (s.epoch, prefix["position"]):
                raise Misfit(
                    f"rank {r}'s ledger stands at epoch {ledger['epoch']}, position "
                    f"{ledger['position']} but the run's progress at epoch {s.epoch}, position "
                    f"{prefix['position']}; the checkpoint is inconsistent: resume from another."
                )
        prefix["ledgers"] = [
            Tallied(
                samples=ledger["samples"],
                fingerprint=ledger.get("fingerprint", 0),
                workers=ledger.get("workers", []),
                derived=ledger.get("derived", False),
            )
            for ledger in saved
        ]

    def start_fresh(self) -> str:
        return "no ledger saved: a resumed epoch's data/epoch_* keys count from the resume"


class Parts(NamedTuple):
    """A checkpoint's parts by name (``checkpoint.Checkpointer``'s), each restored in its
    order and refusing its own misfit."""

    parts: dict[str, Any]  # whole, in rank 0's file
    sliced: dict[str, Any]  # each rank's slices, through DCP (the weights under parallel=fsdp2)
    rank_parts: dict[str, Any]  # each rank's own


def named_parts(
    tr: Trainer, state: TrainState, switches: dict[str, Any], selection: Any, info: DataInfo
) -> Parts:
    """Where training stands, the weights (whole, or each rank's slices), the optimizer, the
    switches (the EMA), the LR schedule, the scaler, the selection; per rank its sampler, RNG,
    ledger and spike rule; the data's ``DataInfo``, for the record (the model from the file
    alone)."""
    weights = {
        "model": weights_part(tr.module),
        "optimizer": tr.parallel.optimizer_part(tr.module, tr.optimizer),
        **switches,
    }
    parts = {
        "progress": Progress(state=state, trainer=tr),
        **({} if tr.parallel.sliced else weights),
        "scheduler": tr.scheduler,
        "scaler": scaler_part(tr.scaler),
        "selection": selection,
        "data_info": DataRecord(info),
    }
    rank_parts = {
        "sampler": SamplerPosition(sampler=tr.sampler, state=state),
        "rng": RngState(),
        "ledger": Ledger(state=state),
        **({"spike": tr.spikes} if tr.spikes is not None else {}),
    }
    return Parts(parts, weights if tr.parallel.sliced else {}, rank_parts)
