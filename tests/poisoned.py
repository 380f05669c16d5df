"""A data factory for the spike tests: ``data=diabetes`` with one training input poisoned."""

from ddp_template.data import builtin
from ddp_template.data.contract import Splits

INDEX, SCALE = 100, 1000.0  # training sample INDEX's features are multiplied by SCALE


def diabetes(test_fraction: float = 0.2, split_seed: int = 0) -> Splits:
    splits = builtin.diabetes(test_fraction, split_seed)
    splits.train.x[INDEX] *= SCALE
    return splits


# ``data=digits`` (the default job's) with training sample DIGIT's pixels x DIGIT_SCALE and its
# label changed: under BatchNorm its loss barely shows, its input does.
DIGIT, DIGIT_SCALE = 700, 100.0


def digits(test_fraction: float = 0.2, split_seed: int = 0) -> Splits:
    splits = builtin.digits(test_fraction, split_seed)
    splits.train.x[DIGIT] *= DIGIT_SCALE
    splits.train.y[DIGIT] = (splits.train.y[DIGIT] + 1) % 10
    return splits
