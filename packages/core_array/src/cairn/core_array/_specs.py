"""``ArraySpec``: the shape, dtype, logical axes and sharding of an array, without data.

A shape entry is an int or a *symbolic dimension*: a name such as ``"b"`` (a Python
identifier) standing for a size known only when an array arrives, limited by
``constraints`` written as JAX's shape polymorphism writes them (``"b <= 64"``,
``"b >= 1"``, ``"2 <= b"``, ``"b == c"``; ``<`` and ``>`` are accepted and stored as
``<=``/``>=`` with the bound moved by one).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
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

__all__ = ["ArraySpec", "spec_of", "specs_to_json", "specs_from_json", "shape_dtype_structs"]

# version 1: concrete shapes only; version 2 adds symbolic dims and constraints. A tree with
# no symbolic spec is still written as version 1, so older readers keep reading it.
_FORMAT = "cairn.specs/1"
_FORMAT_SYMBOLIC = "cairn.specs/2"
_FORMATS = (_FORMAT, _FORMAT_SYMBOLIC)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_CONSTRAINT = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*|-?\d+)\s*(<=|>=|==|<|>)\s*([A-Za-z_][A-Za-z0-9_]*|-?\d+)\s*\Z")


def _term(t: str) -> int | str:
    return t if _NAME.match(t) else int(t)


def _parse_constraint(text: Any) -> tuple[int | str, str, int | str]:
    """``"b < 65"`` -> ``("b", "<=", 64)``: one side a dimension name, ``<``/``>`` made
    non-strict (sizes are integers)."""
    m = _CONSTRAINT.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(
            f"ArraySpec constraint {text!r} must read '<term> <op> <term>' with op one of <=, >=, ==, <, > "
            "and each term a dimension name or an integer (e.g. 'b <= 64')"
        )
    lhs, op, rhs = _term(m.group(1)), m.group(2), _term(m.group(3))
    if isinstance(lhs, int) and isinstance(rhs, int):
        raise ValueError(f"ArraySpec constraint {text!r} names no dimension")
    if op in ("<", ">"):
        # a < b  <=>  a <= b - 1 (integers); move the bound on whichever side is a number
        delta = -1 if op == "<" else 1
        if isinstance(rhs, int):
            rhs += delta
        elif isinstance(lhs, int):
            lhs -= delta
        else:
            raise ValueError(f"ArraySpec constraint {text!r}: strict comparison of two dimensions; use <= or >=")
        op += "="
    return lhs, op, rhs


def _render_constraint(c: tuple[int | str, str, int | str]) -> str:
    return f"{c[0]} {c[1]} {c[2]}"


def _holds(c: tuple[int | str, str, int | str], env: Mapping[str, int]) -> bool:
    lhs = env[c[0]] if isinstance(c[0], str) else c[0]
    rhs = env[c[2]] if isinstance(c[2], str) else c[2]
    return lhs <= rhs if c[1] == "<=" else lhs >= rhs if c[1] == ">=" else lhs == rhs


def _norm_dim(d: Any, shape: Any) -> int | str:
    if isinstance(d, str):
        if not _NAME.match(d):
            raise ValueError(
                f"ArraySpec shape {tuple(shape)!r}: symbolic dimension {d!r} must be a name (a Python identifier)"
            )
        return d
    try:
        n = int(d)
    except Exception:  # noqa: BLE001 - a JAX symbolic dim raises its own error type
        if type(d).__name__ == "_DimExpr" and str(d).isidentifier():
            return str(d)  # a jax.export symbolic dimension that is a plain name
        raise ValueError(
            f"ArraySpec shape must be a sequence of ints or dimension names, got {shape!r}"
        ) from None
    if n < 0 or isinstance(d, bool) or n != d:
        raise ValueError(f"ArraySpec shape must be non-negative integers or names, got {tuple(shape)!r}")
    return n


def _norm_axis_entry(entry: Any, where: str) -> Any:
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, (list, tuple)) and all(isinstance(e, str) for e in entry):
        return tuple(entry) if len(entry) != 1 else entry[0]
    raise ValueError(f"{where}: entry {entry!r} must be None, a mesh axis name or a tuple of names")


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """What an array is, without its data.

    Args:
      shape: tuple with one entry per dim: a non-negative int, or a symbolic dimension
        name (``"b"``) whose size is bound when an array is checked against the spec.
      dtype: canonical dtype name (anything :func:`canonical_dtype` accepts is converted).
      logical_axes: optional tuple of logical axis names (or ``None`` entries), one per dim.
      sharding: optional partition spec: a tuple with one entry per dim, each ``None``, a
        mesh axis name, or a tuple of mesh axis names.
      constraints: constraints on the symbolic dims in JAX's syntax (``"b <= 64"``); each
        compares a dimension name with an integer or another name. Stored normalised
        (``"b < 65"`` becomes ``"b <= 64"``). Every name must appear in ``shape``.

    Raises:
      ValueError: a negative or non-integer size, a bad name or constraint, or a
        constraint on a dimension the shape does not have.

    >>> s = ArraySpec((2, 3), "bf16", logical_axes=("batch", None))
    >>> s.dtype, s.nbytes, ArraySpec.from_json(s.to_json()) == s
    ('bfloat16', 12, True)
    >>> t = ArraySpec(("b", 512), "float32", constraints=("b <= 64",))
    >>> t.symbols, t.dim_bounds(), t.matches((8, 512)), t.matches((65, 512))
    (('b',), {'b': (1, 64)}, True, False)
    >>> t.bind(b=8).shape
    (8, 512)
    """

    shape: tuple[int | str, ...]
    dtype: str
    logical_axes: tuple[str | None, ...] | None = None
    sharding: tuple | None = None
    constraints: tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.shape, str) or not hasattr(self.shape, "__iter__"):
            raise ValueError(f"ArraySpec shape must be a sequence of ints or dimension names, got {self.shape!r}")
        shape = tuple(_norm_dim(d, self.shape) for d in self.shape)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        self._init_constraints()
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

    def _init_constraints(self) -> None:
        raw = self.constraints
        if isinstance(raw, str):
            raw = (raw,)
        parsed = [_parse_constraint(c) for c in raw]
        names = set(self.symbols)
        for c in parsed:
            for t in (c[0], c[2]):
                if isinstance(t, str) and t not in names:
                    raise ValueError(
                        f"ArraySpec constraint {_render_constraint(c)!r} names dimension {t!r}, which the shape "
                        f"{self.shape} does not have"
                    )
        object.__setattr__(self, "constraints", tuple(dict.fromkeys(_render_constraint(c) for c in parsed)))

    # --- sizes ---

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def symbols(self) -> tuple[str, ...]:
        """The symbolic dimension names, in order of first appearance."""
        return tuple(dict.fromkeys(d for d in self.shape if isinstance(d, str)))

    @property
    def is_symbolic(self) -> bool:
        return any(isinstance(d, str) for d in self.shape)

    def _concrete_shape(self, what: str) -> tuple[int, ...]:
        if self.is_symbolic:
            raise ValueError(f"ArraySpec.{what}: shape {self.shape} has symbolic dims {self.symbols}; bind() them first")
        return self.shape  # type: ignore[return-value]  # no str entries

    @property
    def size(self) -> int:
        return math.prod(self._concrete_shape("size"))

    @property
    def numpy_dtype(self) -> np.dtype:
        return as_numpy_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self._concrete_shape("nbytes")) * self.numpy_dtype.itemsize

    def dim_bounds(self) -> dict[str, tuple[int, int | None]]:
        """``{name: (lowest, highest or None)}`` from the constraints that compare a name
        with an integer. A symbolic size is at least 1 (as in ``jax.export``)."""
        out: dict[str, tuple[int, int | None]] = {}
        for name in self.symbols:
            lo, hi = 1, None
            for c in (_parse_constraint(t) for t in self.constraints):
                for t, op, v in ((c[0], c[1], c[2]), (c[2], _FLIP[c[1]], c[0])):
                    if t == name and isinstance(v, int):
                        if op in ("<=", "=="):
                            hi = v if hi is None else min(hi, v)
                        if op in (">=", "=="):
                            lo = max(lo, v)
            out[name] = (lo, hi)
        return out

    # --- checking arrays against the spec ---

    def check_shape(self, shape: Any, bindings: Mapping[str, int] | None = None, *, what: str = "array") -> dict[str, int]:
        """Check a concrete ``shape`` against this spec and return the symbolic bindings.

        Args:
          shape: the concrete shape (a tuple of ints).
          bindings: sizes already bound to names (e.g. by another input sharing ``"b"``);
            a dimension of that name must agree.
          what: how the error message names the array (``"input 'x'"``).

        Returns:
          ``bindings`` extended with this spec's names.

        Raises:
          ValueError: naming the axis (and dimension name) that does not fit, or the
            constraint that fails.
        """
        shape = tuple(int(d) for d in shape)
        if len(shape) != len(self.shape):
            raise ValueError(f"{what}: has shape {shape} ({len(shape)} dims), expected {self.shape} ({self.ndim} dims)")
        env = dict(bindings or {})
        for axis, (got, want) in enumerate(zip(shape, self.shape)):
            if isinstance(want, int):
                if got != want:
                    raise ValueError(f"{what}: axis {axis} has size {got}, expected {want} (shape {self.shape})")
            elif got < 1:
                raise ValueError(f"{what}: axis {axis} ({want}) has size {got}; a symbolic dimension is at least 1")
            elif want in env and env[want] != got:
                raise ValueError(
                    f"{what}: axis {axis} ({want}) has size {got}, but {want} = {env[want]} elsewhere"
                )
            else:
                env[want] = got
        for text in self.constraints:
            if not _holds(_parse_constraint(text), env):
                bound = ", ".join(f"{n} = {env[n]}" for n in self.symbols)
                raise ValueError(f"{what}: shape {shape} gives {bound}, which breaks the constraint {text!r}")
        return env

    def matches(self, shape: Any) -> bool:
        """Whether a concrete ``shape`` fits (sizes, shared names, constraints).

        Args:
          shape: a concrete shape (a tuple of ints).
        """
        try:
            self.check_shape(shape)
        except (ValueError, TypeError):
            return False
        return True

    def bind(self, bindings: Mapping[str, int] | None = None, /, **sizes: int) -> ArraySpec:
        """This spec with symbolic dims replaced by sizes: a constraint whose names are
        all bound is checked and dropped, one partly bound gets the sizes substituted.

        Args:
          bindings: ``{name: size}`` for symbolic dims.
          **sizes: more sizes by name.

        Raises:
          ValueError: a size breaks a constraint.
        """
        env = {**(bindings or {}), **sizes}
        shape = tuple(env.get(d, d) if isinstance(d, str) else d for d in self.shape)
        left = []
        for text in self.constraints:
            c = _parse_constraint(text)
            if all(n in env for n in _names(text)):
                if not _holds(c, env):
                    raise ValueError(f"ArraySpec.bind: {env} breaks the constraint {text!r}")
            else:  # partly bound: the bound side becomes its number ("t >= b" with b=2: "t >= 2")
                left.append(_render_constraint(tuple(env.get(t, t) if isinstance(t, str) else t for t in c)))  # type: ignore[arg-type]
        return dataclasses.replace(self, shape=shape, constraints=tuple(left))

    # --- JSON and JAX ---

    def to_json(self) -> dict:
        """A JSON-able dict: ``{"shape", "dtype", "logical_axes", "sharding"}``, plus
        ``"constraints"`` when there are any (a concrete spec's JSON is unchanged)."""
        sh = None if self.sharding is None else [list(e) if isinstance(e, tuple) else e for e in self.sharding]
        d: dict[str, Any] = {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "logical_axes": None if self.logical_axes is None else list(self.logical_axes),
            "sharding": sh,
        }
        if self.constraints:
            d["constraints"] = list(self.constraints)
        return d

    @classmethod
    def from_json(cls, d: dict) -> ArraySpec:
        """Inverse of :meth:`to_json` (a dict without ``"constraints"`` loads too).

        Args:
          d: a dict as :meth:`to_json` writes it.

        Raises:
          ValueError: not an object with ``shape`` and ``dtype``, or unknown keys.
        """
        if not isinstance(d, dict) or "shape" not in d or "dtype" not in d:
            raise ValueError(f"ArraySpec JSON must be an object with 'shape' and 'dtype', got {d!r}")
        unknown = set(d) - {"shape", "dtype", "logical_axes", "sharding", "constraints"}
        if unknown:
            raise ValueError(f"ArraySpec JSON has unknown keys {sorted(unknown)}")
        if not isinstance(d["shape"], list | tuple):
            raise ValueError(f"ArraySpec JSON 'shape' must be a list, got {d['shape']!r}")
        cons = d.get("constraints") or ()
        if not isinstance(cons, list | tuple):
            raise ValueError(f"ArraySpec JSON 'constraints' must be a list of strings, got {cons!r}")
        return cls(tuple(d["shape"]), d["dtype"], d.get("logical_axes"), d.get("sharding"), tuple(cons))

    @classmethod
    def from_array(cls, x: Any, logical_axes: tuple | None = None) -> ArraySpec:
        """The spec of an array-like (NumPy, JAX, ``jax.ShapeDtypeStruct``, scalar).

        A JAX array or struct with a ``NamedSharding`` contributes its partition spec.

        Args:
          x: the array-like.
          logical_axes: optional logical axis names, one per dim.
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

    def to_shape_dtype_struct(self, mesh: Any = None, *, scope: Any = None) -> jax.ShapeDtypeStruct:
        """A ``jax.ShapeDtypeStruct``; with ``mesh``, carrying a ``NamedSharding``.

        Symbolic dims become ``jax.export`` symbolic dimensions. Specs that share a name
        must share a scope: pass ``scope`` (a ``jax.export.SymbolicScope``, e.g. from
        :func:`shape_dtype_structs`, which does this for a whole tree); without it this
        spec's own constraints make a fresh scope.

        Args:
          mesh: a ``jax.sharding.Mesh`` for the spec's ``sharding``, or ``None``.
          scope: a ``jax.export.SymbolicScope`` shared with other specs, or ``None``.
        """
        jax = require_jax("ArraySpec.to_shape_dtype_struct")
        sharding = None
        if mesh is not None:
            sharding = jax.sharding.NamedSharding(mesh, self.partition_spec())
        shape: Any = self.shape
        if self.is_symbolic:
            from jax import export

            if scope is None:
                scope = export.SymbolicScope(self.constraints)
            shape = export.symbolic_shape(", ".join(str(d) for d in self.shape), scope=scope)
        return jax.ShapeDtypeStruct(shape, self.numpy_dtype, sharding=sharding)


_FLIP = {"<=": ">=", ">=": "<=", "==": "=="}


def _names(constraint: str) -> list[str]:
    c = _parse_constraint(constraint)
    return [t for t in (c[0], c[2]) if isinstance(t, str)]


_register_leaf_type(ArraySpec)


def spec_of(tree: Any) -> Any:
    """The tree of :class:`ArraySpec` for a tree of arrays (same structure).

    Args:
      tree: a pytree of arrays (NumPy, JAX, ``QArray``) or ``jax.ShapeDtypeStruct`` s.
    """
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


def _leaf_specs(tree: Any) -> list[ArraySpec]:
    out: list[ArraySpec] = []
    map_with_path(lambda _p, x: out.append(x) if isinstance(x, ArraySpec) else None, tree)
    return out


def specs_to_json(tree: Any) -> str:
    """Serialise a tree of :class:`ArraySpec` to JSON, keeping dict/list/tuple structure.

    A ``QArray`` whose parts are specs (what :func:`spec_of` gives for a ``QArray``) keeps
    its qtype, dtype and layout. A tree with a symbolic spec is written as format
    ``cairn.specs/2``; any other as ``cairn.specs/1`` (what older readers expect).

    Args:
      tree: a pytree of :class:`ArraySpec` (and ``QArray`` s of specs).

    >>> t = {"w": ArraySpec((2,), "float32"), "s": [ArraySpec((), "int4")]}
    >>> specs_from_json(specs_to_json(t)) == t
    True
    >>> u = {"x": ArraySpec(("b", 3), "float32", constraints=("b <= 8",))}
    >>> json.loads(specs_to_json(u))["format"], specs_from_json(specs_to_json(u)) == u
    ('cairn.specs/2', True)
    """
    encoded = _encode(tree, "")
    fmt = _FORMAT_SYMBOLIC if any(s.is_symbolic for s in _leaf_specs(tree)) else _FORMAT
    return json.dumps({"format": fmt, "tree": encoded}, separators=(",", ":"))


def specs_from_json(text: str) -> Any:
    """Inverse of :func:`specs_to_json` (reads formats ``cairn.specs/1`` and ``/2``).

    Args:
      text: a JSON document written by :func:`specs_to_json`.

    Raises:
      ValueError: not JSON, an unknown format, a malformed node, or a symbolic dim in a
        version 1 document.
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"specs_from_json: not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") not in _FORMATS:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"specs_from_json: expected a document with format in {_FORMATS}, got {got!r}")
    tree = _decode(doc.get("tree"), "")
    if doc["format"] == _FORMAT and any(s.is_symbolic for s in _leaf_specs(tree)):
        raise ValueError(f"specs_from_json: a {_FORMAT!r} document cannot hold symbolic dims")
    return tree


def shape_dtype_structs(tree: Any, mesh: Any = None) -> Any:
    """The tree of ``jax.ShapeDtypeStruct`` for a tree of :class:`ArraySpec`.

    All symbolic dims share one ``jax.export.SymbolicScope`` holding every spec's
    constraints, so ``"b"`` in two inputs is the same dimension (JAX refuses dims from
    different scopes in one export).

    Args:
      tree: a pytree of :class:`ArraySpec`.
      mesh: a ``jax.sharding.Mesh``; specs with a ``sharding`` then get a ``NamedSharding`` on it.

    >>> import jax
    >>> t = shape_dtype_structs({"x": ArraySpec(("b", 3), "float32", constraints=("b <= 8",)),
    ...                          "y": ArraySpec(("b",), "int32")})
    >>> str(t["x"].shape[0]) == str(t["y"].shape[0]) == "b"
    True
    """
    require_jax("shape_dtype_structs")
    specs = _leaf_specs(tree)
    scope = None
    if any(s.is_symbolic for s in specs):
        from jax import export

        scope = export.SymbolicScope(tuple(dict.fromkeys(c for s in specs for c in s.constraints)))
    return map_with_path(
        lambda _p, x: x.to_shape_dtype_struct(mesh, scope=scope) if isinstance(x, ArraySpec) else x, tree
    )
