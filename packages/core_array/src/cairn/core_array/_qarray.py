"""``QArray``: quantized values with their scale, zero point and scale layout.

``cairn.quant`` makes them and ``cairn.kernels`` consumes them; neither imports the other.

Sub-byte packing is decided here, once: values of a ``bits``-wide type (int4, uint4,
int2, uint2, float4_e2m1fn) are packed ``8 // bits`` to a byte along the *last* axis,
element ``k`` of each group in bits ``[k*bits, (k+1)*bits)`` (the first element in the
low bits); the last axis is padded with zero bits to a whole number of bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from cairn.core_array._dtypes import DTypeInfo, as_numpy_dtype, canonical_dtype, dtype_info
from cairn.core_array._jax_compat import jax_tree_util, on_jax_import
from cairn.core_array._paths import _register_leaf_type, _register_node_type

__all__ = ["QuantLayout", "QArray", "pack_bits", "unpack_bits", "LOGICAL_QTYPES", "NF4_LEVELS", "storage_dtype"]

# qtypes stored in another dtype: nf4 as 4-bit indices into NF4_LEVELS; the microscaling
# block formats as their element type (their block scales are the QArray's per-tile scale)
LOGICAL_QTYPES = {"nf4": "uint4", "mxfp8": "float8_e4m3fn", "mxfp4": "float4_e2m1fn", "nvfp4": "float4_e2m1fn"}

# NormalFloat4 (Dettmers et al. 2023, QLoRA): quantiles of N(0, 1) normalised to [-1, 1],
# 8 positive and 7 negative levels plus an exact 0. tests/core_array recomputes them.
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


def storage_dtype(qtype: str) -> str:
    """The dtype a qtype's values are stored in: ``uint4`` for ``nf4``, the element type
    for the block formats, the qtype itself otherwise.

    Args:
      qtype: a quantized type name (``"int8"``, ``"nf4"``, ``"mxfp4"``...).

    >>> storage_dtype("nf4"), storage_dtype("mxfp4"), storage_dtype("int8")
    ('uint4', 'float4_e2m1fn', 'int8')
    """
    return LOGICAL_QTYPES.get(qtype) or canonical_dtype(qtype)

_KINDS = ("per_tensor", "per_channel", "per_tile")


@dataclasses.dataclass(frozen=True)
class QuantLayout:
    """How ``scale`` (and ``zero_point``) cover the values.

    - ``per_tensor``: one scale; ``scale.shape`` is ``()`` or all ones.
    - ``per_channel``: one scale per index of ``axes``; ``scale`` keeps every dim, with
      size 1 on the other axes (``keepdims`` form, so it broadcasts).
    - ``per_tile``: each axis of ``axes`` is cut into tiles (``tile_size``: one length for
      every tiled axis, or a tuple with one length per axis), so on two axes the scales
      cover 2-d blocks (e.g. 128x128 weight blocks); along a tiled axis ``scale`` has
      ``shape[axis] // tile`` entries, on other axes 1 or the full size. One tiled axis
      keeps ``tile_size`` an ``int``.

    Args:
      kind: ``"per_tensor"``, ``"per_channel"`` or ``"per_tile"``.
      axes: the axes the scales vary along (per channel) or that are tiled (per tile).
      tile_size: per tile, one tile length for every tiled axis or one per axis; else ``None``.

    >>> QuantLayout.per_tile((0, 1), (2, 4)).expected_scale_shape((4, 8, 3))
    (2, 2, 3)
    """

    kind: str = "per_tensor"
    axes: tuple[int, ...] = ()
    tile_size: int | tuple[int, ...] | None = None

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"QuantLayout kind {self.kind!r} unknown; expected one of {_KINDS}")
        object.__setattr__(self, "axes", tuple(int(a) for a in self.axes))
        if self.kind == "per_tensor" and (self.axes or self.tile_size is not None):
            raise ValueError("QuantLayout per_tensor takes no axes and no tile_size")
        if self.kind == "per_channel" and (not self.axes or self.tile_size is not None):
            raise ValueError("QuantLayout per_channel needs axes and no tile_size")
        if self.kind == "per_tile":
            self._check_tiles()

    def _check_tiles(self) -> None:
        given = self.tile_size
        sizes: tuple[Any, ...] = tuple(given) if isinstance(given, list | tuple) else (given,) * len(self.axes)
        if not self.axes or len(sizes) != len(self.axes) or not all(
            isinstance(t, int | np.integer) and not isinstance(t, bool) and t > 0 for t in sizes
        ):
            raise ValueError(
                f"QuantLayout per_tile needs one or more axes and a positive tile_size (an int, or one per axis); "
                f"got axes {self.axes} and tile_size {self.tile_size!r}"
            )
        ints = tuple(int(t) for t in sizes)
        object.__setattr__(self, "tile_size", ints[0] if len(set(ints)) == 1 else ints)

    @property
    def tile_sizes(self) -> tuple[int, ...]:
        """One tile length per axis of ``axes`` (``()`` unless ``per_tile``)."""
        if self.kind != "per_tile":
            return ()
        t = self.tile_size
        return tuple(t) if isinstance(t, tuple) else (int(cast(int, t)),) * len(self.axes)

    @classmethod
    def per_tensor(cls) -> QuantLayout:
        return cls("per_tensor")

    @classmethod
    def per_channel(cls, *axes: int) -> QuantLayout:
        """One scale per index of ``axes`` (the other axes reduced).

        Args:
          *axes: the axes the scales vary along (an output-channel axis, usually).
        """
        return cls("per_channel", tuple(axes))

    @classmethod
    def per_tile(cls, axis: int | Sequence[int], tile_size: int | Sequence[int]) -> QuantLayout:
        """Tiles along ``axis`` (one int) or along each of several axes (``tile_size``: one
        length for all, or one per axis).

        Args:
          axis: the tiled axis, or several.
          tile_size: the tile length (for every tiled axis), or one per axis.
        """
        axes = (axis,) if isinstance(axis, int | np.integer) else tuple(axis)
        return cls("per_tile", axes, tile_size if isinstance(tile_size, int | np.integer) else tuple(tile_size))

    def expected_scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The full (non-broadcast) scale shape for values of ``shape``.

        Args:
          shape: the values' shape.
        """
        nd = len(shape)
        bad = [a for a in self.axes if not -nd <= a < nd]
        if bad:
            raise ValueError(f"QuantLayout {self.kind} axis {bad[0]} is out of range for values of shape {tuple(shape)}")
        axes = tuple(a % nd for a in self.axes)
        if len(set(axes)) != len(axes):
            raise ValueError(f"QuantLayout {self.kind} axes {self.axes} name the same axis twice for a {nd}-d shape")
        if self.kind == "per_tensor":
            return (1,) * nd
        if self.kind == "per_channel":
            return tuple(d if i in axes else 1 for i, d in enumerate(shape))
        tiles = dict(zip(axes, self.tile_sizes))
        for ax, tile in tiles.items():
            if shape[ax] % tile:
                raise ValueError(f"axis {ax} of size {shape[ax]} is not a multiple of tile_size {tile}")
        return tuple(d // tiles[i] if i in tiles else d for i, d in enumerate(shape))

    def repeat_tiles(self, a: Any, shape: tuple[int, ...]) -> Any:
        """A per-group array (a scale or zero point of this layout) with each tile's entry
        repeated over its tile, so it broadcasts against values of ``shape`` (NumPy or JAX;
        unchanged unless ``per_tile``).

        Args:
          a: the per-group array (NumPy or JAX).
          shape: the values' shape.

        >>> QuantLayout.per_tile(1, 2).repeat_tiles(np.array([[1.0, 2.0]]), (1, 4))
        array([[1., 1., 2., 2.]])
        """
        xp = _xp(a)
        for axis, size in zip((x % len(shape) for x in self.axes), self.tile_sizes):
            a = xp.repeat(a, size, axis=axis)
        return a

    def to_json(self) -> dict:
        t = self.tile_size
        return {"kind": self.kind, "axes": list(self.axes), "tile_size": list(t) if isinstance(t, tuple) else t}

    @classmethod
    def from_json(cls, d: dict) -> QuantLayout:
        """Inverse of :meth:`to_json`.

        Args:
          d: a dict with ``kind`` (and ``axes``, ``tile_size``).
        """
        if not isinstance(d, dict) or "kind" not in d:
            raise ValueError(f"QuantLayout.from_json expects a dict with 'kind', got {d!r}")
        axes = d.get("axes", ())
        if not isinstance(axes, list | tuple) or not all(
            isinstance(a, int) and not isinstance(a, bool) for a in axes
        ):
            raise ValueError(f"QuantLayout.from_json: 'axes' must be a list of ints, got {axes!r}")
        tile = d.get("tile_size")
        return cls(d["kind"], tuple(axes), tuple(tile) if isinstance(tile, list) else tile)


def _array_to_json(x: Any) -> dict:
    a = np.asarray(x)
    name = canonical_dtype(a.dtype)
    info = dtype_info(name)
    # ints as ints; floats (ml_dtypes included) widen exactly to float64
    wide = a.astype(np.int64 if info.kind in ("int", "uint") else np.float64)
    if info.kind == "bool":
        wide = a.astype(bool)
    return {"dtype": name, "shape": list(a.shape), "data": wide.reshape(-1).tolist()}


def _array_from_json(d: Any, what: str) -> np.ndarray:
    if not isinstance(d, dict) or any(k not in d for k in ("dtype", "shape", "data")):
        raise ValueError(f"QArray.from_json: {what!r} must be a dict with dtype, shape and data, got {d!r}")
    dtype = as_numpy_dtype(d["dtype"])
    shape = tuple(d["shape"])
    data = d["data"]
    if not isinstance(data, list) or len(data) != int(np.prod(shape, dtype=np.int64)):
        raise ValueError(
            f"QArray.from_json: {what!r} has shape {list(shape)} but "
            f"{len(data) if isinstance(data, list) else type(data).__name__} values"
        )
    kind = dtype_info(d["dtype"]).kind
    wide = np.asarray(data, np.int64 if kind in ("int", "uint") else (bool if kind == "bool" else np.float64))
    out = wide.astype(dtype).reshape(shape)
    if kind in ("int", "uint") and not np.array_equal(out.astype(np.int64), wide.reshape(shape)):
        raise ValueError(f"QArray.from_json: {what!r} holds values outside {d['dtype']}")
    return out


def _tile_split(shape: tuple[int, ...], layout: QuantLayout) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``shape`` with each tiled axis split into (tiles, tile) and the positions of the
    inner (tile) axes: a scale of the layout's shape broadcasts once expanded there."""
    tiles = dict(zip((a % len(shape) for a in layout.axes), layout.tile_sizes))
    split: list[int] = []
    inner: list[int] = []
    for i, d in enumerate(shape):
        if i in tiles:
            split += [d // tiles[i], tiles[i]]
            inner.append(len(split) - 1)
        else:
            split.append(d)
    return tuple(split), tuple(inner)


def _xp(x: Any):
    if isinstance(x, np.ndarray) or np.isscalar(x):
        return np
    import jax.numpy as jnp

    return jnp


@dataclasses.dataclass(frozen=True, eq=False)
class QArray:
    """Quantized ``qvalue`` with ``scale`` (and optional ``zero_point``).

    ``dequantize()`` computes ``(qvalue - zero_point) * scale`` in float32 and casts to
    ``dtype`` (the original dtype). ``qvalue`` holds the quantized type ``qtype``
    unpacked (one element per value; ml_dtypes for sub-byte types), or, after
    :meth:`pack`, sub-byte values packed into ``uint8`` along the last axis with
    ``packed_length`` the logical length of that axis (half the memory for 4-bit types;
    :meth:`dequantize` unpacks). A JAX pytree (children: qvalue, scale, zero_point) once
    JAX is imported.

    Args:
      qvalue: the quantized values (``qtype``, or packed ``uint8`` after :meth:`pack`).
      scale: the scales, shaped as ``layout`` says (broadcastable against ``qvalue``).
      zero_point: optional zero points, shaped like ``scale`` (``None``: symmetric).
      qtype: the quantized type's name (``"int8"``, ``"int4"``, ``"nf4"``...).
      layout: how ``scale`` covers the values (a :class:`QuantLayout`).
      dtype: the original dtype that :meth:`dequantize` returns.
      packed_length: the logical last-axis length of packed sub-byte values, else ``None``.

    >>> q = QArray(np.array([[2, -4]], np.int8), np.array([[0.5, 0.25]], np.float32),
    ...            qtype="int8", layout=QuantLayout.per_channel(1))
    >>> q.dequantize()
    array([[ 1., -1.]], dtype=float32)
    """

    qvalue: Any
    scale: Any
    zero_point: Any = None
    qtype: str = "int8"
    layout: QuantLayout = dataclasses.field(default_factory=QuantLayout)
    dtype: str = "float32"
    packed_length: int | None = None

    def __post_init__(self):
        if self.qtype not in LOGICAL_QTYPES:
            object.__setattr__(self, "qtype", canonical_dtype(self.qtype))
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if not isinstance(self.layout, QuantLayout):
            raise TypeError(f"QArray layout must be a QuantLayout, got {type(self.layout).__name__}")
        jax_tree_util()  # registers QArray as a pytree if JAX is in use
        vdtype = getattr(self.qvalue, "dtype", None)
        if self.packed_length is not None:
            self._check_packed(vdtype)
            vdtype = None
        if vdtype is not None:
            try:
                vname = canonical_dtype(vdtype)
            except ValueError:
                vname = str(vdtype)
            if vname != storage_dtype(self.qtype):
                raise ValueError(
                    f"QArray qvalue has dtype {vname} but qtype is {self.qtype!r}"
                    + (f" (stored as {storage_dtype(self.qtype)})" if self.qtype in LOGICAL_QTYPES else "")
                    + "; qvalue holds the "
                    "quantized type itself, unpacked (use unpack_bits on packed storage)"
                )
        shape = getattr(self.qvalue, "shape", None)
        sshape = getattr(self.scale, "shape", None)
        if shape is None:
            return
        shape = self.shape
        expected = self.layout.expected_scale_shape(shape)  # checks the layout's axes too
        if sshape is None:
            return
        sshape = tuple(sshape)
        ok = sshape == () or (
            len(sshape) == len(shape) and all(s == e or s == 1 for s, e in zip(sshape, expected))
        )
        if self.layout.kind == "per_tile" and sshape != ():
            ok = ok and all(sshape[a % len(shape)] == expected[a % len(shape)] for a in self.layout.axes)
        if not ok:
            raise ValueError(
                f"QArray scale shape {sshape} does not fit values of shape {shape} with layout "
                f"{self.layout}; expected {expected} (1 allowed on broadcast axes)"
            )
        if self.zero_point is not None:
            zshape = tuple(getattr(self.zero_point, "shape", ()))
            if zshape not in ((), sshape):
                raise ValueError(f"QArray zero_point shape {zshape} must be () or the scale shape {sshape}")

    def _check_packed(self, vdtype: Any) -> None:
        bits = dtype_info(storage_dtype(self.qtype)).bits
        if bits >= 8:
            raise ValueError(f"QArray packed_length: only sub-byte qtypes are packed, not {self.qtype!r}")
        if vdtype is not None and canonical_dtype(vdtype) != "uint8":
            raise ValueError(f"QArray packed_length: a packed qvalue is uint8, got {vdtype}")
        shape = getattr(self.qvalue, "shape", None)
        n = int(self.packed_length or 0)
        if shape is not None and (not shape or -(-n * bits // 8) != shape[-1]):
            raise ValueError(
                f"QArray packed_length {n} of {bits}-bit values needs {-(-n * bits // 8)} bytes in the last "
                f"axis, but qvalue has shape {tuple(shape)}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        shape = tuple(self.qvalue.shape)
        return shape if self.packed_length is None else (*shape[:-1], int(self.packed_length))

    def pack(self) -> QArray:
        """The same values with sub-byte ``qvalue`` packed into ``uint8`` (NumPy or JAX)."""
        if self.packed_length is not None or dtype_info(storage_dtype(self.qtype)).bits >= 8:
            return self
        return dataclasses.replace(self, qvalue=pack_bits(self.qvalue), packed_length=self.shape[-1])

    def unpack(self) -> QArray:
        """The same values with ``qvalue`` one element per value (inverse of :meth:`pack`)."""
        if self.packed_length is None:
            return self
        values = unpack_bits(self.qvalue, storage_dtype(self.qtype), int(self.packed_length))
        return dataclasses.replace(self, qvalue=values, packed_length=None)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the values, scales and zero points as stored packed (sub-byte types at
        their bit width, as :func:`pack_bits` stores them)."""
        total = 0
        for a in (self.qvalue, self.scale, self.zero_point):
            if a is not None and hasattr(a, "dtype"):
                shape = tuple(getattr(a, "shape", ()))
                rows = int(np.prod(shape[:-1], dtype=np.int64)) if shape else 1
                last = shape[-1] if shape else 1
                # pack_bits pads each row of the last axis to whole bytes
                total += rows * ((last * dtype_info(a.dtype).bits + 7) // 8)
        return total

    def dequantize(self) -> Any:
        if self.packed_length is not None:
            return self.unpack().dequantize()
        xp = _xp(self.qvalue)
        if self.qtype == "nf4":
            v = xp.asarray(NF4_LEVELS, xp.float32)[self.qvalue.astype(xp.int32)]
        else:
            v = self.qvalue.astype(xp.float32)
        scale: Any = xp.asarray(self.scale).astype(xp.float32)
        zero = None if self.zero_point is None else xp.asarray(self.zero_point).astype(xp.float32)
        if self.layout.kind == "per_tile" and scale.ndim > 0:
            # tiles as their own axes: the scale broadcasts, no repeated copy of it is made
            shape = v.shape
            split, tile_axes = _tile_split(shape, self.layout)
            v = v.reshape(split)
            if zero is not None:
                v = v - xp.expand_dims(zero, tile_axes)
            v = (v * xp.expand_dims(scale, tile_axes)).reshape(shape)
            return v.astype(as_numpy_dtype(self.dtype))
        if zero is not None:
            v = v - zero
        v = v * scale
        return v.astype(as_numpy_dtype(self.dtype))

    def metadata(self) -> dict:
        """JSON-able description (everything but the arrays)."""
        return {
            "qtype": self.qtype,
            "dtype": self.dtype,
            "layout": self.layout.to_json(),
            "has_zero_point": self.zero_point is not None,
            "packed_length": self.packed_length,
        }

    def to_json(self) -> dict:
        """The whole QArray as JSON-able data (arrays as dtype name, shape and values;
        exact for every dtype in the table, sub-byte ones included).

        >>> q = QArray(np.array([[1, -2]], np.int8), np.array([[0.5, 0.25]], np.float32),
        ...            qtype="int8", layout=QuantLayout.per_channel(1))
        >>> r = QArray.from_json(q.to_json())
        >>> r.layout == q.layout and r.scale.dtype == np.float32 and r.qvalue.tolist()
        [[1, -2]]
        """
        return {
            **self.metadata(),
            "qvalue": _array_to_json(self.qvalue),
            "scale": _array_to_json(self.scale),
            "zero_point": None if self.zero_point is None else _array_to_json(self.zero_point),
        }

    @classmethod
    def from_json(cls, d: dict) -> QArray:
        """Inverse of :meth:`to_json` (NumPy arrays, bit for bit).

        Args:
          d: a dict as :meth:`to_json` writes it.
        """
        if not isinstance(d, dict):
            raise ValueError(f"QArray.from_json expects a dict, got {type(d).__name__}")
        missing = [k for k in ("qtype", "dtype", "layout", "qvalue", "scale") if k not in d]
        if missing:
            raise ValueError(f"QArray.from_json: missing keys {missing}")
        zp = d.get("zero_point")
        return cls(
            _array_from_json(d["qvalue"], "qvalue"),
            _array_from_json(d["scale"], "scale"),
            None if zp is None else _array_from_json(zp, "zero_point"),
            qtype=d["qtype"],
            layout=QuantLayout.from_json(d["layout"]),
            dtype=d["dtype"],
            packed_length=d.get("packed_length"),
        )


_CHILDREN = ("qvalue", "scale", "zero_point")


def _rebuild(q: QArray, children: list) -> QArray:
    """``q`` with new children, unvalidated (as JAX rebuilds pytrees: the children may be
    tracers, ShapeDtypeStructs or ``None`` placeholders)."""
    new = object.__new__(QArray)
    for name, v in zip(_CHILDREN, children):
        object.__setattr__(new, name, v)
    for name in ("qtype", "layout", "dtype", "packed_length"):
        object.__setattr__(new, name, getattr(q, name))
    return new


# the path walker sees the same children with or without JAX (None zero_point: no leaf)
_register_node_type(QArray, lambda q: [(n, getattr(q, n)) for n in _CHILDREN], _rebuild)
_register_leaf_type(QuantLayout)


def _register_qarray() -> None:
    import jax.tree_util as tu

    def flatten_with_keys(q: QArray):
        children = (
            (tu.GetAttrKey("qvalue"), q.qvalue),
            (tu.GetAttrKey("scale"), q.scale),
            (tu.GetAttrKey("zero_point"), q.zero_point),
        )
        return children, (q.qtype, q.layout, q.dtype, q.packed_length)

    def unflatten(aux, children):
        q = object.__new__(QArray)
        for name, v in zip(("qvalue", "scale", "zero_point"), children):
            object.__setattr__(q, name, v)
        for name, v in zip(("qtype", "layout", "dtype", "packed_length"), aux):
            object.__setattr__(q, name, v)
        return q

    tu.register_pytree_with_keys(QArray, flatten_with_keys, unflatten)


on_jax_import(_register_qarray)


def _bits_of(dtype: Any, bits: int | None) -> int:
    if bits is not None:
        return int(bits)
    return dtype_info(dtype).bits


def pack_bits(x: Any, bits: int | None = None) -> np.ndarray:
    """Pack a sub-byte array along its last axis into ``uint8``.

    ``x`` is an ml_dtypes sub-byte array (int4, uint4, int2, uint2, float4_e2m1fn) or an
    integer array with values representable in ``bits`` bits. The last axis shrinks to
    ``ceil(n * bits / 8)``.

    A JAX array is packed with JAX operations (under ``jit`` too) and stays a JAX array.

    Args:
      x: a sub-byte ml_dtypes array, or an integer array whose values fit in ``bits`` bits (NumPy or JAX).
      bits: the width per value; ``None`` reads it from ``x``'s dtype.

    >>> import ml_dtypes
    >>> pack_bits(np.array([1, -1, 7], ml_dtypes.int4))
    array([241,   7], dtype=uint8)
    """
    xp = np if isinstance(x, np.ndarray | np.generic) or not hasattr(x, "dtype") else _xp(x)
    x = np.asarray(x) if xp is np else x
    b = _bits_of(np.dtype(x.dtype), bits) if bits is None else int(bits)
    if b not in (1, 2, 4):
        raise ValueError(f"pack_bits packs 1-, 2- or 4-bit values, got bits={b} for dtype {x.dtype}")
    if x.ndim == 0:
        raise ValueError("pack_bits needs at least one axis")
    mask = (1 << b) - 1
    if xp is not np:  # JAX: float4 by its bit pattern, not its value
        wide = _float4_bits(x) if xp.issubdtype(x.dtype, xp.floating) else x.astype(xp.int32)
        raw = (wide & mask).astype(xp.uint8)
    elif x.dtype.itemsize == 1:
        raw = x.view(np.uint8) & mask
    else:
        raw = (x.astype(np.int64) & mask).astype(np.uint8)
    per, n = 8 // b, x.shape[-1]
    pad = (-n) % per
    if pad:
        raw = xp.concatenate([raw, xp.zeros(x.shape[:-1] + (pad,), xp.uint8)], axis=-1)
    raw = raw.reshape(x.shape[:-1] + ((n + pad) // per, per))
    shifts = (xp.arange(per, dtype=xp.uint8) * b).astype(xp.uint8)
    return xp.bitwise_or.reduce(raw << shifts, axis=-1).astype(xp.uint8)

def unpack_bits(packed: Any, dtype: Any, length: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: ``length`` values of ``dtype`` along the last axis.

    Args:
      packed: the ``uint8`` array :func:`pack_bits` gave.
      dtype: the dtype of the values (``"int4"``...).
      length: the logical length of the last axis before packing.

    >>> import ml_dtypes
    >>> unpack_bits(np.array([241, 7], np.uint8), "int4", 3)
    array([1, -1, 7], dtype=int4)
    """
    xp = np if isinstance(packed, np.ndarray | np.generic) or not hasattr(packed, "dtype") else _xp(packed)
    packed = np.asarray(packed) if xp is np else packed
    if packed.dtype != np.uint8:
        raise ValueError(f"unpack_bits expects uint8 input, got {packed.dtype}")
    info = dtype_info(dtype)
    b = info.bits
    if b not in (1, 2, 4):
        raise ValueError(f"unpack_bits: {info.name} is not a 1-, 2- or 4-bit type")
    per = 8 // b
    if length > packed.shape[-1] * per or length < 0:
        raise ValueError(f"unpack_bits: {length} values do not fit {packed.shape[-1]} bytes of {b}-bit values")
    shifts = (xp.arange(per, dtype=xp.uint8) * b).astype(xp.uint8)
    raw = (packed[..., None] >> shifts) & ((1 << b) - 1)
    raw = raw.reshape(packed.shape[:-1] + (packed.shape[-1] * per,))[..., :length].astype(xp.uint8)
    if xp is not np:
        return _codes_to_jax(raw, info, b)
    if info.kind == "int":
        # sign-extend into the byte so that the ml_dtypes view reads the right value
        sign = (raw >> (b - 1)) & 1
        raw = raw | (sign * np.uint8((0xFF << b) & 0xFF)).astype(np.uint8)
    return np.ascontiguousarray(raw).view(info.dtype)

def _float4_bits(x: Any) -> Any:
    """The 4-bit code of each float4_e2m1fn value (sign, 2 exponent bits, 1 mantissa bit)."""
    import jax.numpy as jnp

    values = jnp.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], jnp.float32)
    v = x.astype(jnp.float32)
    code = jnp.argmin(jnp.abs(jnp.abs(v)[..., None] - values), axis=-1).astype(jnp.int32)
    return code | (jnp.signbit(v).astype(jnp.int32) << 3)


def _codes_to_jax(raw: Any, info: DTypeInfo, b: int) -> Any:
    """JAX values of ``b``-bit codes (JAX arrays cannot be viewed as ml_dtypes bytes)."""
    import jax.numpy as jnp

    raw = raw.astype(jnp.int32)
    if info.kind == "float":
        values = jnp.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], jnp.float32)
        mag = values[raw & 7]
        return jnp.where((raw >> 3) & 1, -mag, mag).astype(info.dtype)
    if info.kind == "int":
        raw = raw - ((raw >> (b - 1)) & 1) * (1 << b)
    return raw.astype(info.dtype)
