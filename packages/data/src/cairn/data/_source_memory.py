"""In-memory random-access sources, and the helpers every cairn.data source shares.

A *source* is anything with ``__len__``, ``__getitem__(i)`` and the batched
``__getitems__(indices) -> list``. The datasets call ``__getitems__`` once per batch of
(shuffled) indices, so that is the fast path each source optimises.
"""

from __future__ import annotations

import glob
import operator
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "CorruptRecordError",
    "InMemoryDataSource",
    "RangeDataSource",
]


class CorruptRecordError(RuntimeError):
    """A stored record or file could not be decoded.

    ``path`` is the file and ``index`` the record's index inside that file (``None`` when
    the whole file is unreadable); the message names both.

    Args:
      message: the error text (it names the file and the record).
      path: the file that could not be decoded, or None.
      index: the record's index inside ``path``; None when the whole file is unreadable.
    """

    def __init__(self, message: str, path: str | None = None, index: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.index = index


# --- indices ---


def _normalize_index(i: Any, length: int, owner: str) -> int:
    """Return ``i`` as a non-negative int in ``[0, length)`` (negative counts from the end)."""
    if isinstance(i, bool | np.bool_):
        raise TypeError(f"{owner} indices must be integers, got bool {i!r}")
    try:
        j = operator.index(i)
    except TypeError:
        raise TypeError(f"{owner} indices must be integers, got {type(i).__name__} {i!r}") from None
    k = j + length if j < 0 else j
    if not 0 <= k < length:
        raise IndexError(
            f"index {j} is out of range for {owner} of length {length} "
            f"(valid indices: {-length}..{length - 1})"
            if length
            else f"index {j} is out of range: {owner} is empty (length 0)"
        )
    return k


def _normalize_indices(indices: Any, length: int, owner: str) -> np.ndarray:
    """Vectorised :func:`_normalize_index` over a 1-D sequence; returns int64 array."""
    arr = np.asarray(indices)
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.ndim != 1:
        raise TypeError(
            f"{owner}.__getitems__ expects a 1-D sequence of integer indices, "
            f"got an array of shape {arr.shape}"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        bad = next((x for x in indices if not isinstance(x, int | np.integer)), arr[0])
        raise TypeError(f"{owner} indices must be integers, got {type(bad).__name__} {bad!r}")
    arr = arr.astype(np.int64, copy=True)
    neg = arr < 0
    arr[neg] += length
    bad = (arr < 0) | (arr >= length)
    if bad.any():
        pos = int(np.flatnonzero(bad)[0])
        orig = int(np.asarray(indices)[pos])
        raise IndexError(
            f"index {orig} (position {pos} of the batch) is out of range for {owner} of "
            f"length {length} (valid indices: {-length}..{length - 1})"
            if length
            else f"index {orig} is out of range: {owner} is empty (length 0)"
        )
    return arr


# --- paths ---

_INSTRUCTION_RE = re.compile(r"^(.*)\[(\d+):(\d+)\]$")
_GLOB_CHARS = re.compile(r"[*?[]")


def _expand_paths(
    paths: Any, *, marker: str, kind: str
) -> list[tuple[str, int | None, int | None]]:
    """Expand ``paths`` into ``(file, start, end)`` triples (``None`` = whole file).

    Accepts one path or a sequence of: files, directories (their files whose name
    contains ``marker``, e.g. ``".parquet"``, sorted; hidden files are ignored), glob patterns (sorted matches), ``"file[start:end]"`` strings and objects
    with ``filename``/``skip``/``take`` attributes (Grain's ``FileInstruction``).
    """
    if isinstance(paths, str | os.PathLike) or hasattr(paths, "filename"):
        items: Iterable[Any] = [paths]
    else:
        try:
            items = list(paths)
        except TypeError:
            raise TypeError(
                f"{kind} paths must be a path, a glob pattern or a list of them, got "
                f"{type(paths).__name__}"
            ) from None
    out: list[tuple[str, int | None, int | None]] = []
    for item in items:
        if hasattr(item, "filename") and hasattr(item, "skip") and hasattr(item, "take"):
            fn = os.fspath(item.filename)
            if not os.path.isfile(fn):
                raise FileNotFoundError(f"{kind} file not found: {fn!r}")
            out.append((fn, int(item.skip), int(item.skip) + int(item.take)))
            continue
        if not isinstance(item, str | os.PathLike):
            raise TypeError(
                f"{kind} paths must be str or os.PathLike, got {type(item).__name__} {item!r}"
            )
        p = os.fspath(item)
        if os.path.isfile(p):
            out.append((p, None, None))
            continue
        m = _INSTRUCTION_RE.match(p)
        if m and os.path.isfile(m.group(1)):
            start, end = int(m.group(2)), int(m.group(3))
            if end < start:
                raise ValueError(f"{kind} file instruction {p!r}: end {end} < start {start}")
            out.append((m.group(1), start, end))
            continue
        if os.path.isdir(p):
            found = sorted(
                os.path.join(p, f)
                for f in os.listdir(p)
                if not f.startswith(".") and marker in f and os.path.isfile(os.path.join(p, f))
            )
            if not found:
                raise FileNotFoundError(
                    f"{kind} directory {p!r} contains no files whose name contains {marker!r}"
                )
            out.extend((f, None, None) for f in found)
            continue
        if _GLOB_CHARS.search(p):
            found = sorted(f for f in glob.glob(p) if os.path.isfile(f))
            if not found:
                raise FileNotFoundError(f"{kind} glob pattern {p!r} matched no files")
            out.extend((f, None, None) for f in found)
            continue
        raise FileNotFoundError(f"{kind} file not found: {p!r}")
    if not out:
        raise ValueError(f"{kind} needs at least one file; got an empty list of paths")
    return out


# --- sources ---


class InMemoryDataSource:
    """A random-access source over a Python sequence (list, tuple, NumPy array, ...).

    Records are returned exactly as stored (no copy). ``__getitems__`` gathers a batch in
    one call; when the sequence is a NumPy array it uses fancy indexing and returns a
    list of rows.

    Args:
      elements: any sequence with ``__len__`` and ``__getitem__`` (list, tuple, NumPy array...);
        kept by reference.

    >>> src = InMemoryDataSource(["a", "b", "c"])
    >>> len(src), src[0], src[-1], src.__getitems__([2, 0])
    (3, 'a', 'c', ['c', 'a'])

    Raises:
      TypeError: ``elements`` is not such a sequence.
    """

    def __init__(self, elements: Sequence[Any]) -> None:
        if not hasattr(elements, "__len__") or not hasattr(elements, "__getitem__"):
            raise TypeError(
                "InMemoryDataSource needs a sequence with __len__ and __getitem__, got "
                f"{type(elements).__name__}; materialise iterators with list(...) first"
            )
        self._elements = elements
        self._len = len(elements)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Any:
        return self._elements[_normalize_index(index, self._len, "InMemoryDataSource")]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        idx = _normalize_indices(indices, self._len, "InMemoryDataSource")
        el = self._elements
        if isinstance(el, np.ndarray):
            return list(el[idx])
        return [el[i] for i in idx.tolist()]

    def __repr__(self) -> str:
        return f"InMemoryDataSource(len={self._len}, type={type(self._elements).__name__})"


class RangeDataSource:
    """The integers ``range(start, stop, step)`` as a random-access source (Grain's name).

    Records are Python ``int``.

    Args:
      start: the first integer.
      stop: the end (exclusive).
      step: the increment (nonzero, may be negative).

    >>> src = RangeDataSource(10, 0, -3)
    >>> len(src), src[0], src[-1], src.__getitems__([1, 2])
    (4, 10, 1, [7, 4])

    Raises:
      TypeError: a bound that is not an int.
      ValueError: ``step`` is 0.
    """

    def __init__(self, start: int, stop: int, step: int = 1) -> None:
        for name, v in (("start", start), ("stop", stop), ("step", step)):
            if not isinstance(v, int | np.integer) or isinstance(v, bool):
                raise TypeError(f"RangeDataSource {name} must be an int, got {v!r}")
        if step == 0:
            raise ValueError("RangeDataSource step must not be 0")
        self.start, self.stop, self.step = int(start), int(stop), int(step)
        self._range = range(self.start, self.stop, self.step)

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index: int) -> int:
        return self._range[_normalize_index(index, len(self._range), "RangeDataSource")]

    def __getitems__(self, indices: Sequence[int]) -> list[int]:
        idx = _normalize_indices(indices, len(self._range), "RangeDataSource")
        return (self.start + idx * self.step).tolist()

    def __repr__(self) -> str:
        return f"RangeDataSource(start={self.start}, stop={self.stop}, step={self.step})"
