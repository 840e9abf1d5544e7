"""Helpers shared by the cairn.nn layer tests (float64 references, inputs, tolerances)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

DTYPES = [jnp.float32, jnp.bfloat16]


def tolerances(f32: float, bf16: float) -> dict:
    """``assert_allclose`` keyword arguments per dtype: rtol = atol = the given bound."""
    return {jnp.float32: dict(rtol=f32, atol=f32), jnp.bfloat16: dict(rtol=bf16, atol=bf16)}


def f64(x):
    """``x`` (any dtype, bfloat16 included) as a float64 NumPy array."""
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def randn(shape, dtype=jnp.float32, seed=0, scale=1.0, shift=0.0):
    """Standard normal draws (times ``scale`` plus ``shift``) as a ``dtype`` array.

    NumPy draws: no per-shape XLA compile of the random generator.
    """
    x = np.random.default_rng(seed).standard_normal(shape)
    if scale != 1.0 or shift != 0.0:
        x = x * scale + shift
    return jnp.asarray(x, dtype)


def same_pads(sizes, windows, strides) -> list[tuple[int, int]]:
    """'SAME' padding per spatial axis: output ``ceil(n / s)``, the odd pad at the end."""
    pads = []
    for n, k, s in zip(sizes, windows, strides):
        out = -(-n // s)
        total = max((out - 1) * s + k - n, 0)
        pads.append((total // 2, total - total // 2))
    return pads
