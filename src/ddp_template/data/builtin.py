"""The built-in data factories (the ``data`` group's options): digits, synthetic images,
CIFAR-10, MNIST and class-per-folder images, each returning ``Splits``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ddp_template.data.contract import DataInfo, IndexedTensors, Splits, WithIndex
from ddp_template.errors import ConfigError


def digits(test_fraction: float = 0.2, split_seed: int = 0) -> Splits:
    """scikit-learn's bundled 1,797 8x8 digits (offline).

    The split is deterministic: a permutation drawn with ``numpy.random.default_rng(split_seed)``;
    the first ``round(1797 * test_fraction)`` samples (359 by default) are the test set, the
    remaining 1,438 the training set. Pixels (0..16) are standardised with the training set's
    mean and standard deviation.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(
            f"data.test_fraction={test_fraction} must lie strictly between 0 and 1; try 0.2."
        )
    images, target = _digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(target, dtype=torch.long)
    order = torch.from_numpy(np.random.default_rng(split_seed).permutation(len(y)))
    n_test = round(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    info = DataInfo(num_classes=10, in_channels=1, image_size=8)
    return Splits(IndexedTensors(x[train], y[train]), IndexedTensors(x[test], y[test]), info)


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``load_digits()``'s images (1797, 8, 8) and targets, read from the CSV that scikit-learn
    ships, without importing scikit-learn: its import costs every rank about 2 s of CPU."""
    spec = importlib.util.find_spec("sklearn")
    csv = (
        Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if spec and spec.origin
        else None
    )
    if csv is None or not csv.is_file():  # other files: scikit-learn's own reader
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.images, bunch.target
    table = np.loadtxt(csv, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)


def diabetes(test_fraction: float = 0.2, split_seed: int = 0) -> Splits:
    """scikit-learn's bundled diabetes regression data (offline): 442 samples of 10 features,
    one target (disease progression after a year).

    The split is drawn as ``digits``' is: the first ``round(442 * test_fraction)`` of a
    permutation seeded with ``split_seed`` (88 by default) are the test set, the remaining 354
    the training set. Features and target are standardised with the training set's mean and
    standard deviation (so the MSE of predicting the mean is about 1). Targets are float32,
    shaped ``(N, 1)`` like the model's output.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(
            f"data.test_fraction={test_fraction} must lie strictly between 0 and 1; try 0.2."
        )
    features, target = _diabetes_arrays()
    x = torch.tensor(features, dtype=torch.float32)
    y = torch.tensor(target, dtype=torch.float32).unsqueeze(1)
    order = torch.from_numpy(np.random.default_rng(split_seed).permutation(len(y)))
    n_test = round(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    x = (x - x[train].mean(dim=0)) / x[train].std(dim=0)
    y = (y - y[train].mean()) / y[train].std()
    info = DataInfo(in_features=x.shape[1], out_features=1)
    return Splits(IndexedTensors(x[train], y[train]), IndexedTensors(x[test], y[test]), info)


def _diabetes_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``load_diabetes(scaled=False)``'s features (442, 10) and target, read from the files
    scikit-learn ships (without importing scikit-learn, as ``_digits_arrays``)."""
    spec = importlib.util.find_spec("sklearn")
    folder = Path(spec.origin).parent / "datasets" / "data" if spec and spec.origin else None
    names = ("diabetes_data_raw.csv.gz", "diabetes_target.csv.gz")
    files = [folder / name for name in names] if folder else []
    if not files or not all(f.is_file() for f in files):  # other files: scikit-learn's reader
        from sklearn.datasets import load_diabetes

        return load_diabetes(return_X_y=True, scaled=False)
    return np.loadtxt(files[0]), np.loadtxt(files[1])


class SyntheticImages(Dataset):
    """Deterministic, learnable images of any size N, generated on the fly from the index.

    Sample ``i`` has class ``i * 7919 % num_classes`` mixed with a keyed hash, and input
    ``prototype[class] + noise * gaussian(seed, split, i)``. Nothing is stored per sample, so N
    can be 1e8 or more; the same index always gives the same sample on every rank.
    """

    def __init__(
        self,
        *,
        size: int,
        split: int,
        channels: int,
        image_size: int,
        num_classes: int,
        noise: float,
        seed: int,
    ) -> None:
        self.size, self.split, self.noise, self.seed = size, split, noise, seed
        self.num_classes = num_classes
        gen = torch.Generator().manual_seed(seed)
        self.prototypes = torch.randn(num_classes, channels, image_size, image_size, generator=gen)

    def __len__(self) -> int:
        return self.size

    def label(self, i: int) -> int:
        h = (i * 0x9E3779B97F4A7C15 + self.seed * 0xBF58476D1CE4E5B9 + self.split) & (2**64 - 1)
        return (h >> 33) % self.num_classes

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        y = self.label(i)
        gen = torch.Generator().manual_seed((self.seed * 2 + self.split) * 2**40 + i)
        shape = self.prototypes.shape[1:]
        x = self.prototypes[y] + self.noise * torch.randn(shape, generator=gen)
        return x, y, i


def synthetic(
    *,
    size: int = 4096,
    test_size: int = 1024,
    channels: int = 3,
    image_size: int = 32,
    num_classes: int = 10,
    noise: float = 1.0,
    seed: int = 0,
) -> Splits:
    """Synthetic classification data; training and evaluation use disjoint sample streams."""
    for key, value in (
        ("size", size),
        ("test_size", test_size),
        ("num_classes", num_classes),
        ("channels", channels),
        ("image_size", image_size),
    ):
        if value < 1:
            raise ConfigError(f"data.{key}={value} must be at least 1.")
    common: dict[str, Any] = dict(
        channels=channels, image_size=image_size, num_classes=num_classes, noise=noise, seed=seed
    )
    train = SyntheticImages(size=size, split=0, **common)
    info = DataInfo(num_classes=num_classes, in_channels=channels, image_size=image_size)
    return Splits(train, SyntheticImages(size=test_size, split=1, **common), info)


def _torchvision_splits(
    cls_name: str,
    root: str,
    download: bool,
    info: DataInfo,
    mean: tuple[float, ...],
    std: tuple[float, ...],
) -> Splits:
    import torchvision
    from torchvision import transforms

    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    cls = getattr(torchvision.datasets, cls_name)
    try:
        train = cls(root, train=True, download=download, transform=tf)
        test = cls(root, train=False, download=download, transform=tf)
    except Exception as exc:  # torchvision raises RuntimeError, URLError, OSError...
        how = "downloading it failed" if download else "data.download=false"
        raise ConfigError(
            f"data.root={root} holds no {cls_name} and {how} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:120]}); copy the dataset into data.root, or run with "
            f"network access and data.download=true."
        ) from exc
    return Splits(WithIndex(train), WithIndex(test), info)


def cifar10(root: str = "data", download: bool = True) -> Splits:
    """CIFAR-10 via torchvision (50k/10k, 3x32x32, 10 classes)."""
    info = DataInfo(num_classes=10, in_channels=3, image_size=32)
    return _torchvision_splits(
        "CIFAR10", root, download, info, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    )


def mnist(root: str = "data", download: bool = True) -> Splits:
    """MNIST via torchvision (60k/10k, 1x28x28, 10 classes)."""
    info = DataInfo(num_classes=10, in_channels=1, image_size=28)
    return _torchvision_splits("MNIST", root, download, info, (0.1307,), (0.3081,))


def imagefolder(path: str, image_size: int = 64) -> Splits:
    """Class-per-folder images: ``<path>/train/<class>/*.png`` and ``<path>/val/<class>/*``."""
    from torchvision import transforms

    root = Path(path).expanduser()
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise ConfigError(
                f"data.path={path} has no '{split}/' folder; point data.path at a folder holding "
                f"train/<class>/ and val/<class>/ image folders."
            )
    tf = transforms.Compose(
        [transforms.Resize(image_size), transforms.CenterCrop(image_size), transforms.ToTensor()]
    )
    train, val = (_image_folder(root / split, tf, path) for split in ("train", "val"))
    if train.classes != val.classes:
        raise ConfigError(
            f"data.path={path}: train/ classes {train.classes} differ from val/ classes "
            f"{val.classes}; give both splits the same class folders."
        )
    channels = _first_image(train, path).shape[0]
    _first_image(val, path)
    info = DataInfo(num_classes=len(train.classes), in_channels=channels, image_size=image_size)
    return Splits(WithIndex(train), WithIndex(val), info)


def _image_folder(folder: Path, tf: Any, path: str) -> Any:
    from torchvision import datasets

    try:
        return datasets.ImageFolder(folder, transform=tf)
    except (FileNotFoundError, OSError) as exc:  # no class folders, or none holding an image
        raise ConfigError(
            f"data.path={path}: {folder.name}/ holds no class folder with images "
            f"({str(exc).splitlines()[0][:120]}); put each class's images in "
            f"{folder.name}/<class>/ (.png, .jpg, ...)."
        ) from None


def _first_image(folder: Any, path: str) -> torch.Tensor:
    """Open one image of a split now: an unreadable file fails here, not mid-epoch."""
    file = folder.samples[0][0]
    try:
        return folder[0][0]
    except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, ...
        raise ConfigError(
            f"data.path={path}: {file} cannot be read as an image ({type(exc).__name__}); "
            f"replace or remove the file."
        ) from None


def shapes(
    size: int = 512,
    test_size: int = 128,
    image_size: int = 16,
    num_classes: int = 3,
    noise: float = 0.5,
    seed: int = 0,
) -> Splits:
    """Synthetic segmentation (offline, deterministic): 1-channel images holding 1 to 3 filled
    rectangles or discs, each of a class drawn from 1..num_classes-1 and written into a per-pixel
    int64 mask (0 is the background, later shapes cover earlier ones). A pixel of class ``k`` has
    the value ``levels[k] + noise * gaussian``, levels evenly spaced in [-1, 1]: learnable, and
    a network does better by looking at the pixel's neighbours. The test images come from the
    same generator after the training ones."""
    for key, value, least in (
        ("size", size, 1),
        ("test_size", test_size, 1),
        ("image_size", image_size, 4),
        ("num_classes", num_classes, 2),
    ):
        if value < least:
            raise ConfigError(f"data.{key}={value} must be at least {least}.")
    gen = torch.Generator().manual_seed(seed)
    n, h = size + test_size, image_size
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(h), indexing="ij")
    masks = torch.zeros(n, h, h, dtype=torch.int64)

    def draw(high: int, count: int = 1) -> list[int]:
        return torch.randint(0, high, (count,), generator=gen).tolist()

    for mask in masks:
        for _ in range(1 + draw(3)[0]):
            cls, disc, r0, c0, a, b = draw(num_classes - 1)[0] + 1, *draw(2), *draw(h, 4)
            if disc:
                radius = 1 + (a % max(h // 4, 1))
                inside = (rows - r0) ** 2 + (cols - c0) ** 2 <= radius**2
            else:
                inside = (rows >= r0) & (rows <= r0 + a // 2) & (cols >= c0) & (cols <= c0 + b // 2)
            mask[inside] = cls
    levels = torch.linspace(-1.0, 1.0, num_classes)
    x = (levels[masks] + noise * torch.randn(n, h, h, generator=gen)).unsqueeze(1)
    info = DataInfo(num_classes=num_classes, in_channels=1, image_size=h)
    train = IndexedTensors(x[:size], masks[:size])
    return Splits(train, IndexedTensors(x[size:], masks[size:]), info)
