"""Record structures: stacking records into batches and describing their structure.

Records are nested dicts / lists / tuples / namedtuples whose leaves are NumPy arrays,
NumPy or Python scalars, ``bytes`` or ``str``. A leaf's path follows the Cairn
convention: its keys joined by ``/`` (dict keys as text, sequence indices as decimals,
namedtuple fields by name), e.g. ``"features/0/ids"``; the root itself is ``""``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["stack_records", "structure_of", "first_mismatch"]


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _stack_leaves(values: list, path: str) -> Any:
    first = values[0]
    if isinstance(first, np.ndarray):
        try:
            return np.stack(values)
        except ValueError as e:
            for i, v in enumerate(values):
                shape = getattr(v, "shape", None)
                if shape != first.shape:
                    raise ValueError(
                        f"cannot batch records: at path {path or '<root>'!r} record {i} has "
                        f"shape {shape} but record 0 has shape {first.shape}; give batch() a "
                        "batch_fn that pads, or pack the sequences (FirstFitPackIterDataset)"
                    ) from None
            raise ValueError(f"cannot batch records at path {path or '<root>'!r}: {e}") from None
    if isinstance(first, bool | int | float | complex | np.generic):
        return np.asarray(values)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def stack_records(records: Sequence[Any], path: str = "") -> Any:
    """Stack equally structured records leaf by leaf into one batch.

    NumPy leaves are stacked along a new leading axis, numbers become a 1-D array, other
    leaves (``bytes``, ``str``, objects) a 1-D object array. A record whose structure or
    shape differs from the first raises ``ValueError`` naming the record and path.

    >>> import numpy as np
    >>> b = stack_records([{"x": np.zeros(2), "y": 1}, {"x": np.ones(2), "y": 2}])
    >>> b["x"].shape, b["y"].tolist()
    ((2, 2), [1, 2])
    """
    records = list(records)
    if not records:
        raise ValueError("cannot batch an empty list of records")
    first = records[0]
    if isinstance(first, dict):
        keys = list(first)
        for i, r in enumerate(records):
            if not isinstance(r, dict) or len(r) != len(keys):
                _raise_mismatch(records, i, path)
        try:
            return {k: stack_records([r[k] for r in records], _join(path, k)) for k in keys}
        except KeyError:
            for i, r in enumerate(records):
                if r.keys() != first.keys():
                    _raise_mismatch(records, i, path)
            raise
    if isinstance(first, tuple | list):
        n = len(first)
        for i, r in enumerate(records):
            if type(r) is not type(first) or len(r) != n:
                _raise_mismatch(records, i, path)
        cols = [
            stack_records([r[j] for r in records], _join(path, _field(first, j))) for j in range(n)
        ]
        if _is_namedtuple(first):
            return type(first)(*cols)
        return type(first)(cols)
    return _stack_leaves(records, path)


def _field(x: Any, j: int) -> Any:
    return x._fields[j] if _is_namedtuple(x) else j


def _raise_mismatch(records: list, i: int, path: str) -> None:
    msg = first_mismatch(records[0], records[i])
    raise ValueError(
        f"cannot batch records: record {i} differs from record 0"
        + (
            f" at path {_join(path, msg[0]) if msg[0] else (path or '<root>')!r}: {msg[1]}"
            if msg
            else ""
        )
    )


def _leaf_signature(x: Any) -> tuple:
    if isinstance(x, np.ndarray):
        return ("ndarray", str(x.dtype), x.shape)
    if isinstance(x, np.generic):
        return ("scalar", str(x.dtype), ())
    return (type(x).__name__,)


def structure_of(x: Any, path: str = "") -> dict[str, tuple]:
    """Map each path of ``x`` to a signature: (kind, dtype, shape) for leaves, and the
    keys / length of containers (under the path plus ``{}`` / ``[]``).

    >>> import numpy as np
    >>> structure_of({"a": np.zeros((2, 3), np.int32), "b": [1.0]})
    {'{}': ('dict', ('a', 'b')), 'a': ('ndarray', 'int32', (2, 3)), 'b[]': ('list', 1), 'b/0': ('float',)}
    """
    out: dict[str, tuple] = {}
    _structure(x, path, out)
    return out


def _structure(x: Any, path: str, out: dict) -> None:
    if isinstance(x, dict):
        out[path + "{}"] = ("dict", tuple(sorted(map(str, x))))
        for k, v in x.items():
            _structure(v, _join(path, k), out)
    elif isinstance(x, tuple | list):
        out[path + "[]"] = (type(x).__name__, len(x))
        for j, v in enumerate(x):
            _structure(v, _join(path, _field(x, j)), out)
    else:
        out[path] = _leaf_signature(x)


def _describe(sig: tuple) -> str:
    if sig[0] == "ndarray":
        return f"an array of dtype {sig[1]} and shape {sig[2]}"
    if sig[0] == "scalar":
        return f"a NumPy scalar of dtype {sig[1]}"
    if sig[0] == "dict":
        return f"a dict with keys {list(sig[1])}"
    if len(sig) == 2:
        return f"a {sig[0]} of length {sig[1]}"
    return f"a {sig[0]}"


def first_mismatch(reference: Any, other: Any, check_shapes: bool = True) -> tuple[str, str] | None:
    """Return ``(path, explanation)`` of the first structural difference, or ``None``.

    >>> import numpy as np
    >>> first_mismatch({"a": np.zeros(3)}, {"a": np.zeros(4)})
    ('a', 'expected an array of dtype float64 and shape (3,) (as in the first record), got an array of dtype float64 and shape (4,)')
    """
    ref = structure_of(reference)
    got = structure_of(other)
    return _compare(ref, got, check_shapes)


def _compare(ref: dict, got: dict, check_shapes: bool) -> tuple[str, str] | None:
    for path, sig in ref.items():
        other = got.get(path)
        clean = path.removesuffix("{}").removesuffix("[]")
        if other is None:
            return clean, f"missing in this record (the first record has {_describe(sig)} there)"
        same = other == sig
        if not same and not check_shapes and sig[0] == "ndarray" and other[0] == "ndarray":
            same = sig[1] == other[1] and len(sig[2]) == len(other[2])
        if not same:
            return (
                clean,
                f"expected {_describe(sig)} (as in the first record), got {_describe(other)}",
            )
    for path in got:
        if path not in ref:
            clean = path.removesuffix("{}").removesuffix("[]")
            return clean, "present in this record but not in the first record"
    return None


class StructureChecker:
    """Compare every record with the first one seen; raise naming the first mismatch."""

    def __init__(self, stage: str, check_shapes: bool = True):
        self.stage = stage
        self.check_shapes = check_shapes
        self._ref: dict | None = None
        self.count = 0

    def check(self, x: Any, where: Callable[[], str] | None = None) -> None:
        sig = structure_of(x)
        if self._ref is None:
            self._ref = sig
        else:
            m = _compare(self._ref, sig, self.check_shapes)
            if m is not None:
                at = where() if where is not None else f"element {self.count}"
                raise StructureMismatchError(
                    f"debug mode: {at} produced by stage {self.stage!r} differs from the first "
                    f"element at path {m[0] or '<root>'!r}: {m[1]}",
                    path=m[0],
                )
        self.count += 1


class StructureMismatchError(ValueError):
    """A record's structure differs from the first record's (raised in debug mode)."""

    def __init__(self, message: str, path: str = ""):
        super().__init__(message)
        self.path = path
