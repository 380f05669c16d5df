"""Dataclass schemas for every config group, registered in Hydra's ConfigStore.

The YAML files under ``conf/`` name one of these schemas in their defaults list, so a
misspelled key, a wrong type or an unknown enum value fails at composition time with Hydra's
own message, before any process starts. Closed sets of choices are ``str`` enums: they compare
equal to their plain string value, so ``cfg.sampler.mode == "padded"`` reads naturally.

Open groups (``model``, ``data``) are typed ``Any`` at the top level: the built-in options are
validated by their own schema, while a user's own ``_target_`` YAML needs no schema at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class Choice(str, Enum):
    """A closed set of choices; ``str(choice)`` is its plain value (what builders pass on)."""

    def __str__(self) -> str:
        return str.__str__(self)


class MatmulPrecision(Choice):
    """``torch.set_float32_matmul_precision``: highest is fp32; high allows TF32 on GPUs."""

    highest = "highest"
    high = "high"
    medium = "medium"


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


class WandbLayout(Choice):
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


@dataclass
class SamplerConfig:
    mode: SamplerMode = SamplerMode.padded
    shuffle: bool = True
    seed: int | None = None  # None: the top-level seed
    permutation: Permutation = Permutation.auto
    # The DataLoader's own drop_last (drop a rank's last incomplete batch), not the sampler's.
    drop_last_batch: bool = False


@dataclass
class BackendConfig:
    name: BackendName = BackendName.auto
    timeout_s: int = 600


@dataclass
class SyncBNConfig:
    enabled: bool = False


@dataclass
class AmpConfig:
    mode: AmpMode = AmpMode.off
    init_scale: float = 65536.0  # fp16 GradScaler only
    growth_interval: int = 2000  # fp16 GradScaler only


@dataclass
class SmallCNNConfig:
    _target_: str = "ddp_template.models.small_cnn"
    width: int = 32
    depth: int = 2
    dropout: float = 0.0
    norm: str = "batch"  # batch | group | none


@dataclass
class ResNet18Config:
    _target_: str = "ddp_template.models.resnet18"
    zero_init_residual: bool = False


@dataclass
class TorchvisionModelConfig:
    _target_: str = "ddp_template.models.torchvision_model"
    name: str = "mobilenet_v3_small"
    min_image_size: int = 32
    weights: str | None = None  # DEFAULT or a weights enum name, e.g. IMAGENET1K_V1 (downloads)
    weights_path: str | None = None  # a local .pth state_dict instead of a download


@dataclass
class DataSplitConfig:
    """Keys of every built-in data option that the data builder applies itself."""

    val_fraction: float = 0.0  # carve this fraction of the training data as a validation split


@dataclass
class DigitsConfig(DataSplitConfig):
    _target_: str = "ddp_template.data.datasets.digits"
    test_fraction: float = 0.2
    split_seed: int = 0


@dataclass
class SyntheticConfig(DataSplitConfig):
    _target_: str = "ddp_template.data.datasets.synthetic"
    size: int = 4096
    eval_size: int = 1024
    channels: int = 3
    image_size: int = 32
    num_classes: int = 10
    noise: float = 1.0
    seed: int = 0


@dataclass
class TorchvisionDataConfig(DataSplitConfig):
    _target_: str = MISSING
    root: str = "${paths.data_root}"
    download: bool = True


@dataclass
class ImageFolderConfig(DataSplitConfig):
    _target_: str = "ddp_template.data.datasets.imagefolder"
    path: str = MISSING  # holds train/ and val/ class folders
    image_size: int = 64


@dataclass
class ArrayConfig(DataSplitConfig):
    _target_: str = "ddp_template.data.array.array_dataset"
    path: str = MISSING  # .npz with x_train/y_train/x_test/y_test, or a folder of train/test .csv
    image_shape: list[int] | None = None


@dataclass
class TransformsConfig:
    """Training-time augmentation (training split only), torchvision transforms v2."""

    name: TransformName = TransformName.none
    padding: int | None = None  # cifar (4): random crop after padding each side by this many px
    scale: list[float] | None = None  # imagenet ([0.08, 1.0]): the random crop's area range
    # Normalise both splits with these (null: the data builder's own normalisation, if any).
    mean: list[float] | None = None
    std: list[float] | None = None


@dataclass
class LossConfig:
    label_smoothing: float = 0.0  # training loss only; eval/loss is the plain cross-entropy


@dataclass
class EarlyStopConfig:
    patience: int | None = None  # stop after this many epochs without a new best (monitor)


@dataclass
class OptimConfig:
    name: OptimName = OptimName.sgd
    lr: float = 0.1
    weight_decay: float = 5e-4
    momentum: float = 0.9  # sgd
    nesterov: bool = True  # sgd
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw
    schedule: Schedule = Schedule.cosine
    warmup_steps: int = 0
    grad_clip: float | None = None  # max global grad norm; None: no clipping
    # torch's fused kernel (no per-step host sync under fp16); None: on CUDA, off on CPU
    fused: bool | None = None
    accumulate: int = 1  # micro-batches per optimizer step (gradient accumulation)


@dataclass
class LoggerConfig:
    name: LoggerName = LoggerName.wandb
    mode: WandbMode = WandbMode.offline
    project: str = "ddp-template"
    entity: str | None = None
    tags: list[str] = field(default_factory=list)
    layout: WandbLayout = WandbLayout.auto  # auto: per_rank up to per_rank_max ranks, else main
    per_rank_max: int = 8
    system_metrics: SystemMetrics = SystemMetrics.node  # node: local rank 0 of each node
    # false | last | best: a string, since Hydra reads a bare `false` as a bool
    log_checkpoints: str = "false"
    straggler_alert: float | None = 1.5  # slowest rank's step time / fastest's; None: never

    @property
    def checkpoints(self) -> str:
        """``log_checkpoints`` as false, last or best (a bare ``false`` arrives as "False")."""
        return str(self.log_checkpoints).lower()


@dataclass
class DistConfig:
    nproc: int = 1  # ranks started in-process when no outer launcher (torchrun, SLURM) is used
    max_restarts: int = 0  # elastic restarts of all workers after a failure (like torchrun's)
    start_method: StartMethod = StartMethod.forkserver


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # also save every N optimizer steps (0: at epoch ends only)
    keep: int = 0  # keep this many epoch_<k>.pt files besides last.pt (0: none)
    enabled: bool = True
    # Steps between the (asynchronous) all-reduces that let all ranks agree on a preemption
    # signal: a signal stops the run within 2x this many steps, or at the epoch end.
    preempt_check_every: int = 10
    # Keep best.pt beside last.pt: the epoch whose eval/<metric> was best (eval/accuracy,
    # eval/loss, eval/top5), by mode (max or min). null: no best.pt.
    monitor: str | None = None
    mode: MonitorMode = MonitorMode.max


@dataclass
class FaultConfig:
    """Testing aids: crash or signal a rank at a global step. Off by default."""

    crash_at_step: int | None = None
    rank: int = 0
    signal: str | None = None  # e.g. SIGTERM: send it instead of raising
    process_group: bool = False  # send the signal to the whole process group (like Ctrl-C)
    attempt: int = 0  # only on this elastic restart attempt (so the restart can finish)


# The research loop: DDP options, EMA, the profiler window (compile is the top-level key).
@dataclass
class DDPConfig:
    """Arguments of torch's DistributedDataParallel (only with more than one rank)."""

    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    bucket_cap_mb: float = 25.0
    broadcast_buffers: bool = True


@dataclass
class EmaConfig:
    decay: float | None = None  # None: no EMA; e.g. 0.999
    every: int = 1  # optimizer steps between EMA updates
    warmup: int = 0  # optimizer steps during which the EMA copies the weights (no averaging)


@dataclass
class ProfilerConfig:
    enabled: bool = False
    wait: int = 1  # optimizer steps skipped first
    warmup: int = 1  # steps profiled but discarded
    active: int = 3  # steps recorded into rank<r>/trace_step<k>.pt.trace.json


@dataclass
class PathsConfig:
    output_root: str = "outputs"
    multirun_root: str = "multirun"
    data_root: str = "data"


@dataclass
class Config:
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    syncbn: SyncBNConfig = field(default_factory=SyncBNConfig)
    amp: AmpConfig = field(default_factory=AmpConfig)
    model: Any = MISSING
    data: Any = MISSING
    optim: OptimConfig = field(default_factory=OptimConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    compile: bool = False  # torch.compile the model (DDP-wrapped first)
    seed: int = 0
    epochs: int = 10  # 0: evaluate the initial (or resumed) model without training
    batch_size: int = 32  # per rank: the global batch is batch_size x world size
    eval_batch_size: int = 256  # per rank
    num_workers: int = 0  # DataLoader workers per rank
    max_steps_per_epoch: int | None = None  # cap each epoch at this many steps (smoke runs)
    log_every: int = 10  # steps between interval logs
    resume: str = "auto"  # auto | never | <path to a checkpoint>
    shard_report_max_n: int = 10_000_000  # ranks keep their indices for a mismatch's report
    # Numerics and GPU speed (numerics.py, data/loader.py; README "GPU hosts").
    deterministic: bool = False  # deterministic algorithms, cuDNN benchmark off
    matmul_precision: MatmulPrecision = MatmulPrecision.high  # high: TF32 matmuls on GPUs
    cudnn_benchmark: bool | None = None  # None: on unless deterministic
    channels_last: bool = False  # conv models: weights and input batches in NHWC
    pin_memory: bool = True  # page-locked batches for the host-to-GPU copy (CUDA ranks)
    persistent_workers: bool = True  # loader workers live across epochs (num_workers > 0)
    # Start a fresh run from a checkpoint's weights (any world size; resume wins if this run
    # already has a checkpoint of its own). Shapes that differ (a new head) start fresh.
    init_from: str | None = None
    init_from_ema: bool = False  # take the checkpoint's EMA weights instead
    init_from_strict: bool = True  # refuse missing/unexpected keys
    # The split of the final evaluation (summary.json): test, val (data.val_fraction > 0) or
    # train (without augmentation). With epochs=0 and init_from: evaluate a checkpoint on it.
    eval_split: EvalSplit = EvalSplit.test
    loss: LossConfig = field(default_factory=LossConfig)
    transforms: TransformsConfig = field(default_factory=TransformsConfig)
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)


def register_configs() -> None:
    """Register the schemas; idempotent, called before Hydra composes."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    groups: dict[str, dict[str, Any]] = {
        "sampler": {"sampler_schema": SamplerConfig},
        "backend": {"backend_schema": BackendConfig},
        "syncbn": {"syncbn_schema": SyncBNConfig},
        "amp": {"amp_schema": AmpConfig},
        "optim": {"optim_schema": OptimConfig},
        "logger": {"logger_schema": LoggerConfig},
        "transforms": {"transforms_schema": TransformsConfig},
        "model": {
            "small_cnn_schema": SmallCNNConfig,
            "resnet18_schema": ResNet18Config,
            "torchvision_schema": TorchvisionModelConfig,
        },
        "data": {
            "digits_schema": DigitsConfig,
            "synthetic_schema": SyntheticConfig,
            "torchvision_schema": TorchvisionDataConfig,
            "imagefolder_schema": ImageFolderConfig,
            "array_schema": ArrayConfig,
        },
    }
    for group, schemas in groups.items():
        for name, node in schemas.items():
            cs.store(group=group, name=name, node=node)
