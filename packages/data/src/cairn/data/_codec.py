"""The example codec: a compact, pickle-free byte format for dicts of arrays and scalars.

:func:`encode_example` / :func:`decode_example` store the usual payload of an ArrayRecord
record: a (nested) dict whose leaves are NumPy arrays and scalars, ``bytes``, ``str``,
``int``, ``float``, ``bool`` and ``None``. Reading untrusted data cannot run code.

Layout (little-endian): ``b"CDX1"``, ``uint32`` field count, then per field ``uint16``
key length, the UTF-8 key (the field's path: nested dict keys joined by ``/``, the Cairn
path convention), one kind byte and a kind-specific payload:

==== =============== ===============================================================
kind value          payload
==== =============== ===============================================================
d    empty dict      none
n    ``None``        none
?    ``bool``        one byte, 0 or 1
i    ``int``         ``int64``
f    ``float``       ``float64``
s    ``str``         ``uint64`` length, UTF-8 bytes
b    ``bytes``       ``uint64`` length, the bytes (also ``bytearray``, ``memoryview``)
a    ``ndarray``     ``uint8`` dtype-name length, ASCII dtype name, ``uint8`` ndim,
                     ``ndim`` x ``uint64`` shape, ``uint64`` byte count, zero padding
                     to a 16-byte offset, raw C-order data
g    NumPy scalar    as ``a``, with ``ndim`` 0
==== =============== ===============================================================

Each kind is one entry of :data:`_KINDS`: a small encode function (writes the payload)
and a small decode function (reads it back). The format is a storage format: files
written by earlier versions must decode identically (``tests/data/test_data_codec.py``
holds golden bytes).

``cairn.core_array`` (path joining, dtype names) is imported on first use, so
``import cairn.data`` does not load it.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

__all__ = ["decode_example", "encode_example"]

_MAGIC = b"CDX1"
_ALIGN = 16
_MAX_KEY_BYTES = 0xFFFF
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_HEADER = struct.Struct("<4sI")
_SEPARATOR = "/"  # cairn.core_array.SEPARATOR; core_array is imported on first use (below)

# ``data`` as the decoder reads it: ``bytes`` as is, anything else as a byte memoryview.
_Buffer = bytes | memoryview


class _EmptyDict:
    """Marks an empty (nested) dict among the flattened fields: it has no leaf to store."""


_EMPTY = _EmptyDict()


# --- dtypes ---


@functools.lru_cache(maxsize=256)
def _dtype_name(dt: np.dtype) -> str:
    """The name stored for an array's dtype (canonical numeric names, ``dt.str`` for S/U)."""
    if dt.kind not in "SUOM" and dt.names is None:
        try:
            from cairn.core_array import canonical_dtype

            return canonical_dtype(dt)
        except (ImportError, ValueError, TypeError):
            pass
    if dt.kind in "SU":
        return dt.str
    raise TypeError(
        f"dtype {dt} cannot be encoded: use numeric/bool (incl. bfloat16, float8, int4), "
        "fixed-width bytes ('S') or unicode ('U') arrays"
    )


@functools.lru_cache(maxsize=256)
def _dtype_from_name(name: str) -> np.dtype:
    """Inverse of :func:`_dtype_name` (bounded cache: names come from untrusted bytes)."""
    try:
        from cairn.core_array import as_numpy_dtype

        return np.dtype(as_numpy_dtype(name))
    except (ImportError, ValueError, TypeError, KeyError):
        return np.dtype(name)


# --- encoders: append one field's payload (the kind byte is already written) ---


def _encode_nothing(buf: bytearray, path: str, value: Any) -> None:
    """Empty dict and ``None``: the kind byte says it all."""


def _encode_bool(buf: bytearray, path: str, value: bool) -> None:
    buf += b"\x01" if value else b"\x00"


def _encode_int(buf: bytearray, path: str, value: int) -> None:
    if not -(2**63) <= value < 2**63:
        raise OverflowError(f"encode_example: int at {path!r} does not fit in int64")
    buf += _I64.pack(value)


def _encode_float(buf: bytearray, path: str, value: float) -> None:
    buf += _F64.pack(value)


def _encode_str(buf: bytearray, path: str, value: str) -> None:
    _encode_bytes(buf, path, value.encode("utf-8"))


def _encode_bytes(buf: bytearray, path: str, value: bytes | bytearray | memoryview) -> None:
    raw = bytes(value)
    buf += _U64.pack(len(raw))
    buf += raw


def _encode_array(buf: bytearray, path: str, value: np.ndarray | np.generic) -> None:
    arr = np.asarray(value)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    try:
        name = _dtype_name(arr.dtype).encode("ascii")
    except TypeError as e:
        raise TypeError(f"encode_example: field {path!r}: {e}") from None
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")  # (ascontiguousarray would turn 0-d into 1-d)
    buf += _U8.pack(len(name))
    buf += name
    buf += _U8.pack(arr.ndim)
    buf += struct.pack(f"<{arr.ndim}Q", *arr.shape)
    buf += _U64.pack(arr.nbytes)
    buf += b"\x00" * (-len(buf) % _ALIGN)
    buf += arr.tobytes()


# --- decoders: read one field's payload at ``pos``, return (value, position after it) ---


def _need(mv: _Buffer, pos: int, k: int, what: str) -> None:
    if pos + k > len(mv):
        raise ValueError(
            f"decode_example: truncated data: {what} needs {k} bytes at offset {pos}, "
            f"record has {len(mv)}"
        )


def _decode_empty(mv: _Buffer, pos: int, path: str, copy: bool) -> tuple[Any, int]:
    return {}, pos


def _decode_none(mv: _Buffer, pos: int, path: str, copy: bool) -> tuple[Any, int]:
    return None, pos


def _decode_bool(mv: _Buffer, pos: int, path: str, copy: bool) -> tuple[Any, int]:
    _need(mv, pos, 1, f"field {path!r}")
    return mv[pos] != 0, pos + 1


def _decode_int(mv: _Buffer, pos: int, path: str, copy: bool) -> tuple[Any, int]:
    _need(mv, pos, 8, f"field {path!r}")
    return _I64.unpack_from(mv, pos)[0], pos + 8


def _decode_float(mv: _Buffer, pos: int, path: str, copy: bool) -> tuple[Any, int]:
    _need(mv, pos, 8, f"field {path!r}")
    return _F64.unpack_from(mv, pos)[0], pos + 8


def _decode_bytes(mv: _Buffer, pos: int, path: str, copy: bool) -> tuple[Any, int]:
    _need(mv, pos, 8, f"field {path!r}")
    (length,) = _U64.unpack_from(mv, pos)
    pos += 8
    _need(mv, pos, length, f"field {path!r}")
    return bytes(mv[pos : pos + length]), pos + length


def _decode_str(mv: _Buffer, pos: int, path: str, copy: bool) -> tuple[Any, int]:
    raw, pos = _decode_bytes(mv, pos, path, copy)
    return raw.decode("utf-8"), pos


def _decode_array(mv: _Buffer, pos: int, path: str, copy: bool) -> tuple[Any, int]:
    what = f"field {path!r}"
    _need(mv, pos, 1, what)
    name_len = mv[pos]
    pos += 1
    _need(mv, pos, name_len + 1, what)
    dtype = _dtype_from_name(bytes(mv[pos : pos + name_len]).decode("ascii"))
    pos += name_len
    ndim = mv[pos]
    pos += 1
    _need(mv, pos, 8 * ndim + 8, what)
    shape = struct.unpack_from(f"<{ndim}Q", mv, pos)
    pos += 8 * ndim
    (nbytes,) = _U64.unpack_from(mv, pos)
    pos += 8
    pos += -pos % _ALIGN
    _need(mv, pos, nbytes, what)
    if nbytes != math.prod(shape) * dtype.itemsize:
        raise ValueError(
            f"decode_example: field {path!r}: {nbytes} bytes do not match shape {shape} of {dtype}"
        )
    count = nbytes // max(dtype.itemsize, 1)
    arr = np.frombuffer(mv, dtype=dtype, count=count, offset=pos).reshape(shape)
    return (arr.copy() if copy else arr), pos + nbytes


def _decode_scalar(mv: _Buffer, pos: int, path: str, copy: bool) -> tuple[Any, int]:
    arr, pos = _decode_array(mv, pos, path, copy)
    return arr[()], pos


# --- the kind table ---


class _Kind(NamedTuple):
    """How one field kind is written and read."""

    encode: Callable[[bytearray, str, Any], None]
    decode: Callable[[_Buffer, int, str, bool], tuple[Any, int]]


_KINDS: dict[bytes, _Kind] = {
    b"d": _Kind(_encode_nothing, _decode_empty),
    b"n": _Kind(_encode_nothing, _decode_none),
    b"?": _Kind(_encode_bool, _decode_bool),
    b"i": _Kind(_encode_int, _decode_int),
    b"f": _Kind(_encode_float, _decode_float),
    b"s": _Kind(_encode_str, _decode_str),
    b"b": _Kind(_encode_bytes, _decode_bytes),
    b"a": _Kind(_encode_array, _decode_array),
    b"g": _Kind(_encode_array, _decode_scalar),
}

# The kind a leaf is stored as: the first row whose types it is an instance of (so a bool
# is '?', not 'i'; a NumPy float64 scalar, being a float, is 'f').
_KIND_OF: tuple[tuple[type | tuple[type, ...], bytes], ...] = (
    (_EmptyDict, b"d"),
    (type(None), b"n"),
    (bool, b"?"),
    (int, b"i"),
    (float, b"f"),
    (str, b"s"),
    ((bytes, bytearray, memoryview), b"b"),
    (np.ndarray, b"a"),
    (np.generic, b"g"),
)

# type -> (kind byte, encoder), filled on first use of each type.
_KIND_BY_TYPE: dict[type, tuple[bytes, Callable[[bytearray, str, Any], None]]] = {}


def _kind_for(path: str, value: Any) -> tuple[bytes, Callable[[bytearray, str, Any], None]]:
    """The kind byte and encoder for ``value`` (``TypeError`` naming ``path`` if none fits)."""
    found = _KIND_BY_TYPE.get(type(value))
    if found is not None:
        return found
    for types, kind in _KIND_OF:
        if isinstance(value, types):
            found = _KIND_BY_TYPE[type(value)] = (kind, _KINDS[kind].encode)
            return found
    raise TypeError(
        f"encode_example: field {path!r} has unsupported type {type(value).__name__}; "
        "expected numpy array/scalar, bytes, str, int, float, bool, None or dict "
        "(convert lists with numpy.asarray)"
    )


# --- encode_example / decode_example ---


def _flatten(example: Mapping[str, Any], prefix: str, out: list[tuple[str, Any]]) -> None:
    """Append ``(path, leaf)`` for every leaf of ``example``; an empty dict is a leaf."""
    from cairn.core_array import PathError, join_path

    for key, value in example.items():
        if not isinstance(key, str):
            where = prefix + _SEPARATOR if prefix else _SEPARATOR
            raise TypeError(f"encode_example: keys must be str, got {key!r} in {where}")
        try:
            path = join_path(prefix, key)
        except PathError:
            full = prefix + _SEPARATOR + key if prefix else key
            raise ValueError(
                f"encode_example: key {full!r} must be non-empty and contain no '/' "
                "(nested dicts are joined with '/')"
            ) from None
        if not isinstance(value, Mapping):
            out.append((path, value))
        elif value:
            _flatten(value, path, out)
        else:
            out.append((path, _EMPTY))


def encode_example(example: Mapping[str, Any]) -> bytes:
    """Serialise a (nested) dict of arrays and scalars to bytes, without pickle.

    Supported leaves: ``numpy.ndarray`` (any shape; numeric, bool, bfloat16/float8/int4
    from ml_dtypes, fixed-width ``S``/``U``), NumPy scalars, ``bytes``, ``str``, Python
    ``int`` (64-bit), ``float``, ``bool`` and ``None``. Nested dicts are stored under
    ``/``-joined paths and rebuilt by :func:`decode_example`.

    Layout (little-endian): ``b"CDX1"``, ``uint32`` field count, then per field
    ``uint16`` key length, UTF-8 key, one kind byte, and a kind-specific payload; array
    data is zero-padded to a 16-byte offset so :func:`decode_example` can return aligned
    zero-copy views. The module docstring of ``cairn.data._codec`` tabulates the kinds.

    Args:
      example: a dict with ``str`` keys (non-empty, no ``/``); values are leaves as above
        or nested dicts. Arrays of any shape; big-endian arrays are stored little-endian,
        non-contiguous ones in C order.

    Returns:
      The encoded record.

    Raises:
      TypeError: ``example`` is not a dict, a key is not a ``str``, or a leaf (or an
        array's dtype) is not supported; the message names the field's path.
      ValueError: a key is empty or contains ``/``, or is longer than 65535 UTF-8 bytes.
      OverflowError: an ``int`` does not fit in int64.

    >>> import numpy as np
    >>> b = encode_example({"x": np.arange(3, dtype=np.int16), "meta": {"id": 7, "s": "hi"}})
    >>> d = decode_example(b)
    >>> d["x"], d["meta"]
    (array([0, 1, 2], dtype=int16), {'id': 7, 's': 'hi'})
    """
    if not isinstance(example, Mapping):
        raise TypeError(f"encode_example expects a dict, got {type(example).__name__}")
    fields: list[tuple[str, Any]] = []
    _flatten(example, "", fields)
    buf = bytearray(_HEADER.pack(_MAGIC, len(fields)))
    for path, value in fields:
        key = path.encode("utf-8")
        if len(key) > _MAX_KEY_BYTES:
            raise ValueError(f"encode_example: key {path[:40]!r}... is longer than 65535 bytes")
        kind, encode = _kind_for(path, value)
        buf += _U16.pack(len(key))
        buf += key
        buf += kind
        encode(buf, path, value)
    return bytes(buf)


def _insert(out: dict[str, Any], path: str, value: Any) -> None:
    """Put ``value`` at ``path`` in ``out``, creating the nested dicts above it."""
    node = out
    *parents, leaf = path.split(_SEPARATOR)
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value


def decode_example(data: bytes | bytearray | memoryview, *, copy: bool = False) -> dict[str, Any]:
    """Inverse of :func:`encode_example`: bytes -> (nested) dict.

    Args:
      data: one record as written by :func:`encode_example`.
      copy: return writable copies of the arrays instead of views into ``data``.

    Returns:
      The nested dict. Arrays are read-only views into ``data`` (when ``data`` is
      ``bytes``) aligned to 16 bytes within the record, unless ``copy=True``.

    Raises:
      ValueError: ``data`` is not a valid encoding (wrong magic, truncated, an unknown
        kind, an array whose byte count does not match its shape, trailing bytes); the
        message names the byte offset or field.

    >>> decode_example(encode_example({"a": {"b": None}, "c": b"raw"}))
    {'a': {'b': None}, 'c': b'raw'}
    """
    mv: _Buffer = data if isinstance(data, bytes) else memoryview(data).cast("B")
    _need(mv, 0, 8, "header")
    magic, count = _HEADER.unpack_from(mv, 0)
    if magic != _MAGIC:
        raise ValueError(
            f"decode_example: not an encode_example record (magic {magic!r}, expected {_MAGIC!r})"
        )
    pos = 8
    out: dict[str, Any] = {}
    for _ in range(count):
        _need(mv, pos, 2, "key length")
        (key_len,) = _U16.unpack_from(mv, pos)
        pos += 2
        _need(mv, pos, key_len + 1, "key")
        path = bytes(mv[pos : pos + key_len]).decode("utf-8")
        pos += key_len
        kind = bytes(mv[pos : pos + 1])
        handler = _KINDS.get(kind)
        if handler is None:
            raise ValueError(f"decode_example: unknown field kind {kind!r} for {path!r} at offset {pos}")
        value, pos = handler.decode(mv, pos + 1, path, copy)
        _insert(out, path, value)
    if pos != len(mv):
        raise ValueError(f"decode_example: {len(mv) - pos} trailing bytes after the last field")
    return out
