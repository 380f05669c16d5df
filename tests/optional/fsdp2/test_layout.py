"""parallel=fsdp2's layout, in-process and on spawned gloo ranks: what it refuses (one sentence
each), which modules it shards, the bf16 policy, gradients held off the reduce-scatter on an
accumulating micro-batch, and the clipped norm over every rank's slices; checkpoint.async_save's
copy of each rank's slices before its next optimizer step."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import cpu_rank, free_port, join_gloo
from torch import nn
from torch.distributed.tensor import DTensor

from ddp_template.checks import check
from ddp_template.config.boundary import typed
from ddp_template.config.loop import ParallelConfig
from ddp_template.errors import ConfigError
from ddp_template.models import small_cnn
from ddp_template.optional.fsdp2.layout import build_fsdp2, unit_names
from ddp_template.optional.gpt.model import gpt

pytestmark = pytest.mark.needs("gpt")  # its units are the GPT's blocks


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ("parallel=fsdp2 amp=fp16", "amp=fp16 cannot run with parallel=fsdp2"),
        ("parallel=fsdp2 ddp.bucket_cap_mb=50", "ddp.bucket_cap_mb=50.0 is an option of Distrib"),
        ("parallel.replicate=2", "parallel.replicate=2 is an option of parallel=fsdp2"),
        ("parallel=fsdp2 parallel.replicate=0", "parallel.replicate=0 must be >= 1"),
    ],
)
def test_what_fsdp2_cannot_honour_is_refused_in_one_sentence(
    compose_cfg, overrides: str, needle: str
) -> None:
    with pytest.raises(ConfigError) as err:
        check(typed(compose_cfg(*overrides.split())))
    message = str(err.value)
    assert message.startswith(needle) and message.endswith(".") and "\n" not in message
    assert ". " not in message.replace("e.g. ", "")


def test_the_units_are_the_modulelists_members_or_what_the_globs_name() -> None:
    model = gpt(vocab_size=16, block_size=8, n_layer=3, n_head=2, n_embd=8)
    assert unit_names(model, None) == ["blocks.0", "blocks.1", "blocks.2"]
    assert unit_names(model, ["blocks.[02]", "blocks.*.mlp"]) == [
        "blocks.0",
        "blocks.2",
        "blocks.0.mlp",
        "blocks.1.mlp",
        "blocks.2.mlp",
    ]
    assert unit_names(small_cnn(num_classes=3, in_channels=1, image_size=8), None) == []
    with pytest.raises(ConfigError, match=r"pattern 'layers\.\*' names no module of this model"):
        unit_names(model, ["layers.*"])
    with pytest.raises(ConfigError, match=r"names blocks, a container .* e\.g\. blocks\.\*\."):
        unit_names(model, ["blocks"])


def test_offload_on_cpu_and_a_replicate_that_does_not_divide_are_refused() -> None:
    fsdp2 = ParallelConfig(name="fsdp2", offload=True)
    with pytest.raises(ConfigError, match=r"trains on cpu, where they already are; set parallel"):
        build_fsdp2(fsdp2, cpu_rank(0, 2, "gloo"), amp="off")
    with pytest.raises(ConfigError, match=r"replicate=2 does not divide the world size 3"):
        build_fsdp2(ParallelConfig(name="fsdp2", replicate=2), cpu_rank(0, 3, "gloo"), amp="off")


def worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    join_gloo(rank, 2, port)
    try:
        layout = build_fsdp2(ParallelConfig(name="fsdp2"), cpu_rank(rank, 2, "gloo"), amp="bf16")
        torch.manual_seed(0)
        model = gpt(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8)
        seen: list[torch.dtype] = []
        model.blocks[1].mlp.register_forward_pre_hook(lambda m, _: seen.append(m.c_fc.weight.dtype))
        layout.wrap(model)
        x = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(rank))
        with layout.sync(model, False):  # an accumulating micro-batch: no reduce-scatter
            logits = model(x)
            logits.float().mean().backward()
        held = all(p.grad is None for p in model.parameters())
        with layout.sync(model, True):  # the step's last: the sum reduced, each rank its slice
            model(x.flip(0)).float().mean().backward()
        full = torch.cat([p.grad.full_tensor().reshape(-1) for p in model.parameters()])
        total = layout.clip(model, 1e-3)
        clipped = torch.cat([p.grad.full_tensor().reshape(-1) for p in model.parameters()])
        row = {
            "forward_dtypes": set(seen),
            "output_dtype": logits.dtype,
            "slice_dtype": model.blocks[1].mlp.c_fc.weight.to_local().dtype,
            "held": held,
            "norm": float(total),
            "full_norm": float(full.norm()),
            "clipped_norm": float(clipped.norm()),
        }
        if rank == 0:
            torch.save(row, Path(out) / "row.pt")
    finally:
        dist.destroy_process_group()


def test_bf16_forward_held_gradients_and_the_norm_over_every_slice(tmp_path: Path) -> None:
    """amp=bf16: the blocks run on bf16 copies of fp32 slices and the output is fp32; a
    micro-batch outside gradient sync leaves no sliced gradient (they wait, unsharded, for the
    step's last); the clipped norm is the norm of the whole gradient, and clipping reaches it."""
    mp.spawn(worker, args=(free_port(), str(tmp_path)), nprocs=2)
    row = torch.load(tmp_path / "row.pt", weights_only=False)
    assert row["forward_dtypes"] == {torch.bfloat16} and row["output_dtype"] == torch.float32
    assert row["slice_dtype"] == torch.float32 and row["held"]
    assert row["norm"] == pytest.approx(row["full_norm"], rel=1e-5) and row["norm"] > 1e-3
    assert row["clipped_norm"] == pytest.approx(1e-3, rel=1e-3)


class Norm(torch.nn.Module):
    """A GPT block's shape with a BatchNorm: buffers that the forward moves."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.inp(x)).relu())


def whole_of(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def async_worker(rank: int, port: int, out: str) -> None:
    """Each rank's writer thread held before it copies its slices; step S+1's forward and
    backward run, its optimizer step is seen waiting; then the file and slices are step S's."""
    from ddp_template.checkpoint import Checkpointer
    from ddp_template.config.schema import CheckpointConfig
    from ddp_template.models import weights_part
    from ddp_template.optional.fsdp2.layout import OptimizerSlices

    torch.set_num_threads(1)
    join_gloo(rank, 2, port)
    try:
        layout = build_fsdp2(ParallelConfig(name="fsdp2"), cpu_rank(rank, 2, "gloo"), amp="off")
        torch.manual_seed(0)
        model = Norm()
        layout.wrap(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        x = torch.randn(8, 16)  # the same batch on both ranks: their buffers alike
        for _ in range(2):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        inside, release, deferred = threading.Event(), threading.Event(), []
        copy_later = Checkpointer._copy_later

        def held(self, later, staged):
            deferred.append(sum(isinstance(t, DTensor) for t in later))
            stage = copy_later(self, later, staged)

            def hold() -> None:
                inside.set()
                assert release.wait(30)
                stage()

            return hold

        Checkpointer._copy_later = held  # type: ignore[method-assign]  # this process's
        ckpt = Checkpointer(
            directory=Path(out),
            cfg=CheckpointConfig(async_save=True),
            parts={},
            sliced={
                "model": weights_part(model),
                "optimizer": OptimizerSlices(module=model, optimizer=opt),
            },
            config_yaml="",
            info=cpu_rank(rank, 2, "gloo"),
        )
        step_s = {k: whole_of(v).clone() for k, v in model.state_dict().items()}
        ckpt.save()
        assert inside.wait(30)
        model(x).square().mean().backward()  # step S+1's: the BatchNorm statistics move
        stepped = threading.Thread(target=opt.step)
        stepped.start()
        stepped.join(0.5)
        waited = stepped.is_alive()
        release.set()
        stepped.join(30)
        ckpt.close()
        if rank == 0:
            torch.save(
                {"step_s": step_s, "waited": waited, "deferred": deferred}, Path(out) / "row.pt"
            )
    finally:
        dist.destroy_process_group()


def test_async_saves_copy_each_ranks_slices_before_its_next_optimizer_step(tmp_path: Path) -> None:
    """checkpoint.async_save under FSDP2: the weights' and optimizer state's slices (DTensors)
    are copied by each rank's writer thread while step S+1's forward and backward run, its
    optimizer step waits for the copy, and the slices written are step S's, buffers included."""
    from ddp_template.checkpoint import load, whole

    mp.spawn(async_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    row = torch.load(tmp_path / "row.pt", weights_only=False)
    assert row["waited"] and row["deferred"][0] >= 4  # the weights and exp_avg(_sq), as slices
    saved = whole(tmp_path / "last.pt", load(tmp_path / "last.pt"), "model")
    assert saved is not None and saved.keys() == row["step_s"].keys()
    assert [k for k in saved if not torch.equal(saved[k], row["step_s"][k])] == []
