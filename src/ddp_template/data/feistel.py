"""A keyed Feistel permutation of range(n): shuffles any N in O(1) memory, index by index."""

from __future__ import annotations

import numpy as np

from ddp_template.data.splitmix import splitmix64

_M64 = (1 << 64) - 1
_FEISTEL_ROUNDS = 8
_C1 = np.uint64(0x9E3779B97F4A7C15)
_C2 = np.uint64(0xBF58476D1CE4E5B9)
_C3 = np.uint64(0x94D049BB133111EB)


def _mix(x: int) -> int:
    """SplitMix64 of a Python int: derives independent-looking round keys from (seed, epoch)."""
    return int(splitmix64(np.uint64(x & _M64)))


class FeistelPermutation:
    """A keyed bijection of range(n) evaluated pointwise: O(1) memory, vectorised over arrays.

    An unbalanced Feistel network permutes [0, 2**b) with 2**b the next power of two >= n;
    cycle-walking (re-encrypting values that land >= n) restricts it to a bijection of [0, n).
    Because 2**b < 2n, a value needs fewer than two encryptions on average.
    """

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        if n < 1:
            raise ValueError(f"FeistelPermutation needs n >= 1, got n={n}.")
        if n > 2**63:
            raise ValueError(f"FeistelPermutation supports n <= 2**63 (int64 results), got n={n}.")
        self.n = n
        bits = (n - 1).bit_length()
        self._left_bits = bits // 2
        self._right_bits = bits - self._left_bits
        base = _mix(_mix(seed & _M64) ^ (epoch & _M64))
        self._keys = [np.uint64(_mix((base + i) & _M64)) for i in range(_FEISTEL_ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        """One pass over [0, 2**b); half widths swap each round, restored after an even count."""
        right_bits = self._right_bits
        left = x >> np.uint64(right_bits)
        right = x & np.uint64((1 << right_bits) - 1)
        widths = (self._left_bits, right_bits)
        for key in self._keys:
            f = right * _C1
            f += key
            f ^= f >> np.uint64(31)
            f *= _C2
            f ^= f >> np.uint64(29)
            f *= _C3
            f ^= f >> np.uint64(32)
            f &= np.uint64((1 << widths[0]) - 1)
            f ^= left
            left, right = right, f
            widths = (widths[1], widths[0])
        return (left << np.uint64(right_bits)) | right

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Permuted values of x (integers in [0, n)), as int64."""
        y = self._encrypt(np.asarray(x, dtype=np.uint64))
        outside = np.flatnonzero(y >= np.uint64(self.n))
        while outside.size:
            walked = self._encrypt(y[outside])
            y[outside] = walked
            outside = outside[walked >= np.uint64(self.n)]
        return y.astype(np.int64)
