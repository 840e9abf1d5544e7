"""Parameter initializers.

Every initializer is a callable ``init(key, shape, dtype=jnp.float32) -> jax.Array``,
the same calling convention as ``jax.nn.initializers`` and ``flax.nnx.initializers``,
so the two are interchangeable.

Fans follow the usual convention for a kernel of shape
``(*receptive_field, fan_in, fan_out)``: ``fan_in = shape[in_axis] * prod(receptive)``
and ``fan_out = shape[out_axis] * prod(receptive)``, where ``receptive`` is every axis
that is neither the in, the out, nor a batch axis.

>>> import jax
>>> from cairn.nn import initializers
>>> w = initializers.lecun_normal()(jax.random.key(0), (64, 32))
>>> w.shape, str(w.dtype)
((64, 32), 'float32')
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Initializer",
    "constant",
    "delta_orthogonal",
    "glorot_normal",
    "glorot_uniform",
    "he_normal",
    "he_uniform",
    "kaiming_normal",
    "kaiming_uniform",
    "lecun_normal",
    "lecun_uniform",
    "normal",
    "ones",
    "ones_init",
    "orthogonal",
    "truncated_normal",
    "uniform",
    "variance_scaling",
    "xavier_normal",
    "xavier_uniform",
    "zeros",
    "zeros_init",
]

Initializer = Callable[..., jax.Array]
DType = Any

# standard deviation of a standard normal truncated to [-2, 2]
_TRUNC_STD = 0.87962566103423978


def _shape(shape: Sequence[int] | int) -> tuple[int, ...]:
    if isinstance(shape, int | np.integer):
        return (int(shape),)
    try:
        out = tuple(int(s) for s in shape)
    except TypeError as e:
        raise TypeError(f"initializer shape must be a sequence of ints, got {shape!r}") from e
    if any(s < 0 for s in out):
        raise ValueError(f"initializer shape must be non-negative, got {out}")
    return out


def _bucket(n: int) -> int:
    """Sample-vector length for ``n`` values: the next power of two up to 2**20 (at least
    256), then one of 8 sizes per power of two (at most 12.5% spare)."""
    if n <= 256:
        return 256
    if n <= 1 << 20:
        return 1 << (n - 1).bit_length()
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


@functools.partial(jax.jit, static_argnames=("n", "dist"))
def _flat_sample(key, lower, upper, *, n: int, dist: str):
    if dist == "normal":
        return jax.random.normal(key, (n,), jnp.float32)
    if dist == "truncated_normal":
        return jax.random.truncated_normal(key, lower, upper, (n,), jnp.float32)
    return jax.random.uniform(key, (n,), jnp.float32, lower, upper)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _finish(flat, scale, shift, *, shape, dtype):
    size = math.prod(shape)
    return (flat[:size].reshape(shape) * scale + shift).astype(dtype)


def _sample(key, shape, dtype, dist: str, scale=1.0, shift=0.0, lower=-2.0, upper=2.0):
    """``scale * z + shift`` with ``z`` iid from ``dist``, shaped ``shape``.

    Samples are drawn as one flat vector of a bucketed length and then sliced, so model
    construction compiles the random-number generator once per size bucket instead of
    once per parameter shape (the generator's compile dominates eager init time).
    """
    shape = _shape(shape)
    flat = _flat_sample(
        key, jnp.float32(lower), jnp.float32(upper), n=_bucket(math.prod(shape)), dist=dist
    )
    return _finish(flat, jnp.float32(scale), jnp.float32(shift), shape=shape, dtype=jnp.dtype(dtype))


_HOST_FILL_MAX = 1 << 16


def _fill(shape, value, dtype) -> jax.Array:
    # small constant arrays are built on the host and transferred: no per-shape XLA
    # compile of a broadcast (which dominates eager construction of biases and scales)
    shape = _shape(shape)
    if math.prod(shape) <= _HOST_FILL_MAX:
        return jnp.asarray(np.full(shape, value, dtype=jnp.dtype(dtype)))
    return jnp.full(shape, value, dtype)


def zeros(key: jax.Array, shape: Sequence[int], dtype: DType = jnp.float32) -> jax.Array:
    """All zeros (``key`` is ignored).

    Args:
      key: a ``jax.random`` key (ignored).
      shape: the array's shape.
      dtype: the array's dtype.
    """
    del key
    return _fill(shape, 0, dtype)


def ones(key: jax.Array, shape: Sequence[int], dtype: DType = jnp.float32) -> jax.Array:
    """All ones (``key`` is ignored).

    Args:
      key: a ``jax.random`` key (ignored).
      shape: the array's shape.
      dtype: the array's dtype.
    """
    del key
    return _fill(shape, 1, dtype)


def zeros_init() -> Initializer:
    """Returns :func:`zeros` (factory form, as in ``jax.nn.initializers``)."""
    return zeros


def ones_init() -> Initializer:
    """Returns :func:`ones` (factory form, as in ``jax.nn.initializers``)."""
    return ones


def constant(value: Any, dtype: DType = jnp.float32) -> Initializer:
    """Every entry equals ``value``.

    Args:
      value: the value of every entry.
      dtype: the default dtype of the arrays made (``init(key, shape, dtype)`` may override it).
    """

    def init(key, shape, dtype=dtype):
        del key
        return _fill(shape, value, dtype)

    return init


def normal(stddev: float = 1e-2, dtype: DType = jnp.float32) -> Initializer:
    """Samples ``N(0, stddev**2)``.

    Args:
      stddev: the standard deviation.
      dtype: the default dtype of the arrays made (``init(key, shape, dtype)`` may override it).
    """

    def init(key, shape, dtype=dtype):
        return _sample(key, shape, dtype, "normal", stddev)

    return init


def truncated_normal(
    stddev: float = 1e-2, dtype: DType = jnp.float32, lower: float = -2.0, upper: float = 2.0
) -> Initializer:
    """Samples ``stddev * z`` with ``z`` a standard normal truncated to ``[lower, upper]``.

    ``stddev`` is the scale of the underlying normal, not the std of the result (as in JAX).

    Args:
      stddev: the scale of the underlying normal.
      dtype: the default dtype of the arrays made (``init(key, shape, dtype)`` may override it).
      lower: the lower truncation bound, in units of ``stddev``.
      upper: the upper truncation bound, in units of ``stddev``.
    """

    def init(key, shape, dtype=dtype):
        return _sample(key, shape, dtype, "truncated_normal", stddev, lower=lower, upper=upper)

    return init


def uniform(scale: float = 1e-2, dtype: DType = jnp.float32) -> Initializer:
    """Samples ``U[0, scale)``.

    Args:
      scale: the upper bound (exclusive).
      dtype: the default dtype of the arrays made (``init(key, shape, dtype)`` may override it).
    """

    def init(key, shape, dtype=dtype):
        return _sample(key, shape, dtype, "uniform", scale, lower=0.0, upper=1.0)

    return init


def _fans(
    shape: tuple[int, ...], in_axis: int | Sequence[int], out_axis: int | Sequence[int],
    batch_axis: int | Sequence[int],
) -> tuple[float, float]:
    if len(shape) < 1:
        raise ValueError(f"cannot compute fans of a scalar shape {shape}")
    nd = len(shape)

    def norm(axes):
        axes = (axes,) if isinstance(axes, int) else tuple(axes)
        out = []
        for a in axes:
            if not -nd <= a < nd:
                raise ValueError(f"axis {a} out of range for kernel shape {shape}")
            out.append(a % nd)
        return tuple(out)

    if nd == 1:
        # a vector: both fans are its length
        return float(shape[0]), float(shape[0])
    ia, oa, ba = norm(in_axis), norm(out_axis), norm(batch_axis)
    # receptive field = every remaining element (JAX's convention; when in and out name
    # the same axis, as for an embedding table with out_axis=0, fan_in = the other dims)
    denom = math.prod(shape[i] for i in ia) * math.prod(shape[i] for i in oa)
    denom *= math.prod(shape[i] for i in ba)
    rf = math.prod(shape) / denom if denom else 0.0
    fan_in = math.prod(shape[i] for i in ia) * rf
    fan_out = math.prod(shape[i] for i in oa) * rf
    return float(fan_in), float(fan_out)


def variance_scaling(
    scale: float,
    mode: Literal["fan_in", "fan_out", "fan_avg"],
    distribution: Literal["truncated_normal", "normal", "uniform"],
    in_axis: int | Sequence[int] = -2,
    out_axis: int | Sequence[int] = -1,
    batch_axis: Sequence[int] = (),
    dtype: DType = jnp.float32,
) -> Initializer:
    """Samples with variance ``scale / n``, ``n`` = fan_in, fan_out or their mean.

    ``distribution`` is ``'truncated_normal'`` (normal truncated at two stds, rescaled so
    the variance is exact), ``'normal'`` or ``'uniform'`` (``U[-sqrt(3v), sqrt(3v)]``).

    Args:
      scale: the variance numerator.
      mode: ``'fan_in'``, ``'fan_out'`` or ``'fan_avg'`` (the denominator ``n``).
      distribution: ``'truncated_normal'``, ``'normal'`` or ``'uniform'``.
      in_axis: the axis (or axes) counted in ``fan_in``.
      out_axis: the axis (or axes) counted in ``fan_out``.
      batch_axis: axes left out of both fans (stacked, independent kernels).
      dtype: the default dtype of the arrays made (``init(key, shape, dtype)`` may override it).
    """
    if mode not in ("fan_in", "fan_out", "fan_avg"):
        raise ValueError(f"variance_scaling mode must be fan_in/fan_out/fan_avg, got {mode!r}")
    if distribution not in ("truncated_normal", "normal", "uniform"):
        raise ValueError(
            "variance_scaling distribution must be truncated_normal/normal/uniform, "
            f"got {distribution!r}"
        )

    def init(key, shape, dtype=dtype):
        shape = _shape(shape)
        fan_in, fan_out = _fans(shape, in_axis, out_axis, batch_axis)
        n = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[mode]
        var = scale / max(1.0, n)
        if distribution == "truncated_normal":
            return _sample(key, shape, dtype, "truncated_normal", math.sqrt(var) / _TRUNC_STD)
        if distribution == "normal":
            return _sample(key, shape, dtype, "normal", math.sqrt(var))
        lim = math.sqrt(3.0 * var)
        return _sample(key, shape, dtype, "uniform", lim, lower=-1.0, upper=1.0)

    return init


def lecun_normal(
    in_axis: int | Sequence[int] = -2,
    out_axis: int | Sequence[int] = -1,
    batch_axis: Sequence[int] = (),
    dtype: DType = jnp.float32,
) -> Initializer:
    """Truncated normal with variance ``1 / fan_in`` (LeCun 1998).

    Args:
      in_axis: the axis (or axes) counted in ``fan_in``.
      out_axis: the axis (or axes) counted in ``fan_out``.
      batch_axis: axes left out of both fans (stacked, independent kernels).
      dtype: the default dtype of the arrays made (``init(key, shape, dtype)`` may override it).
    """
    return variance_scaling(1.0, "fan_in", "truncated_normal", in_axis, out_axis, batch_axis, dtype)


def lecun_uniform(
    in_axis: int | Sequence[int] = -2,
    out_axis: int | Sequence[int] = -1,
    batch_axis: Sequence[int] = (),
    dtype: DType = jnp.float32,
) -> Initializer:
    """Uniform with variance ``1 / fan_in``.

    Args:
      in_axis: the axis (or axes) counted in ``fan_in``.
      out_axis: the axis (or axes) counted in ``fan_out``.
      batch_axis: axes left out of both fans (stacked, independent kernels).
      dtype: the default dtype of the arrays made (``init(key, shape, dtype)`` may override it).
    """
    return variance_scaling(1.0, "fan_in", "uniform", in_axis, out_axis, batch_axis, dtype)


def glorot_normal(
    in_axis: int | Sequence[int] = -2,
    out_axis: int | Sequence[int] = -1,
    batch_axis: Sequence[int] = (),
    dtype: DType = jnp.float32,
) -> Initializer:
    """Truncated normal with variance ``2 / (fan_in + fan_out)`` (Glorot & Bengio 2010).

    Args:
      in_axis: the axis (or axes) counted in ``fan_in``.
      out_axis: the axis (or axes) counted in ``fan_out``.
      batch_axis: axes left out of both fans (stacked, independent kernels).
      dtype: the default dtype of the arrays made (``init(key, shape, dtype)`` may override it).
    """
    return variance_scaling(1.0, "fan_avg", "truncated_normal", in_axis, out_axis, batch_axis, dtype)


def glorot_uniform(
    in_axis: int | Sequence[int] = -2,
    out_axis: int | Sequence[int] = -1,
    batch_axis: Sequence[int] = (),
    dtype: DType = jnp.float32,
) -> Initializer:
    """Uniform with variance ``2 / (fan_in + fan_out)``.

    Args:
      in_axis: the axis (or axes) counted in ``fan_in``.
      out_axis: the axis (or axes) counted in ``fan_out``.
      batch_axis: axes left out of both fans (stacked, independent kernels).
      dtype: the default dtype of the arrays made (``init(key, shape, dtype)`` may override it).
    """
    return variance_scaling(1.0, "fan_avg", "uniform", in_axis, out_axis, batch_axis, dtype)


def he_normal(
    in_axis: int | Sequence[int] = -2,
    out_axis: int | Sequence[int] = -1,
    batch_axis: Sequence[int] = (),
    dtype: DType = jnp.float32,
) -> Initializer:
    """Truncated normal with variance ``2 / fan_in`` (He et al. 2015).

    Args:
      in_axis: the axis (or axes) counted in ``fan_in``.
      out_axis: the axis (or axes) counted in ``fan_out``.
      batch_axis: axes left out of both fans (stacked, independent kernels).
      dtype: the default dtype of the arrays made (``init(key, shape, dtype)`` may override it).
    """
    return variance_scaling(2.0, "fan_in", "truncated_normal", in_axis, out_axis, batch_axis, dtype)


def he_uniform(
    in_axis: int | Sequence[int] = -2,
    out_axis: int | Sequence[int] = -1,
    batch_axis: Sequence[int] = (),
    dtype: DType = jnp.float32,
) -> Initializer:
    """Uniform with variance ``2 / fan_in``.

    Args:
      in_axis: the axis (or axes) counted in ``fan_in``.
      out_axis: the axis (or axes) counted in ``fan_out``.
      batch_axis: axes left out of both fans (stacked, independent kernels).
      dtype: the default dtype of the arrays made (``init(key, shape, dtype)`` may override it).
    """
    return variance_scaling(2.0, "fan_in", "uniform", in_axis, out_axis, batch_axis, dtype)


xavier_normal = glorot_normal
xavier_uniform = glorot_uniform
kaiming_normal = he_normal
kaiming_uniform = he_uniform


def orthogonal(scale: float = 1.0, column_axis: int = -1, dtype: DType = jnp.float32) -> Initializer:
    """A (semi-)orthogonal matrix times ``scale``.

    The shape is viewed as a matrix ``(prod(other axes), shape[column_axis])``; its columns
    (or rows, whichever are fewer) are orthonormal. Built from the QR decomposition of a
    Gaussian matrix with the sign of ``diag(R)`` folded in, so the result is Haar-uniform.

    Args:
      scale: multiplies the orthogonal matrix.
      column_axis: the axis whose size is the matrix's column count.
      dtype: the default dtype of the arrays made (``init(key, shape, dtype)`` may override it).
    """

    def init(key, shape, dtype=dtype):
        shape = _shape(shape)
        if len(shape) < 2:
            raise ValueError(f"orthogonal initializer needs at least 2 dims, got shape {shape}")
        ax = column_axis % len(shape)
        n_cols = shape[ax]
        n_rows = math.prod(shape) // n_cols
        big, small = max(n_rows, n_cols), min(n_rows, n_cols)
        a = jax.random.normal(key, (big, small), jnp.float32)
        q, r = jnp.linalg.qr(a)
        q = q * jnp.sign(jnp.diagonal(r))[None, :]
        if n_rows < n_cols:
            q = q.T
        # q has shape (n_rows, n_cols); put the column axis back in place
        other = tuple(s for i, s in enumerate(shape) if i != ax)
        q = q.reshape(*other, n_cols)
        q = jnp.moveaxis(q, -1, ax)
        return (scale * q).astype(dtype)

    return init


def delta_orthogonal(scale: float = 1.0, column_axis: int = -1, dtype: DType = jnp.float32) -> Initializer:
    """Delta-orthogonal kernel for 3-, 4- or 5-D convolutions (Xiao et al. 2018).

    All spatial taps are zero except the centre one, which is an orthogonal
    ``(in, out)`` matrix; requires ``in <= out`` and square spatial dims.

    Args:
      scale: multiplies the orthogonal centre tap.
      column_axis: the axis of the output features.
      dtype: the default dtype of the arrays made (``init(key, shape, dtype)`` may override it).
    """

    def init(key, shape, dtype=dtype):
        shape = _shape(shape)
        if len(shape) not in (3, 4, 5):
            raise ValueError(f"delta_orthogonal needs a 3-, 4- or 5-D kernel, got shape {shape}")
        spatial = shape[:-2]
        if len(set(spatial)) != 1:
            raise ValueError(f"delta_orthogonal needs equal spatial dims, got shape {shape}")
        if shape[-2] > shape[-1]:
            raise ValueError(
                f"delta_orthogonal needs in_features <= out_features, got shape {shape}"
            )
        centre = orthogonal(scale, column_axis, dtype)(key, shape[-2:], dtype)
        out = jnp.zeros(shape, dtype)
        mid = tuple(s // 2 for s in spatial)
        return out.at[mid].set(centre)

    return init
