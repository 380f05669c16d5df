"""Multi-node runs across real hosts: network namespaces on one machine (``tests/hosts.py``).

README's two-node torchrun command (c10d, endpoint ``host0:29500``) on two hosts x 2 ranks,
where each host's own name is ``127.0.1.1`` (as on Debian) and a second interface reaches
nothing: the template binds gloo to the interface that reaches the other host. Then a host lost
(every process SIGKILLed at once) and a link cut (the processes alive, the packets gone): each
ends the run in bounded time naming the host, the cut host writes nothing after the cut, and
the same command resumes bit-identical to an uninterrupted run. Needs root (`make test-hosts`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from helpers import TORCHRUN, Started, jsonl, start, summary, train_cmd, wait_for
from hosts import Hosts, unavailable

pytestmark = [
    pytest.mark.hosts,
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
]

RUN = "twohosts"
BASE = ["epochs=2", "checkpoint.every_steps=5"]  # digits: 12 steps an epoch at 4 ranks
ENDED_WITHIN_S = 60  # the bound on ending a run after a host is lost or cut off


def _launch(hosts: Hosts, out: Path, *overrides: str) -> list[Started]:
    """README's two-node command on host0 and host1, 2 ranks each."""
    launcher = [
        *TORCHRUN,
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=host0:29500",
        f"--rdzv-id={RUN}",
    ]
    cmd = train_cmd(out, *BASE, *overrides, launcher=launcher)
    return [start(hosts.command(i, cmd)) for i in range(2)]


def _finish(agents: list[Started]) -> None:
    for agent in agents:
        agent.wait(timeout=240)


def _fingerprints(run_dir: Path, rank: int) -> list[str]:
    rows = jsonl(run_dir / f"rank{rank}" / "metrics.jsonl")
    return [r["data/fingerprint"] for r in rows if "data/fingerprint" in r]


def _verdicts(run_dir: Path) -> list[int]:
    rows = jsonl(run_dir / "rank0" / "metrics.jsonl")
    return [r["shares/verdict_ok"] for r in rows if "shares/verdict_ok" in r]


def _model(run_dir: Path) -> dict[str, torch.Tensor]:
    payload = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert payload["progress"]["step"] == 24, payload["progress"]
    return payload["model"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2 x 2 run across the hosts."""
    out = tmp_path_factory.mktemp("reference")
    with Hosts(2) as hosts:
        _finish(_launch(hosts, out))
    return out / "outputs" / RUN


def test_two_hosts_train_as_four_ranks_on_one(reference: Path, tmp_path: Path) -> None:
    """Every epoch's verdict ok and the same per-rank fingerprints as 4 ranks on one host; the
    ranks bound gloo to eth0, the interface that reaches the other host."""
    one = start(
        train_cmd(tmp_path, *BASE, launcher=[*TORCHRUN, "--standalone", "--nproc-per-node=4"])
    )
    one.wait(timeout=240)
    (single,) = (tmp_path / "outputs").iterdir()
    assert summary(reference)["world_size"] == 4
    assert _verdicts(reference) == _verdicts(single) == [1, 1]
    for rank in range(4):
        across = _fingerprints(reference, rank)
        assert len(across) == 2 and across == _fingerprints(single, rank), rank
    log = (reference / "rank2.log").read_text()
    assert "gloo on eth0 (routes the rendezvous host host0 from 10.77.0.2)" in log, log[-2000:]
    for rank in range(4):
        record = json.loads((reference / f"rank{rank}" / "process.json").read_text())
        assert (record["host"], record["address"]) == (
            f"host{rank // 2}",
            f"10.77.0.{rank // 2 + 1}",
        )


def test_a_host_lost_is_named_and_the_same_command_resumes(reference: Path, tmp_path: Path) -> None:
    """Rank 2 holds after step 7 (checkpoint at 5), so the run is mid-epoch when host1's
    processes are all SIGKILLed: host0's agent ends within the bound, its ranks naming host1
    and its ranks; launched again, the run ends bit-identical to the uninterrupted one."""
    hold = ["fault.crash_at_step=7", "fault.rank=2", "fault.hold=true"]
    run_dir = tmp_path / "outputs" / RUN
    with Hosts(2) as hosts:
        agents = _launch(hosts, tmp_path, *hold)
        wait_for(run_dir / "checkpoints" / "last.pt", *agents)
        killed = time.monotonic()
        assert len(hosts.kill(1)) >= 3  # the agent and its two ranks
        first = agents[0].wait(timeout=ENDED_WITHIN_S, check=False)
        assert time.monotonic() - killed < ENDED_WITHIN_S
        agents[1].wait(check=False)
        assert first.returncode != 0
        said = "host host1 (ranks 2, 3) closed its connections"
        assert said in first.stdout + first.stderr, first.stderr[-3000:]
        _finish(_launch(hosts, tmp_path))
    reference_model, resumed = _model(reference), _model(run_dir)
    assert all(torch.equal(reference_model[k], resumed[k]) for k in reference_model)


def _written_since(run_dir: Path, since: float, ranks: list[int]) -> list[str]:
    names = [f"rank{r}" for r in ranks] + [f"rank{r}.log" for r in ranks]
    paths = [run_dir / n for n in names]
    paths += [p for n in names if (run_dir / n).is_dir() for p in (run_dir / n).rglob("*")]
    return [str(p) for p in paths if p.exists() and p.stat().st_mtime > since]


def test_a_cut_link_is_named_the_cut_host_fenced_and_the_run_resumed(
    reference: Path, tmp_path: Path
) -> None:
    """Rank 0 holds after step 7, so host1's ranks wait in a collective when host1's link goes
    down (its processes alive). Within the bound host0's ranks end the run naming host1; host1's
    ranks find themselves cut off and stop without writing anything into the run; after the
    link is healed the same command resumes bit-identical to the uninterrupted run."""
    hold = ["fault.crash_at_step=7", "fault.rank=0", "fault.hold=true"]
    run_dir = tmp_path / "outputs" / RUN
    with Hosts(2) as hosts:
        agents = _launch(hosts, tmp_path, *hold)
        wait_for(run_dir / "checkpoints" / "last.pt", *agents)
        records = {r: (run_dir / f"rank{r}" / "process.json").read_text() for r in (2, 3)}
        cut, cut_clock = time.monotonic(), time.time()
        hosts.cut(1)
        first = agents[0].wait(timeout=ENDED_WITHIN_S, check=False)
        assert time.monotonic() - cut < ENDED_WITHIN_S
        assert first.returncode != 0
        said = "host host1 (ranks 2, 3) went silent"
        assert said in first.stdout + first.stderr, first.stderr[-3000:]
        pids = [json.loads(records[r])["pid"] for r in (2, 3)]
        deadline = time.monotonic() + ENDED_WITHIN_S
        while any(p in hosts.pids(1) for p in pids):  # fenced: they exit on their own
            assert time.monotonic() < deadline, "the cut host's ranks never stopped"
            time.sleep(0.2)
        assert _written_since(run_dir, cut_clock, [2, 3]) == []
        assert {r: (run_dir / f"rank{r}" / "process.json").read_text() for r in (2, 3)} == records
        assert not (run_dir / "rank2" / "error.json").exists()
        hosts.heal(1)
        second = agents[1].wait(check=False)
        assert second.stderr.count("is cut off: none of its heartbeats") == 2, second.stderr[-3000:]
        _finish(_launch(hosts, tmp_path))
    reference_model, resumed = _model(reference), _model(run_dir)
    assert all(torch.equal(reference_model[k], resumed[k]) for k in reference_model)
