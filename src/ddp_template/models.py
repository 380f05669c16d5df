"""Model factories (the ``model`` config group) and SyncBN conversion.

The model contract: a ``model`` YAML's ``_target_`` names any callable that accepts the keyword
arguments ``num_classes``, ``in_channels`` and ``image_size`` (plus its own YAML keys) and
returns an ``nn.Module`` mapping a float batch ``(B, in_channels, image_size, image_size)`` to
logits ``(B, num_classes)``. The template passes those three from the data's ``DataInfo``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ddp_template.data.datasets import DataInfo
from ddp_template.errors import ConfigError, instantiate_clean

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
    num_classes: int, in_channels: int, image_size: int, name: str, min_image_size: int = 32
) -> nn.Module:
    """Any torchvision classification model by name, randomly initialised."""
    import torchvision

    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        raise ConfigError(
            f"model.name={name} is not a torchvision classification model; pick one of "
            f"torchvision.models.list_models(), e.g. resnet18, mobilenet_v3_small, efficientnet_b0."
        )
    net = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    adapter = _Adapter(in_channels, image_size, min_image_size)
    return nn.Sequential(adapter, net)


def build_model(model_cfg: Any, info: DataInfo) -> nn.Module:
    """Instantiate the ``model`` group's factory with the data's shape and class count."""
    model = instantiate_clean(
        model_cfg,
        num_classes=info.num_classes,
        in_channels=info.in_channels,
        image_size=info.image_size,
    )
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model._target_={model_cfg.get('_target_')} returned {type(model).__name__}; a "
            f"model factory must return a torch.nn.Module."
        )
    return model


def convert_syncbn(model: nn.Module, device: torch.device) -> nn.Module:
    """Swap BatchNorm for synchronised BN before DDP wraps the model.

    Must happen before DDP: DDP registers the module's parameters and buffers once. torch's
    SyncBatchNorm only runs on CUDA, so CPU ranks get the template's equivalent.
    """
    from ddp_template.sync_batchnorm import convert_sync_batchnorm

    return convert_sync_batchnorm(model, device_type=device.type)
