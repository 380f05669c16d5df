"""Your own arrays as a dataset: the worked example of the template's dataset contract.

The contract every ``data`` option keeps (and that this module shows end to end):

1. **Items carry their index.** ``dataset[i]`` returns ``(x, y, i)``: a float tensor
   ``(C, H, W)``, an integer label and ``i`` itself. The loader batches the indices with the
   inputs, and the training loop counts, fingerprints and reports them per rank
   (``data/samples``, ``data/fingerprint``, ``data/first_index``… in ``rank<r>/metrics.jsonl``
   and W&B). That is how a rank's log says *which* samples it saw — the number that exposes
   overlapping shares or a forgotten ``set_epoch`` — whatever sampler or worker count ran.
   :class:`~ddp_template.data.contract.IndexedTensors` does this for in-memory tensors;
   :class:`~ddp_template.data.contract.WithIndex` wraps any ``(x, y)`` dataset.
2. **Splits are given, not drawn.** A data factory (the YAML's ``_target_``) returns
   ``Splits(train, test, info)``. The ShareSampler deals ``train`` across ranks; ``test`` is
   split exactly (no padding) for evaluation. ``info = DataInfo(num_classes, in_channels,
   image_size)`` is what the model factory receives, so the model fits the data.
3. **Bad input is a ConfigError** naming the key (``data.path``), the bad value and the fix.

Worked example — 8x8 one-channel images stored as flat CSV rows::

    mkdir -p /tmp/toy && python - <<'EOF'
    import numpy as np
    rng = np.random.default_rng(0)
    for split, n in (("train", 200), ("test", 50)):
        y = rng.integers(0, 3, n)
        x = rng.normal(size=(n, 64)) + y[:, None]          # 64 = 1 x 8 x 8 features
        np.savetxt(f"/tmp/toy/{split}.csv", np.column_stack([y, x]), delimiter=",")
    EOF
    python train.py data=array data.path=/tmp/toy data.image_shape=[1,8,8]

Accepted formats for ``data.path``:

* ``<file>.npz`` with arrays ``x_train``, ``y_train``, ``x_test``, ``y_test``; ``x_*`` may be
  flat ``(N, F)``, ``(N, H, W)`` or ``(N, C, H, W)``.
* a folder with ``train.csv`` and ``test.csv``: one sample per row, the integer label in the
  first column and the features after it (an optional header row is skipped).

Shapes: with ``image_shape=[C, H, W]`` (H == W, the model contract is square images) each
sample's features are reshaped to it, and their count must be ``C*H*W``. Without it, 4-D arrays
are used as they are, 3-D arrays get one channel, and flat features become an ``(F, 1, 1)``
image — F channels of one pixel — which every built-in model accepts (small_cnn then acts as
an MLP). Features are used as given: standardise them beforehand if their scales differ.
``num_classes`` is the largest label in either split plus one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ddp_template.data.contract import DataInfo, IndexedTensors, Splits
from ddp_template.errors import ConfigError

NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
_HELP = (
    "point data.path at a .npz with x_train, y_train, x_test, y_test, or at a folder "
    "holding train.csv and test.csv (integer label first, then the features)"
)


def array_dataset(path: str, image_shape: list[int] | None = None) -> Splits:
    """Load a .npz file or a train.csv/test.csv folder into indexed tensor splits."""
    root = Path(path).expanduser()
    if root.is_dir():
        arrays = {
            **_read_csv(root / "train.csv", path, "train"),
            **_read_csv(root / "test.csv", path, "test"),
        }
    elif root.is_file() and root.suffix == ".npz":
        arrays = _read_npz(root, path)
    else:
        raise ConfigError(f"data.path={path} is neither a .npz file nor a folder; {_HELP}.")
    shape = _check_image_shape(image_shape)
    xs = {s: _to_images(arrays[f"x_{s}"], shape, path, s) for s in ("train", "test")}
    ys = {s: _to_labels(arrays[f"y_{s}"], len(xs[s]), path, s) for s in ("train", "test")}
    if xs["train"].shape[1:] != xs["test"].shape[1:]:
        raise ConfigError(
            f"data.path={path}: train samples have shape {tuple(xs['train'].shape[1:])} but "
            f"test samples {tuple(xs['test'].shape[1:])}; give both splits the same features."
        )
    channels, height, _ = xs["train"].shape[1:]
    labels = torch.cat([ys["train"], ys["test"]])
    num_classes = int(labels.max()) + 1 if labels.numel() else 1  # empty: build_splits refuses
    info = DataInfo(num_classes=num_classes, in_channels=channels, image_size=height)
    return Splits(
        IndexedTensors(xs["train"], ys["train"]), IndexedTensors(xs["test"], ys["test"]), info
    )


def _read_npz(file: Path, path: str) -> dict[str, np.ndarray]:
    try:
        with np.load(file, allow_pickle=False) as npz:
            names, arrays = list(npz.files), {k: npz[k] for k in NPZ_KEYS if k in npz.files}
    except (OSError, ValueError) as exc:  # not a zip, or object arrays that need pickle
        raise ConfigError(f"data.path={path} is not a readable .npz ({exc}); {_HELP}.") from exc
    missing = [k for k in NPZ_KEYS if k not in arrays]
    if missing:
        raise ConfigError(
            f"data.path={path} lacks the arrays {missing} (it has {names}); save it with "
            f"np.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)."
        )
    return arrays


def _read_csv(file: Path, path: str, split: str) -> dict[str, np.ndarray]:
    if not file.is_file():
        raise ConfigError(f"data.path={path} has no {file.name}; {_HELP}.")
    try:
        table = np.loadtxt(file, delimiter=",", ndmin=2, dtype=np.float64)
    except ValueError:  # a header row is the one non-numeric line allowed
        try:
            table = np.loadtxt(file, delimiter=",", ndmin=2, dtype=np.float64, skiprows=1)
        except ValueError as exc:
            raise ConfigError(
                f"data.path={path}: {file.name} is not a numeric CSV ({exc}); {_HELP}."
            ) from exc
    if table.shape[1] < 2 or len(table) == 0:
        raise ConfigError(
            f"data.path={path}: {file.name} needs rows of a label and at least one feature; "
            f"{_HELP}."
        )
    return {f"y_{split}": table[:, 0], f"x_{split}": table[:, 1:]}


def _check_image_shape(image_shape: list[int] | None) -> tuple[int, int, int] | None:
    if image_shape is None:
        return None
    shape = tuple(int(v) for v in image_shape)
    if len(shape) != 3 or min(shape) < 1 or shape[1] != shape[2]:
        raise ConfigError(
            f"data.image_shape={list(shape)} must be [C, H, W] with H == W (the model contract "
            f"is square images), e.g. data.image_shape=[1,8,8]; or null for flat features."
        )
    return shape


def _to_images(
    x: np.ndarray, shape: tuple[int, int, int] | None, path: str, split: str
) -> torch.Tensor:
    """Reshape one split's features to (N, C, H, W) floats; see the module docstring."""
    if x.ndim < 2 or not np.issubdtype(x.dtype, np.number):
        raise ConfigError(
            f"data.path={path}: x_{split} has shape {x.shape} and dtype {x.dtype}; it needs "
            f"numeric samples along the first axis, e.g. (N, F) or (N, C, H, W)."
        )
    n, features = len(x), int(np.prod(x.shape[1:]))
    if shape is not None:
        if features != int(np.prod(shape)):
            raise ConfigError(
                f"data.path={path}: {split} samples have {features} features but "
                f"data.image_shape={list(shape)} needs {int(np.prod(shape))}; fix "
                f"data.image_shape or set it to null."
            )
        x = x.reshape(n, *shape)
    elif x.ndim == 2:
        x = x.reshape(n, features, 1, 1)
    elif x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4 or x.shape[2] != x.shape[3]:
        raise ConfigError(
            f"data.path={path}: x_{split} samples have shape {x.shape[1:]}; set "
            f"data.image_shape=[C,H,W] with H == W to reshape them into square images."
        )
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def _to_labels(y: np.ndarray, n: int, path: str, split: str) -> torch.Tensor:
    y = np.asarray(y).reshape(-1)
    if len(y) != n:
        raise ConfigError(
            f"data.path={path}: {split} has {n} samples but {len(y)} labels; give every sample "
            f"one label."
        )
    numeric = np.issubdtype(y.dtype, np.number) and not np.issubdtype(y.dtype, np.complexfloating)
    if not numeric or not np.all(np.isfinite(y)) or np.any(y != np.round(y)) or np.any(y < 0):
        bad = y[:5].tolist()
        raise ConfigError(
            f"data.path={path}: {split} labels must be integers >= 0 (class ids), got "
            f"{y.dtype} values like {bad}; map class names to 0..K-1 first."
        )
    return torch.from_numpy(y.astype(np.int64))
