"""``gated_linear_unit``: ``activation(x @ w[:, 0]) * (x @ w[:, 1])`` fused.

Tokamax's name, arguments and weights layout (``[k, 2, n]``). Implementations under op
``"gated_linear_unit"``: ``xla`` (one dot for both projections), ``pallas_triton`` (a
tiled kernel that reads ``x`` once for both projections and applies the gate before the
store) and ``pallas_mosaic_gpu`` (the same with two ``wgmma`` accumulators). A
:class:`cairn.core_array.QArray` ``weights`` with a per-output-channel scale runs the
integer values through one dot and scales the projections before the gate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn.core_array import QArray
from cairn.kernels._glu.xla import apply, glu_xla
from cairn.kernels._quantized.common import split_scale
from cairn.kernels._registry import (
    call,
    register_builtin,
)

__all__ = ["gated_linear_unit"]

OP = "gated_linear_unit"


def _bucket(x: Any, weights: Any, **_: Any) -> tuple[Any, ...]:
    return (1 << max(x.shape[0] - 1, 0).bit_length(), weights.shape[0], weights.shape[2], jnp.dtype(x.dtype).name)


# xla first on a GPU too: its one [k, 2n] dot runs at the plain composition's speed
# (0.93x forward, 0.97x with the backward on an H200 at bf16 x[8192,4096] w[4096,2,14336]),
# where the Triton and Mosaic forwards measured 0.58x and 0.45x (benchmarks/kernels_gpu.py)
register_builtin(
    OP, bucket=_bucket, preference=("xla", "pallas_mosaic_gpu", "pallas_triton"), xla=glu_xla,
    gpu={"pallas_triton": "cairn.kernels._glu.pallas_triton", "pallas_mosaic_gpu": "cairn.kernels._glu.pallas_mosaic"},
)


def _quantized(x2, weights: QArray, activation, precision, dtype):
    k, _, n = weights.shape
    values, post = split_scale(weights, contracting=(0,))
    h = jnp.dot(x2, values.reshape(k, 2 * n).astype(x2.dtype), precision=precision, preferred_element_type=jnp.float32)
    if post is not None:
        h = h * jnp.broadcast_to(post, (1, 2, n)).reshape(1, 2 * n)
    return apply(h, activation, n).astype(dtype)


def gated_linear_unit(
    x: jax.Array,
    weights: jax.Array | QArray,
    *,
    activation: Callable[[jax.Array], jax.Array] | None = None,
    precision: Any = None,
    implementation: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """Gated linear unit: ``activation(x @ weights[:, 0]) * (x @ weights[:, 1])``.

    SwiGLU with ``activation=jax.nn.swish``, GEGLU with ``jax.nn.gelu``, GLU with
    ``jax.nn.sigmoid``; no activation is the bilinear unit. Products accumulate in float32.

    Args:
      x: ``[..., k]``.
      weights: ``[k, 2, n]`` (Tokamax's layout: value then gate projection), or a
        ``QArray`` of it.
      activation: an elementwise function, or ``None``.
      precision: ``jax.lax`` precision of the dots.
      implementation: ``"xla"``, ``"pallas_triton"``, ``"pallas_mosaic_gpu"``, a sequence,
        or ``None``.

    Returns:
      ``[..., n]`` in ``x``'s dtype.

    Raises:
      ValueError: ``weights`` not ``[k, 2, n]`` with ``x``'s ``k``, ``x`` and ``weights``
        dtypes differ, unknown implementation, a config that does not fit.

    >>> import jax.numpy as jnp
    >>> w = jnp.stack([jnp.eye(2), 2 * jnp.eye(2)], axis=1)  # [2, 2, 2]
    >>> gated_linear_unit(jnp.array([[1.0, 2.0]]), w).tolist()
    [[2.0, 8.0]]
    """
    xs, ws = tuple(np.shape(x)), tuple(weights.shape)
    if len(xs) < 1:
        raise ValueError("x must have at least one axis (the contracted k)")
    if len(ws) != 3 or ws[1] != 2 or ws[0] != xs[-1]:
        raise ValueError(f"weights must be [k={xs[-1]}, 2, n] (value and gate projections), got shape {ws}")
    x2 = jnp.asarray(x).reshape(-1, xs[-1])
    if isinstance(weights, QArray):
        out = _quantized(x2, weights, activation, precision, x2.dtype)
    else:
        if jnp.dtype(x2.dtype) != jnp.dtype(weights.dtype):
            raise ValueError(
                f"x and weights must have the same dtype, got {jnp.dtype(x2.dtype).name} and "
                f"{jnp.dtype(weights.dtype).name}"
            )
        out = call(OP, x2, weights, implementation=implementation, activation=activation, precision=precision)
    return out.reshape(*xs[:-1], ws[2])
