"""What a ShareSampler's ``state_dict`` holds and how ``load_state_dict`` checks it.

The state names the sampler it belongs to (mode, seed, shuffle, permutation, N, W, rank) and
where its epoch stands (``epoch``, ``position``; ``yielded`` repeats ``position`` under
torchdata's name). Loading refuses a state written by a different sampler, so a checkpoint can
never silently resume onto another data order. torchdata's own ``StatefulDistributedSampler``
state (``{"yielded": k}``, optionally with ``"epoch"``) is accepted as it is: it says nothing
about the sampler, so there is nothing to compare.
"""

from __future__ import annotations

from typing import Any

from ddp_template.data.sampler_args import as_int

IDENTITY_KEYS = ("mode", "seed", "shuffle", "dataset_size", "num_replicas", "rank")
WORLD_KEYS = ("num_replicas", "rank")
ATTRIBUTE = {"dataset_size": "base_size"}  # N, also while an epoch deals only its rest
TORCHDATA_KEYS = {"yielded", "epoch"}


def state_of(sampler: Any, position: int) -> dict[str, Any]:
    """The state of ``sampler`` with ``position`` indices of its epoch's list consumed."""
    position = as_int("position", position)
    if not 0 <= position <= sampler.epoch_length:
        raise ValueError(
            f"position={position} is outside this rank's epoch [0, {sampler.epoch_length}]; "
            "pass the number of indices consumed this epoch."
        )
    return {
        "epoch": int(sampler.epoch),
        "position": position,
        "yielded": position,
        "mode": sampler.mode,
        "seed": sampler.seed,
        "shuffle": sampler.shuffle,
        "permutation": sampler.permutation,
        "dataset_size": int(sampler.base_size),
        "num_replicas": int(sampler.num_replicas),
        "rank": int(sampler.rank),
        "prior": sampler.prior,  # the epoch's prefixes read at other world sizes
    }


def resume_point(sampler: Any, state: dict[str, Any]) -> tuple[int | None, int]:
    """``(epoch, position)`` to resume ``sampler`` at; epoch None keeps the sampler's own."""
    if "position" not in state and "yielded" in state and set(state) <= TORCHDATA_KEYS:
        epoch = as_int("epoch", state["epoch"]) if "epoch" in state else None
        return epoch, _position(sampler, as_int("yielded", state["yielded"]), "yielded")
    _compare(sampler, state, IDENTITY_KEYS)
    position = _position(sampler, as_int("position", state["position"]), "position")
    return as_int("epoch", state["epoch"]), position


def check_order(sampler: Any, state: dict[str, Any]) -> None:
    """Refuse a state of a sampler that orders the epoch otherwise (any world size)."""
    _compare(sampler, state, tuple(k for k in IDENTITY_KEYS if k not in WORLD_KEYS))


def _compare(sampler: Any, state: dict[str, Any], identity: tuple[str, ...]) -> None:
    keys = list(identity)
    if sampler.shuffle:
        keys.append("permutation")  # without shuffling the order is the identity anyway
    for key in [*keys, "epoch", "position"]:
        if key not in state:
            raise ValueError(f"Sampler state_dict is missing key {key!r}; it cannot resume.")
    for key in keys:
        saved, current = state[key], getattr(sampler, ATTRIBUTE.get(key, key))
        if saved != current:
            raise ValueError(
                f"Sampler state_dict key {key!r} was saved as {saved!r} but this sampler has "
                f"{current!r}; resume with {key}={saved!r} or start a fresh run."
            )


def _position(sampler: Any, position: int, key: str) -> int:
    if not 0 <= position <= sampler.epoch_length:
        raise ValueError(
            f"Sampler state_dict key {key!r} is {position}, outside [0, {sampler.epoch_length}]; "
            "the state does not belong to this sampler."
        )
    return position
