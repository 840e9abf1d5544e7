"""``quantized_dot_general``: ``jax.lax.dot_general`` on :class:`cairn.core_array.QArray` operands.

A drop-in ``dot_general`` for ``cairn.nn.Linear`` / ``LinearGeneral``
(``Linear(..., dot_general=kernels.quantized_dot_general)``): with a ``QArray`` kernel the
layer hands the quantized values to this function as they are, and the integer values
enter the dot (int32 accumulation when both operands are integer QArrays), scales
applied after it. Implementations under op ``"quantized_dot_general"``: ``xla`` (any
dimension numbers, see :mod:`cairn.kernels._quantized.xla`) and ``pallas_triton`` (the
2-d ``Linear`` case with per-channel or per-tensor scales; weights stay int8 in memory).
No Mosaic GPU kernel yet (it would convert int8 blocks to 16 bits between the TMA copy
and ``wgmma``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn.core_array import QArray
from cairn.kernels._quantized.xla import quantized_dot_general_xla
from cairn.kernels._registry import (
    call,
    register_builtin,
)

__all__ = ["quantized_dot_general"]

OP = "quantized_dot_general"


def _qtype(x: Any) -> str:
    return x.qtype if isinstance(x, QArray) else jnp.dtype(x.dtype).name


def _bucket(lhs: Any, rhs: Any, dimension_numbers: Any, **_: Any) -> tuple[Any, ...]:
    lead = int(np.prod(lhs.shape[:-1])) if len(lhs.shape) > 1 else 1
    return (1 << max(lead - 1, 0).bit_length(), tuple(rhs.shape), _qtype(lhs), _qtype(rhs), str(dimension_numbers))


# xla first on a GPU too: the int8 -> bf16 convert fuses into the dot; the Triton kernel
# measured 2.3x slower at w8 [4096, 4096] on an H200 (benchmarks/kernels_gpu.py)
register_builtin(
    OP, bucket=_bucket, preference=("xla", "pallas_triton"), xla=quantized_dot_general_xla,
    gpu={"pallas_triton": "cairn.kernels._quantized.pallas_triton"},
)


def _normalize(dimension_numbers: Any, lnd: int, rnd: int) -> tuple[Any, ...]:
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        dn = tuple(tuple(tuple(int(a) for a in axes) for axes in pair) for pair in ((lc, rc), (lb, rb)))
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)), "
            f"got {dimension_numbers!r}"
        ) from e
    (lc, rc), (lb, rb) = dn
    for name, axes, nd in (("lhs", lc + lb, lnd), ("rhs", rc + rb, rnd)):
        if any(not -nd <= a < nd for a in axes):
            raise ValueError(f"dimension_numbers name an axis out of range for the {nd}-d {name}: {dimension_numbers!r}")
    return ((tuple(a % lnd for a in lc), tuple(a % rnd for a in rc)), (tuple(a % lnd for a in lb), tuple(a % rnd for a in rb)))


def quantized_dot_general(
    lhs: jax.Array | QArray,
    rhs: jax.Array | QArray,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    implementation: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """``jax.lax.dot_general(dequantize(lhs), dequantize(rhs), ...)`` computed on the
    quantized values.

    Args:
      lhs: an array or a ``QArray`` (int8, int4 packed or not, fp8; per-tensor,
        per-channel or per-tile scales).
      rhs: an array or a ``QArray``.
      dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``.
      precision: ``jax.lax`` precision (float dots).
      preferred_element_type: the output dtype (default: the operands' original dtype).
      implementation: ``"xla"``, ``"pallas_triton"``, a sequence, or ``None``.

    Returns:
      The ``dot_general`` result.

    Raises:
      ValueError: malformed ``dimension_numbers``, contracting or batch sizes that differ
        (naming both shapes), unknown implementation, a config that does not fit.

    >>> import numpy as np
    >>> from cairn.core_array import QArray, QuantLayout
    >>> w = QArray(np.array([[2, -4], [1, 1]], np.int8), np.array([[0.5, 0.25]], np.float32),
    ...            layout=QuantLayout.per_channel(1))
    >>> quantized_dot_general(np.ones((1, 2), np.float32), w, (((1,), (0,)), ((), ()))).tolist()
    [[1.5, -0.75]]
    """
    lshape, rshape = tuple(lhs.shape), tuple(rhs.shape)
    dn = _normalize(dimension_numbers, len(lshape), len(rshape))
    (lc, rc), (lb, rb) = dn
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(f"dimension_numbers pair {len(lc)} lhs with {len(rc)} rhs contracting axes: {dn}")
    for kind, la, ra in (("contracting", lc, rc), ("batch", lb, rb)):
        if [lshape[a] for a in la] != [rshape[a] for a in ra]:
            raise ValueError(
                f"{kind} sizes differ: lhs shape {lshape} axes {la} vs rhs shape {rshape} axes {ra}"
            )
    if not isinstance(lhs, QArray):
        lhs = jnp.asarray(lhs)
    if not isinstance(rhs, QArray):
        rhs = jnp.asarray(rhs)
    # dimension numbers as a keyword: static structure, not an array argument (the tracer
    # and the offline autotuner keep keyword arguments as given)
    return call(OP, lhs, rhs, implementation=implementation, dimension_numbers=dn, precision=precision,
                preferred_element_type=preferred_element_type)
