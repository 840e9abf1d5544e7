"""``ragged_dot`` and ``ragged_dot_general``: the grouped matmul of mixture-of-experts layers.

Same semantics as ``jax.lax.ragged_dot`` / ``jax.lax.ragged_dot_general`` (Tokamax's names
and arguments), with three implementations registered under op ``"ragged_dot"``:
``xla`` (a work-item loop, one ``[block_m, k] @ [k, n]`` per (row tile, group) pair),
``pallas_triton`` and ``pallas_mosaic_gpu``. A :class:`cairn.core_array.QArray` ``rhs``
selects the quantized path: the integer values go through the same kernel and the
per-channel scale multiplies the output rows of each group after the dot.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cairn.core_array import QArray
from cairn.kernels._quantized.common import split_scale
from cairn.kernels._ragged_dot.xla import ragged_dot_xla, row_groups
from cairn.kernels._registry import (
    call,
    register_builtin,
)

__all__ = ["ragged_dot", "ragged_dot_general"]

OP = "ragged_dot"


def _shapes(lhs: Any, rhs: Any, group_sizes: Any, mode: str) -> tuple[int, int, int, int]:
    m, k = lhs.shape
    n = rhs.shape[2] if mode == "m" else rhs.shape[1]
    return m, k, n, group_sizes.shape[0]


def _bucket(lhs: Any, rhs: Any, group_sizes: Any, *, ragged: str = "m", **_: Any) -> tuple[Any, ...]:
    m, k, n, g = _shapes(lhs, rhs, group_sizes, ragged)
    return (ragged, 1 << max(m - 1, 0).bit_length(), k, n, g, jnp.dtype(lhs.dtype).name)


def _xla_default(lhs: Any, *_: Any, **__: Any) -> dict[str, Any]:
    m = lhs.shape[0]
    return {"method": "tiled", "block_m": int(min(128, max(8, 1 << max(m - 1, 0).bit_length())))}


def _xla_configs(*_: Any, **__: Any) -> list[dict[str, Any]]:
    return [{"method": "tiled", "block_m": b} for b in (64, 128, 256)] + [{"method": "dense", "block_m": 128}]


register_builtin(
    OP, bucket=_bucket, xla=ragged_dot_xla, xla_configs=_xla_configs, xla_default_config=_xla_default,
    gpu={"pallas_triton": "cairn.kernels._ragged_dot.pallas_triton",
         "pallas_mosaic_gpu": "cairn.kernels._ragged_dot.pallas_mosaic"},
)


def _check(lhs: Any, rhs: Any, group_sizes: Any, mode: str) -> None:
    lshape = tuple(np.shape(lhs))
    rshape = tuple(rhs.shape)
    if len(lshape) != 2:
        raise ValueError(f"lhs must be 2-d [m, k], got shape {lshape}")
    gshape = tuple(np.shape(group_sizes))
    if not jnp.issubdtype(jnp.result_type(group_sizes), jnp.integer):
        raise TypeError(f"group_sizes must be an integer array, got dtype {jnp.result_type(group_sizes)}")
    if mode == "m":
        if len(rshape) != 3:
            raise ValueError(f"rhs must be 3-d [groups, k, n], got shape {rshape}")
        if rshape[1] != lshape[1]:
            raise ValueError(f"rhs contracting size {rshape[1]} (shape {rshape}) != lhs's k={lshape[1]} (shape {lshape})")
        groups = rshape[0]
    else:
        if len(rshape) != 2 or rshape[0] != lshape[0]:
            raise ValueError(f"rhs must be [m, n] with m={lshape[0]} for a ragged contraction, got shape {rshape}")
        groups = gshape[0] if len(gshape) == 1 else -1
    if gshape != (groups,):
        raise ValueError(f"group_sizes must have shape ({groups},) (one size per group), got {gshape}")


def _quantized_m(lhs, rhs: QArray, group_sizes, precision, preferred_element_type, implementation):
    values, post = split_scale(rhs, contracting=(1,), out_axes=(0, 2))
    dtype = jnp.dtype(preferred_element_type) if preferred_element_type is not None else jnp.dtype(lhs.dtype)
    if post is None:  # a layout whose scale is not a per-output-channel factor: dequantize
        w = values
        out = call(OP, lhs, w.astype(lhs.dtype), group_sizes, implementation=implementation,
                   ragged="m", precision=precision, preferred_element_type=jnp.float32)
        return out.astype(dtype)
    out = call(OP, lhs, values.astype(lhs.dtype), group_sizes, implementation=implementation,
               ragged="m", precision=precision, preferred_element_type=jnp.float32)
    scale = jnp.broadcast_to(post, (post.shape[0], 1, rhs.shape[2]))[:, 0, :]
    rows = row_groups(group_sizes, lhs.shape[0])
    per_row = jnp.take(scale, jnp.minimum(rows, scale.shape[0] - 1), axis=0) if scale.shape[0] > 1 else scale
    return (out * per_row).astype(dtype)


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array | QArray,
    group_sizes: jax.Array,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    implementation: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """Grouped matmul: ``out[i] = lhs[i] @ rhs[g(i)]`` where row ``i`` is in group ``g(i)``.

    The rows of ``lhs`` are cut into consecutive groups of ``group_sizes`` rows; rows after
    ``sum(group_sizes)`` give zeros (as ``jax.lax.ragged_dot``). Differentiable in ``lhs``
    and ``rhs`` (every implementation's backward runs its own kernels).

    Args:
      lhs: ``[m, k]``.
      rhs: ``[groups, k, n]``, or a ``QArray`` of that shape (int8, int4, fp8; scale per
        output channel ``[groups or 1, 1, n]`` is applied after the dot, other layouts
        are dequantized first).
      group_sizes: integer ``[groups]``.
      precision: ``jax.lax`` precision of the dots.
      preferred_element_type: the output dtype (default: ``lhs``/``rhs`` promoted).
      implementation: ``"xla"``, ``"pallas_triton"``, ``"pallas_mosaic_gpu"``, a sequence
        of them, or ``None`` (override block, autotune cache, then preference order).

    Returns:
      ``[m, n]``.

    Raises:
      ValueError: shapes that do not fit (naming ``lhs``, ``rhs`` or ``group_sizes``), an
        unknown implementation, or a config that does not fit.
      TypeError: non-integer ``group_sizes``.

    >>> import jax.numpy as jnp
    >>> out = ragged_dot(jnp.ones((5, 2)), jnp.stack([jnp.eye(2), 2 * jnp.eye(2)]),
    ...                  jnp.array([2, 2]))
    >>> out[:, 0].tolist()
    [1.0, 1.0, 2.0, 2.0, 0.0]
    """
    _check(lhs, rhs, group_sizes, "m")
    if isinstance(rhs, QArray):
        return _quantized_m(lhs, rhs, group_sizes, precision, preferred_element_type, implementation)
    return call(OP, lhs, rhs, group_sizes, implementation=implementation, ragged="m", precision=precision,
                preferred_element_type=preferred_element_type)


def _canonical(lhs, rhs, dn):
    """``(mode, lhs2, rhs2)`` for dimension numbers the kernels cover, else ``None``."""
    (lc, rc), (lb, rb) = dn.dot_dimension_numbers
    lr, rg = tuple(dn.lhs_ragged_dimensions), tuple(dn.rhs_group_dimensions)
    if lb or rb or lhs.ndim != 2 or len(lc) != 1 or len(rc) != 1 or len(lr) != 1:
        return None
    lc, rc, lr = lc[0] % 2, rc[0] % rhs.ndim, lr[0] % 2
    if lr != lc and rhs.ndim == 3 and len(rg) == 1:
        g = rg[0] % 3
        if g == rc:
            return None
        n_axis = ({0, 1, 2} - {g, rc}).pop()
        return "m", (lhs if lc == 1 else lhs.T), jnp.transpose(rhs, (g, rc, n_axis))
    if lr == lc and rhs.ndim == 2 and not rg:
        return "k", (lhs if lc == 0 else lhs.T), (rhs if rc == 0 else rhs.T)
    return None


def ragged_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    ragged_dot_dimension_numbers: lax.RaggedDotDimensionNumbers,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    implementation: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """``jax.lax.ragged_dot_general`` on this package's kernels.

    Two forms run on the kernels (2-d ``lhs``, one contracting dim, no batch dims):
    ragged non-contracting rows with a group dim in ``rhs`` (``ragged_dot``, any dim
    order; output ``[m, n]``), and a ragged contracting dim (``rhs`` 2-d, output
    ``[groups, k, n]``: the weight gradient of a MoE layer). Any other dimension numbers
    run ``jax.lax.ragged_dot_general`` itself (no kernel, ``implementation`` ignored).

    Args:
      lhs: the left operand.
      rhs: the right operand.
      group_sizes: integer ``[groups]``.
      ragged_dot_dimension_numbers: a ``jax.lax.RaggedDotDimensionNumbers``.
      precision: ``jax.lax`` precision.
      preferred_element_type: the output dtype.
      implementation: as in :func:`ragged_dot`.

    Returns:
      The result, shaped as ``jax.lax.ragged_dot_general``'s.

    Raises:
      ValueError, TypeError: as :func:`ragged_dot`.
    """
    canon = _canonical(lhs, rhs, ragged_dot_dimension_numbers)
    if canon is None:
        return lax.ragged_dot_general(
            lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision=precision,
            preferred_element_type=preferred_element_type,
        )
    mode, a, b = canon
    _check(a, b, group_sizes, mode)
    return call(OP, a, b, group_sizes, implementation=implementation, ragged=mode, precision=precision,
                preferred_element_type=preferred_element_type)
