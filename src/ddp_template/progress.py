"""Where training stands, as checkpoint parts: the run's epoch, step and position, and this
rank's sampler at that position."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
