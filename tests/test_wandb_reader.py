"""The offline-file reader against real files written by wandb's own offline mode."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest
import wandb
from wandb_reader import BLOCK_LEN, find_runs, iter_payloads, read_run

CONFIG = {"model": {"name": "small_cnn", "widths": [8, 16]}, "optim": {"lr": 0.1}, "seed": 3}
BIG = "x" * 100_000  # larger than three 32 KiB blocks: forces FIRST/MIDDLE/LAST fragments


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two real offline runs in one tree: a typical worker rank and one with huge values."""
    root = tmp_path_factory.mktemp("wandb_runs")
    with pytest.MonkeyPatch.context() as mp:
        for var, sub in [
            ("WANDB_DIR", ""),
            ("WANDB_CACHE_DIR", "cache"),
            ("WANDB_CONFIG_DIR", "config"),
            ("WANDB_DATA_DIR", "data"),
        ]:
            mp.setenv(var, str(root / sub))
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        _worker_run(root / "rank1")
        _big_run(root / "rank2")
        # finish() returns before the service's writer has closed the files; teardown waits
        # for the service process to exit, so the reader never meets a torn tail.
        wandb.teardown()
    return root


def _init(run_dir: Path, name: str, config: dict, **settings):
    return wandb.init(
        mode="offline",
        dir=run_dir,
        project="p",
        group="g",
        job_type="worker",
        name=name,
        config=config,
        settings=wandb.Settings(**settings),
    )


def _worker_run(run_dir: Path) -> None:
    run = _init(run_dir, "n-rank1", CONFIG, x_label="rank1", x_disable_stats=False)
    run.define_metric("epoch")
    run.define_metric("data/*", step_metric="epoch")
    run.config.update({"rank": 1, "world_size": 2})  # a second config record, merged
    for epoch in range(3):
        run.log(
            {
                "epoch": epoch,
                "data/samples": 6 + epoch,
                "data/fingerprint": f"{0x0123456789ABCDEF + epoch:016x}",
                "train/loss_local": 0.5 / (epoch + 1),
            }
        )
    run.summary["verdict"] = "ok"
    run.alert(title="STRAGGLER", text="rank 1", level=wandb.AlertLevel.WARN)
    (run_dir / "ckpt.pt").write_bytes(b"weights")
    artifact = wandb.Artifact("ckpt-n", type="model", metadata={"step": 7, "eval/accuracy": 0.5})
    artifact.add_file(str(run_dir / "ckpt.pt"), name="last.pt")
    run.log_artifact(artifact, aliases=["last", "epoch-2"])
    run.finish()


def _big_run(run_dir: Path) -> None:
    run = _init(run_dir, "n-rank2", {"blob": BIG})
    run.log({"nested": {"a": 1, "b": {"c": 2.5}}, "text": BIG})
    run.config.update({"blob": "short"}, allow_val_change=True)
    run.finish(exit_code=3)


def test_reads_every_field_of_a_worker_run(root: Path) -> None:
    (path,) = sorted((root / "rank1").rglob("run-*.wandb"))
    run = read_run(path)
    assert run.path == path
    assert path.name == f"run-{run.run_id}.wandb" and len(run.run_id) == 8
    assert (run.name, run.group, run.job_type, run.project) == ("n-rank1", "g", "worker", "p")
    assert run.config == {**CONFIG, "rank": 1, "world_size": 2}
    assert [row["_step"] for row in run.history] == [0, 1, 2]
    assert [row["epoch"] for row in run.history] == [0, 1, 2]
    assert [row["data/samples"] for row in run.history] == [6, 7, 8]
    assert all(type(row["data/samples"]) is int for row in run.history)
    prints = [row["data/fingerprint"] for row in run.history]
    assert prints == ["0123456789abcdef", "0123456789abcdf0", "0123456789abcdf1"]
    assert [row["train/loss_local"] for row in run.history] == pytest.approx([0.5, 0.25, 1 / 6])
    assert all(isinstance(row["_timestamp"], float) for row in run.history)
    assert run.summary["data/samples"] == 8 and run.summary["verdict"] == "ok"
    assert run.summary["data/fingerprint"] == "0123456789abcdf1"
    assert run.exit_code == 0
    assert run.labels == {"rank1"} and "memory_percent/l:rank1" in run.stats[0]
    assert run.alerts == [{"title": "STRAGGLER", "text": "rank 1", "level": "WARN"}]
    (artifact,) = run.artifacts
    assert (artifact["name"], artifact["type"], artifact["files"]) == (
        "ckpt-n",
        "model",
        ["last.pt"],
    )
    assert set(artifact["aliases"]) == {"last", "latest", "epoch-2"}
    assert artifact["metadata"] == {"step": 7, "eval/accuracy": 0.5}


def test_joins_fragments_nested_keys_and_later_config(root: Path) -> None:
    (path,) = sorted((root / "rank2").rglob("run-*.wandb"))
    assert path.stat().st_size > 3 * BLOCK_LEN
    run = read_run(path)
    assert run.config == {"blob": "short"}
    (row,) = run.history
    assert row["text"] == BIG
    assert (row["nested.a"], row["nested.b.c"]) == (1, 2.5)
    assert run.summary["nested"] == {"a": 1, "b": {"c": 2.5}}
    assert run.exit_code == 3
    assert run.stats and not run.labels  # W&B samples by default; no x_label, no suffix
    assert not run.alerts and not run.artifacts


def test_find_runs_returns_all_runs_sorted_by_path(root: Path) -> None:
    runs = find_runs(root)
    assert [r.name for r in runs] == ["n-rank1", "n-rank2"]
    assert [r.path for r in runs] == sorted(r.path for r in runs)


def test_corrupt_or_foreign_files_raise(root: Path, tmp_path: Path) -> None:
    data = bytearray(sorted((root / "rank1").rglob("run-*.wandb"))[0].read_bytes())
    data[200] ^= 0xFF
    with pytest.raises(ValueError, match="CRC"):
        list(iter_payloads(bytes(data)))
    with pytest.raises(ValueError, match="not a W&B"):
        list(iter_payloads(b"SQLite format 3\0"))


def _leveldb_log(payloads: list[bytes]) -> bytes:
    """A minimal writer with LevelDB's block rules, to pin down the edge cases exactly."""
    out = bytearray(struct.pack("<4sHB", b":W&B", 0xBEE1, 0))
    for payload in payloads:
        rest, first = payload, True
        while True:
            left = BLOCK_LEN - len(out) % BLOCK_LEN
            if left < 7:
                out += b"\0" * left
                left = BLOCK_LEN
            chunk, rest = rest[: left - 7], rest[left - 7 :]
            kind = (1 if not rest else 2) if first else (4 if not rest else 3)
            out += struct.pack("<IHB", zlib.crc32(bytes([kind]) + chunk), len(chunk), kind)
            out += chunk
            first = False
            if not rest:
                break
    return bytes(out)


@pytest.mark.parametrize("fill", [BLOCK_LEN - 14 - 7, BLOCK_LEN - 14 - 3, BLOCK_LEN - 14])
def test_block_edges(fill: int) -> None:
    # fill leaves exactly 7 bytes (a zero-length FIRST fragment), 3 bytes (trailer), or 0
    payloads = [b"a" * fill, b"b" * 70_000, b"", b"c"]
    data = _leveldb_log(payloads)
    assert list(iter_payloads(data)) == payloads
    assert list(iter_payloads(data[:-1])) == payloads[:-1]  # torn tail ends quietly
