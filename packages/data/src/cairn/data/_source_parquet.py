"""Random access to the rows of Parquet files through row-group offsets.

Parquet can only decode whole row groups. The source reads every file's footer once,
keeps cumulative row counts over all row groups of all files, maps a row index to
``(row group, row in group)`` with a binary search, and keeps a bounded LRU cache of
decoded row groups (as NumPy columns). A batch decodes each row group it needs once.
"""

from __future__ import annotations

import array
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from cairn.data._source_memory import (
    CorruptRecordError,
    _expand_paths,
    _normalize_index,
    _normalize_indices,
)

__all__ = ["ParquetDataSource"]


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "ParquetDataSource needs pyarrow: pip install 'cairn-data[parquet]'"
        ) from e
    return pa, pq


def _object_array(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _readonly(a: np.ndarray) -> np.ndarray:
    if a.flags.writeable:
        a.setflags(write=False)
    return a


class _Column:
    """One decoded column of one row group.

    kind "np": ``values[i]`` is the row (NumPy scalar or fixed-shape array);
    kind "list": row ``i`` is ``values[offsets[i]:offsets[i+1]]`` (1-D array);
    kind "bytes" / "str": ``values`` is the column's whole data buffer (one ``bytes``)
    and row ``i`` is ``values[offsets[i]:offsets[i+1]]`` (decoded for "str"): the cache
    holds one buffer instead of one Python object per row, so a row group decodes fast
    and forked workers read the parent's cached buffers without copying their pages;
    kind "obj": ``values`` is an object array of Python values (nested types).
    ``mask`` (optional) marks null rows, returned as ``None``.
    """

    __slots__ = ("kind", "values", "offsets", "mask")

    def __init__(self, kind: str, values: Any, offsets=None, mask=None):
        self.kind, self.values, self.offsets, self.mask = kind, values, offsets, mask

    def row(self, i: int) -> Any:
        if self.mask is not None and self.mask[i]:
            return None
        kind = self.kind
        if kind == "bytes":
            return self.values[self.offsets[i] : self.offsets[i + 1]]
        if kind == "str":
            return self.values[self.offsets[i] : self.offsets[i + 1]].decode()
        if kind == "list":
            return self.values[self.offsets[i] : self.offsets[i + 1]]
        return self.values[i]

    def rows(self, idx: list[int]) -> list[Any]:
        """``[self.row(i) for i in idx]``, without a method call per row."""
        kind, v = self.kind, self.values
        if self.mask is not None or kind == "str":
            return [self.row(i) for i in idx]
        if kind == "bytes" or kind == "list":
            o = self.offsets
            return [v[o[i] : o[i + 1]] for i in idx]
        if kind == "np" and v.ndim == 1:
            return list(v[idx])  # NumPy scalars, as v[i] gives
        return [v[i] for i in idx]

    def take(self, idx: np.ndarray) -> list[Any] | np.ndarray:
        """Rows ``idx`` as an array (kinds np/obj/bytes/str) or a list of 1-D arrays
        (kind list)."""
        if self.kind in ("bytes", "str"):
            return _object_array([self.row(i) for i in idx.tolist()])
        if self.kind == "list":
            o = self.offsets
            m = self.mask
            return [
                None if (m is not None and m[i]) else self.values[o[i] : o[i + 1]]
                for i in idx.tolist()
            ]
        vals = self.values[idx]
        if self.mask is not None and self.mask[idx].any():
            out = _object_array(list(vals))
            out[self.mask[idx]] = None
            return out
        return vals


def _decode_column(pa: Any, arr: Any) -> _Column:
    t = arr.type
    n = len(arr)
    types = pa.types

    if isinstance(t, pa.FixedShapeTensorType):
        if arr.null_count == 0:
            return _Column("np", _readonly(np.asarray(arr.to_numpy_ndarray())))
    elif types.is_fixed_size_list(t) and _is_plain_type(pa, t.value_type):
        if arr.null_count == 0 and arr.values.null_count == 0:
            flat = arr.flatten().to_numpy(zero_copy_only=False)
            return _Column("np", _readonly(flat.reshape(n, t.list_size)))
    elif (types.is_list(t) or types.is_large_list(t)) and _is_plain_type(pa, t.value_type):
        child = arr.values
        if child.null_count == 0:
            mask = arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else None
            offsets = np.asarray(arr.offsets.to_numpy(zero_copy_only=False), np.int64)
            values = _readonly(child.to_numpy(zero_copy_only=False))
            return _Column("list", values, offsets, mask)
    elif _is_plain_type(pa, t):
        if arr.null_count == 0:
            return _Column("np", _readonly(arr.to_numpy(zero_copy_only=False)))
        mask = arr.is_null().to_numpy(zero_copy_only=False)
        try:
            filled = arr.fill_null(pa.scalar(False if types.is_boolean(t) else 0).cast(t))
            return _Column("np", _readonly(filled.to_numpy(zero_copy_only=False)), mask=mask)
        except (pa.ArrowException, TypeError, ValueError):
            pass
    elif (
        types.is_string(t)
        or types.is_large_string(t)
        or types.is_binary(t)
        or (types.is_large_binary(t))
    ):
        _, obuf, data = arr.buffers()
        mask = arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else None
        large = types.is_large_string(t) or types.is_large_binary(t)
        o = np.frombuffer(obuf, np.int64 if large else np.int32)[arr.offset : arr.offset + n + 1]
        byte_offsets = array.array("q", o.astype(np.int64).tobytes())
        kind = "str" if (types.is_string(t) or types.is_large_string(t)) else "bytes"
        return _Column(kind, data.to_pybytes() if data is not None else b"", byte_offsets, mask)
    return _Column("obj", _readonly(_object_array(arr.to_pylist())))


def _is_plain_type(pa: Any, vt: Any) -> bool:
    t = pa.types
    return t.is_integer(vt) or t.is_floating(vt) or t.is_boolean(vt) or t.is_temporal(vt)


class _RowGroup:
    __slots__ = ("names", "columns", "num_rows", "nbytes")

    def __init__(self, names: list[str], columns: list[_Column], num_rows: int, nbytes: int):
        self.names, self.columns, self.num_rows, self.nbytes = names, columns, num_rows, nbytes

    def row(self, i: int) -> dict[str, Any]:
        return {n: c.row(i) for n, c in zip(self.names, self.columns)}


class ParquetDataSource:
    """Random access to the rows of one or many Parquet files.

    Args:
      paths: a file, a directory (every file whose name contains ``.parquet``, sorted),
        a glob pattern, or a list of these. Rows are numbered across files in order.
      columns: the columns to read (default: all). A name that is not in a file raises
        ``ValueError`` naming the column, the file and the available columns.
      cache_row_groups: at most this many decoded row groups stay cached (LRU, per
        process); ``None`` (default) = no count limit; 0 keeps none between calls.
      cache_bytes: and at most this many bytes of them (Arrow size of the decoded row
        groups; default 512 MiB; ``None`` = no byte limit). A row group larger than
        the limit is used for its batch and not kept. Random access over more data than
        the cache holds decodes about one row group per record, so write small row
        groups (see :func:`write_parquet`) or size the cache to hold the data.
      skip_bad_records: if False (default) a corrupt row group raises
        :class:`CorruptRecordError` naming the file and the row. If True its rows come
        back as ``None`` (filtered out by the datasets) and are counted in
        ``bad_records``; an unreadable file is skipped at construction (``bad_files``).
      verify_checksums: verify page CRCs (written by :func:`write_parquet`), so flipped
        bytes are reported instead of decoded into wrong values. Default True.

    Record type: ``dict`` mapping each column to the row's value:

    ========================================  ==========================================
    Arrow column type                         value
    ========================================  ==========================================
    integer / floating / bool / timestamp     NumPy scalar of that dtype (``np.int64``...)
    string / binary                           ``str`` / ``bytes``
    ``list<numeric>``                          1-D read-only ``np.ndarray`` (a view)
    ``fixed_size_list<numeric>``               1-D read-only ``np.ndarray``
    ``fixed_shape_tensor``                     read-only ``np.ndarray`` of the tensor shape
    anything else (struct, nested lists...)   the Python value from ``to_pylist``
    null                                      ``None``
    ========================================  ==========================================

    :meth:`read_batch` returns the same rows column-wise as NumPy arrays.

    The source pickles cheaply (paths, row counts); files are reopened lazily in each
    process (one handle per thread) and the cache starts empty; a worker process started
    with ``fork`` keeps the row groups the parent had cached (read from shared pages).

    >>> import tempfile
    >>> from cairn.data import write_parquet
    >>> d = tempfile.mkdtemp()
    >>> _ = write_parquet([{"id": i, "name": f"r{i}"} for i in range(5)], d, row_group_size=2)
    >>> src = ParquetDataSource(d)
    >>> len(src), src[3]
    (5, {'id': np.int64(3), 'name': 'r3'})
    >>> src.read_batch([4, 0])["id"]
    array([4, 0])
    """

    def __init__(
        self,
        paths: Any,
        *,
        columns: Sequence[str] | None = None,
        cache_row_groups: int | None = None,
        cache_bytes: int | None = 512 * 2**20,
        skip_bad_records: bool = False,
        verify_checksums: bool = True,
    ) -> None:
        pa, pq = _pyarrow()
        if cache_row_groups is not None and (
            not isinstance(cache_row_groups, int) or cache_row_groups < 0
        ):
            raise ValueError(
                f"cache_row_groups must be None or an int >= 0, got {cache_row_groups!r}"
            )
        if cache_bytes is not None and (not isinstance(cache_bytes, int) or cache_bytes < 0):
            raise ValueError(f"cache_bytes must be None or an int >= 0, got {cache_bytes!r}")
        if isinstance(columns, str):
            raise TypeError(f"columns must be a list of names, got the string {columns!r}")
        files = _expand_paths(paths, marker=".parquet", kind="ParquetDataSource")
        self.skip_bad_records = bool(skip_bad_records)
        self.verify_checksums = bool(verify_checksums)
        self.cache_row_groups = cache_row_groups
        self.cache_bytes = cache_bytes
        self.bad_records = 0
        self.bad_files: list[str] = []
        self._paths: list[str] = []
        rg_file: list[int] = []
        rg_index: list[int] = []
        rg_rows: list[int] = []
        self._columns: list[str] | None = list(columns) if columns is not None else None
        self._schema: Any = None
        for fn, start, end in files:
            if start is not None or end is not None:
                raise ValueError(
                    f"ParquetDataSource does not take row slices ({fn!r}[{start}:{end}]); "
                    "slice the dataset instead"
                )
            footer = self._read_footer(pq, fn)
            if footer is None:
                continue
            md, schema = footer
            self._select_columns(pa, fn, schema)
            f = len(self._paths)
            self._paths.append(fn)
            for g in range(md.num_row_groups):
                rg_file.append(f)
                rg_index.append(g)
                rg_rows.append(md.row_group(g).num_rows)
        if self._columns is None:
            self._columns = []
        self._rg_file = np.asarray(rg_file, np.int64)
        self._rg_index = np.asarray(rg_index, np.int64)
        self._rg_cum = np.concatenate([[0], np.cumsum(rg_rows, dtype=np.int64)]).astype(np.int64)
        self._len = int(self._rg_cum[-1])
        self._init_runtime()

    def _read_footer(self, pq: Any, fn: str) -> tuple[Any, Any] | None:
        """``(metadata, Arrow schema)`` of file ``fn``; ``None`` if it is unreadable and
        ``skip_bad_records`` is set (the file is then listed in ``bad_files``)."""
        try:
            pf = pq.ParquetFile(fn)
            return pf.metadata, pf.schema_arrow
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types
            err = CorruptRecordError(
                f"cannot read Parquet file {fn!r} (truncated or not Parquet?): {e}", path=fn
            )
            if not self.skip_bad_records:
                raise err from e
            # stacklevel 3: the warning points at the ParquetDataSource(...) call
            warnings.warn(f"skipping unreadable file: {err}", RuntimeWarning, stacklevel=3)
            self.bad_files.append(fn)
            return None

    def _select_columns(self, pa: Any, fn: str, schema: Any) -> None:
        """Pick the selected columns of file ``fn``; every file must agree on their schema."""
        if self._columns is None:
            self._columns = list(schema.names)
        for c in self._columns:
            if c not in schema.names:
                raise ValueError(
                    f"column {c!r} not found in Parquet file {fn!r}; available columns: "
                    f"{', '.join(schema.names) or '(none)'}"
                )
        sel = pa.schema([schema.field(c) for c in self._columns])
        if self._schema is None:
            self._schema = sel
        elif not sel.equals(self._schema):
            raise ValueError(
                f"Parquet file {fn!r} has schema {sel} for the selected columns, but "
                f"{self._paths[0] if self._paths else 'the first file'!r} has {self._schema}"
            )

    # --- process-local ---
    def _init_runtime(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._cache: OrderedDict[int, _RowGroup] = OrderedDict()
        self._cached_bytes = 0
        self._bad_groups: dict[int, str] = {}
        self._pid = os.getpid()
        self.row_groups_decoded = 0
        self.cache_hits = 0

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for k in (
            "_local",
            "_lock",
            "_cache",
            "_cached_bytes",
            "_bad_groups",
            "_pid",
            "row_groups_decoded",
            "cache_hits",
        ):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def _after_fork(self) -> None:
        """In a forked child: new lock and file handles (never share the parent's), but
        keep the decoded row groups: they are immutable, and reading them costs nothing."""
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.row_groups_decoded = 0
        self.cache_hits = 0
        # Another parent thread may have been between its two cache updates at the fork.
        self._cached_bytes = sum(rg.nbytes for rg in self._cache.values())

    def _file(self, f: int) -> Any:
        if self._pid != os.getpid():
            self._after_fork()
        handles = getattr(self._local, "handles", None)
        if handles is None:
            handles = self._local.handles = {}
        pf = handles.get(f)
        if pf is None:
            _, pq = _pyarrow()
            pf = pq.ParquetFile(self._paths[f], page_checksum_verification=self.verify_checksums)
            handles[f] = pf
        return pf

    def _decode(self, g: int) -> _RowGroup:
        pa, _ = _pyarrow()
        f, k = int(self._rg_file[g]), int(self._rg_index[g])
        columns = self._columns or []  # (a list once __init__ has run)
        table = self._file(f).read_row_group(k, columns=columns, use_threads=False)
        cols = [_decode_column(pa, table.column(c).combine_chunks()) for c in columns]
        return _RowGroup(list(columns), cols, table.num_rows, int(table.nbytes))

    def _row_group(self, g: int) -> _RowGroup | None:
        """Decoded row group ``g`` (from the cache or freshly decoded); None if corrupt."""
        if self._pid != os.getpid():
            self._after_fork()
        with self._lock:
            rg = self._cache.get(g)
            if rg is not None:
                self._cache.move_to_end(g)
                self.cache_hits += 1
                return rg
            if g in self._bad_groups:
                return None
        try:
            rg = self._decode(g)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types
            f, k = int(self._rg_file[g]), int(self._rg_index[g])
            first = int(self._rg_cum[g])
            msg = (
                f"corrupt data in Parquet file {self._paths[f]!r}, row group {k} (source "
                f"rows {first}..{int(self._rg_cum[g + 1]) - 1}): {type(e).__name__}: {e}"
            )
            if not self.skip_bad_records:
                raise CorruptRecordError(msg, path=self._paths[f], index=first) from e
            with self._lock:
                self._bad_groups[g] = msg
            return None
        with self._lock:
            self.row_groups_decoded += 1
            if self.cache_row_groups != 0 and g not in self._cache:
                self._cache[g] = rg
                self._cached_bytes += rg.nbytes
                while self._cache and (
                    (self.cache_row_groups is not None and len(self._cache) > self.cache_row_groups)
                    or (self.cache_bytes is not None and self._cached_bytes > self.cache_bytes)
                ):
                    _, old = self._cache.popitem(last=False)
                    self._cached_bytes -= old.nbytes
        return rg

    def _locate(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g = np.searchsorted(self._rg_cum, idx, side="right") - 1
        return g, idx - self._rg_cum[g]

    def _groups(self, g: np.ndarray) -> dict[int, _RowGroup | None]:
        return {int(x): self._row_group(int(x)) for x in np.unique(g).tolist()}

    # --- protocol ---
    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, Any] | None:
        i = _normalize_index(index, self._len, "ParquetDataSource")
        g = int(np.searchsorted(self._rg_cum, i, side="right")) - 1
        rg = self._row_group(g)
        if rg is None:
            with self._lock:
                self.bad_records += 1
            return None
        return rg.row(i - int(self._rg_cum[g]))

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any] | None]:
        idx = _normalize_indices(indices, self._len, "ParquetDataSource")
        if idx.size == 0:
            return []
        g, local = self._locate(idx)
        groups = self._groups(g)
        out: list[dict[str, Any] | None] = [None] * idx.size
        bad = 0
        # Row group by row group, column by column: one list per column, then the dicts.
        order = np.argsort(g, kind="stable")
        gs = g[order]
        cuts = [0, *(np.flatnonzero(gs[1:] != gs[:-1]) + 1).tolist(), idx.size]
        for a, b in zip(cuts[:-1], cuts[1:]):
            rg = groups[int(gs[a])]
            pos = order[a:b]
            if rg is None:
                bad += b - a
                continue
            li = local[pos].tolist()
            names = rg.names
            cols = [c.rows(li) for c in rg.columns]
            if len(cols) == 1:
                name = names[0]
                for p, v in zip(pos.tolist(), cols[0]):
                    out[p] = {name: v}
            else:
                for p, vals in zip(pos.tolist(), zip(*cols)):
                    out[p] = dict(zip(names, vals))
        if bad:
            with self._lock:
                self.bad_records += bad
        return out

    def read_batch(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        """Rows ``indices`` column-wise: ``{column: array with one entry per row}``.

        Numeric columns give arrays of their dtype; ``fixed_shape_tensor`` and
        ``fixed_size_list`` columns give ``(n, *shape)`` arrays; ``list`` columns give a
        2-D array when all selected rows have the same length, otherwise an object
        array of 1-D arrays; strings, bytes, nested values and columns with a null in
        the batch give object arrays (``None`` for null). With ``skip_bad_records``,
        rows of corrupt row groups are left out (the batch is shorter).

        Args:
          indices: the row indices to read (negative ones count from the end).
        """
        idx = _normalize_indices(indices, self._len, "ParquetDataSource")
        names = list(self._columns or [])
        if idx.size == 0:
            return {n: np.zeros(0) for n in names}
        g, local = self._locate(idx)
        groups = self._groups(g)
        good = np.array([groups[x] is not None for x in g.tolist()])
        if not good.all():
            with self._lock:
                self.bad_records += int((~good).sum())
            g, local = g[good], local[good]
        live = {k: rg for k, rg in groups.items() if rg is not None}  # (the rows left)
        order = np.argsort(g, kind="stable")
        gs = g[order]
        cuts = [0, *(np.flatnonzero(np.diff(gs)) + 1).tolist(), gs.size]
        out: dict[str, np.ndarray] = {}
        for c, name in enumerate(names):
            pieces: list[Any] = []
            for a, b in zip(cuts[:-1], cuts[1:]):
                if a == b:
                    continue
                pieces.append(live[int(gs[a])].columns[c].take(local[order[a:b]]))
            out[name] = _assemble(pieces, order)
        return out

    def __iter__(self):
        """All rows in order, one row group at a time."""
        for g in range(len(self._rg_file)):
            rg = self._row_group(g)
            n = int(self._rg_cum[g + 1] - self._rg_cum[g])
            if rg is None:
                with self._lock:
                    self.bad_records += n
                yield from [None] * n
                continue
            for i in range(n):
                yield rg.row(i)

    # --- info ---
    @property
    def paths(self) -> list[str]:
        """The files read, in row order."""
        return list(self._paths)

    @property
    def columns(self) -> list[str]:
        """The selected columns."""
        return list(self._columns or [])

    @property
    def schema(self) -> Any:
        """The ``pyarrow.Schema`` of the selected columns."""
        return self._schema

    @property
    def num_row_groups(self) -> int:
        return len(self._rg_file)

    def cache_info(self) -> dict[str, int | None]:
        """``{"size", "max_size", "bytes", "max_bytes", "decoded", "hits"}`` (this process).

        ``size``/``bytes``: row groups cached and their Arrow size; ``decoded``: row groups
        decoded so far; ``hits``: row-group lookups served from the cache.
        """
        with self._lock:
            return {
                "size": len(self._cache),
                "max_size": self.cache_row_groups,
                "bytes": self._cached_bytes,
                "max_bytes": self.cache_bytes,
                "decoded": self.row_groups_decoded,
                "hits": self.cache_hits,
            }

    def __repr__(self) -> str:
        return (
            f"ParquetDataSource(files={len(self._paths)}, len={self._len}, "
            f"row_groups={len(self._rg_file)}, columns={self._columns})"
        )


def _assemble(pieces: list[Any], order: np.ndarray) -> np.ndarray:
    """Concatenate per-row-group pieces (in group order) and undo the sort by group."""
    n = order.size
    if pieces and all(isinstance(p, list) for p in pieces):  # list column
        rows: list[Any] = [None] * n
        flat = [x for p in pieces for x in p]
        for pos, v in zip(order.tolist(), flat):
            rows[pos] = v
        lens = {None if v is None else v.shape[0] for v in rows}
        if len(lens) == 1 and None not in lens:
            return np.stack(rows) if rows else np.zeros(0)
        return _object_array(rows)
    if any(p.dtype == object for p in pieces):
        cat = _object_array([x for p in pieces for x in p])
    else:
        cat = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
    res = np.empty_like(cat)
    res[order] = cat
    return res
