"""``layer_norm`` and ``rms_norm``: fused normalisation with a fused backward.

Tokamax's ``layer_norm`` arguments (``rms_norm`` is ``layer_norm`` with
``subtract_mean=False`` and no offset). Implementations under op ``"layer_norm"``: ``xla``
(one fused forward saving only per-row mean and rstd, a one-pass ``custom_vjp`` backward)
and ``pallas_triton`` (forward and backward kernels). No Mosaic GPU kernel: a row-wise
normalisation is bandwidth-bound and has no matmul for ``wgmma`` to speed up, so the
Triton kernel already reads each element once (Tokamax ships none either).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn.kernels._norms.xla import norm_xla
from cairn.kernels._registry import (
    call,
    register_builtin,
)

__all__ = ["layer_norm", "rms_norm"]

OP = "layer_norm"


def _bucket(x: Any, *_: Any, subtract_mean: bool = True, **__: Any) -> tuple[Any, ...]:
    return (1 << max(x.shape[0] - 1, 0).bit_length(), x.shape[1], jnp.dtype(x.dtype).name, bool(subtract_mean))


# xla first on a GPU too: XLA fuses a norm into one pass; the Triton kernel measured 4-7x
# slower at bf16 [16384, 4096] on an H200 (benchmarks/kernels_gpu.py)
register_builtin(
    OP, bucket=_bucket, preference=("xla", "pallas_triton"), xla=norm_xla,
    gpu={"pallas_triton": "cairn.kernels._norms.pallas_triton"},
)


def _check_param(name: str, p: Any, d: int, axis: int) -> None:
    if p is not None and tuple(np.shape(p)) != (d,):
        raise ValueError(f"{name} must have shape ({d},) (the size of x's axis {axis}), got {tuple(np.shape(p))}")


def layer_norm(
    x: jax.Array,
    scale: jax.Array | None,
    offset: jax.Array | None,
    *,
    axis: int = -1,
    epsilon: float = 1e-6,
    scale_offset: float = 0.0,
    subtract_mean: bool = True,
    implementation: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """Layer normalisation: ``(x - mean) / sqrt(var + epsilon) * (scale + scale_offset) + offset``.

    Statistics over ``axis`` in float32 (16-bit inputs are upcast, the output is cast
    back to ``x.dtype``). Differentiable in ``x``, ``scale`` and ``offset``.

    Args:
      x: any shape; normalised over ``axis``.
      scale: ``[x.shape[axis]]`` or ``None`` (no scaling).
      offset: ``[x.shape[axis]]`` or ``None`` (no offset).
      axis: the normalised axis.
      epsilon: added to the variance.
      scale_offset: added to ``scale`` (``1.0`` for zero-centred scales, as Gemma's).
      subtract_mean: ``False`` is RMS norm (the mean is taken as zero).
      implementation: ``"xla"``, ``"pallas_triton"``, a sequence, or ``None``.

    Returns:
      ``x``'s shape and dtype.

    Raises:
      ValueError: ``scale``/``offset`` shape, ``axis`` out of range, unknown
        implementation, a config that does not fit.

    >>> import jax.numpy as jnp
    >>> layer_norm(jnp.array([[1.0, 3.0]]), None, None).round(3).tolist()
    [[-1.0, 1.0]]
    """
    x = jnp.asarray(x)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for x of shape {x.shape}")
    ax = axis % x.ndim
    d = x.shape[ax]
    _check_param("scale", scale, d, axis)
    _check_param("offset", offset, d, axis)
    if scale is not None and scale_offset:
        scale = scale + scale_offset
    elif scale is None and scale_offset:
        scale = jnp.full((d,), 1.0 + scale_offset, jnp.float32)
    moved = jnp.moveaxis(x, ax, -1)
    y = call(
        OP, moved.reshape(-1, d), scale, offset, implementation=implementation, epsilon=float(epsilon),
        subtract_mean=bool(subtract_mean),
    )
    return jnp.moveaxis(y.reshape(moved.shape), -1, ax)


def rms_norm(
    x: jax.Array,
    scale: jax.Array | None,
    *,
    axis: int = -1,
    epsilon: float = 1e-6,
    scale_offset: float = 0.0,
    implementation: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """RMS normalisation: ``x / sqrt(mean(x**2) + epsilon) * (scale + scale_offset)``.

    :func:`layer_norm` with ``subtract_mean=False`` and no offset.

    Args:
      x: any shape; normalised over ``axis``.
      scale: ``[x.shape[axis]]`` or ``None``.
      axis: the normalised axis.
      epsilon: added to the mean square.
      scale_offset: added to ``scale``.
      implementation: as :func:`layer_norm`.

    Returns:
      ``x``'s shape and dtype.

    Raises:
      ValueError: as :func:`layer_norm`.

    >>> import jax.numpy as jnp
    >>> y = rms_norm(jnp.array([[3.0, 4.0]]), jnp.array([1.0, 2.0]), epsilon=0.0)
    >>> [round(float(v), 3) for v in y[0]]
    [0.849, 2.263]
    """
    return layer_norm(
        x, scale, None, axis=axis, epsilon=epsilon, scale_offset=scale_offset, subtract_mean=False,
        implementation=implementation,
    )
