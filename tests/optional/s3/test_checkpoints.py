"""Checkpoints in object storage for real: ``checkpoint.folder=s3://…`` on the local S3 server.

- A DDP run killed with SIGKILL inside a save (``fault.phase=write``: its bytes written, not yet
  published) leaves the previous checkpoint as ``last.pt`` and nothing half-written; resumed
  from the bucket it ends bit-identical to an uninterrupted run that checkpointed to local disk
  (``replay --losses`` reads its weights from the bucket),
  and the store's secret is in no file of its run directory (W&B's offline files included);
  ``checkpoint.async_save`` publishes to the bucket from its writer thread, whole.
- An FSDP2 run's DCP slices in the bucket, the run killed and resumed at another world size;
  ``export`` and ``finetune.init_from`` read the sliced weights back from the bucket.
- A wrong bucket and refused credentials: one sentence each at startup, exit 2, and the secret
  in no output and no file of the run.
"""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest
import torch
from helpers import assert_killed_rank_reported, cpu_rank, jsonl, run, run_env, train_cmd
from test_async_checkpoint import Held

from ddp_template import storage
from ddp_template.checkpoint import Checkpointer, load, whole
from ddp_template.config.loop import FinetuneConfig
from ddp_template.config.schema import CheckpointConfig
from ddp_template.errors import EXIT_CONFIG_ERROR
from ddp_template.export import main as export_main
from ddp_template.finetune import init_weights
from ddp_template.replay import main as replay_main

BASE = [
    "data=synthetic",
    "data.size=40",
    "data.test_size=16",
    "data.image_size=8",
    "loader.batch_size=4",
    "epochs=2",
    "checkpoint.every_steps=1",
]  # 40 samples / 2 ranks / batch 4: 5 steps an epoch, 10 in all
KILL_IN_SAVE = ["fault.crash_at_step=7", "fault.rank=0", "fault.signal=SIGKILL"]
BUCKET = "ckpts"


def launch(out: Path, server, run_id: str, *overrides: str, check: bool = True, env=None):
    cmd = train_cmd(out, *overrides)
    return run(cmd, env=run_env(RUN_ID=run_id, **(env or server.env)), check=check)


def model_at(location: str) -> dict[str, torch.Tensor]:
    payload = load(location)
    assert payload["progress"]["step"] == 10
    return payload["model"]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory, s3_server) -> Path:
    """An uninterrupted run to local disk; the same run to the bucket, killed inside step 7's
    save (copied before it is resumed)."""
    out = tmp_path_factory.mktemp("s3ckpt")
    s3_server.bucket(BUCKET)
    launch(out, s3_server, "local", *BASE, "dist.nproc=2")
    folder = f"checkpoint.folder=s3://{BUCKET}/cut"
    proc = launch(
        out, s3_server, "cut", *BASE, folder, "dist.nproc=2", *KILL_IN_SAVE,
        "fault.phase=write", check=False,
    )  # fmt: skip
    assert_killed_rank_reported(proc, rank=0, sig="SIGKILL")
    return out


def test_a_save_killed_mid_write_keeps_the_last_complete_one_and_resumes_identically(
    ddp_runs: Path, s3, capsys: pytest.CaptureFixture
) -> None:
    where = storage.at(f"s3://{BUCKET}/cut")
    assert where.names() == ["last.pt"]  # nothing half-written beside it
    assert torch.load(io.BytesIO(where.read("last.pt")))["progress"]["step"] == 6
    wandb = ["logger=wandb", "logger.log_checkpoints=last"]  # a reference to the object
    proc = launch(
        ddp_runs, s3, "cut", *BASE, f"checkpoint.folder=s3://{BUCKET}/cut", "dist.nproc=2", *wandb
    )
    output = proc.stdout + proc.stderr
    assert f"resumed from s3://{BUCKET}/cut/last.pt at epoch 1, step 6" in output
    assert "could not log checkpoint" not in output
    local = model_at(str(ddp_runs / "outputs/local/checkpoints/last.pt"))
    resumed = model_at(f"s3://{BUCKET}/cut/last.pt")
    assert local.keys() == resumed.keys()
    assert [k for k in local if not torch.equal(local[k], resumed[k])] == []
    run_dir = ddp_runs / "outputs/cut"
    assert not (run_dir / "checkpoints").exists()  # nothing went to the run dir
    replay_main(["--step", "7", "--losses", f"s3://{BUCKET}/cut/last.pt", str(run_dir)])
    assert "losses with the weights of step 10" in capsys.readouterr().err
    secret = s3.env["AWS_SECRET_ACCESS_KEY"].encode()
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files)
    assert [p for p in files if secret in p.read_bytes()] == []


LM = [
    "task=lm",
    "model=gpt",
    "model.n_layer=1",
    "model.n_embd=16",
    "model.n_head=2",
    "data=tokens",
    "data.block_size=16",
    "sampler=exact",
    "loader.batch_size=6",
    "epochs=1",
    "checkpoint.every_steps=4",
    "parallel=fsdp2",
]


@pytest.mark.needs("tokens", "gpt", "fsdp2")
def test_fsdp2_slices_in_the_bucket_resume_at_another_world_size(
    tmp_path: Path, s3, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddp_template.optional.tokens.corpus import text
    from ddp_template.optional.tokens.writer import write_text

    data = tmp_path / "corpus"
    write_text(text(4_000), data, 0.1)
    s3.bucket("slices")
    lm = [*LM, f"data.path={data}", "checkpoint.folder=s3://slices/lm"]
    kill = ["fault.crash_at_step=6", "fault.rank=1", "fault.signal=SIGKILL"]
    proc = launch(tmp_path, s3, "lm", *lm, "dist.nproc=2", *kill, check=False)
    assert_killed_rank_reported(proc, rank=1, sig="SIGKILL")
    where = storage.at("s3://slices/lm")
    payload = load("s3://slices/lm/last.pt")
    assert payload["progress"]["step"] == 4 and "model" not in payload
    assert where.names(f"slices/{payload['slices']}") == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    proc = launch(tmp_path, s3, "lm", *lm, "dist.nproc=3")
    assert "world size 2 → 3 at step 4" in proc.stdout
    rows = jsonl(tmp_path / "outputs/lm/rank0/metrics.jsonl")
    verdicts = [r["shares/verdict_ok"] for r in rows if "shares/verdict_ok" in r]
    assert verdicts == [1]
    final = load("s3://slices/lm/last.pt")
    weights = whole("s3://slices/lm/last.pt", final, "model")
    assert weights is not None and len(weights) > 4
    export_main(["s3://slices/lm/last.pt", "s3://slices/export/model.pt"])
    exported = torch.load(io.BytesIO(storage.at("s3://slices").read("export/model.pt")))
    assert all(torch.equal(exported[k], weights[k]) for k in weights)
    model = torch.nn.Module()
    model.register_parameter("w", torch.nn.Parameter(torch.zeros(1)))  # nothing in common
    cfg = FinetuneConfig(init_from="s3://slices/lm/last.pt", strict=False)
    report = init_weights(cfg, model)
    assert report.missing == ["w"] and len(report.unexpected) == len(weights)


def test_a_wrong_bucket_and_refused_credentials_are_one_sentence_and_never_said(
    tmp_path: Path, s3
) -> None:
    secret = "s3cret-never-written-7f3a9c"
    cases = {
        "s3://no-such-bucket/run": (s3.env, "bucket no-such-bucket (of s3://no-such-bucket/run"),
        f"s3://{BUCKET}/run": (
            {**s3.env, "AWS_SECRET_ACCESS_KEY": secret},
            "refuses the credentials found for s3://",
        ),
    }
    s3.bucket(BUCKET)
    for k, (folder, (env, said)) in enumerate(cases.items()):
        proc = launch(
            tmp_path, s3, f"bad{k}", *BASE, f"checkpoint.folder={folder}", check=False, env=env
        )
        output = proc.stdout + proc.stderr
        assert proc.returncode == EXIT_CONFIG_ERROR, output[-2000:]
        assert f"checkpoint.folder={folder}: " in output and said in output
        assert "Traceback" not in output and secret not in output
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert not [p for p in written if secret.encode() in p.read_bytes()]


def test_an_async_save_to_the_bucket_is_published_whole_after_training_moved_on(s3) -> None:
    """checkpoint.async_save: the writer thread held between writing and publishing: the bucket
    still shows the previous checkpoint; released, the state of the save, not of later steps."""
    s3.bucket("async")
    model = torch.nn.Linear(32, 32)
    inside, release, held = threading.Event(), threading.Event(), {"on": False}

    def hold(payload: dict) -> None:
        if held["on"]:
            inside.set()
            assert release.wait(30)

    ckpt = Checkpointer(
        directory="s3://async/run",
        cfg=CheckpointConfig(async_save=True),
        parts={"model": Held(model)},
        config_yaml="",
        info=cpu_rank(),
        before_publish=hold,
    )
    ckpt.save()
    ckpt.wait()
    first = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    second = model.weight.detach().clone()
    held["on"] = True
    ckpt.save()
    assert inside.wait(30)
    assert torch.equal(load("s3://async/run/last.pt")["model"]["weight"], first)
    with torch.no_grad():
        model.weight.mul_(3.0)  # the next step, while the write runs
    release.set()
    ckpt.close()
    assert torch.equal(load("s3://async/run/last.pt")["model"]["weight"], second)
    assert storage.at("s3://async/run").names() == ["last.pt"]
