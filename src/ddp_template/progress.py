"""Where training stands, as checkpoint parts: the run's epoch, step and position, this
rank's sampler at that position, and this rank's ledger of the epoch so far."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddp_template.data.accounting import join_ledgers
from ddp_template.engine import TrainState
from ddp_template.errors import Misfit


@dataclass(kw_only=True)
class Progress:
    """``TrainState`` under this run's ``optim.accumulate``; refuses another K's, since a
    mid-epoch position need not be a step boundary of another K."""

    state: TrainState
    accumulate: int

    def state_dict(self) -> dict[str, Any]:
        s = self.state
        return {
            "epoch": s.epoch,
            "step": s.step,
            "position": s.position,
            "accumulate": self.accumulate,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        k, mine = saved["accumulate"], self.accumulate
        if k != mine:
            raise Misfit(
                f"it was written with optim.accumulate={k} but this run has "
                f"optim.accumulate={mine}; resume with optim.accumulate={k}, or start a new "
                f"run from its weights with finetune.init_from=<that checkpoint>."
            )
        self.state.epoch, self.state.step = saved["epoch"], saved["step"]
        self.state.position = saved["position"]


@dataclass(kw_only=True)
class SamplerPosition:
    """This rank's sampler at ``state.position`` (the sampler refuses its own misfits)."""

    sampler: Any
    state: TrainState

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict(self.state.position)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.sampler.load_state_dict(saved)


@dataclass(kw_only=True)
class Ledger:
    """This rank's tally of the current epoch up to ``state.position`` (counts and fingerprints,
    per loader worker too), so that a resumed epoch's ledger joins the part read before it."""

    state: TrainState

    def state_dict(self) -> dict[str, Any]:
        s, tally = self.state, self.state.tally
        if tally is None or s.position == 0:
            return {"epoch": s.epoch, "position": s.position, "samples": 0}
        carried = s.carried if s.carried and s.carried["epoch"] == s.epoch else None
        return {"epoch": s.epoch, "position": s.position, **join_ledgers(carried, tally)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if saved["position"] != self.state.position or saved["epoch"] != self.state.epoch:
            raise Misfit(
                f"its ledger stands at epoch {saved['epoch']}, position {saved['position']} but "
                f"the run's progress at epoch {self.state.epoch}, position "
                f"{self.state.position}; the checkpoint is inconsistent: resume from another."
            )
        self.state.carried = saved if saved["samples"] else None

    def start_fresh(self) -> str:
        return "no ledger saved: a resumed epoch's data/epoch_* keys count from the resume"
