"""The provenance chain: every resume proves it continues the run, or is refused naming why.

Real runs (gloo, 2 and 3 ranks): a run killed mid-epoch, resumed at its world size and killed
again, then resumed at another world size; the chain printed; refusals said once. The tamper
tests alter each field of a real checkpoint's link in turn and hand it to the check the resume
runs; the data tests change one sample of a real .npz under a run.
"""

from __future__ import annotations

import copy
import hashlib
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers import PY, ROOT, jsonl, run, run_env, summary, train_cmd
from test_elastic import replayed_epoch

from ddp_template.checkpoint import load
from ddp_template.errors import ConfigError
from ddp_template.provenance import FIELDS, Chain, Link, link_hash

SAVES = ["epochs=2", "checkpoint.every_steps=5"]
N_DIGITS = 1438


def _copy(run_dir: Path, tmp: Path, name: str) -> Path:
    shutil.copytree(run_dir, tmp / "outputs" / name)
    return tmp / "outputs" / name


def _said(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def chained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank run killed after step 7 (checkpoint: step 5), resumed at 2 ranks and killed
    after step 32 (checkpoint: step 30, mid-epoch 1): a chain of two links."""
    out = tmp_path_factory.mktemp("provenance")
    crash = ["dist.nproc=2", "fault.rank=1", *SAVES]
    cut = run(
        train_cmd(out, *crash, "fault.crash_at_step=7"), env=run_env(RUN_ID="prov"), check=False
    )
    assert cut.returncode != 0, _said(cut)[-2000:]
    again = run(
        train_cmd(out, *crash, "fault.crash_at_step=32"), env=run_env(RUN_ID="prov"), check=False
    )
    assert again.returncode != 0, _said(again)[-2000:]
    assert "resume: continues run prov, link 0 → 1 at step 5: 0 samples skipped, 0 repeated" in (
        _said(again)
    )
    return out / "outputs" / "prov"


def test_a_run_resumed_twice_once_at_another_world_size_prints_its_chain(
    chained: Path, tmp_path: Path
) -> None:
    """2 → 2 → 3 ranks: the refused resize is said once (rank 0; the others in their own
    log files), nothing written; the allowed one continues link 1 → 2 with nothing skipped or
    repeated, the resize recorded as a break; epoch 1 (read across the resize) holds each index
    once (plus the mode's pad); the chain command prints the three links."""
    run_dir = _copy(chained, tmp_path, "prov")
    before = hashlib.sha256((run_dir / "checkpoints/last.pt").read_bytes()).hexdigest()
    three = ["dist.nproc=3", *SAVES]
    refused = run(
        train_cmd(tmp_path, *three, "elastic.on_resize=refuse"),
        env=run_env(RUN_ID="prov"),
        check=False,
    )
    errors = [line for line in _said(refused).splitlines() if "ERROR" in line]
    assert refused.returncode == 2 and len(errors) == 1, _said(refused)[-3000:]
    assert "[rank0]" in errors[0] and "elastic.on_resize=refuse" in errors[0]
    for r in (1, 2):  # the other ranks met it too: their own log files keep it
        assert "elastic.on_resize=refuse" in (run_dir / f"rank{r}.log").read_text()
    after = hashlib.sha256((run_dir / "checkpoints/last.pt").read_bytes()).hexdigest()
    assert after == before
    resumed = run(
        train_cmd(tmp_path, *three, "elastic.global_batch=scale"), env=run_env(RUN_ID="prov")
    )
    line = (
        "resume: continues run prov, link 1 → 2 at step 30: 0 samples skipped, 0 repeated; "
        "break: world size 2 → 3 (elastic resume)"
    )
    assert line in _said(resumed)
    assert [r["resume"] for r in jsonl(run_dir / "rank0/metrics.jsonl") if "resume" in r][
        -1
    ] == line
    assert summary(run_dir)["eval_accuracy"] >= 0.9
    seen = replayed_epoch(run_dir, epoch=1)
    assert len(seen) == N_DIGITS and sum(seen.values()) - N_DIGITS <= 2  # 3 ranks' pads only
    printed = subprocess.run(
        [PY, "-m", "ddp_template.provenance", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    links = [line for line in printed.splitlines() if line.startswith("link ")]
    assert [link.split(",")[0:2] for link in links] == [
        ["link 0: run prov", " world size 2"],
        ["link 1: run prov", " world size 2"],
        ["link 2: run prov", " world size 3"],
    ], printed
    assert "at epoch 0 step 5 position 160" in links[0] and "at epoch 1 step 30" in links[1]
    assert "  break: world size 2 → 3 (elastic resume)" in printed


def test_a_changed_split_is_refused_naming_it_and_nothing_is_written(tmp_path: Path) -> None:
    """The resume of the issue: `python train.py epochs=1`, then the same run directory with
    `epochs=2 data.split_seed=1`, which would train on what epoch 0 tested on: refused in one
    sentence naming the key, both values and the fix; the checkpoint untouched."""
    env = run_env(RUN_ID="split")
    run(train_cmd(tmp_path, "epochs=1"), env=env)
    last = tmp_path / "outputs" / "split" / "checkpoints" / "last.pt"
    before = last.read_bytes()
    proc = run(train_cmd(tmp_path, "epochs=2", "data.split_seed=1"), env=env, check=False)
    errors = [line for line in _said(proc).splitlines() if "ERROR" in line]
    assert proc.returncode == 2 and len(errors) == 1, _said(proc)[-3000:]
    assert (
        "was written on other data or in another order: data.split_seed is 1 but the run it "
        "continues had 0; resume with data.split_seed=0, accept the change with "
        "provenance.allow=[order]"
    ) in errors[0]
    assert last.read_bytes() == before


# ------------------------------------------------------------------------------------ tamper
def _chain_for(payload: dict, allow: frozenset[str] = frozenset()) -> Chain:
    """This run's facts as the checkpoint's run had them (the same config and data)."""
    last: Link = payload["chain"][-1]
    return Chain(
        run=last["run"],
        sampler=last["sampler"],
        data=last["data"],
        order=last["order"],
        allow=allow,
    )


ALTERED = {
    "run": "another-run",
    "segment": 7,
    "world_size": 3,
    "sampler": {"mode": "drop_last", "permutation": "auto", "seed": 0},
    "order": {"hash": "0" * 16, "keys": {"seed": 1}},
    "data": {"length": N_DIGITS, "fingerprint": "0" * 16, "how": "every tensor hashed"},
    "cursor": {"epoch": 1, "step": 29, "position": 448},
    "ledger": "0" * 16,
    "prev": "0" * 16,
    "hash": "0" * 16,
}


@pytest.mark.parametrize("field", [*FIELDS, "hash"])
def test_each_altered_field_of_a_link_is_refused_naming_it(chained: Path, field: str) -> None:
    path = chained / "checkpoints" / "last.pt"
    payload = load(path)
    assert len(payload["chain"]) == 2
    _chain_for(payload).check(path, payload, world_size=2)  # the real one continues
    tampered = copy.deepcopy(payload)
    tampered["chain"][-1][field] = ALTERED[field]
    with pytest.raises(ConfigError, match=rf"provenance link 1 was altered .*its {field} is "):
        _chain_for(payload).check(path, tampered, world_size=2)


def test_an_altered_earlier_link_or_a_rehashed_inconsistency_is_refused(chained: Path) -> None:
    path = chained / "checkpoints" / "last.pt"
    payload = load(path)
    earlier = copy.deepcopy(payload)
    earlier["chain"][0]["cursor"]["step"] = 4
    with pytest.raises(ConfigError, match="provenance link 0 was altered"):
        _chain_for(payload).check(path, earlier, world_size=2)
    rehashed = copy.deepcopy(payload)  # a cursor rewritten with a valid hash: still caught
    link = rehashed["chain"][-1]
    link["cursor"]["step"] = 29
    link["hash"] = link_hash(link)
    with pytest.raises(ConfigError, match="has cursor .* but the checkpoint's progress part"):
        _chain_for(payload).check(path, rehashed, world_size=2)


# -------------------------------------------------------------------------- data under a run
def test_data_changed_under_a_run_is_refused_and_continues_when_allowed(tmp_path: Path) -> None:
    """One training sample of a .npz changed (same length): refused naming the data's
    fingerprint; with provenance.allow=[data] the run continues and the chain names the break."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = (digits.images / 16.0).astype(np.float32)[:, None], digits.target.astype(np.int64)
    path = tmp_path / "data.npz"
    np.savez(path, x_train=x[:1400], y_train=y[:1400], x_test=x[1400:], y_test=y[1400:])
    data = ["data=array", f"data.path={path}"]
    env = run_env(RUN_ID="npz")
    run(train_cmd(tmp_path, *data, "epochs=1"), env=env)
    x[3] = 1.0 - x[3]
    np.savez(path, x_train=x[:1400], y_train=y[:1400], x_test=x[1400:], y_test=y[1400:])
    refused = run(train_cmd(tmp_path, *data, "epochs=2"), env=env, check=False)
    assert refused.returncode == 2, _said(refused)[-2000:]
    assert "the data's fingerprint is " in _said(refused)
    assert "accept the change with provenance.allow=[data]" in _said(refused)
    run(train_cmd(tmp_path, *data, "epochs=2", "provenance.allow=[data]"), env=env)
    chain = load(tmp_path / "outputs" / "npz" / "checkpoints" / "last.pt")["chain"]
    assert [link["segment"] for link in chain] == [0, 1]
    assert chain[0]["data"]["fingerprint"] != chain[1]["data"]["fingerprint"]
    assert chain[1]["breaks"] and "(provenance.allow=data)" in chain[1]["breaks"][0]
    assert chain[1]["data"]["length"] == 1400


def test_the_chain_command_refuses_what_is_not_a_checkpoint(tmp_path: Path, capsys) -> None:
    from ddp_template.provenance import main

    assert main([str(tmp_path / "nothing")]) == 2
    assert "does not exist; give a run directory or a checkpoint file" in capsys.readouterr().err
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    assert main([str(tmp_path / "junk.pt")]) == 2
    assert "cannot be read" in capsys.readouterr().err
