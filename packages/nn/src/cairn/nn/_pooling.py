"""Pooling over spatial windows: ``pool``, ``avg_pool``, ``max_pool``, ``min_pool``.

Inputs are channels-last, ``(*batch, *spatial, features)`` with ``len(spatial) ==
len(window_shape)``; an input with no batch axis (``ndim == len(window_shape) + 1``) is
accepted too. ``padding`` is ``'VALID'``, ``'SAME'`` or a sequence of ``(low, high)``
pairs, one per spatial axis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cairn.nn import _checks

__all__ = ["avg_pool", "max_pool", "min_pool", "pool"]

Padding = str | Sequence[tuple[int, int]]


def _check(name: str, inputs, window_shape, strides, padding):
    window_shape = _checks.positive_ints(name, "window_shape", window_shape)
    nsp = len(window_shape)
    strides = (1,) * nsp if strides is None else _checks.positive_ints(name, "strides", strides)
    if len(strides) != nsp:
        raise ValueError(
            f"{name}: strides {strides} must have one entry per window dim {window_shape}"
        )
    if inputs.ndim < nsp + 1:
        raise ValueError(
            f"{name}: input of shape {inputs.shape} needs at least {nsp + 1} dims "
            f"(spatial {nsp} + features) for window_shape {window_shape}"
        )
    if not isinstance(padding, str):
        padding = tuple((int(lo), int(hi)) for lo, hi in padding)
        if len(padding) != nsp:
            raise ValueError(
                f"{name}: padding {padding} must have one (low, high) pair per spatial dim "
                f"({nsp})"
            )
    elif padding.upper() not in ("SAME", "VALID"):
        raise ValueError(f"{name}: padding must be 'SAME', 'VALID' or pairs, got {padding!r}")
    else:
        padding = padding.upper()
    return window_shape, strides, padding


def pool(
    inputs: jax.Array,
    init: Any,
    reduce_fn: Callable[[Any, Any], Any],
    window_shape: Sequence[int],
    strides: Sequence[int] | None,
    padding: Padding,
) -> jax.Array:
    """Reduces each window with ``reduce_fn`` starting from ``init`` (``lax.reduce_window``).

    Batch axes (all leading axes before the spatial ones) and the feature axis get a
    window and stride of 1. Pass ``init`` as a Python or NumPy scalar: with ``lax.add`` /
    ``lax.max`` / ``lax.min`` and their identity (0, -inf, +inf) the result is then
    differentiable under ``jax.jit`` too; a ``jnp`` array is a tracer under ``jit`` and
    takes the generic reduction, which has no reverse-mode derivative.

    Args:
      inputs: ``(*batch, *spatial, features)``.
      init: the reduction's initial value (a Python or NumPy scalar).
      reduce_fn: the binary reduction (``lax.add``, ``lax.max``...).
      window_shape: the window size per spatial axis.
      strides: the stride per spatial axis; None means 1.
      padding: ``"SAME"``, ``"VALID"`` or per-axis ``(low, high)`` pairs.
    """
    return _pool("pool", inputs, init, reduce_fn, window_shape, strides, padding)


def _pool(name, inputs, init, reduce_fn, window_shape, strides, padding) -> jax.Array:
    window_shape, strides, padding = _check(name, inputs, window_shape, strides, padding)
    nsp = len(window_shape)
    nbatch = inputs.ndim - nsp - 1
    dims = (1,) * nbatch + window_shape + (1,)
    strd = (1,) * nbatch + strides + (1,)
    if not isinstance(padding, str):
        padding = ((0, 0),) * nbatch + padding + ((0, 0),)
    return lax.reduce_window(inputs, init, reduce_fn, dims, strd, padding)


def _identity(dtype, value: float) -> np.ndarray:
    """A concrete NumPy scalar of ``dtype`` holding ``value`` (clipped to the int range).

    ``lax.reduce_window`` picks its differentiable monoid path (sum / max / min) only when
    the init value is concrete; a ``jnp`` array becomes a tracer under ``jax.jit`` and the
    generic path has no reverse-mode rule ("Linearization failed"), so the init value is
    built with NumPy, never ``jnp``.
    """
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        value = info.min if value == -np.inf else info.max if value == np.inf else value
    elif dtype == np.bool_:
        value = value > 0
    return np.asarray(value, dtype)


def max_pool(
    inputs: jax.Array,
    window_shape: Sequence[int],
    strides: Sequence[int] | None = None,
    padding: Padding = "VALID",
) -> jax.Array:
    """Maximum over each window; padded positions count as ``-inf``.

    Args:
      inputs: ``(*batch, *spatial, features)`` (or ``(*spatial, features)``), one spatial
        axis per ``window_shape`` entry.
      window_shape: the window's size on each spatial axis.
      strides: the step on each spatial axis (default 1).
      padding: ``'VALID'``, ``'SAME'`` or one ``(low, high)`` pair per spatial axis.

    Returns:
      ``(*batch, *spatial_out, features)``, ``inputs``' dtype.

    Raises:
      TypeError / ValueError: ``window_shape`` or ``strides`` that are not positive ints
        (or disagree in length), an input with too few axes, or a padding that is neither
        ``'SAME'``/``'VALID'`` nor one pair per spatial axis.

    >>> import jax.numpy as jnp
    >>> x = jnp.arange(16.0).reshape(1, 4, 4, 1)
    >>> max_pool(x, (2, 2), (2, 2))[0, :, :, 0].tolist()
    [[5.0, 7.0], [13.0, 15.0]]
    """
    init = _identity(inputs.dtype, -np.inf)
    return _pool("max_pool", inputs, init, lax.max, window_shape, strides, padding)


def min_pool(
    inputs: jax.Array,
    window_shape: Sequence[int],
    strides: Sequence[int] | None = None,
    padding: Padding = "VALID",
) -> jax.Array:
    """Minimum over each window; padded positions count as ``+inf``.

    Arguments, result and errors as for :func:`max_pool`.

    Args:
      inputs: ``(*batch, *spatial, features)``.
      window_shape: the window size per spatial axis.
      strides: the stride per spatial axis; None means 1.
      padding: ``"SAME"``, ``"VALID"`` or per-axis ``(low, high)`` pairs.

    >>> import jax.numpy as jnp
    >>> x = jnp.arange(16.0).reshape(1, 4, 4, 1)
    >>> min_pool(x, (2, 2), (2, 2))[0, :, :, 0].tolist()
    [[0.0, 2.0], [8.0, 10.0]]
    """
    init = _identity(inputs.dtype, np.inf)
    return _pool("min_pool", inputs, init, lax.min, window_shape, strides, padding)


def avg_pool(
    inputs: jax.Array,
    window_shape: Sequence[int],
    strides: Sequence[int] | None = None,
    padding: Padding = "VALID",
    count_include_pad: bool = True,
) -> jax.Array:
    """Mean over each window.

    With ``count_include_pad=True`` the divisor is always ``prod(window_shape)``; with
    ``False`` it is the number of real (unpadded) elements in the window.

    Args:
      inputs: ``(*batch, *spatial, features)`` (or ``(*spatial, features)``), one spatial
        axis per ``window_shape`` entry.
      window_shape: the window's size on each spatial axis.
      strides: the step on each spatial axis (default 1).
      padding: ``'VALID'``, ``'SAME'`` or one ``(low, high)`` pair per spatial axis.
      count_include_pad: whether padded positions count in the divisor.

    Returns:
      ``(*batch, *spatial_out, features)``.

    Raises:
      TypeError / ValueError: ``window_shape`` or ``strides`` that are not positive ints
        (or disagree in length), an input with too few axes, or a padding that is neither
        ``'SAME'``/``'VALID'`` nor one pair per spatial axis.

    >>> import jax.numpy as jnp
    >>> x = jnp.arange(4.0).reshape(1, 2, 2, 1)
    >>> avg_pool(x, (2, 2), padding=((0, 1), (0, 1)))[0, :, :, 0].tolist()
    [[1.5, 1.0], [1.25, 0.75]]
    >>> avg_pool(x, (2, 2), padding=((0, 1), (0, 1)), count_include_pad=False)[0, :, :, 0].tolist()
    [[1.5, 2.0], [2.5, 3.0]]
    """
    window_shape = _checks.positive_ints("avg_pool", "window_shape", window_shape)
    summed = _pool(
        "avg_pool", inputs, _identity(inputs.dtype, 0), lax.add, window_shape, strides, padding
    )
    if count_include_pad:
        return summed / np.prod(window_shape).astype(np.float32).item()
    ones_shape = (1,) * (inputs.ndim - len(window_shape) - 1) + inputs.shape[
        inputs.ndim - len(window_shape) - 1 : -1
    ] + (1,)
    counts = _pool(
        "avg_pool", jnp.ones(ones_shape, inputs.dtype), _identity(inputs.dtype, 0), lax.add,
        window_shape, strides, padding,
    )
    return summed / counts
