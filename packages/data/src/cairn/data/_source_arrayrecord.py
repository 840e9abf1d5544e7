"""Random access to records stored in many ArrayRecord shards.

array_record's own ``reader.read(list_of_indices)`` scans a table with one entry per
chunk on every call, so its per-record cost grows with the shard (11 us at 1k records,
~400 us at 100k). A *range* read ``reader.read(start, stop)`` does not: it costs the
same per record whatever the file size. This source therefore sorts each batch of
indices, splits it into runs of consecutive records per shard and reads each run with
one range read.

Fork safety. The first reader opened in a process starts array_record's thread pool and
riegeli's background cleaner; they stay alive after every reader is closed. A process
forked while they run inherits their mutexes in whatever state they were, and a reader
opened in the child can spin forever on one held by a thread that does not exist there.
So no reader may be used in a process forked from one that had opened readers: the
source says so (``_fork_safe = False``), ``mp_prefetch`` then starts its workers with
``forkserver`` (clean processes forked from a server that never opened a reader), and a
reader opened in a forked child of such a process warns.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from cairn.data._source_memory import (
    CorruptRecordError,
    _expand_paths,
    _normalize_index,
    _normalize_indices,
)

__all__ = ["ArrayRecordDataSource"]

_READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"
_GROUP_RE = re.compile(r"group_size:(\d+)")


def _array_record_module() -> Any:
    try:
        from array_record.python import array_record_module
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "ArrayRecord support needs the array_record package: "
            "pip install 'cairn-data[arrayrecord]'"
        ) from e
    return array_record_module


# pid of the process that first used array_record's native code (its threads start then)
_native_pid: int | None = None


def mark_native_threads() -> None:
    """Record that array_record's native threads may run in this process from now on; warn
    if they ran in a process this one was forked from (a reader here can deadlock)."""
    global _native_pid
    pid = os.getpid()
    if _native_pid == pid:
        return
    if _native_pid is not None:
        warnings.warn(
            f"this process ({pid}) was forked from process {_native_pid}, which had opened "
            "ArrayRecord readers or writers: array_record's native threads were running at "
            "the fork, and a reader opened here can deadlock on a lock one of them held. "
            "Start such processes with 'forkserver' or 'spawn' (cairn.data's mp_prefetch "
            "does this by itself).",
            RuntimeWarning,
            stacklevel=3,
        )
    _native_pid = pid


def _open_reader(path: str, options: str) -> Any:
    """Open an ArrayRecord reader and fail loudly if the file is unusable.

    array_record does not raise on a missing or truncated file: it returns a reader whose
    ``ok()`` is false and which reports 0 records. We turn that into an error.
    """
    mod = _array_record_module()
    mark_native_threads()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"ArrayRecord file not found: {path!r}")
    try:
        reader = mod.ArrayRecordReader(path, options, file_reader_buffer_size=32768)
    except Exception as e:  # noqa: BLE001 - re-raised with the path
        raise CorruptRecordError(f"cannot open ArrayRecord file {path!r}: {e}", path=path) from e
    if not reader.ok():
        try:
            reader.close()
        except Exception:  # noqa: BLE001, S110 - the reader is already broken
            pass
        raise CorruptRecordError(
            f"cannot open ArrayRecord file {path!r}: the file is truncated, empty or not an "
            f"ArrayRecord file (its footer/index could not be read; size "
            f"{os.path.getsize(path)} bytes)",
            path=path,
        )
    return reader


class ArrayRecordDataSource:
    """Random access to ``bytes`` records in one or many ArrayRecord files.

    Args:
      paths: a file, a directory (every file whose name contains ``.array_record``,
        sorted), a glob pattern, a ``"file[start:end]"`` slice, an object with
        ``filename``/``skip``/``take`` (Grain's ``FileInstruction``), or a list of these.
        Records are numbered across the files in the order given.
      reader_options: extra array_record reader options (``"key:value,..."``), appended
        to ``readahead_buffer_size:0,max_parallelism:0`` (the random-access settings).
      read_threads: if > 1, a batch's reads are spread over this many threads (the
        array_record reads release the GIL); 0 (default) reads in the calling thread,
        the right choice when worker processes already use every core.
      skip_bad_records: if False (default) a corrupt record raises
        :class:`CorruptRecordError` naming the file and the record's index in it. If
        True, a corrupt record is returned as ``None`` (the datasets treat ``None`` as
        filtered out, like Grain's ``MapDataset``), and counted in ``bad_records``; an
        unreadable file (e.g. truncated, so its index is gone) is skipped at
        construction with a warning and listed in ``bad_files``.

    Records are ``bytes``, exactly as written. A global index ``i`` maps to
    ``(shard, local index)`` with a binary search over cumulative record counts.
    ``__getitems__`` (one call per batch) reads each run of consecutive records with
    one range read, so the cost per record does not depend on shard size.

    The source pickles cheaply (paths and counts only); readers are opened lazily, once
    per process and kept open. It is not fork-safe (see the module notes): ``mp_prefetch``
    starts workers for it with ``forkserver``, so its functions must be picklable.

    >>> import os, tempfile
    >>> from cairn.data import write_array_record
    >>> d = tempfile.mkdtemp()
    >>> paths = write_array_record([b"a", b"bb", b"ccc"], d, num_shards=2)
    >>> src = ArrayRecordDataSource(d)
    >>> len(src), src[2], src.__getitems__([1, 0, -1])
    (3, b'ccc', [b'bb', b'a', b'ccc'])
    """

    _fork_safe = False  # native reader threads: never read it in a forked worker

    def __init__(
        self,
        paths: Any,
        *,
        reader_options: str | None = None,
        skip_bad_records: bool = False,
        read_threads: int = 0,
    ) -> None:
        files = _expand_paths(paths, marker=".array_record", kind="ArrayRecordDataSource")
        self._options = _READER_OPTIONS + (f",{reader_options}" if reader_options else "")
        self.skip_bad_records = bool(skip_bad_records)
        if not isinstance(read_threads, int) or read_threads < 0:
            raise ValueError(f"read_threads must be an int >= 0, got {read_threads!r}")
        self.read_threads = read_threads
        self.bad_records = 0
        self.bad_files: list[str] = []
        self._paths: list[str] = []
        starts: list[int] = []
        counts: list[int] = []
        for fn, start, end in files:
            try:
                reader = _open_reader(fn, self._options)
            except CorruptRecordError as e:
                if not self.skip_bad_records:
                    raise
                warnings.warn(f"skipping unreadable file: {e}", RuntimeWarning, stacklevel=2)
                self.bad_files.append(fn)
                continue
            try:
                n = reader.num_records()
                self._check_group_size(fn, reader)
            finally:
                reader.close()
            lo = 0 if start is None else start
            hi = n if end is None else end
            if not 0 <= lo <= hi <= n:
                raise IndexError(
                    f"ArrayRecord file instruction [{lo}:{hi}] is out of range for {fn!r}, "
                    f"which has {n} records"
                )
            self._paths.append(fn)
            starts.append(lo)
            counts.append(hi - lo)
        self._start = np.asarray(starts, np.int64)
        self._cum = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        self._len = int(self._cum[-1])
        self._init_runtime()

    # --- process-local ---
    def _init_runtime(self) -> None:
        self._readers: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._pool: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for k in ("_readers", "_lock", "_pid", "_pool"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    @staticmethod
    def _check_group_size(path: str, reader: Any) -> None:
        m = _GROUP_RE.search(reader.writer_options_string() or "")
        if m and int(m.group(1)) > 1:
            warnings.warn(
                f"ArrayRecord file {path!r} was written with group_size:{m.group(1)}; every "
                "random read decodes a whole group. Rewrite it with group_size:1 (the "
                "default of cairn.data.write_array_record) for fast random access.",
                RuntimeWarning,
                stacklevel=4,
            )

    def _reader(self, shard: int) -> Any:
        if self._pid != os.getpid():  # inherited through fork: never share native readers
            self._init_runtime()
        r = self._readers.get(shard)
        if r is None:
            with self._lock:
                r = self._readers.get(shard)
                if r is None:
                    r = _open_reader(self._paths[shard], self._options)
                    self._readers[shard] = r
        return r

    def close(self) -> None:
        """Close the open readers (they reopen lazily on the next read)."""
        with self._lock:
            for r in self._readers.values():
                r.close()
            self._readers.clear()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    # --- reading ---
    def _read_run(self, shard: int, lo: int, hi: int, first_global: int) -> list[Any]:
        """Records ``lo..hi-1`` (file-local) of ``shard``; ``first_global`` is lo's index."""
        reader = self._reader(shard)
        try:
            return reader.read(lo, hi)
        except Exception:  # noqa: BLE001 - find the culprit record by record
            pass
        out: list[Any] = []
        for k in range(lo, hi):
            try:
                out.append(reader.read(k, k + 1)[0])
            except Exception as e:  # noqa: BLE001
                if not self.skip_bad_records:
                    raise CorruptRecordError(
                        f"corrupt record {k} in ArrayRecord file {self._paths[shard]!r} "
                        f"(source index {first_global + k - lo}): {e}",
                        path=self._paths[shard],
                        index=k,
                    ) from e
                with self._lock:
                    self.bad_records += 1
                out.append(None)
        return out

    def _read_runs(self, runs: list[tuple[int, int, int, int]]) -> list[Any]:
        out: list[Any] = []
        for shard, lo, hi, first in runs:
            out.extend(self._read_run(shard, lo, hi, first))
        return out

    def _executor(self) -> Any:
        if self._pid != os.getpid():
            self._init_runtime()
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    from concurrent.futures import ThreadPoolExecutor

                    self._pool = ThreadPoolExecutor(
                        self.read_threads, thread_name_prefix="cairn-arrayrecord"
                    )
        return self._pool

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> bytes:
        i = _normalize_index(index, self._len, "ArrayRecordDataSource")
        s = int(np.searchsorted(self._cum, i, side="right")) - 1
        lo = i - int(self._cum[s]) + int(self._start[s])
        return self._read_run(s, lo, lo + 1, i)[0]

    def __getitems__(self, indices: Sequence[int]) -> list[bytes]:
        idx = _normalize_indices(indices, self._len, "ArrayRecordDataSource")
        if idx.size == 0:
            return []
        uniq, inverse = np.unique(idx, return_inverse=True)
        shard = np.searchsorted(self._cum, uniq, side="right") - 1
        local = uniq - self._cum[shard] + self._start[shard]
        breaks = np.flatnonzero((np.diff(shard) != 0) | (np.diff(local) != 1)) + 1
        bounds = [0, *breaks.tolist(), uniq.size]
        shard_l, local_l, uniq_l = shard.tolist(), local.tolist(), uniq.tolist()
        runs = [
            (shard_l[a], local_l[a], local_l[a] + (b - a), uniq_l[a])
            for a, b in zip(bounds[:-1], bounds[1:])
        ]
        nt = self.read_threads
        if nt > 1 and len(runs) >= 4 * nt:
            step = -(-len(runs) // nt)
            parts = [runs[k : k + step] for k in range(0, len(runs), step)]
            got = [x for part in self._executor().map(self._read_runs, parts) for x in part]
        else:
            got = self._read_runs(runs)
        if uniq.size == idx.size and bool((np.diff(idx) > 0).all()):
            return got  # already sorted and distinct
        return [got[j] for j in inverse.reshape(-1).tolist()]

    def __iter__(self) -> Iterator[bytes]:
        """All records in order, read in blocks of 1024 with range reads."""
        for s in range(len(self._paths)):
            base = int(self._start[s])
            n = int(self._cum[s + 1] - self._cum[s])
            for lo in range(0, n, 1024):
                hi = min(n, lo + 1024)
                yield from self._read_run(s, base + lo, base + hi, int(self._cum[s]) + lo)

    # --- info ---
    @property
    def paths(self) -> list[str]:
        """The files read, in record order."""
        return list(self._paths)

    @property
    def num_records_per_file(self) -> list[int]:
        """How many records each file contributes (after ``[start:end]`` slicing)."""
        return np.diff(self._cum).tolist()

    def __repr__(self) -> str:
        return (
            f"ArrayRecordDataSource(files={len(self._paths)}, len={self._len}, "
            f"skip_bad_records={self.skip_bad_records})"
        )
