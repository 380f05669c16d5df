"""Model factories (the ``model`` config group) and SyncBN conversion.

The model contract: a ``model`` YAML's ``_target_`` names any callable returning an
``nn.Module`` whose output the task reads (logits ``(B, num_classes)`` for classification,
``(B, out_features)`` for regression, ``(B, num_classes, H, W)`` for segmentation, the
representation and its projection for contrastive learning). Each field
the data's ``DataInfo`` sets (``num_classes``, ``in_channels``, ``image_size``, ``in_features``,
``out_features``) goes to the factory's argument of that name, unless its YAML sets it.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from hydra.utils import get_method
from torch import nn

from ddp_template.data.contract import DataInfo
from ddp_template.errors import ConfigError, Guarded, instantiate_clean

NORMS: dict[str, Callable[[int], list[nn.Module]]] = {
    "batch": lambda c: [nn.BatchNorm2d(c)],
    "group": lambda c: [nn.GroupNorm(math.gcd(c, 8), c)],
    "none": lambda c: [],
}


def small_cnn(
    num_classes: int,
    in_channels: int,
    image_size: int,
    width: int = 32,
    depth: int = 2,
    dropout: float = 0.0,
    norm: str = "batch",
) -> nn.Module:
    """Conv-norm-ReLU blocks, global pool, linear.

    ``norm=batch`` (BN on purpose: it is what SyncBN changes); ``group`` (GroupNorm, up to 8
    groups: no batch dependence, for small per-rank batches and exact accumulation checks);
    ``none`` (a biased conv, no normalisation).
    """
    if width < 1 or depth < 1:
        raise ConfigError(f"model.width={width} and model.depth={depth} must both be >= 1.")
    if norm not in NORMS:
        raise ConfigError(
            f"model.norm={norm} is not a normalisation; use one of {', '.join(NORMS)}."
        )
    layers: list[nn.Module] = []
    channels = in_channels
    for i in range(depth):
        out = width * 2**i
        layers += [
            nn.Conv2d(channels, out, 3, padding=1, bias=norm == "none"),
            *NORMS[norm](out),
            nn.ReLU(inplace=True),
        ]
        if i < depth - 1 and image_size >= 2 ** (i + 2):
            layers.append(nn.MaxPool2d(2))
        channels = out
    layers += [
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(channels, num_classes),
    ]
    return nn.Sequential(*layers)


def fcn(num_classes: int, in_channels: int, width: int = 16, depth: int = 3) -> nn.Module:
    """A small fully convolutional net for segmentation: ``depth`` conv-BN-ReLU blocks at full
    resolution, then a 1x1 head: ``(B, in_channels, H, W)`` → ``(B, num_classes, H, W)`` logits,
    for any H and W."""
    if width < 1 or depth < 1:
        raise ConfigError(f"model.width={width} and model.depth={depth} must both be >= 1.")
    layers: list[nn.Module] = []
    channels = in_channels
    for _ in range(depth):
        layers += [
            nn.Conv2d(channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        ]
        channels = width
    layers.append(nn.Conv2d(channels, num_classes, 1))
    return nn.Sequential(*layers)


def mlp(
    in_features: int | None = None,
    out_features: int | None = None,
    hidden: int = 64,
    depth: int = 2,
) -> nn.Module:
    """A multilayer perceptron for flat features (tabular data, regression): ``depth`` hidden
    Linear-ReLU layers of ``hidden`` units, then a linear head: ``(B, in_features)`` →
    ``(B, out_features)``; ``depth=0`` is a linear model. Inputs of more dimensions are
    flattened first."""
    if in_features is None or out_features is None:
        raise ConfigError(
            f"model=mlp needs the data's in_features and out_features (here {in_features} and "
            f"{out_features}): return them in the data factory's DataInfo, e.g. data=diabetes, "
            f"or set model.in_features and model.out_features."
        )
    if hidden < 1 or depth < 0:
        raise ConfigError(f"model.hidden={hidden} must be >= 1 and model.depth={depth} >= 0.")
    layers: list[nn.Module] = [nn.Flatten()]
    features = in_features
    for _ in range(depth):
        layers += [nn.Linear(features, hidden), nn.ReLU(inplace=True)]
        features = hidden
    layers.append(nn.Linear(features, out_features))
    return nn.Sequential(*layers)


class Projected(nn.Module):
    """An encoder and a projection head: ``(B, C, H, W)`` → ``(h, z)``, the representation
    ``(B, features)`` and its projection ``(B, projection)``; ``(B, V, C, H, W)`` (V views of
    each sample) → ``(B, V, features)`` and ``(B, V, projection)``."""

    def __init__(self, encoder: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.encoder, self.head = encoder, head

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lead = x.shape[:-3]  # (B,) or (B, V)
        h = self.encoder(x.reshape(-1, *x.shape[-3:]))
        z = self.head(h)
        return h.reshape(*lead, h.shape[-1]), z.reshape(*lead, z.shape[-1])


def contrastive(
    in_channels: int,
    image_size: int,
    features: int = 32,
    projection: int = 16,
    width: int = 16,
    depth: int = 2,
    norm: str = "none",
) -> nn.Module:
    """``task=contrastive``'s model: :func:`small_cnn`'s blocks as the encoder (its head gives
    ``features`` values, the representation), then a Linear-ReLU-Linear projection head to
    ``projection`` values, the space the loss contrasts in (:class:`Projected`). ``norm=none``
    by default: BatchNorm's per-rank statistics would make 2 ranks differ from 1 process, and
    GroupNorm collapses this small encoder at the default ``optim.lr=0.1``."""
    if features < 1 or projection < 1:
        raise ConfigError(
            f"model.features={features} and model.projection={projection} must both be >= 1."
        )
    encoder = small_cnn(features, in_channels, image_size, width=width, depth=depth, norm=norm)
    head = nn.Sequential(nn.Linear(features, features), nn.ReLU(), nn.Linear(features, projection))
    return Projected(encoder, head)


def resnet18(
    num_classes: int, in_channels: int, image_size: int, zero_init_residual: bool = False
) -> nn.Module:
    """torchvision's ResNet-18, with the stem adapted to the data.

    Small images (< 64 px, e.g. CIFAR's 32x32) get the usual CIFAR stem: a 3x3 stride-1 first
    convolution and no max-pool, so the feature maps do not collapse to 1x1 after the stem.
    """
    from torchvision.models import resnet18 as tv_resnet18

    model = tv_resnet18(num_classes=num_classes, zero_init_residual=zero_init_residual)
    if image_size < 64:
        model.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
    return model


class _Adapter(nn.Module):
    """Maps the data's channels to RGB and upsamples tiny images for stock torchvision models."""

    def __init__(self, in_channels: int, image_size: int, min_image_size: int) -> None:
        super().__init__()
        self.to_rgb = nn.Conv2d(in_channels, 3, 1) if in_channels != 3 else nn.Identity()
        self.size = max(image_size, min_image_size)
        self.resize = image_size < min_image_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.to_rgb(x)
        if self.resize:
            x = nn.functional.interpolate(x, size=self.size, mode="bilinear", align_corners=False)
        return x


def torchvision_model(
    num_classes: int,
    in_channels: int,
    image_size: int,
    name: str,
    min_image_size: int = 32,
    weights: str | None = None,
    weights_path: str | None = None,
) -> nn.Module:
    """Any torchvision classification model by name: randomly initialised, or from pretrained
    ``weights`` (an enum name of the model's weights, or DEFAULT; downloaded) or a local
    ``weights_path``. A classifier whose shape differs (another number of classes) starts fresh.
    """
    import torchvision

    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        raise ConfigError(
            f"model.name={name} is not a torchvision classification model; pick one of "
            f"torchvision.models.list_models(), e.g. resnet18, mobilenet_v3_small, efficientnet_b0."
        )
    net = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    if weights is not None and weights_path is not None:
        raise ConfigError(
            f"model.weights={weights} and model.weights_path={weights_path} both name weights; "
            f"keep one of them."
        )
    if weights is not None:
        load_matching(
            net, _hub_weights(name, weights), strict=True, source=f"model.weights={weights}"
        )
    if weights_path is not None:
        state = _local_weights(weights_path)
        load_matching(net, state, strict=True, source=f"model.weights_path={weights_path}")
    adapter = _Adapter(in_channels, image_size, min_image_size)
    return nn.Sequential(adapter, net)


def _hub_weights(name: str, weights: str) -> dict[str, torch.Tensor]:
    import torchvision

    enum = torchvision.models.get_model_weights(name)
    names = ["DEFAULT", *enum.__members__]
    if weights not in names:
        raise ConfigError(
            f"model.weights={weights} is not a weights name of {name}; use one of {names}, or "
            f"model.weights_path=<local .pth>."
        )
    chosen = enum[weights] if weights != "DEFAULT" else enum.DEFAULT
    try:
        return chosen.get_state_dict(progress=False)
    except Exception as exc:  # URLError, HTTPError, OSError... without network
        raise ConfigError(
            f"model.weights={weights} could not be downloaded from {chosen.url} "
            f"({type(exc).__name__}); download that file elsewhere and pass it as "
            f"model.weights_path=<local .pth> (with model.weights=null)."
        ) from None


def _local_weights(weights_path: str) -> dict[str, torch.Tensor]:
    path = Path(weights_path).expanduser()
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(
            f"model.weights_path={weights_path} cannot be read as a state_dict "
            f"({type(exc).__name__}); pass a .pth saved with torch.save(model.state_dict(), path)."
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(
            f"model.weights_path={weights_path} holds no state_dict of tensors; pass a .pth "
            f"saved with torch.save(model.state_dict(), path)."
        )
    return state


class LoadReport(NamedTuple):
    loaded: list[str]
    reinitialised: list[str]  # in both, shapes differ: kept the fresh initialisation
    missing: list[str]  # the model's, not in the weights
    unexpected: list[str]  # the weights', not in the model


def _names(keys: list[str]) -> str:
    more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
    return f"{keys[:4]}{more}"


def load_matching(
    module: nn.Module, state: dict[str, torch.Tensor], *, strict: bool, source: str, fix: str = ""
) -> LoadReport:
    """Load ``state`` into ``module`` by name. The rule for another number of classes (or any
    tensor whose shape differs): the model keeps its fresh, seeded initialisation for it.
    ``strict``: keys on one side only are refused; otherwise they are skipped and reported."""
    own = module.state_dict()
    reinit = [k for k in state if k in own and own[k].shape != state[k].shape]
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if strict and (missing or unexpected):
        raise ConfigError(
            f"{source} does not fit the model (missing keys {_names(missing)}, unexpected keys "
            f"{_names(unexpected)}); build the model these weights came from{fix}."
        )
    loaded = [k for k in state if k in own and k not in reinit]
    module.load_state_dict({k: state[k] for k in loaded}, strict=False)
    return LoadReport(loaded, reinit, missing, unexpected)


def describe_load(report: LoadReport) -> str:
    """One log line: what was loaded, what starts fresh, what was skipped."""
    parts = [f"{len(report.loaded)} tensors loaded"]
    if report.reinitialised:
        parts.append(f"re-initialised (shape differs) {_names(report.reinitialised)}")
    if report.missing:
        parts.append(f"missing (kept fresh) {_names(report.missing)}")
    if report.unexpected:
        parts.append(f"unexpected (skipped) {_names(report.unexpected)}")
    return "; ".join(parts)


def build_model(model_cfg: Any, info: DataInfo) -> nn.Module:
    """Instantiate the ``model`` group's factory, told the data's shapes: each field the data
    set (``DataInfo.given``) goes to the factory's argument of that name, unless the YAML sets
    it."""
    target = get_method(model_cfg["_target_"])
    params = inspect.signature(target).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    told = {
        k: v
        for k, v in info.given().items()
        if (takes_any or k in params) and model_cfg.get(k) is None
    }
    missing = [
        name
        for name, p in params.items()
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and name not in told
        and model_cfg.get(name) is None
    ]
    if missing:
        raise ConfigError(
            f"model._target_={model_cfg['_target_']} needs {', '.join(missing)}, which the data "
            f"does not give (it gives {', '.join(info.given()) or 'nothing'}); pick a model for "
            f"this data, or set model.{missing[0]}=<value>."
        )
    model = instantiate_clean(model_cfg, **told)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model._target_={model_cfg.get('_target_')} returned {type(model).__name__}; a "
            f"model factory must return a torch.nn.Module."
        )
    return model


def check_batch_statistics(model: nn.Module, sample: Callable[[], Any], last_batch: int) -> None:
    """Refuse, before training, a per-rank last batch of one sample that a layer normalising
    with batch statistics cannot train on (BatchNorm with one value per channel): probed with
    ``sample()``, a batch of one input, on a copy of the model."""
    if last_batch != 1:
        return
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return
    probe = copy.deepcopy(model).train()
    try:
        probe(sample())
    except ValueError as exc:  # "Expected more than 1 value per channel when training"
        raise ConfigError(
            f"each rank's last training batch holds one sample, which the model's BatchNorm "
            f"cannot normalise ({str(exc).splitlines()[0][:80]}); set "
            f"sampler.drop_last_batch=true, pick another batch_size, or use a norm layer "
            f"without batch statistics."
        ) from None


def convert_syncbn(model: nn.Module, device: torch.device) -> nn.Module:
    """Swap BatchNorm for synchronised BN before DDP wraps the model.

    Must happen before DDP: DDP registers the module's parameters and buffers once. torch's
    SyncBatchNorm only runs on CUDA, so CPU ranks get the template's equivalent.
    """
    from ddp_template.sync_batchnorm import convert_sync_batchnorm

    return convert_sync_batchnorm(model, device_type=device.type)


def weights_part(module: nn.Module) -> Guarded:
    """The model's weights as a checkpoint part; refuses another model's."""
    return Guarded(
        module,
        lambda torch_says: (
            f"it holds a different model ({torch_says}); resume with the model "
            f"config it was written with, or resume=never."
        ),
    )
