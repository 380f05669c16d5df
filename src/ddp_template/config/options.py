"""Schemas of the option groups: the built-in ``model`` and ``data`` options (Hydra
instantiates these groups, so their keys are the arguments of each option's ``_target_``; a
user's own ``_target_`` YAML needs no schema at all) and ``transforms`` with its checks."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from ddp_template.config.choices import Norm, TransformName
from ddp_template.errors import require


@dataclass
class SmallCNNConfig:
    _target_: str = "ddp_template.models.small_cnn"
    width: int = 32
    depth: int = 2
    dropout: float = 0.0
    norm: Norm = Norm.batch


@dataclass
class ContrastiveModelConfig:
    _target_: str = "ddp_template.models.contrastive"
    features: int = 32  # the representation (what the evaluation's class means average)
    projection: int = 16  # the projection head's output (what the loss contrasts)
    width: int = 16
    depth: int = 2
    norm: Norm = Norm.none


@dataclass
class FCNConfig:
    _target_: str = "ddp_template.models.fcn"
    width: int = 16
    depth: int = 3


@dataclass
class MLPConfig:
    _target_: str = "ddp_template.models.mlp"
    in_features: int | None = None  # null: the data's (DataInfo.in_features)
    out_features: int | None = None  # null: the data's (DataInfo.out_features)
    hidden: int = 64
    depth: int = 2


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
    _target_: str = "ddp_template.data.builtin.digits"
    test_fraction: float = 0.2
    split_seed: int = 0


@dataclass
class DiabetesConfig(DataSplitConfig):
    _target_: str = "ddp_template.data.builtin.diabetes"
    test_fraction: float = 0.2
    split_seed: int = 0


@dataclass
class SyntheticConfig(DataSplitConfig):
    _target_: str = "ddp_template.data.builtin.synthetic"
    size: int = 4096
    test_size: int = 1024
    channels: int = 3
    image_size: int = 32
    num_classes: int = 10
    noise: float = 1.0
    seed: int = 0


@dataclass
class ShapesConfig(DataSplitConfig):
    _target_: str = "ddp_template.data.builtin.shapes"
    size: int = 512
    test_size: int = 128
    image_size: int = 16
    num_classes: int = 3
    noise: float = 0.5
    seed: int = 0


@dataclass
class TorchvisionDataConfig(DataSplitConfig):
    _target_: str = MISSING
    root: str = "${paths.data_root}"
    download: bool = True


@dataclass
class ImageFolderConfig(DataSplitConfig):
    _target_: str = "ddp_template.data.builtin.imagefolder"
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

    def check(self) -> None:
        t = self
        for key, owner, example in (("padding", "cifar", "4"), ("scale", "imagenet", "[0.08,1.0]")):
            value = getattr(t, key)
            require(
                value is None or t.name == owner,
                f"transforms.{key}={value} belongs to transforms={owner} (here transforms.name="
                f"{t.name}); choose transforms={owner}, or drop transforms.{key}.",
            )
            require(
                value is not None or t.name != owner,
                f"transforms.{key}=null: transforms={owner} needs it; e.g. "
                f"transforms.{key}={example}.",
            )
        require(
            t.padding is None or t.padding >= 0,
            f"transforms.padding={t.padding} must be >= 0; e.g. transforms.padding=4.",
        )
        require(
            t.scale is None or (len(t.scale) == 2 and 0.0 < t.scale[0] <= t.scale[1] <= 1.0),
            f"transforms.scale={t.scale} must be [min, max] with 0 < min <= max <= 1; e.g. "
            f"transforms.scale=[0.08,1.0].",
        )
        require(
            (t.mean is None) == (t.std is None),
            f"transforms.mean={t.mean} and transforms.std={t.std} normalise together; give both "
            f"(one value per channel) or neither.",
        )
        require(
            t.std is None or all(v > 0 for v in t.std),
            f"transforms.std={t.std} must be positive; e.g. transforms.std=[0.229,0.224,0.225].",
        )
