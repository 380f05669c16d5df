"""Dataclass schemas for every config group, registered in Hydra's ConfigStore.

The YAML files under ``conf/`` name one of these schemas in their defaults list, so a
misspelled key, a wrong type or an unknown enum value fails at composition time with Hydra's
own message, before any process starts. Closed sets of choices are ``str`` enums: they compare
equal to their plain string value, so ``cfg.sampler.mode == "padded"`` reads naturally.

Open groups (``model``, ``data``) are typed ``Any`` at the top level: the built-in options are
validated by their own schema, while a user's own ``_target_`` YAML needs no schema at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from ddp_template.config.choices import (
    AmpMode,
    BackendName,
    Change,
    EvalSplit,
    FaultPhase,
    FaultScope,
    GlobalBatch,
    LogCheckpoints,
    LoggerName,
    MatmulPrecision,
    OnResize,
    OptimName,
    Permutation,
    SamplerMode,
    Schedule,
    StartMethod,
    SystemMetrics,
    Tolerance,
    WandbMode,
    WandbRuns,
)
from ddp_template.config.loop import (
    DDPConfig,
    EmaConfig,
    FinetuneConfig,
    ParallelConfig,
    ProfilerConfig,
    SelectionConfig,
    SpikeConfig,
)
from ddp_template.config.options import (
    ArrayConfig,
    ContrastiveModelConfig,
    DataSplitConfig,
    DiabetesConfig,
    DigitsConfig,
    FCNConfig,
    ImageFolderConfig,
    MLPConfig,
    ResNet18Config,
    ShapesConfig,
    SmallCNNConfig,
    SyntheticConfig,
    TorchvisionDataConfig,
    TorchvisionModelConfig,
    TransformsConfig,
)
from ddp_template.errors import ConfigError

SPLIT_KEYS = tuple(f.name for f in fields(DataSplitConfig))  # data keys the template applies


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
    # A multi-node run's ranks beat into the rendezvous store every heartbeat_s (reach.py): a
    # host silent for lost_after_s ends the run, named; a rank that cannot reach the store that
    # long is cut off and stops without another write. lost_after_s=0: no heartbeats.
    heartbeat_s: float = 1.0
    lost_after_s: float = 30.0

    def check(self) -> None:
        if self.heartbeat_s <= 0:
            raise ConfigError(
                f"backend.heartbeat_s={self.heartbeat_s} must be positive; e.g. "
                f"backend.heartbeat_s={BackendConfig.heartbeat_s}."
            )
        if self.lost_after_s < 0 or 0 < self.lost_after_s <= 3 * self.heartbeat_s:
            raise ConfigError(
                f"backend.lost_after_s={self.lost_after_s} must exceed three heartbeats "
                f"(backend.heartbeat_s={self.heartbeat_s}), or a busy store loses hosts that "
                f"are there; raise it, or set 0 for no heartbeats."
            )


@dataclass
class SyncBNConfig:
    enabled: bool = False


@dataclass
class AmpConfig:
    mode: AmpMode = AmpMode.off
    init_scale: float = 65536.0  # fp16 GradScaler only
    growth_interval: int = 2000  # fp16 GradScaler only


@dataclass
class LoaderConfig:
    """The DataLoaders (``data.loader.build_train_loader``, ``build_eval_loader``)."""

    batch_size: int = 32  # per rank: the global batch is batch_size x world size x accumulate
    eval_batch_size: int = 256  # per rank
    num_workers: int = 0  # DataLoader workers per rank
    pin_memory: bool = True  # page-locked batches for the host-to-GPU copy (CUDA ranks)
    persistent_workers: bool = True  # workers live across epochs (num_workers > 0)

    def check(self) -> None:
        for key in ("batch_size", "eval_batch_size"):
            value = getattr(self, key)
            if value < 1:
                raise ConfigError(f"loader.{key}={value} must be >= 1; e.g. loader.{key}=32.")
        if self.num_workers < 0:
            raise ConfigError(f"loader.num_workers={self.num_workers} must be >= 0.")


@dataclass
class NumericsConfig:
    """Numerics and GPU speed (``numerics.apply``; README "GPU hosts")."""

    deterministic: bool = False  # deterministic algorithms, cuDNN benchmark off
    matmul_precision: MatmulPrecision = MatmulPrecision.high  # high: TF32 matmuls on GPUs
    cudnn_benchmark: bool | None = None  # None: on unless deterministic
    channels_last: bool = False  # conv models: weights and input batches in NHWC

    def check(self) -> None:
        if self.deterministic and self.cudnn_benchmark:
            raise ConfigError(
                "numerics.cudnn_benchmark=true contradicts numerics.deterministic=true "
                "(benchmark mode times and picks convolution kernels per run, not "
                "reproducibly); drop numerics.cudnn_benchmark (it is off under deterministic) "
                "or set numerics.deterministic=false."
            )


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
    runs: WandbRuns = WandbRuns.auto  # auto: per_rank up to per_rank_max ranks, else main
    per_rank_max: int = 8
    system_metrics: SystemMetrics = SystemMetrics.node  # node: local rank 0 of each node
    log_checkpoints: LogCheckpoints = LogCheckpoints.none
    straggler_alert: float | None = 1.5  # slowest rank's step time / fastest's; None: never
    # Rank 0 also prints each log_every interval's row as a line: step, loss, lr, grad norm,
    # samples/s and ms/step (its own numbers: no collective).
    step_lines: bool = False

    def check(self) -> None:
        if self.per_rank_max < 1:
            raise ConfigError(
                f"logger.per_rank_max={self.per_rank_max} must be >= 1 (ranks that get a W&B "
                f"run each under logger.runs=auto); e.g. logger.per_rank_max=8."
            )
        alert = self.straggler_alert
        if alert is not None and alert <= 1:
            raise ConfigError(
                f"logger.straggler_alert={alert} must be > 1 (the slowest rank's step time over "
                f"the fastest's) or null for no alert; e.g. logger.straggler_alert=1.5."
            )


@dataclass
class DistConfig:
    nproc: int = 1  # ranks started in-process when no outer launcher (torchrun, SLURM) is used
    # Hosts of a run the template's launcher starts, one launcher per host, this one's index
    # (fault_tolerance=live across hosts; any other multi-node run starts under torchrun/srun).
    nnodes: int = 1
    node_rank: int = 0
    max_restarts: int = 0  # elastic restarts of all workers after a failure (like torchrun's)
    start_method: StartMethod = StartMethod.forkserver


@dataclass
class CheckpointConfig:
    # Where checkpoints are written and resume=auto looks: a local folder or s3://bucket/prefix
    # (credentials: boto3's chain; AWS_ENDPOINT_URL for an S3-compatible store). Empty:
    # <run dir>/checkpoints.
    folder: str = ""
    every_steps: int = 0  # also save every N optimizer steps (0: at epoch ends only)
    keep: int = 0  # keep this many epoch_<k>.pt files besides last.pt (0: none)
    enabled: bool = True
    # Copy the small state and the buffers to CPU memory at the step boundary; the weights and
    # the optimizer's state are copied by a background thread before the next optimizer step,
    # which waits for it, then written there while training goes on (``async`` is Python's
    # keyword): one save in flight at most. Off: a checkpoint is durable when ``save`` returns.
    async_save: bool = False
    # Steps between the (asynchronous) all-reduces that let all ranks agree on a preemption
    # signal: a signal stops the run within 2x this many steps, or at the epoch end.
    preempt_check_every: int = 10


@dataclass
class ElasticConfig:
    """Resuming a checkpoint written at another world size (an elastic restart, a requeue on
    another node count): the rest of its epoch is dealt to this run's ranks."""

    on_resize: OnResize = OnResize["continue"]  # refuse: resume only at the checkpoint's size
    # keep: batch_size x W x accumulate unchanged (the per-rank batch kept where it can be,
    # accumulate adjusted), so steps per epoch and the LR schedule go on; scale: the per-rank
    # batch and accumulate as configured, the global batch changes, the LR schedule re-derived.
    global_batch: GlobalBatch = GlobalBatch.keep


@dataclass
class ProvenanceConfig:
    """The chain every checkpoint carries (``provenance``): what a resume may change."""

    # The changes a resume accepts, each recorded in the chain as a break: sampler, order
    # (data.*, seed, sampler.* keys), data (its content). [] refuses every change.
    allow: list[Change] = field(default_factory=list)


@dataclass
class FaultConfig:
    """Testing aids: crash or signal a rank at a global step. Off by default."""

    crash_at_step: int | None = None
    rank: int = 0
    signal: str | None = None  # e.g. SIGTERM: send it instead of raising
    scope: FaultScope = FaultScope.rank  # who gets the signal: rank | process_group | node
    hold: bool = False  # instead: stop after the step until a signal comes (a busy rank)
    spin: bool = False  # instead: spin in a Python loop, its threads alive (a stuck rank)
    attempt: int = 0  # only on this restart attempt (live: this membership), so the run can finish
    phase: FaultPhase = FaultPhase.step  # allreduce: inside the step's gradient all-reduce
    again_at_step: int | None = None  # strike again there (whichever process is fault.rank)


@dataclass
class FaultToleranceConfig:
    """``fault_tolerance=live`` (experimental): a rank's or a host's death is survived in
    place. The membership coordinator (in node 0's launcher) hosts the ranks' store and judges
    their heartbeats and step progress; the survivors regroup, take the state of the one
    furthest on and deal the rest of the epoch among themselves; a replacement for a dead
    rank's slot, or a host started again, joins at a step boundary."""

    mode: Tolerance = Tolerance.off
    heartbeat_s: float = 0.5  # each rank's heartbeat into the coordinator's store
    # A rank silent this long (SIGSTOP, a cut link), or without step progress this long while
    # the others are past it (stuck), is killed where it can be and counted lost.
    dead_after_s: float = 5.0
    min_members: int = 1  # fewer ranks alive: the run ends (resume from its last checkpoint)
    replacements: int = 3  # processes the launcher starts in dead ranks' slots, in all
    admit_every: int = 4  # steps between the checks for a waiting replacement (an async collective)
    regroup_timeout_s: float = 120.0  # the longest a regroup waits for its members
    # Across hosts (dist.nnodes > 1): host:port of the membership coordinator, which node 0's
    # launcher runs (it binds the port); empty on one host (a free loopback port).
    coordinator: str = ""

    def check(self) -> None:
        for key in ("heartbeat_s", "dead_after_s", "regroup_timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(
                    f"fault_tolerance.{key}={getattr(self, key)} must be positive; e.g. "
                    f"fault_tolerance.{key}={getattr(FaultToleranceConfig, key)}."
                )
        if self.dead_after_s <= 2 * self.heartbeat_s:
            raise ConfigError(
                f"fault_tolerance.dead_after_s={self.dead_after_s} must exceed two heartbeats "
                f"(fault_tolerance.heartbeat_s={self.heartbeat_s}), or a busy rank is killed; "
                f"raise dead_after_s or lower heartbeat_s."
            )
        for key in ("min_members", "admit_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"fault_tolerance.{key}={getattr(self, key)} must be at least 1.")
        host, _, port = self.coordinator.rpartition(":")
        if self.coordinator and not (host and port.isdigit()):
            raise ConfigError(
                f"fault_tolerance.coordinator={self.coordinator} is not host:port; e.g. "
                f"fault_tolerance.coordinator=node0:29400."
            )
        if self.replacements < 0:
            raise ConfigError(
                f"fault_tolerance.replacements={self.replacements} must be >= 0 (0: the "
                f"survivors go on without a replacement)."
            )


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
    # Every data option's keys merge over the template's own (``SPLIT_KEYS``, at their defaults):
    # ``data.val_fraction=0.2`` works with a forker's factory YAML as with the built-in ones.
    data: Any = field(default_factory=lambda: {f.name: f.default for f in fields(DataSplitConfig)})
    task: Any = MISSING  # what is learned: its loss and metrics (ddp_template.task)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    provenance: ProvenanceConfig = field(default_factory=ProvenanceConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    compile: bool = False  # torch.compile the model (DDP-wrapped first)
    seed: int = 0
    epochs: int = 10  # 0: evaluate the initial (or resumed) model without training
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    max_steps_per_epoch: int | None = None  # cap each epoch at this many steps (smoke runs)
    # End the run after this many optimizer steps in all, mid-epoch if need be (the LR
    # schedule's horizon with it); None: at the end of its epochs. Past their end: refused.
    max_steps: int | None = None
    # Also evaluate (exactly, as at an epoch's end) and checkpoint every N optimizer steps; 0:
    # at epoch ends only. The epoch's end still evaluates, verifies and selects.
    eval_every_steps: int = 0
    log_every: int = 10  # steps between interval logs
    resume: str = "auto"  # auto | never | <path to a checkpoint>
    share_report_max_n: int = 10_000_000  # ranks keep their indices for a mismatch's report
    # Rank 0 draws epoch 0's shares into <run_dir>/shares.png (and W&B's shares/picture):
    # matplotlib in a background thread, about a second of CPU. Streams have no picture.
    share_picture: bool = True
    numerics: NumericsConfig = field(default_factory=NumericsConfig)
    # The split of the final evaluation (summary.json): test, val (data.val_fraction > 0) or
    # train (without augmentation). With epochs=0 and finetune.init_from: evaluate a checkpoint.
    eval_split: EvalSplit = EvalSplit.test
    transforms: TransformsConfig = field(default_factory=TransformsConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)


# The schemas' own group: an option's YAML names its schema as ``/schema/<group>@_here_`` (or
# ``/schema/model/<name>@_here_``), so no schema shows among a group's options (``model=nope``).
SCHEMA_GROUP = "schema"


def register_configs() -> None:
    """Register the schemas; idempotent, called before Hydra composes."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    groups: dict[str, dict[str, Any]] = {
        "sampler": {"sampler": SamplerConfig},
        "backend": {"backend": BackendConfig},
        "syncbn": {"syncbn": SyncBNConfig},
        "amp": {"amp": AmpConfig},
        "parallel": {"parallel": ParallelConfig},
        "fault_tolerance": {"fault_tolerance": FaultToleranceConfig},
        "optim": {"optim": OptimConfig},
        "logger": {"logger": LoggerConfig},
        "transforms": {"transforms": TransformsConfig},
        "model": {
            "small_cnn": SmallCNNConfig,
            "resnet18": ResNet18Config,
            "torchvision": TorchvisionModelConfig,
            "mlp": MLPConfig,
            "fcn": FCNConfig,
            "contrastive": ContrastiveModelConfig,
        },
        "data": {
            "digits": DigitsConfig,
            "diabetes": DiabetesConfig,
            "synthetic": SyntheticConfig,
            "torchvision": TorchvisionDataConfig,
            "imagefolder": ImageFolderConfig,
            "array": ArrayConfig,
            "shapes": ShapesConfig,
        },
    }
    for group, schemas in groups.items():
        for name, node in schemas.items():
            # /schema/<group> for a group of one schema, /schema/<group>/<option> for the others
            within = SCHEMA_GROUP if len(schemas) == 1 else f"{SCHEMA_GROUP}/{group}"
            cs.store(group=within, name=name, node=node)
