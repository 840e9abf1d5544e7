"""``ArraySpec``: the shape, dtype, logical axes and sharding of an array, without data."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from cairn.core_array._dtypes import as_numpy_dtype, canonical_dtype
from cairn.core_array._jax_compat import require_jax
from cairn.core_array._paths import (
    PathError,
    _children,
    _register_leaf_type,
    join_path,
    map_with_path,
)
from cairn.core_array._qarray import QArray, QuantLayout

if TYPE_CHECKING:
    import jax

__all__ = ["ArraySpec", "spec_of", "specs_to_json", "specs_from_json"]

_FORMAT = "cairn.specs/1"


def _norm_axis_entry(entry: Any, where: str) -> Any:
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, (list, tuple)) and all(isinstance(e, str) for e in entry):
        return tuple(entry) if len(entry) != 1 else entry[0]
    raise ValueError(f"{where}: entry {entry!r} must be None, a mesh axis name or a tuple of names")


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """What an array is, without its data.

    Attributes:
      shape: tuple of non-negative ints.
      dtype: canonical dtype name (anything :func:`canonical_dtype` accepts is converted).
      logical_axes: optional tuple of logical axis names (or ``None`` entries), one per dim.
      sharding: optional partition spec: a tuple with one entry per dim, each ``None``, a
        mesh axis name, or a tuple of mesh axis names.

    >>> s = ArraySpec((2, 3), "bf16", logical_axes=("batch", None))
    >>> s.dtype, s.nbytes, ArraySpec.from_json(s.to_json()) == s
    ('bfloat16', 12, True)
    """

    shape: tuple[int, ...]
    dtype: str
    logical_axes: tuple[str | None, ...] | None = None
    sharding: tuple | None = None

    def __post_init__(self):
        try:
            shape = tuple(int(d) for d in self.shape)
        except (TypeError, ValueError):
            raise ValueError(f"ArraySpec shape must be a sequence of ints, got {self.shape!r}") from None
        if any(d < 0 for d in shape):
            raise ValueError(f"ArraySpec shape must be non-negative, got {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if self.logical_axes is not None:
            axes = tuple(self.logical_axes)
            if len(axes) != len(shape):
                raise ValueError(
                    f"ArraySpec logical_axes {axes} has {len(axes)} entries for a {len(shape)}-d shape {shape}"
                )
            for a in axes:
                if a is not None and not isinstance(a, str):
                    raise ValueError(f"ArraySpec logical axis {a!r} must be a string or None")
            object.__setattr__(self, "logical_axes", axes)
        if self.sharding is not None:
            sh = tuple(_norm_axis_entry(e, "ArraySpec sharding") for e in self.sharding)
            if len(sh) > len(shape):
                raise ValueError(f"ArraySpec sharding {sh} has more entries than the shape {shape} has dims")
            object.__setattr__(self, "sharding", sh)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def numpy_dtype(self) -> np.dtype:
        return as_numpy_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.size * self.numpy_dtype.itemsize

    def to_json(self) -> dict:
        """A JSON-able dict: ``{"shape", "dtype", "logical_axes", "sharding"}``."""
        sh = None if self.sharding is None else [list(e) if isinstance(e, tuple) else e for e in self.sharding]
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "logical_axes": None if self.logical_axes is None else list(self.logical_axes),
            "sharding": sh,
        }

    @classmethod
    def from_json(cls, d: dict) -> ArraySpec:
        if not isinstance(d, dict) or "shape" not in d or "dtype" not in d:
            raise ValueError(f"ArraySpec JSON must be an object with 'shape' and 'dtype', got {d!r}")
        unknown = set(d) - {"shape", "dtype", "logical_axes", "sharding"}
        if unknown:
            raise ValueError(f"ArraySpec JSON has unknown keys {sorted(unknown)}")
        return cls(tuple(d["shape"]), d["dtype"], d.get("logical_axes"), d.get("sharding"))

    @classmethod
    def from_array(cls, x: Any, logical_axes: tuple | None = None) -> ArraySpec:
        """The spec of an array-like (NumPy, JAX, ``jax.ShapeDtypeStruct``, scalar).

        A JAX array or struct with a ``NamedSharding`` contributes its partition spec.
        """
        sharding = None
        sh = getattr(x, "sharding", None)
        spec = getattr(sh, "spec", None)
        if spec is not None:
            sharding = tuple(spec)
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return cls(tuple(x.shape), x.dtype, logical_axes, sharding)
        arr = np.asarray(x)
        return cls(arr.shape, arr.dtype, logical_axes, sharding)  # type: ignore[arg-type]  # __post_init__ canonicalizes the dtype

    def partition_spec(self) -> jax.sharding.PartitionSpec:
        """The sharding as a ``jax.sharding.PartitionSpec`` (replicated when ``None``)."""
        jax = require_jax("ArraySpec.partition_spec")
        return jax.sharding.PartitionSpec(*(self.sharding or ()))

    def to_shape_dtype_struct(self, mesh: Any = None) -> jax.ShapeDtypeStruct:
        """A ``jax.ShapeDtypeStruct``; with ``mesh``, carrying a ``NamedSharding``."""
        jax = require_jax("ArraySpec.to_shape_dtype_struct")
        sharding = None
        if mesh is not None:
            sharding = jax.sharding.NamedSharding(mesh, self.partition_spec())
        return jax.ShapeDtypeStruct(self.shape, self.numpy_dtype, sharding=sharding)


_register_leaf_type(ArraySpec)


def spec_of(tree: Any) -> Any:
    """The tree of :class:`ArraySpec` for a tree of arrays (same structure)."""
    return map_with_path(lambda _p, x: ArraySpec.from_array(x), tree)


def _encode(x: Any, prefix: str) -> dict:
    if x is None:
        return {"t": "none"}
    if isinstance(x, ArraySpec):
        return {"t": "spec", "v": x.to_json()}
    if isinstance(x, QArray):
        parts = {n: _encode(getattr(x, n), join_path(prefix, n)) for n in ("qvalue", "scale", "zero_point")}
        return {"t": "qarray", "meta": x.metadata(), "v": parts}
    if isinstance(x, dict) and type(x) is dict:
        bad = [k for k in x if not isinstance(k, str)]
        if bad:
            raise PathError(f"specs_to_json: dict keys under {prefix or '<root>'!r} must be strings, got {bad!r}")
        return {"t": "dict", "v": {k: _encode(v, join_path(prefix, k)) for k, v in x.items()}}
    if type(x) in (list, tuple):
        return {"t": type(x).__name__, "v": [_encode(v, join_path(prefix, i)) for i, v in enumerate(x)]}
    ch = _children(x, prefix)
    if ch is None:
        raise PathError(f"specs_to_json: leaf at {prefix or '<root>'!r} is {type(x).__name__}, expected ArraySpec")
    # Other containers (namedtuples, dataclasses, registered pytrees) are stored by their
    # path components and come back as dicts.
    return {"t": "dict", "v": {c: _encode(v, join_path(prefix, c)) for c, v in ch[0]}}


def _decode_qarray(d: dict, where: str) -> QArray:
    meta, parts = d.get("meta"), d.get("v")
    if not isinstance(meta, dict) or not isinstance(parts, dict):
        raise ValueError(f"specs_from_json: malformed QArray node at {where or '<root>'!r}")
    children = {n: _decode(parts.get(n, {"t": "none"}), join_path(where, n)) for n in ("qvalue", "scale", "zero_point")}
    try:
        return QArray(
            children["qvalue"], children["scale"], children["zero_point"],
            qtype=meta["qtype"], layout=QuantLayout.from_json(meta["layout"]), dtype=meta["dtype"],
        )
    except (KeyError, TypeError) as e:
        raise ValueError(f"specs_from_json: QArray node at {where or '<root>'!r} lacks {e}") from None


def _decode(d: Any, where: str) -> Any:
    if not isinstance(d, dict) or "t" not in d:
        raise ValueError(f"specs_from_json: malformed node at {where or '<root>'!r}: {d!r}")
    t = d["t"]
    if t == "none":
        return None
    if t == "spec":
        return ArraySpec.from_json(d["v"])
    if t == "qarray":
        return _decode_qarray(d, where)
    if t == "dict":
        return {k: _decode(v, join_path(where, k)) for k, v in d["v"].items()}
    if t in ("list", "tuple"):
        items = [_decode(v, join_path(where, i)) for i, v in enumerate(d["v"])]
        return items if t == "list" else tuple(items)
    raise ValueError(f"specs_from_json: unknown node type {t!r} at {where or '<root>'!r}")


def specs_to_json(tree: Any) -> str:
    """Serialise a tree of :class:`ArraySpec` to JSON, keeping dict/list/tuple structure.

    A ``QArray`` whose parts are specs (what :func:`spec_of` gives for a ``QArray``) keeps
    its qtype, dtype and layout.

    >>> t = {"w": ArraySpec((2,), "float32"), "s": [ArraySpec((), "int4")]}
    >>> specs_from_json(specs_to_json(t)) == t
    True
    """
    return json.dumps({"format": _FORMAT, "tree": _encode(tree, "")}, separators=(",", ":"))


def specs_from_json(text: str) -> Any:
    """Inverse of :func:`specs_to_json`."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"specs_from_json: not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise ValueError(f"specs_from_json: expected a document with format {_FORMAT!r}")
    return _decode(doc["tree"], "")
