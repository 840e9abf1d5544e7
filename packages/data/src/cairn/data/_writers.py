"""Writers that turn an iterable of records into ArrayRecord or Parquet shards.

Every writer writes each shard to a hidden temporary file next to its final name and
renames all shards into place only when the last record is written; on an error the
temporary files are deleted, so a reader never sees a half-written shard.

The record codec (:func:`encode_example` / :func:`decode_example`) lives in
``cairn.data._codec``; it is re-exported here because ``cairn.data`` imports it from
this module.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from cairn.core_array import fsync_dir, fsync_file
from cairn.data._codec import decode_example, encode_example

__all__ = [
    "ArrayRecordWriter",
    "ParquetWriter",
    "decode_example",
    "encode_example",
    "write_array_record",
    "write_parquet",
]

# --- sharding ---

_SHARD_RE = r"-(\d{5})-of-(\d{5})"


class _ShardedFileWriter:
    """Shared machinery: shard sizing, temp files, naming, atomic commit."""

    _ext = ""
    _kind = ""

    def __init__(
        self,
        path: str | os.PathLike,
        records_per_shard: int | None,
        shard_sizes: Sequence[int] | None,
        prefix: str,
        overwrite: bool,
    ):
        if records_per_shard is not None and (
            not isinstance(records_per_shard, int) or records_per_shard < 1
        ):
            raise ValueError(
                f"{self._kind}: records_per_shard must be a positive int, got {records_per_shard!r}"
            )
        self._target = os.fspath(path)
        self._prefix = prefix
        self._overwrite = overwrite
        self._records_per_shard = records_per_shard
        self._shard_sizes = list(shard_sizes) if shard_sizes is not None else None
        if "{" in self._target:
            self._mode = "template"
            self._dir = os.path.dirname(self._target) or "."
        elif self._target.endswith(self._ext):
            self._mode = "file"
            self._dir = os.path.dirname(self._target) or "."
        else:
            self._mode = "dir"
            self._dir = self._target
        os.makedirs(self._dir, exist_ok=True)
        if self._mode == "dir" and not overwrite:
            pat = re.compile(re.escape(prefix) + _SHARD_RE + re.escape(self._ext) + "$")
            old = sorted(f for f in os.listdir(self._dir) if pat.match(f))
            if old:
                raise FileExistsError(
                    f"{self._kind}: {self._dir!r} already holds shards ({old[0]}, ...); pass "
                    "overwrite=True to replace them or choose another directory"
                )
        self._token = uuid.uuid4().hex[:12]
        self._tmp_paths: list[str] = []
        self._shard_count = 0  # records in the open shard
        self._total = 0
        self._open = False
        self._closed = False
        self.paths: list[str] | None = None

    # --- subclass hooks ---
    def _open_shard(self, tmp_path: str) -> None:
        raise NotImplementedError

    def _close_shard(self) -> None:
        raise NotImplementedError

    def _abort_shard(self) -> None:
        raise NotImplementedError

    def _add(self, record: Any) -> None:
        raise NotImplementedError

    # --- shards ---
    def _capacity(self) -> int | None:
        shard = len(self._tmp_paths) - 1
        if self._shard_sizes is not None:
            return self._shard_sizes[shard] if shard < len(self._shard_sizes) else 0
        return self._records_per_shard

    def _start_shard(self) -> None:
        tmp = os.path.join(
            self._dir, f".{self._prefix}.{self._token}.{len(self._tmp_paths):05d}.tmp"
        )
        self._tmp_paths.append(tmp)
        self._shard_count = 0
        self._open_shard(tmp)
        self._open = True

    def write(self, record: Any) -> None:
        """Append one record (to the current shard, starting a new one when it is full).

        Args:
          record: the record to append, of the kind this writer stores (``bytes`` for
            :class:`ArrayRecordWriter`, a row dict for :class:`ParquetWriter`).

        Raises:
          ValueError: the writer is closed, or the record does not fit the shard sizes given.
        """
        if self._closed:
            raise ValueError(f"{self._kind} is closed")
        try:
            if not self._open:
                self._start_shard()
            cap = self._capacity()
            while cap is not None and self._shard_count >= cap:
                self._close_shard()
                self._open = False
                if self._shard_sizes is not None and len(self._tmp_paths) >= len(self._shard_sizes):
                    raise ValueError(
                        f"{self._kind}: more records than the {sum(self._shard_sizes)} "
                        "the shard sizes allow"
                    )
                self._start_shard()
                cap = self._capacity()
            self._add(record)
            self._shard_count += 1
            self._total += 1
        except BaseException:
            self.abort()
            raise

    def _final_names(self) -> list[str]:
        k = len(self._tmp_paths)
        if self._mode == "template":
            return [self._target.format(shard=i, num_shards=k) for i in range(k)]
        if self._mode == "file":
            if k == 1:
                return [self._target]
            stem = self._target[: -len(self._ext)]
            return [f"{stem}-{i:05d}-of-{k:05d}{self._ext}" for i in range(k)]
        return [
            os.path.join(self._dir, f"{self._prefix}-{i:05d}-of-{k:05d}{self._ext}")
            for i in range(k)
        ]

    def close(self) -> list[str]:
        """Finish the last shard, rename every shard into place and return their paths."""
        if self._closed:
            if self.paths is None:
                raise ValueError(f"{self._kind} was aborted; nothing was written")
            return list(self.paths)
        try:
            if not self._open:
                self._start_shard()  # always at least one (possibly empty) shard
            if self._shard_sizes is not None:
                # Sized split: emit the remaining (empty) shards too.
                while len(self._tmp_paths) < len(self._shard_sizes):
                    self._close_shard()
                    self._start_shard()
            self._close_shard()
            self._open = False
            finals = self._final_names()
            if not self._overwrite:
                clash = [f for f in finals if os.path.exists(f)]
                if clash:
                    raise FileExistsError(
                        f"{self._kind}: {clash[0]!r} already exists; pass overwrite=True to "
                        "replace it"
                    )
            for tmp in self._tmp_paths:
                fsync_file(tmp)
            for tmp, final in zip(self._tmp_paths, finals):
                os.replace(tmp, final)
            if self._mode == "dir" and self._overwrite:
                pat = re.compile(re.escape(self._prefix) + _SHARD_RE + re.escape(self._ext) + "$")
                keep = {os.path.basename(f) for f in finals}
                for f in os.listdir(self._dir):
                    if pat.match(f) and f not in keep:
                        os.remove(os.path.join(self._dir, f))
            fsync_dir(self._dir)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self.paths = finals
        return list(finals)

    def abort(self) -> None:
        """Drop everything written so far (temporary files are deleted)."""
        if self._open:
            try:
                self._abort_shard()
            except Exception:  # noqa: BLE001, S110 - best effort while failing
                pass
            self._open = False
        for tmp in self._tmp_paths:
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass
        self._tmp_paths = []
        self._closed = True

    @property
    def num_records(self) -> int:
        """Records written so far."""
        return self._total

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()


def _split_sizes(n: int, num_shards: int) -> list[int]:
    base, extra = divmod(n, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


def _check_shard_args(records: Any, num_shards: Any, records_per_shard: Any, kind: str):
    if num_shards is not None and records_per_shard is not None:
        raise ValueError(f"{kind}: pass num_shards or records_per_shard, not both")
    if num_shards is None:
        return None
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"{kind}: num_shards must be a positive int, got {num_shards!r}")
    if not hasattr(records, "__len__"):
        raise TypeError(
            f"{kind}: num_shards needs a sized collection of records (a list) to split "
            "evenly; for a stream of unknown length pass records_per_shard instead"
        )
    return _split_sizes(len(records), num_shards)


def _write_all(
    writer: Callable[..., _ShardedFileWriter],
    kind: str,
    records: Iterable[Any],
    path: str | os.PathLike,
    num_shards: int | None,
    records_per_shard: int | None,
    **options: Any,
) -> list[str]:
    """The body of ``write_array_record`` / ``write_parquet``: shard, write, commit."""
    sizes = _check_shard_args(records, num_shards, records_per_shard, kind)
    w = writer(path, records_per_shard=records_per_shard, _shard_sizes=sizes, **options)
    with w:
        for r in records:
            w.write(r)
    return list(w.paths or [])


# --- ArrayRecord ---


class ArrayRecordWriter(_ShardedFileWriter):
    """Write ``bytes`` records to ArrayRecord shards, atomically.

    Args:
      path: a directory (shards are named ``<prefix>-00000-of-00004.array_record``), a
        file name ending in ``.array_record`` (one shard keeps that name; several get
        ``-00000-of-0000N`` inserted before the suffix), or a template with ``{shard}``
        and ``{num_shards}`` fields such as ``"out/train-{shard:05d}.array_record"``.
      records_per_shard: start a new shard after this many records (default: one shard).
      options: array_record writer options; ``group_size:1`` (the default) stores every
        record in its own chunk, which random access needs.
      prefix: file-name prefix in directory mode.
      overwrite: replace existing shards (in directory mode also delete older
        ``<prefix>-*-of-*`` shards); otherwise existing targets raise ``FileExistsError``.

    Use as a context manager, or call :meth:`write` then :meth:`close` (which returns the
    shard paths). Nothing is visible under the final names until :meth:`close`; on an
    error the temporary files are removed.
    """

    _ext = ".array_record"
    _kind = "ArrayRecordWriter"

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        records_per_shard: int | None = None,
        options: str = "group_size:1",
        prefix: str = "data",
        overwrite: bool = False,
        _shard_sizes: Sequence[int] | None = None,
    ) -> None:
        from cairn.data._source_arrayrecord import _array_record_module

        self._mod = _array_record_module()
        self._options = options
        self._writer: Any = None
        super().__init__(path, records_per_shard, _shard_sizes, prefix, overwrite)

    def _open_shard(self, tmp_path: str) -> None:
        from cairn.data._source_arrayrecord import mark_native_threads

        mark_native_threads()
        self._writer = self._mod.ArrayRecordWriter(tmp_path, self._options)
        if not self._writer.ok():
            raise OSError(f"ArrayRecordWriter: cannot create {tmp_path!r}")

    def _add(self, record: Any) -> None:
        if not isinstance(record, bytes | bytearray | memoryview):
            hint = (
                "; serialise dicts with cairn.data.encode_example(record)"
                if isinstance(record, Mapping)
                else ""
            )
            raise TypeError(
                f"ArrayRecordWriter: record {self._total} is {type(record).__name__}, "
                f"expected bytes{hint}"
            )
        self._writer.write(bytes(record))

    def _close_shard(self) -> None:
        w, self._writer = self._writer, None
        if not w.ok():  # pragma: no cover - disk errors
            w.close()
            raise OSError(f"ArrayRecordWriter: writing {self._tmp_paths[-1]!r} failed")
        w.close()

    def _abort_shard(self) -> None:
        if self._writer is not None:
            w, self._writer = self._writer, None
            w.close()


def write_array_record(
    records: Iterable[bytes],
    path: str | os.PathLike,
    *,
    num_shards: int | None = None,
    records_per_shard: int | None = None,
    options: str = "group_size:1",
    prefix: str = "data",
    overwrite: bool = False,
) -> list[str]:
    """Write ``records`` (bytes) to ArrayRecord shards and return the shard paths.

    ``num_shards`` splits a sized collection into that many contiguous shards (sizes
    differ by at most one; some may be empty); ``records_per_shard`` cuts a stream of any
    length; neither writes one shard. Reading the shards in the returned order yields the
    records in input order. See :class:`ArrayRecordWriter` for ``path``, ``options``,
    ``prefix`` and ``overwrite``.

    Args:
      records: the ``bytes`` records, any iterable (sized for ``num_shards``).
      path: a directory, a ``.array_record`` file name or a ``{shard}`` template (see
        :class:`ArrayRecordWriter`).
      num_shards: split ``records`` into this many contiguous shards.
      records_per_shard: start a new shard after this many records.
      options: array_record writer options (``group_size:1`` keeps random access).
      prefix: file-name prefix in directory mode.
      overwrite: replace existing shards.

    >>> import tempfile
    >>> paths = write_array_record([b"x"] * 5, tempfile.mkdtemp(), records_per_shard=2)
    >>> [p.rsplit("/", 1)[1] for p in paths]
    ['data-00000-of-00003.array_record', 'data-00001-of-00003.array_record', 'data-00002-of-00003.array_record']

    Returns:
      the shard paths, in order.
    """
    return _write_all(
        ArrayRecordWriter,
        "write_array_record",
        records,
        path,
        num_shards,
        records_per_shard,
        options=options,
        prefix=prefix,
        overwrite=overwrite,
    )


# --- Parquet ---


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("Parquet support needs pyarrow: pip install 'cairn-data[parquet]'") from e
    return pa, pq


def _column_to_arrow(pa: Any, name: str, values: list[Any], typ: Any, first: int) -> Any:
    """Convert one column of a row group (Python/NumPy values) to an Arrow array."""
    where = f"column {name!r} (records {first}..{first + len(values) - 1})"
    sample = next((v for v in values if v is not None), None)
    try:
        if isinstance(typ, pa.FixedShapeTensorType) or (
            typ is None and isinstance(sample, np.ndarray) and sample.ndim >= 2
        ):
            if any(v is None for v in values):
                raise ValueError("tensor columns cannot hold None")
            shapes = {np.shape(v) for v in values}
            if len(shapes) != 1:
                raise ValueError(
                    f"arrays of 2+ dimensions must share one shape per column, got {sorted(shapes)}"
                )
            stacked = np.ascontiguousarray(np.stack([np.asarray(v) for v in values]))
            arr = pa.FixedShapeTensorArray.from_numpy_ndarray(stacked)
            return arr if typ is None or arr.type == typ else arr.cast(typ)
        is_list_type = typ is not None and (pa.types.is_list(typ) or pa.types.is_large_list(typ))
        if is_list_type or (typ is None and isinstance(sample, np.ndarray) and sample.ndim == 1):
            mask = np.array([v is None for v in values])
            parts = [np.asarray(v).reshape(-1) if v is not None else None for v in values]
            lens = np.array([0 if p is None else p.size for p in parts], np.int64)
            offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            nonempty = [p for p in parts if p is not None]
            if typ is not None:
                flat = pa.array(np.concatenate(nonempty) if nonempty else [], type=typ.value_type)
            else:
                flat = pa.array(np.concatenate(nonempty) if nonempty else np.zeros(0, np.asarray(sample).dtype))
            arr = pa.ListArray.from_arrays(
                pa.array(offsets), flat, mask=pa.array(mask) if mask.any() else None
            )
            return arr if typ is None or arr.type == typ else arr.cast(typ)
        if isinstance(sample, np.generic) and not any(v is None for v in values):
            arr = pa.array(np.asarray(values))
        else:
            arr = pa.array(values, type=typ)
        return arr if typ is None or arr.type == typ else arr.cast(typ)
    except (pa.ArrowException, ValueError, TypeError) as e:
        raise ValueError(f"ParquetWriter: cannot store {where}: {e}") from e


class ParquetWriter(_ShardedFileWriter):
    """Write dict records (one dict per row) to Parquet shards, atomically.

    Args:
      path: a directory (``<prefix>-00000-of-00004.parquet``), a file name ending in
        ``.parquet``, or a template with ``{shard}``/``{num_shards}`` (as in
        :class:`ArrayRecordWriter`).
      records_per_shard: start a new shard after this many rows (default: one shard).
      row_group_size: rows per row group (default 1024). Random access decodes whole
        row groups, so smaller groups make random reads cheaper and files larger.
      schema: a ``pyarrow.Schema``; by default inferred from the first row group and
        then enforced (a later row that does not fit raises ``ValueError`` naming the
        column and records).
      compression: Parquet codec (default ``"snappy"``, fast to decode).
      prefix: as in :class:`ArrayRecordWriter`.
      overwrite: as in :class:`ArrayRecordWriter`.

    Value -> column type: ``int``/``float``/``bool``/``str``/``bytes`` and NumPy scalars
    -> Arrow scalar types (NumPy dtypes kept); 1-D ``ndarray`` -> ``list<dtype>``
    (lengths may vary); ``ndarray`` with 2+ dims -> the ``fixed_shape_tensor``
    extension type (one shape per column). ``None`` is a null. Pages carry CRC
    checksums so :class:`ParquetDataSource` can detect corruption.
    """

    _ext = ".parquet"
    _kind = "ParquetWriter"

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        records_per_shard: int | None = None,
        row_group_size: int = 1024,
        schema: Any = None,
        compression: str | None = "snappy",
        prefix: str = "data",
        overwrite: bool = False,
        _shard_sizes: Sequence[int] | None = None,
    ) -> None:
        self._pa, self._pq = _pyarrow()
        if not isinstance(row_group_size, int) or row_group_size < 1:
            raise ValueError(
                f"ParquetWriter: row_group_size must be a positive int, got {row_group_size!r}"
            )
        if schema is not None and not isinstance(schema, self._pa.Schema):
            raise TypeError(
                f"ParquetWriter: schema must be a pyarrow.Schema, got {type(schema).__name__}"
            )
        self._row_group_size = row_group_size
        self._schema = schema
        self._compression = compression
        self._buffer: list[Mapping[str, Any]] = []
        self._buffer_first = 0
        self._pw: Any = None
        self._tmp_current: str | None = None
        super().__init__(path, records_per_shard, _shard_sizes, prefix, overwrite)

    def _open_shard(self, tmp_path: str) -> None:
        self._tmp_current = tmp_path
        self._pw = None  # created with the first row group (needs the schema)
        self._buffer = []
        self._buffer_first = self._total

    def _add(self, record: Any) -> None:
        if not isinstance(record, Mapping):
            raise TypeError(
                f"ParquetWriter: record {self._total} is {type(record).__name__}, expected a "
                "dict of column name -> value"
            )
        self._buffer.append(record)
        if len(self._buffer) >= self._row_group_size:
            self._flush()

    def _flush(self) -> None:
        pa = self._pa
        rows, first = self._buffer, self._buffer_first
        self._buffer, self._buffer_first = [], first + len(rows)
        if not rows:
            return
        names = list(self._schema.names) if self._schema is not None else list(rows[0].keys())
        for name in names:
            if not isinstance(name, str):
                raise TypeError(f"ParquetWriter: column names must be str, got {name!r}")
        expected = set(names)
        for j, r in enumerate(rows):
            if r.keys() != expected:
                missing = sorted(expected - set(r.keys()))
                extra = sorted(set(r.keys()) - expected)
                raise ValueError(
                    f"ParquetWriter: record {first + j} has different columns from the "
                    f"schema {names}: missing {missing}, unexpected {extra}"
                )
        arrays = []
        for k, name in enumerate(names):
            typ = self._schema.field(k).type if self._schema is not None else None
            arrays.append(_column_to_arrow(pa, name, [r[name] for r in rows], typ, first))
        if self._schema is None:
            self._schema = pa.schema([pa.field(n, a.type) for n, a in zip(names, arrays)])
        table = pa.Table.from_arrays(arrays, schema=self._schema)
        if self._pw is None:
            self._pw = self._pq.ParquetWriter(
                self._tmp_current,
                self._schema,
                compression=self._compression,
                write_page_checksum=True,
            )
        self._pw.write_table(table, row_group_size=self._row_group_size)

    def _close_shard(self) -> None:
        self._flush()
        if self._pw is None:  # empty shard: a valid file with the schema and no rows
            schema = self._schema if self._schema is not None else self._pa.schema([])
            self._pw = self._pq.ParquetWriter(
                self._tmp_current, schema, compression=self._compression, write_page_checksum=True
            )
        pw, self._pw = self._pw, None
        pw.close()

    def _abort_shard(self) -> None:
        self._buffer = []
        if self._pw is not None:
            pw, self._pw = self._pw, None
            pw.close()


def write_parquet(
    records: Iterable[Mapping[str, Any]],
    path: str | os.PathLike,
    *,
    num_shards: int | None = None,
    records_per_shard: int | None = None,
    row_group_size: int = 1024,
    schema: Any = None,
    compression: str | None = "snappy",
    prefix: str = "data",
    overwrite: bool = False,
) -> list[str]:
    """Write dict records to Parquet shards and return the shard paths.

    Sharding as in :func:`write_array_record`; columns and types as in
    :class:`ParquetWriter`.

    Args:
      records: the row dicts, any iterable (sized for ``num_shards``).
      path: a directory, a ``.parquet`` file name or a ``{shard}`` template (see
        :class:`ParquetWriter`).
      num_shards: split ``records`` into this many contiguous shards.
      records_per_shard: start a new shard after this many rows.
      row_group_size: rows per row group (smaller groups: cheaper random reads, larger files).
      schema: a ``pyarrow.Schema``; None infers it from the first row group.
      compression: the Parquet codec (None for none).
      prefix: file-name prefix in directory mode.
      overwrite: replace existing shards.

    >>> import tempfile, numpy as np
    >>> rows = [{"id": i, "x": np.full(2, i, np.float32)} for i in range(3)]
    >>> [p.rsplit("/", 1)[1] for p in write_parquet(rows, tempfile.mkdtemp())]
    ['data-00000-of-00001.parquet']

    Returns:
      the shard paths, in order.
    """
    return _write_all(
        ParquetWriter,
        "write_parquet",
        records,
        path,
        num_shards,
        records_per_shard,
        row_group_size=row_group_size,
        schema=schema,
        compression=compression,
        prefix=prefix,
        overwrite=overwrite,
    )
