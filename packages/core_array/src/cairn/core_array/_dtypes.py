"""One table of canonical dtype names for NumPy and ml_dtypes types, with bit widths."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["DTypeInfo", "DTYPE_TABLE", "dtype_info", "canonical_dtype", "as_numpy_dtype", "bit_width"]


@dataclasses.dataclass(frozen=True)
class DTypeInfo:
    """A dtype's canonical ``name``, NumPy ``dtype``, storage ``bits`` and ``kind``.

    ``bits`` is the logical width (4 for ``int4``), not NumPy's itemsize (one byte).
    ``kind`` is one of ``'float'``, ``'int'``, ``'uint'``, ``'bool'``, ``'complex'``.

    Args:
      name: the canonical name (``"bfloat16"``).
      dtype: the NumPy or ml_dtypes dtype.
      bits: the logical width in bits.
      kind: ``'float'``, ``'int'``, ``'uint'``, ``'bool'`` or ``'complex'``.
    """

    name: str
    dtype: np.dtype
    bits: int
    kind: str

    @property
    def is_sub_byte(self) -> bool:
        return self.bits < 8


def _entries() -> list[tuple[str, Any, int, str]]:
    rows: list[tuple[str, Any, int, str]] = [
        ("bool", np.bool_, 8, "bool"),
        ("float64", np.float64, 64, "float"),
        ("float32", np.float32, 32, "float"),
        ("float16", np.float16, 16, "float"),
        ("bfloat16", ml_dtypes.bfloat16, 16, "float"),
        ("int64", np.int64, 64, "int"),
        ("int32", np.int32, 32, "int"),
        ("int16", np.int16, 16, "int"),
        ("int8", np.int8, 8, "int"),
        ("uint64", np.uint64, 64, "uint"),
        ("uint32", np.uint32, 32, "uint"),
        ("uint16", np.uint16, 16, "uint"),
        ("uint8", np.uint8, 8, "uint"),
        ("complex64", np.complex64, 64, "complex"),
        ("complex128", np.complex128, 128, "complex"),
    ]
    optional = [
        ("float8_e4m3fn", 8, "float"),
        ("float8_e5m2", 8, "float"),
        ("float8_e4m3fnuz", 8, "float"),
        ("float8_e5m2fnuz", 8, "float"),
        ("float8_e4m3b11fnuz", 8, "float"),
        ("float8_e3m4", 8, "float"),
        ("float8_e4m3", 8, "float"),
        ("float8_e8m0fnu", 8, "float"),
        ("float6_e2m3fn", 6, "float"),
        ("float6_e3m2fn", 6, "float"),
        ("float4_e2m1fn", 4, "float"),
        ("int4", 4, "int"),
        ("uint4", 4, "uint"),
        ("int2", 2, "int"),
        ("uint2", 2, "uint"),
    ]
    for name, bits, kind in optional:
        t = getattr(ml_dtypes, name, None)
        if t is not None:
            rows.append((name, t, bits, kind))
    return rows


DTYPE_TABLE: Mapping[str, DTypeInfo] = MappingProxyType(
    {name: DTypeInfo(name, np.dtype(t), bits, kind) for name, t, bits, kind in _entries()}
)

_BY_DTYPE: dict[np.dtype, DTypeInfo] = {info.dtype: info for info in DTYPE_TABLE.values()}

_ALIASES = {
    "bf16": "bfloat16",
    "f64": "float64",
    "f32": "float32",
    "f16": "float16",
    "fp32": "float32",
    "fp16": "float16",
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "i64": "int64",
    "i32": "int32",
    "i16": "int16",
    "i8": "int8",
    "u64": "uint64",
    "u32": "uint32",
    "u16": "uint16",
    "u8": "uint8",
    "i4": "int4",
    "u4": "uint4",
    "s4": "int4",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "fp4": "float4_e2m1fn",
    "nvfp4": "float4_e2m1fn",
    "bool_": "bool",
}


def dtype_info(x: Any) -> DTypeInfo:
    """Look up a dtype by canonical name, alias, NumPy dtype, scalar type or JAX dtype.

    Args:
      x: a canonical name or alias (``"bf16"``), a NumPy or ml_dtypes dtype, a scalar type or a JAX dtype.

    >>> dtype_info("bf16").name, dtype_info("int4").bits
    ('bfloat16', 4)

    Raises ``ValueError`` naming the input and listing the known names when unknown.
    """
    if isinstance(x, DTypeInfo):
        return x
    if isinstance(x, str):
        key = x.strip().lower()
        key = _ALIASES.get(key, key)
        info = DTYPE_TABLE.get(key)
        if info is not None:
            return info
        try:
            dt = np.dtype(x)
        except TypeError:
            dt = None
        if dt is not None and dt in _BY_DTYPE:
            return _BY_DTYPE[dt]
        raise ValueError(f"unknown dtype name {x!r}; expected one of {', '.join(DTYPE_TABLE)}")
    try:
        if isinstance(x, np.dtype):
            dt = x
        elif isinstance(x, type) or not hasattr(x, "dtype"):
            dt = np.dtype(x)
        else:
            dt = np.dtype(x.dtype)
    except (TypeError, ValueError):
        raise ValueError(f"cannot interpret {x!r} (type {type(x).__name__}) as a dtype") from None
    info = _BY_DTYPE.get(dt)
    if info is None:
        raise ValueError(f"dtype {dt} is not in Cairn's dtype table; expected one of {', '.join(DTYPE_TABLE)}")
    return info


def canonical_dtype(x: Any) -> str:
    """The canonical name of a dtype: ``canonical_dtype(np.float32) == 'float32'``.

    Args:
      x: anything :func:`dtype_info` accepts.
    """
    return dtype_info(x).name


def as_numpy_dtype(x: Any) -> np.dtype:
    """The NumPy (or ml_dtypes) dtype for a name or dtype-like.

    Args:
      x: anything :func:`dtype_info` accepts.
    """
    return dtype_info(x).dtype


def bit_width(x: Any) -> int:
    """Logical bits per element: 16 for bfloat16, 4 for int4 and float4_e2m1fn.

    Args:
      x: anything :func:`dtype_info` accepts.
    """
    return dtype_info(x).bits
