"""A keyed Feistel permutation of range(n): shuffles any N in O(1) memory, index by index."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ddp_template.splitmix import splitmix64

_M64 = (1 << 64) - 1
_FEISTEL_ROUNDS = 8
_C1 = np.uint64(0x9E3779B97F4A7C15)
_C2 = np.uint64(0xBF58476D1CE4E5B9)
_C3 = np.uint64(0x94D049BB133111EB)


def _mix(x: int) -> int:
    """SplitMix64 of a Python int: derives independent-looking round keys from (seed, epoch)."""
    return int(splitmix64(np.uint64(x & _M64)))


def _round(half: np.ndarray, key: np.ndarray, bits: int) -> np.ndarray:
    """The round function: a SplitMix-style hash of one half, cut to ``bits`` bits.

    Arrays only (never numpy scalars): uint64 arithmetic on arrays wraps silently, as intended.
    """
    f = half * _C1
    f += key
    f ^= f >> np.uint64(31)
    f *= _C2
    f ^= f >> np.uint64(29)
    f *= _C3
    f ^= f >> np.uint64(32)
    f &= np.uint64((1 << bits) - 1)
    return f


class FeistelPermutation:
    """A keyed bijection of range(n) evaluated pointwise: O(1) memory, vectorised over arrays.

    An unbalanced Feistel network permutes [0, 2**b) with 2**b the next power of two >= n;
    cycle-walking (re-encrypting values that land >= n) restricts it to a bijection of [0, n).
    Because 2**b < 2n, a value needs fewer than two encryptions on average. ``inverse`` walks
    back with the decryption, so finding where an index lands costs as little as the forward map.
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
            left, right = right, _round(right, key, widths[0]) ^ left
            widths = (widths[1], widths[0])
        return (left << np.uint64(right_bits)) | right

    def _decrypt(self, y: np.ndarray) -> np.ndarray:
        """The inverse of ``_encrypt``: the rounds undone in reverse order."""
        right_bits = self._right_bits
        left = y >> np.uint64(right_bits)
        right = y & np.uint64((1 << right_bits) - 1)
        widths = (self._left_bits, right_bits)  # (left, right) after an even number of rounds
        for key in reversed(self._keys):
            # Round: (l, r) -> (r, F(r) ^ l), where F's output has l's width (now ``widths[1]``).
            left, right = right ^ _round(left, key, widths[1]), left
            widths = (widths[1], widths[0])
        return (left << np.uint64(right_bits)) | right

    def _walk(self, x: np.ndarray, step: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Apply ``step`` until every value lies in [0, n) (cycle-walking); any shape, int64."""
        values = np.asarray(x)
        if values.size and (values.min() < 0 or values.max() >= self.n):
            raise IndexError(f"FeistelPermutation of n={self.n} takes values in [0, {self.n}).")
        flat = values.astype(np.uint64).reshape(-1)
        y = step(flat)
        outside = np.flatnonzero(y >= np.uint64(self.n))
        while outside.size:
            walked = step(y[outside])
            y[outside] = walked
            outside = outside[walked >= np.uint64(self.n)]
        return y.astype(np.int64).reshape(values.shape)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Permuted values of x (integers in [0, n)), as int64 of x's shape (0-d for a scalar)."""
        return self._walk(x, self._encrypt)

    def inverse(self, y: np.ndarray) -> np.ndarray:
        """The x with ``self(x) == y``, as int64 of y's shape."""
        return self._walk(y, self._decrypt)
