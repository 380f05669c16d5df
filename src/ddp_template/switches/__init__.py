"""Research-loop switches: stateful parts that act after each optimizer step (the EMA is one).

A switch is a module here with a builder ``build_<switch>(cfg, model, info, mirror) -> switch``
(``mirror`` lays a copy of the model out as the model is: ``parallel.Parallel.mirror``); the
switch has ``after_step(state)`` and ``state_dict()``/``load_state_dict()``. ``SWITCHES`` maps
its config key (a field of the root ``Config`` whose schema has ``on``) to its builder, so a
switch that is off is never imported. ``build_switches`` is ``train.build``'s one reader.
"""

from __future__ import annotations

from typing import Any, Protocol

from ddp_template.registry import load


class Switch(Protocol):
    """A research-loop switch as the loop and the checkpoint read it: ``after_step(state)``
    after each optimizer step (``state``: the ``engine.TrainState``), and its state."""

    def after_step(self, state: Any, /) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any], /) -> None: ...


SWITCHES = {"ema": "ddp_template.switches.ema:build_ema"}  # config key → builder


def build_switches(cfg: Any, model: Any, info: Any, mirror: Any) -> dict[str, Switch]:
    """The switches that are on, by name: each a checkpoint part with ``after_step(state)``."""
    return {
        key: load(builder, key=f"{key}.on=true", fix=f"set {key}.on=false.")(
            getattr(cfg, key), model, info, mirror
        )
        for key, builder in SWITCHES.items()
        if getattr(cfg, key).on
    }
