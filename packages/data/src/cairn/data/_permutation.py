"""A vectorised, stateless pseudo-random permutation of ``range(n)``.

``permute(indices, n, seed, epoch)`` maps each index to its image under a bijection of
``[0, n)`` chosen by ``(seed, epoch)``. It is a Feistel network on the smallest number
of bits covering ``n`` (so the cipher's domain is below ``2 n``), with
cycle walking: an image that falls outside ``[0, n)`` is encrypted again until it lands
inside, which keeps the map a bijection of ``[0, n)``. Nothing is stored per index (O(1)
memory), and a whole array of indices is computed with NumPy ``uint64`` arithmetic.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["permute", "mix_seed", "splitmix64"]

_MASK64 = (1 << 64) - 1
_ROUNDS = 4
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_S29 = np.uint64(29)


def splitmix64(x: int) -> int:
    """One step of the SplitMix64 generator on a Python int (mod 2**64)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*parts: int) -> int:
    """Hash a tuple of integers (any sign or size) into one 64-bit key."""
    h = 0x6A09E667F3BCC908
    for p in parts:
        p = int(p)
        # Fold arbitrarily large / negative ints into 64-bit words.
        words = [p & _MASK64, (p >> 64) & _MASK64 if p.bit_length() > 63 else (0 if p >= 0 else 1)]
        for w in words:
            h = splitmix64(h ^ w)
    return h


@functools.lru_cache(maxsize=256)
def _round_keys(seed: int, epoch: int) -> tuple[tuple[np.uint64, np.uint64], ...]:
    k = mix_seed(seed, epoch)
    keys = []
    for _ in range(_ROUNDS):
        k = splitmix64(k)
        k2 = splitmix64(k ^ 0x5851F42D4C957F2D)
        keys.append((np.uint64(k), np.uint64(k2 | 1)))
    return tuple(keys)


def _encrypt(x: np.ndarray, bits: int, keys: tuple) -> np.ndarray:
    """An (unbalanced when ``bits`` is odd) Feistel network on ``bits``-bit integers.

    Each round splits ``x`` into a left part of ``wl`` bits and a right part of ``wr``
    bits and maps ``(L, R) -> (R, L xor F(R))``; the widths swap every round, so every
    round (and thus the whole network) is a bijection of ``[0, 2**bits)``.
    """
    wl, wr = bits // 2, bits - bits // 2
    for k1, k2 in keys:
        left = x >> np.uint64(wr)
        right = x & np.uint64((1 << wr) - 1)
        h = (right + k1) * _M1
        h ^= h >> _S29
        h *= k2
        f = h >> np.uint64(64 - wl)
        x = (right << np.uint64(wl)) | (left ^ f)
        wl, wr = wr, wl
    return x


def permute(indices: np.ndarray, n: int, seed: int, epoch: int = 0) -> np.ndarray:
    """Images of ``indices`` (int array, values in ``[0, n)``) under the permutation.

    >>> import numpy as np
    >>> p = permute(np.arange(10), 10, seed=0)
    >>> sorted(p.tolist()) == list(range(10))
    True
    """
    idx = np.asarray(indices, dtype=np.int64)
    if n <= 1 or idx.size == 0:
        return idx.copy()
    bits = max(2, int(n - 1).bit_length())
    keys = _round_keys(int(seed) & _MASK64, int(epoch) & _MASK64)
    limit = np.uint64(n)
    y = _encrypt(idx.astype(np.uint64), bits, keys)
    sel = np.flatnonzero(y >= limit)
    while sel.size:
        z = _encrypt(y[sel], bits, keys)
        y[sel] = z
        sel = sel[z >= limit]
    return y.astype(np.int64)
