"""The closed sets of choices of the config: ``str`` enums, so a wrong value fails at
composition with Hydra's message, and ``cfg.sampler.mode == "padded"`` reads naturally."""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A closed set of choices; ``str(choice)`` is its plain value (what builders pass on)."""

    def __str__(self) -> str:
        return str.__str__(self)


class MatmulPrecision(Choice):
    """``torch.set_float32_matmul_precision``: highest is fp32; high allows TF32 on GPUs."""

    highest = "highest"
    high = "high"
    medium = "medium"


class Parallelism(Choice):
    """How the model is laid out over the ranks (the ``parallel`` group)."""

    ddp = "ddp"  # a whole replica per rank, gradients all-reduced
    fsdp2 = "fsdp2"  # a slice of every parameter per rank (torch's fully_shard)


class SamplerMode(Choice):
    padded = "padded"
    drop_last = "drop_last"
    sequential = "sequential"
    exact = "exact"


class Permutation(Choice):
    auto = "auto"
    randperm = "randperm"
    feistel = "feistel"


class BackendName(Choice):
    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


class AmpMode(Choice):
    off = "off"
    bf16 = "bf16"
    fp16 = "fp16"


class Schedule(Choice):
    none = "none"
    cosine = "cosine"


class OptimName(Choice):
    sgd = "sgd"
    adamw = "adamw"


class LoggerName(Choice):
    wandb = "wandb"
    none = "none"


class WandbMode(Choice):
    offline = "offline"
    online = "online"
    disabled = "disabled"


class WandbRuns(Choice):
    auto = "auto"
    per_rank = "per_rank"
    main = "main"
    shared = "shared"


class SystemMetrics(Choice):
    node = "node"
    all = "all"
    off = "off"


class TransformName(Choice):
    none = "none"
    cifar = "cifar"
    imagenet = "imagenet"


class EvalSplit(Choice):
    test = "test"
    val = "val"
    train = "train"


class MonitorMode(Choice):
    max = "max"
    min = "min"


class StartMethod(Choice):
    spawn = "spawn"
    forkserver = "forkserver"
    fork = "fork"


class Norm(Choice):
    batch = "batch"
    group = "group"
    none = "none"


class FaultScope(Choice):
    """Who gets an injected fault's signal: the rank, its process group (as a terminal's
    Ctrl-C: the launcher, this node's ranks, their loader workers), or its node (the launcher
    that started it too: torchrun's agent, a lost node)."""

    rank = "rank"
    process_group = "process_group"
    node = "node"


class Tolerance(Choice):
    """What a rank's death does: end the group (a restart resumes from the last checkpoint), or
    the survivors go on and a replacement rejoins (experimental: torch's reconfigurable gloo
    process group)."""

    off = "off"
    live = "live"


class FaultPhase(Choice):
    """Where an injected fault strikes: after the optimizer step, inside the step's gradient
    all-reduce (the DDP communication hook of the step), as the epoch's evaluation starts (at
    its last step), as the step's checkpoint starts, or inside its write (rank 0, the temporary
    file written, not yet published: under ``checkpoint.async_save`` in the background)."""

    step = "step"
    allreduce = "allreduce"
    evaluation = "evaluation"
    checkpoint = "checkpoint"
    write = "write"


class GlobalBatch(Choice):
    """At another world size: keep batch_size x W x accumulate, or the per-rank batch."""

    keep = "keep"
    scale = "scale"


class Change(Choice):
    """What ``provenance.allow`` lets a resume change (recorded in the chain as a break)."""

    sampler = "sampler"  # sampler.mode, permutation or seed
    order = "order"  # a config key that decides the data or its order (data.*, seed, ...)
    data = "data"  # the data's content fingerprint or length


class OnResize(Choice):
    """A checkpoint of another world size: continue at this one, or refuse."""

    locals()["continue"] = "continue"  # a Python keyword: the member is OnResize["continue"]
    refuse = "refuse"


class LogCheckpoints(Choice):
    """Which checkpoint becomes a W&B model artifact version at each epoch end."""

    none = "none"
    last = "last"
    best = "best"
