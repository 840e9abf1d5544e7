"""Record structures: stacking records into batches and describing their structure.

Records are nested dicts / lists / tuples / namedtuples whose leaves are NumPy arrays,
NumPy or Python scalars, ``bytes`` or ``str``. A leaf's path follows the Cairn
convention of ``cairn.core_array`` (whose :func:`~cairn.core_array.join_path` builds
every path here): its keys joined by ``/`` (dict keys as text, sequence indices as
decimals, namedtuple fields by name), e.g. ``"features/0/ids"``; the root itself is
``""``.

core_array is imported on first use (when a path is needed), so ``import cairn.data``
does not load it. Batching and the debug-mode structure check accept any dict key; paths are only built
to name where a record differs. A key that cannot be a path component (neither ``str``
nor ``int``, or a ``str`` containing ``/``) is then named by its ``repr`` under the path
of its parent, so the error stays readable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["batch_and_pad", "stack_records", "structure_of", "first_mismatch"]

# A position in a record: the keys from the root (dict keys, sequence indices, fields).
_Keys = tuple[Any, ...]


# --- naming positions ---


def _path(parent: str, keys: _Keys) -> str:
    """The path of ``keys`` below ``parent`` (``PathError`` for a key no path can hold)."""
    from cairn.core_array import join_path

    path = parent
    for key in keys:
        path = join_path(path, key)
    return path


def _location(parent: str, keys: _Keys) -> tuple[str, str]:
    """``(path, text)`` naming a position in an error message; never raises.

    ``path`` is the position's path, or for a key that cannot be a path component the
    path of the deepest container above it that has one; ``text`` says which it is.
    """
    try:
        from cairn.core_array import PathError, join_path
    except ImportError:  # (an error message is being built: do not replace it by another)
        return parent, f"keys {list(keys)!r} under path {parent or '<root>'!r}"
    path = parent
    for i, key in enumerate(keys):
        try:
            path = join_path(path, key)
        except PathError:
            rest = ", ".join(repr(k) for k in keys[i:])
            return path, f"key {rest} under path {path or '<root>'!r}"
    return path, f"path {path or '<root>'!r}"


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _field(x: Any, j: int) -> Any:
    """The key of element ``j`` of a sequence: its field name in a namedtuple, else ``j``."""
    return x._fields[j] if _is_namedtuple(x) else j


# --- batching ---


def _stack_leaves(values: list[Any], parent: str, keys: _Keys) -> Any:
    first = values[0]
    if isinstance(first, np.ndarray):
        try:
            return np.stack(values)
        except ValueError as e:
            where = _location(parent, keys)[1]
            for i, v in enumerate(values):
                shape = getattr(v, "shape", None)
                if shape != first.shape:
                    raise ValueError(
                        f"cannot batch records: at {where} record {i} has "
                        f"shape {shape} but record 0 has shape {first.shape}; give batch() a "
                        "batch_fn that pads, or pack the sequences (FirstFitPackIterDataset)"
                    ) from None
            raise ValueError(f"cannot batch records at {where}: {e}") from None
    if isinstance(first, bool | int | float | complex | np.generic):
        return np.asarray(values)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def stack_records(records: Sequence[Any], path: str = "") -> Any:
    """Stack equally structured records leaf by leaf into one batch.

    NumPy leaves are stacked along a new leading axis, numbers become a 1-D array, other
    leaves (``bytes``, ``str``, objects) a 1-D object array.

    Args:
      records: records of one structure (nested dicts / lists / tuples / namedtuples).
      path: the path of the records within a larger structure, used in error messages.

    Returns:
      One record of that structure whose leaves have a leading axis of ``len(records)``.

    Raises:
      ValueError: ``records`` is empty, or a record's structure or a leaf's shape
        differs from the first record's; the message names the record and the path.

    >>> import numpy as np
    >>> b = stack_records([{"x": np.zeros(2), "y": 1}, {"x": np.ones(2), "y": 2}])
    >>> b["x"].shape, b["y"].tolist()
    ((2, 2), [1, 2])
    """
    records = list(records)
    if not records:
        raise ValueError("cannot batch an empty list of records")
    return _stack(records, path, ())


def batch_and_pad(values: Sequence[Any], *, batch_size: int, pad_value: Any = 0) -> Any:
    """Stack ``values`` like :func:`stack_records` and pad every leaf to ``batch_size`` rows.

    Pass it as ``batch_fn`` (with ``functools.partial``) to keep a last, short batch at
    full size instead of dropping it. Padding rows are ``pad_value`` in each leaf's dtype.

    Args:
      values: between 1 and ``batch_size`` records of one structure.
      batch_size: the number of rows of every leaf of the result.
      pad_value: the value of the padding rows.

    Raises:
      ValueError: for no values, more than ``batch_size`` values, or values of
        different structures (named as by ``stack_records``).

    >>> import functools
    >>> pad = functools.partial(batch_and_pad, batch_size=3, pad_value=-1)
    >>> pad([{"x": np.ones(2)}, {"x": np.ones(2)}])["x"].tolist()
    [[1.0, 1.0], [1.0, 1.0], [-1.0, -1.0]]
    """
    values = list(values)
    if not values:
        raise ValueError("batch_and_pad: Cannot batch 0 values.")
    if len(values) > batch_size:
        raise ValueError(f"batch_and_pad: Cannot batch {len(values)} values to {batch_size}.")
    batch = _stack(values, "", ())
    missing = batch_size - len(values)
    return batch if missing == 0 else _pad(batch, missing, pad_value)


def _pad(x: Any, missing: int, pad_value: Any) -> Any:
    """Every array leaf of a stacked batch with ``missing`` rows of ``pad_value`` appended."""
    if isinstance(x, dict):
        return type(x)((k, _pad(v, missing, pad_value)) for k, v in x.items())
    if _is_namedtuple(x):
        return type(x)(*(_pad(v, missing, pad_value) for v in x))
    if isinstance(x, list | tuple):
        return type(x)(_pad(v, missing, pad_value) for v in x)
    x = np.asarray(x)
    fill = np.full((missing, *x.shape[1:]), pad_value, dtype=x.dtype)
    return np.concatenate([x, fill], axis=0)


def _stack(records: list[Any], parent: str, keys: _Keys) -> Any:
    first = records[0]
    if isinstance(first, dict):
        n = len(first)
        for i, r in enumerate(records):
            if not isinstance(r, dict) or len(r) != n:
                _raise_mismatch(records, i, parent, keys)
        try:
            return {k: _stack([r[k] for r in records], parent, keys + (k,)) for k in first}
        except KeyError:
            for i, r in enumerate(records):
                if r.keys() != first.keys():
                    _raise_mismatch(records, i, parent, keys)
            raise
    if isinstance(first, tuple | list):
        n = len(first)
        for i, r in enumerate(records):
            if type(r) is not type(first) or len(r) != n:
                _raise_mismatch(records, i, parent, keys)
        cols = [
            _stack([r[j] for r in records], parent, keys + (_field(first, j),)) for j in range(n)
        ]
        if _is_namedtuple(first):
            return type(first)(*cols)
        return type(first)(cols)
    return _stack_leaves(records, parent, keys)


def _raise_mismatch(records: list[Any], i: int, parent: str, keys: _Keys) -> None:
    found = _compare(_structure(records[0]), _structure(records[i]), True)
    detail = ""
    if found is not None:
        detail = f" at {_location(parent, keys + found[0])[1]}: {found[1]}"
    raise ValueError(f"cannot batch records: record {i} differs from record 0{detail}")


# --- structure signatures ---


def _leaf_signature(x: Any) -> tuple[Any, ...]:
    if isinstance(x, np.ndarray):
        return ("ndarray", str(x.dtype), x.shape)
    if isinstance(x, np.generic):
        return ("scalar", str(x.dtype), ())
    return ("leaf", type(x).__name__)


def _structure(x: Any) -> dict[_Keys, tuple[Any, ...]]:
    """Each position of ``x`` (keys from the root, containers included) -> its signature."""
    out: dict[_Keys, tuple[Any, ...]] = {}
    _walk(x, (), out)
    return out


def _walk(x: Any, keys: _Keys, out: dict[_Keys, tuple[Any, ...]]) -> None:
    if isinstance(x, dict):
        out[keys] = ("dict", tuple(sorted(map(str, x))))
        for k, v in x.items():
            _walk(v, (*keys, k), out)
    elif isinstance(x, tuple | list):
        out[keys] = ("sequence", type(x).__name__, len(x))
        for j, v in enumerate(x):
            _walk(v, (*keys, _field(x, j)), out)
    else:
        out[keys] = _leaf_signature(x)


def structure_of(x: Any, path: str = "") -> dict[str, tuple[Any, ...]]:
    """Map each path of ``x`` to the signature of what sits there.

    Containers have paths too (the root is ``path``, ``""`` by default), so one mapping
    in the one path convention describes the whole record; a path holds either a
    container or a leaf, never both.

    Signatures: ``("ndarray", dtype, shape)`` for arrays, ``("scalar", dtype, ())`` for
    NumPy scalars, ``("leaf", type name)`` for other leaves, ``("dict", sorted keys as
    str)`` for dicts and ``("sequence", type name, length)`` for lists, tuples and
    namedtuples.

    Args:
      x: a record (nested dicts / lists / tuples / namedtuples of leaves).
      path: the path of ``x`` itself; every other path is joined below it.

    Returns:
      ``{path: signature}`` in depth-first order, each container before its children.

    Raises:
      PathError: a dict key cannot be a path component (see
        :func:`cairn.core_array.key_name`); the message names the parent path.

    >>> import numpy as np
    >>> structure_of({"a": np.zeros((2, 3), np.int32), "b": [1.0]})
    {'': ('dict', ('a', 'b')), 'a': ('ndarray', 'int32', (2, 3)), 'b': ('sequence', 'list', 1), 'b/0': ('leaf', 'float')}
    """
    return {_path(path, keys): sig for keys, sig in _structure(x).items()}


def _describe(sig: tuple[Any, ...]) -> str:
    if sig[0] == "ndarray":
        return f"an array of dtype {sig[1]} and shape {sig[2]}"
    if sig[0] == "scalar":
        return f"a NumPy scalar of dtype {sig[1]}"
    if sig[0] == "dict":
        return f"a dict with keys {list(sig[1])}"
    if sig[0] == "sequence":
        return f"a {sig[1]} of length {sig[2]}"
    return f"a {sig[1]}"


def first_mismatch(reference: Any, other: Any, check_shapes: bool = True) -> tuple[str, str] | None:
    """Return ``(path, explanation)`` of the first structural difference, or ``None``.

    Args:
      reference: the record to compare against (the first record of a stream).
      other: the record to check.
      check_shapes: compare array shapes; if ``False`` only dtype and rank.

    Raises:
      PathError: the differing position is under a dict key that cannot be a path
        component.

    >>> import numpy as np
    >>> first_mismatch({"a": np.zeros(3)}, {"a": np.zeros(4)})
    ('a', 'expected an array of dtype float64 and shape (3,) (as in the first record), got an array of dtype float64 and shape (4,)')
    """
    found = _compare(_structure(reference), _structure(other), check_shapes)
    return None if found is None else (_path("", found[0]), found[1])


def _compare(
    ref: dict[_Keys, tuple[Any, ...]], got: dict[_Keys, tuple[Any, ...]], check_shapes: bool
) -> tuple[_Keys, str] | None:
    """``(keys, explanation)`` of the first position where ``got`` differs from ``ref``."""
    for keys, sig in ref.items():
        other = got.get(keys)
        if other is None:
            return keys, f"missing in this record (the first record has {_describe(sig)} there)"
        same = other == sig
        if not same and not check_shapes and sig[0] == "ndarray" and other[0] == "ndarray":
            same = sig[1] == other[1] and len(sig[2]) == len(other[2])
        if not same:
            return keys, f"expected {_describe(sig)} (as in the first record), got {_describe(other)}"
    for keys in got:
        if keys not in ref:
            return keys, "present in this record but not in the first record"
    return None


class StructureChecker:
    """Compare every record with the first one seen; raise naming the first mismatch.

    Args:
      stage: the pipeline stage whose output is checked (named in the error).
      check_shapes: compare array shapes; if ``False`` only dtype and rank.
    """

    def __init__(self, stage: str, check_shapes: bool = True) -> None:
        self.stage = stage
        self.check_shapes = check_shapes
        self._ref: dict[_Keys, tuple[Any, ...]] | None = None
        self.count = 0

    def check(self, x: Any, where: Callable[[], str] | None = None) -> None:
        """Record ``x`` as the reference if it is the first, else compare it with it.

        Raises:
          StructureMismatchError: ``x`` differs from the first record; ``where()`` (or
            ``"element <n>"``) names it in the message.
        """
        sig = _structure(x)
        if self._ref is None:
            self._ref = sig
        else:
            m = _compare(self._ref, sig, self.check_shapes)
            if m is not None:
                at = where() if where is not None else f"element {self.count}"
                path, text = _location("", m[0])
                raise StructureMismatchError(
                    f"debug mode: {at} produced by stage {self.stage!r} differs from the first "
                    f"element at {text}: {m[1]}",
                    path=path,
                )
        self.count += 1


class StructureMismatchError(ValueError):
    """A record's structure differs from the first record's (raised in debug mode).

    ``path`` is the path of the differing position (for a key that cannot be a path
    component, the path of the container holding it).

    Args:
      message: the error text.
      path: the path of the differing position (``""`` for the root).
    """

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path
