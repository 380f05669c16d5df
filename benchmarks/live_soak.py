"""fault_tolerance=live across hosts, soaked: 2 hosts x 2 ranks with a fault every ~30 s.

    python benchmarks/live_soak.py [--epochs 460] [--every 30] [--seed 0] \
        [--out benchmarks/live_soak_results.md]          # as root: network namespaces

Two hosts made of network namespaces (``tests/hosts.py``), the template's launcher on each, the
membership coordinator in host0's. Three runs of the same job, interleaved: fault-free (A), the
soak (S), fault-free again (A', the A/A noise floor). During S, every ``--every`` seconds (±20 %,
seeded) one fault is drawn from

- ``sigkill``: SIGKILL a rank (any member, either host);
- ``sigstop``: SIGSTOP a rank (found silent after ``dead_after_s``, killed by its agent);
- ``host``: kill host1 (its launcher and ranks at once), its launcher started again 2 s later;
- ``cut``: cut host1's link, heal it 10 s later (its ranks fence themselves, its agent starts
  them again once it reaches the coordinator).

Host0 is never killed or cut: it runs the coordinator, whose loss ends the run by design. Every
lost slot is started again (``fault_tolerance.replacements`` is large) and rejoins. The report:
every fault with its recovery time (the fault to the first step committed by the membership that
dropped its target), the memberships and replacements, every epoch's verdict, replay's count of
every sample of every epoch (``sampler=exact``: each exactly once), and the throughput share:
samples per second of S over those of A (the same samples: every epoch trains all of them), with
A'/A as the noise floor.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))

from helpers import Started, jsonl, run_env, start, train_cmd, verdicts  # noqa: E402
from hosts import Hosts, unavailable  # noqa: E402

from ddp_template.replay import load_run, step_rows  # noqa: E402

RUN = "soak"
N_DIGITS = 1438
# A global batch of 24 (6 x 4 ranks) that 3, 2 and 1 ranks keep too; a wider MLP so a step's
# compute, not the epoch's bookkeeping, is what the throughput measures.
JOB = [
    "dist.nproc=2",
    "dist.nnodes=2",
    "fault_tolerance=live",
    "fault_tolerance.coordinator=host0:29400",
    "fault_tolerance.dead_after_s=2",
    "fault_tolerance.replacements=1000",
    "model=mlp",
    "model.in_features=64",
    "model.out_features=10",
    "model.hidden=1024",
    "loader.batch_size=6",
    "sampler=exact",
    "log_every=20",
]
FAULTS = ("sigkill", "sigstop", "host", "cut")


def rows(path: Path) -> list[dict[str, Any]]:
    """``path``'s rows, none while the run has not written it yet."""
    return jsonl(path) if path.exists() else []


class Job:
    """One run of the job on the hosts: its launchers, started again where a host was lost."""

    def __init__(self, hosts: Hosts, out: Path, epochs: int) -> None:
        self.hosts, self.out, self.epochs = hosts, out, epochs
        self.run_dir = out / "outputs" / RUN
        self.agents: list[Started] = [self.launch(node) for node in (0, 1)]

    def launch(self, node: int) -> Started:
        cmd = train_cmd(self.out, *JOB, f"epochs={self.epochs}", f"dist.node_rank={node}")
        return start(self.hosts.command(node, cmd), env=run_env(RUN_ID=RUN))

    @property
    def record(self) -> list[dict[str, Any]]:
        return rows(self.run_dir / "live.jsonl")

    def running(self) -> bool:
        return self.agents[0].popen.poll() is None

    def members(self) -> dict[str, int]:
        """The newest membership's members and their pids."""
        memberships = [r for r in self.record if r["event"] == "membership"]
        return dict(memberships[-1]["pids"]) if memberships else {}

    def finish(self) -> None:
        """Once host0's launcher is done: host1's, which a cut near the end leaves waiting for
        a coordinator that is gone (``regroup_timeout_s``), is ended after 15 s."""
        first = self.agents[0].wait(timeout=3600, check=False)
        if first.returncode:
            raise SystemExit(f"the run failed ({first.returncode}):\n{first.stderr[-3000:]}")
        deadline = time.monotonic() + 15
        while self.agents[1].popen.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        self.hosts.kill(1)
        self.agents[1].wait(check=False, leftovers=None)


def strike(job: Job, kind: str, rng: random.Random) -> dict[str, Any] | None:
    """One fault; what it struck (None where its target is not there now)."""
    members = job.members()
    on_host1 = {m: p for m, p in members.items() if int(m.split(".")[0]) >= 2}
    at = time.time()
    gen = max((r["gen"] for r in job.record if r["event"] == "membership"), default=0)
    if kind in ("sigkill", "sigstop"):
        member = rng.choice(sorted(members))
        os.kill(members[member], signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP)
        return {"kind": kind, "target": member, "time": at, "gen": gen}
    if not on_host1:
        return None  # host1 is still rejoining from the last fault
    if kind == "host":
        job.hosts.kill(1)
        time.sleep(2)
        job.agents[1] = job.launch(1)
    else:
        job.hosts.cut(1)
        time.sleep(10)
        job.hosts.heal(1)
    return {"kind": kind, "target": "host1", "time": at, "gen": gen}


def soak(job: Job, every: float, rng: random.Random) -> list[dict[str, Any]]:
    struck: list[dict[str, Any]] = []
    while not (job.run_dir / "live.jsonl").exists():
        time.sleep(0.2)
    next_at = time.monotonic() + every * rng.uniform(0.8, 1.2)
    while job.running():
        if time.monotonic() >= next_at:
            fault = strike(job, rng.choice(FAULTS), rng)
            if fault is not None:
                struck.append(fault)
            next_at = time.monotonic() + every * rng.uniform(0.8, 1.2)
        time.sleep(0.2)
    return struck


def recovery(record: list[dict[str, Any]], fault: dict[str, Any]) -> float | None:
    """The fault to the first step committed by a membership after the one it struck."""
    commits = [r for r in record if r["event"] == "committed"]
    later = [r for r in commits if r["gen"] > fault["gen"] and r["time"] > fault["time"]]
    return later[0]["time"] - fault["time"] if later else None


def stalled_s(record: list[dict[str, Any]], faults: list[dict[str, Any]]) -> float:
    """Seconds in which no step committed because of a fault or a rejoin: each fault to the
    next step committed after it, each admission's membership to its first commit."""
    stalled = sum(f["recovery_s"] or 0.0 for f in faults)
    commits = [r for r in record if r["event"] == "committed"]
    for m in record:
        if m["event"] == "membership" and "rejoin" in m["reason"]:
            first = next((c for c in commits if c["gen"] >= m["gen"]), None)
            stalled += first["time"] - m["time"] if first else 0.0
    return stalled


def training_s(record: list[dict[str, Any]]) -> float:
    """From membership 0 to the last rank's finish."""
    first = next(r for r in record if r["event"] == "membership")
    last = max(r["time"] for r in record if r["event"] == "finished")
    return last - first["time"]


def replayed(run_dir: Path) -> dict[int, Counter]:
    """Every index replay lists, per epoch."""
    run = load_run(run_dir)
    seen: dict[int, Counter] = {}
    for piece in run.pieces:
        counts = seen.setdefault(piece.epoch, Counter())
        for step in range(piece.first_step, piece.first_step + piece.steps):
            for row in step_rows(run, step):
                counts.update(row["indices"])
    return seen


def one(hosts_out: Path, epochs: int, every: float | None, rng: random.Random) -> dict[str, Any]:
    shutil.rmtree(hosts_out, ignore_errors=True)
    with Hosts(2) as hosts:
        job = Job(hosts, hosts_out, epochs)
        struck = soak(job, every, rng) if every else []
        job.finish()
    record = rows(job.run_dir / "live.jsonl")
    for fault in struck:
        fault["recovery_s"] = recovery(record, fault)
    epochs_ok = {step: ok for step, (ok, _) in verdicts(job.run_dir).items()}
    seen = replayed(job.run_dir)
    once = [e for e, c in seen.items() if set(c) == set(range(N_DIGITS)) and set(c.values()) == {1}]
    return {
        "training_s": training_s(record),
        "stalled_s": stalled_s(record, struck),
        "faults": struck,
        "memberships": sum(r["event"] == "membership" for r in record),
        "replacements": sum(r["event"] == "started" and r["incarnation"] > 0 for r in record),
        "lost": Counter(r["why"].split(" ")[0] for r in record if r["event"] == "lost"),
        "epochs": len(epochs_ok),
        "verdicts_ok": sum(epochs_ok.values()),
        "epochs_replayed_once": len(once),
        "epochs_replayed": len(seen),
    }


def report(args: argparse.Namespace, a: dict, s: dict, a2: dict) -> str:
    share = a["training_s"] / s["training_s"]
    floor = a["training_s"] / a2["training_s"]
    lines = [
        "# fault_tolerance=live across hosts: the chaos soak",
        "",
        f"`python benchmarks/live_soak.py --epochs {args.epochs} --every {args.every} "
        f"--seed {args.seed}` on this machine (2 cores, CPU, gloo; 2 hosts of network "
        f"namespaces x 2 ranks). Runs in the order A, S, A'.",
        "",
        "| run | training (s) | samples/s | share of A | memberships | replacements | "
        "epochs: verdict ok | epochs: every sample once |",
        "|---|---|---|---|---|---|---|---|",
    ]
    samples = args.epochs * N_DIGITS
    for name, r in (("A (fault-free)", a), ("S (soak)", s), ("A' (fault-free)", a2)):
        lines.append(
            f"| {name} | {r['training_s']:.1f} | {samples / r['training_s']:.0f} | "
            f"{a['training_s'] / r['training_s']:.3f} | {r['memberships']} | "
            f"{r['replacements']} | {r['verdicts_ok']}/{r['epochs']} | "
            f"{r['epochs_replayed_once']}/{r['epochs_replayed']} |"
        )
    recoveries = [f["recovery_s"] for f in s["faults"] if f["recovery_s"] is not None]
    lines += [
        "",
        f"Throughput share over the soak: **{share:.3f}** of the fault-free run's (noise floor "
        f"A/A': {floor:.3f}). Faults: {len(s['faults'])} "
        f"({', '.join(f'{k} {v}' for k, v in Counter(f['kind'] for f in s['faults']).items())}); "
        f"losses by cause: {dict(s['lost'])}; recovery median "
        f"{statistics.median(recoveries):.2f} s, max {max(recoveries):.2f} s. No step committed "
        f"for {s['stalled_s']:.1f} s of the soak's {s['training_s']:.1f} s (faults and "
        f"rejoins): training went on {1 - s['stalled_s'] / s['training_s']:.3f} of the time.",
        "",
        "| # | at (s) | fault | target | recovery (s) |",
        "|---|---|---|---|---|",
    ]
    t0 = s["faults"][0]["time"] if s["faults"] else 0
    for i, f in enumerate(s["faults"], 1):
        rec = "—" if f["recovery_s"] is None else f"{f['recovery_s']:.2f}"
        lines.append(f"| {i} | {f['time'] - t0:.0f} | {f['kind']} | {f['target']} | {rec} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=460)
    parser.add_argument("--every", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "live_soak_results.md")
    args = parser.parse_args()
    if why := unavailable():
        raise SystemExit(f"live_soak needs hosts: {why}")
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        a = one(Path(tmp) / "a", args.epochs, None, rng)
        print(f"A: {a['training_s']:.1f} s", flush=True)
        s = one(Path(tmp) / "s", args.epochs, args.every, rng)
        print(f"S: {s['training_s']:.1f} s, {len(s['faults'])} faults", flush=True)
        a2 = one(Path(tmp) / "a2", args.epochs, None, rng)
        print(f"A': {a2['training_s']:.1f} s", flush=True)
    text = report(args, a, s, a2)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
