"""The quantized types a rule may name, with their value ranges.

Integer types quantize as ``q = clip(round(x / scale) [+ zero_point], qmin, qmax)``;
float types (fp8) as ``q = cast(clip(x / scale, -fmax, fmax))``, the cast rounding to
the nearest representable value.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

__all__ = ["QTypeInfo", "qtype_info", "QTYPES"]


@dataclasses.dataclass(frozen=True)
class QTypeInfo:
    """One qtype: its ``name``, the dtype ``storage`` of its values, and its range.

    ``kind`` is ``"int"`` (signed), ``"uint"``, ``"float"`` (fp8), ``"nf4"`` (indices into the
    NormalFloat levels), ``"mx"`` (OCP microscaling: power-of-two block scales) or ``"nv"``
    (NVFP4: fp8 block scales). ``qmin``/``qmax`` bound the values before storage (for
    floats, ``-fmax``/``fmax``); ``bits`` is the logical width; ``block`` the block length
    of the block formats, whose scales are stored as ``scale_dtype``.

    Args:
      name: the qtype's name (``"int8"``, ``"nf4"``, ``"mxfp8_e4m3"``...).
      storage: the NumPy/ml_dtypes dtype name its values are stored as.
      kind: ``"int"``, ``"uint"``, ``"float"``, ``"nf4"``, ``"mx"`` or ``"nv"`` (see above).
      bits: the logical width in bits.
      qmin: the smallest value before storage.
      qmax: the largest value before storage.
      block: the block length of the block formats; None for the others.
      scale_dtype: the dtype the block scales are stored as.
    """

    name: str
    storage: str
    kind: str
    bits: int
    qmin: float
    qmax: float
    block: int | None = None
    scale_dtype: str = "float32"

    @property
    def is_float(self) -> bool:
        """Values are rounded by a cast to a float element type (fp8, and the block formats)."""
        return self.kind in ("float", "mx", "nv")


def _int(name: str, bits: int) -> QTypeInfo:
    return QTypeInfo(name, name, "int", bits, -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)


def _uint(name: str, bits: int) -> QTypeInfo:
    return QTypeInfo(name, name, "uint", bits, 0, 2**bits - 1)


def _float(name: str) -> QTypeInfo:
    fmax = float(ml_dtypes.finfo(getattr(ml_dtypes, name)).max)
    return QTypeInfo(name, name, "float", 8, -fmax, fmax)


QTYPES: dict[str, QTypeInfo] = {
    q.name: q
    for q in (
        _int("int8", 8),
        _int("int4", 4),
        _int("int2", 2),
        _uint("uint8", 8),
        _uint("uint4", 4),
        _uint("uint2", 2),
        _float("float8_e4m3fn"),
        _float("float8_e5m2"),
        QTypeInfo("nf4", "uint4", "nf4", 4, -1.0, 1.0),
        QTypeInfo("mxfp8", "float8_e4m3fn", "mx", 8, -448.0, 448.0, 32, "float8_e8m0fnu"),
        QTypeInfo("mxfp4", "float4_e2m1fn", "mx", 4, -6.0, 6.0, 32, "float8_e8m0fnu"),
        QTypeInfo("nvfp4", "float4_e2m1fn", "nv", 4, -6.0, 6.0, 16, "float8_e4m3fn"),
    )
}


def required(qtype: str | None, what: str) -> str:
    """``qtype`` itself; a rule field the caller has already checked is set.

    Raises:
      ValueError: it is ``None`` (``what`` names the rule field).
    """
    if qtype is None:
        raise ValueError(f"{what} is not set")
    return qtype


def qtype_info(qtype: object) -> QTypeInfo:
    """The :class:`QTypeInfo` of ``qtype`` (a name, a NumPy/ml_dtypes dtype or a JAX dtype).

    Args:
      qtype: a qtype name, or a NumPy/ml_dtypes/JAX dtype.

    >>> qtype_info("int8").qmax, qtype_info("float8_e4m3fn").qmax
    (127, 448.0)

    Raises:
      ValueError: ``qtype`` is not one of :data:`QTYPES`.
    """
    name = qtype if isinstance(qtype, str) else getattr(qtype, "name", None) or getattr(qtype, "__name__", None)
    if name is None:
        try:
            name = np.dtype(qtype).name  # type: ignore[call-overload]
        except TypeError:
            name = None
    info = QTYPES.get(name) if isinstance(name, str) else None
    if info is None:
        raise ValueError(f"unknown qtype {qtype!r}; expected one of {sorted(QTYPES)}")
    return info
