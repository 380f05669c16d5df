"""The provenance chain: every checkpoint says which run it continues and proves it on resume.

Each checkpoint carries the chain of its run: one link per launch that wrote checkpoints (a
segment), the last one describing this checkpoint: the run's id, the segment number, the world
size, the sampler (mode, permutation, seed), the data's identity (``data.identity``: length and
content fingerprint), a hash of the config keys that decide which samples are read in which
order (and the keys themselves, so a refusal can name one), the cursor (epoch, step, position),
a digest of the ledgers the checkpoint holds folded onto the previous link's, the previous
link's hash and the link's own. ``Chain.check`` compares every field with what it must equal
before any part is restored; an intended change (``provenance.allow``) or a resize (elastic
resume) is recorded in the next link as a break with its reason.

    python -m ddp_template.provenance outputs/<run_id>     # the chain of the run's last.pt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from ddp_template.config.schema import Config
from ddp_template.data.identity import DataIdentity
from ddp_template.errors import ConfigError
from ddp_template.storage import name_of

CHANGES = ("sampler", "order", "data")  # what provenance.allow may let change
_PLACE = ("path", "root")  # data keys saying where the data lives, not what it is


class Cursor(TypedDict):
    epoch: int
    step: int
    position: int


class Order(TypedDict):
    hash: str
    keys: dict[str, Any]  # every config key that decides which samples come in which order


class Link(TypedDict):
    """One segment of a run as a checkpoint of it saw it."""

    run: str
    segment: int
    world_size: int
    sampler: dict[str, Any]  # mode, permutation, seed
    data: DataIdentity
    order: Order
    cursor: Cursor
    ledger: str  # the checkpoint's ledgers folded onto the previous link's digest
    prev: str  # the previous link's hash ("" for the first)
    breaks: list[str]  # the changes this segment began with, each with its reason
    hash: str  # of every field above


FIELDS = ("run", "segment", "world_size", "sampler", "order", "data", "cursor", "ledger", "prev")


def _digest(value: Any) -> str:
    raw = json.dumps(value, sort_keys=True, default=str).encode()
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def link_hash(link: Link) -> str:
    return _digest({k: v for k, v in link.items() if k != "hash"})


def order_keys(whole: dict[str, Any]) -> Order:
    """The config keys that decide the data and its order, from the config as plain containers
    (``config.boundary.plain``): ``seed``, ``max_steps_per_epoch``, every ``sampler`` key and
    every ``data`` key but where the data lives."""
    keys: dict[str, Any] = {k: whole[k] for k in ("seed", "max_steps_per_epoch")}
    keys |= {f"sampler.{k}": v for k, v in whole["sampler"].items()}
    keys |= {f"data.{k}": v for k, v in sorted(whole["data"].items()) if k not in _PLACE}
    keys = json.loads(json.dumps(keys, default=str))
    return Order(hash=_digest(keys), keys=keys)


def cursor_of(payload: dict[str, Any]) -> Cursor:
    progress = payload["progress"]
    return Cursor(epoch=progress["epoch"], step=progress["step"], position=progress["position"])


def ledger_digest(before: str, payload: dict[str, Any]) -> str:
    """Every rank's ledger part in ``payload`` (epoch, position, samples, fingerprint) folded
    onto ``before``, the previous link's digest."""
    rows = [
        [r.get("epoch"), r.get("position"), r.get("samples"), r.get("fingerprint", 0)]
        for r in (rank.get("ledger", {}) for rank in payload["ranks"])
    ]
    return _digest([before, rows])


@dataclass(kw_only=True)
class Chain:
    """This launch's facts and the chain it continues; ``seal`` makes a checkpoint's chain,
    ``check`` proves a checkpoint continues this run (or refuses in one sentence)."""

    run: str
    sampler: dict[str, Any]
    data: DataIdentity
    order: Order
    allow: frozenset[str]
    history: list[Link] = field(default_factory=list)  # up to the link this launch resumed at
    breaks: list[str] = field(default_factory=list)

    def seal(self, payload: dict[str, Any]) -> list[Link]:
        """The chain a checkpoint of ``payload`` carries: the history and this segment's link."""
        prev = self.history[-1] if self.history else None
        link = Link(
            run=self.history[0]["run"] if self.history else self.run,
            segment=len(self.history),
            world_size=payload["world_size"],
            sampler=self.sampler,
            data=self.data,
            order=self.order,
            cursor=cursor_of(payload),
            ledger=ledger_digest(prev["ledger"] if prev else "", payload),
            prev=prev["hash"] if prev else "",
            breaks=list(self.breaks),
            hash="",
        )
        link["hash"] = link_hash(link)
        return [*self.history, link]

    def check(self, path: str | Path, payload: dict[str, Any], world_size: int) -> Link | None:
        """Every field of the checkpoint's link against what it must equal; refuses (one
        sentence naming the field, both values and the fix) or continues the chain: its last
        link, None for a checkpoint written before the chain."""
        chain: list[Link] = payload.get("chain") or []
        if not chain:
            self.breaks.append(f"{name_of(path)} carries no chain (written before provenance)")
            return None
        last, k = chain[-1], len(chain) - 1
        prev = chain[-2] if k else None
        truth = {
            "run": (self.run, "this run's id"),
            "segment": (k, "its place in the chain"),
            "world_size": (payload["world_size"], "the checkpoint's own world size"),
            "sampler": (self.sampler, "this run's sampler"),
            "data": (self.data, "this run's data"),
            "order": (self.order, "this run's config"),
            "cursor": (cursor_of(payload), "the checkpoint's progress part"),
            "ledger": (ledger_digest(prev["ledger"] if prev else "", payload), "its ledgers"),
            "prev": (prev["hash"] if prev else "", "the link before it"),
        }
        fields: Mapping[str, Any] = last  # its fields by name
        differ = [f for f in FIELDS if last.get(f) != truth[f][0]]
        if link_hash(last) != last.get("hash"):
            named = differ[0] if differ else "hash"
            said, source = truth.get(named, (link_hash(last), "the hash of its fields"))
            raise ConfigError(
                f"checkpoint {path}: its provenance link {k} was altered after it was written: "
                f"its {named} is {_show(last.get(named))} but {source} says {_show(said)}; "
                f"resume from another checkpoint, or start fresh with resume=never."
            )
        for name in differ:
            if name == "run":  # a sound chain continued under another launch id
                continue
            if name not in CHANGES:
                raise ConfigError(
                    f"checkpoint {path}: its provenance link {k} has {name} "
                    f"{_show(fields[name])} but {truth[name][1]} says {_show(truth[name][0])}: "
                    f"the checkpoint is inconsistent; resume from another checkpoint, or start "
                    f"fresh with resume=never."
                )
            self.breaks.append(self._change(path, name, fields[name], truth[name][0]))
        for i in range(k):  # the links before it, whose hashes the next ones name
            _intact(path, chain, i)
        if last["world_size"] != world_size:
            self.breaks.append(f"world size {last['world_size']} → {world_size} (elastic resume)")
        self.history = list(chain)
        return last

    def _change(self, path: str | Path, name: str, was: Any, now: Any) -> str:
        """A change of the data or its order: refused unless ``provenance.allow`` names it,
        else the break's reason."""
        if name == "data":
            what = (
                f"the data's fingerprint is {now['fingerprint']} ({now['length']} training "
                f"samples) but the run it continues read {was['fingerprint']} ({was['length']})"
            )
            back = "the data it was written on"
        else:
            keys = was if name == "sampler" else was["keys"]
            mine = now if name == "sampler" else now["keys"]
            prefix = "sampler." if name == "sampler" else ""
            diff = sorted(k for k in keys.keys() | mine.keys() if keys.get(k) != mine.get(k))
            what = ", ".join(
                f"{prefix}{k} is {_show(mine.get(k))} but the run it continues had "
                f"{_show(keys.get(k))}"
                for k in diff
            )
            back = " ".join(f"{prefix}{k}={_show(keys.get(k))}" for k in diff)
        if name not in self.allow:
            raise ConfigError(
                f"checkpoint {path} was written on other data or in another order: {what}; "
                f"resume with {back}, accept the change with provenance.allow=[{name}] "
                f"(recorded in the chain as a break), or start fresh with resume=never."
            )
        return f"{what} (provenance.allow={name})"

    def describe(self, found: Link | None, step: int, skipped: int, repeated: int) -> str:
        """The resume's line: which run, which link to which, what was skipped or repeated."""
        if found is None:
            head = f"resume: starts a chain for run {self.run} at step {step}"
        else:
            head = (
                f"resume: continues run {found['run']}, link {found['segment']} → "
                f"{found['segment'] + 1} at step {step}"
            )
        line = f"{head}: {skipped} samples skipped, {repeated} repeated"
        return line + "".join(f"; break: {b}" for b in self.breaks)


def _intact(path: str | Path, chain: list[Link], i: int) -> None:
    """Link ``i`` (not the last) hashes to itself, sits at its place and is the one the next
    link names."""
    link, after = chain[i], chain[i + 1]
    wrong = None
    if link_hash(link) != link.get("hash"):
        wrong = f"its fields no longer hash to its recorded hash {link.get('hash')}"
    elif link.get("segment") != i:
        wrong = f"its segment is {link.get('segment')}, not {i}"
    elif after.get("prev") != link["hash"]:
        wrong = f"link {i + 1} names {after.get('prev')} as its predecessor, not {link['hash']}"
    elif link.get("run") != chain[0]["run"]:
        wrong = f"its run is {link.get('run')}, not the chain's {chain[0]['run']}"
    if wrong:
        raise ConfigError(
            f"checkpoint {path}: its provenance link {i} was altered ({wrong}); resume from "
            f"another checkpoint, or start fresh with resume=never."
        )


def _show(value: Any) -> str:
    if isinstance(value, dict) and "fingerprint" in value:
        return str(value["fingerprint"])
    if isinstance(value, dict) and "hash" in value:
        return str(value["hash"])
    return json.dumps(value, default=str) if isinstance(value, dict | list) else str(value)


def build_chain(cfg: Config, *, plain: dict[str, Any], run: str, data: DataIdentity) -> Chain:
    """The ``provenance`` group's builder: this launch's facts and what it may change
    (``plain``: the config as plain containers, which the run already made for its logs)."""
    sampler = {
        "mode": str(cfg.sampler.mode),
        "permutation": str(cfg.sampler.permutation),
        "seed": cfg.sampler.seed if cfg.sampler.seed is not None else cfg.seed,
    }
    allow = frozenset(str(a) for a in cfg.provenance.allow)
    return Chain(run=run, sampler=sampler, data=data, order=order_keys(plain), allow=allow)


def describe_link(link: Link) -> list[str]:
    c, s, d = link["cursor"], link["sampler"], link["data"]
    lines = [
        f"link {link['segment']}: run {link['run']}, world size {link['world_size']}, at epoch "
        f"{c['epoch']} step {c['step']} position {c['position']}",
        f"  sampler {s['mode']} ({s['permutation']}, seed {s['seed']}); data {d['length']} "
        f"training samples, fingerprint {d['fingerprint']} ({d['how']}); order "
        f"{link['order']['hash']}; ledger {link['ledger']}; hash {link['hash']}"
        + (f" (after {link['prev']})" if link["prev"] else ""),
    ]
    return lines + [f"  break: {b}" for b in link["breaks"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_template.provenance",
        description="Print the provenance chain of a run directory's last.pt (or of a file).",
    )
    parser.add_argument("where", help="a run directory, or a checkpoint file (a path or s3://…)")
    args = parser.parse_args(argv)
    where = Path(args.where)
    path = str(where / "checkpoints" / "last.pt") if where.is_dir() else args.where
    from ddp_template.checkpoint import checkpoint_file, load

    try:
        fix = "give a run directory or a checkpoint file"
        path = checkpoint_file(path, said="", fix=fix)
        payload = load(path, fix="give a run directory or a checkpoint written by train.py")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    chain = payload.get("chain") or []
    if not chain:
        print(f"{path}: no provenance chain (written before it)")
        return 0
    print(f"{path}: run {chain[0]['run']}, {len(chain)} links")
    for link in chain:
        print("\n".join(describe_link(link)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
