"""``mp_prefetch``: compute a pipeline's ``MapDataset`` part in worker processes.

Design. The ``MapDataset`` under ``to_iter_dataset()`` is split into chunks by one plan
(:func:`chunk_plan`: sizes 1, 2, 4, ... up to a cap, from the start index). The main
process computes chunk 0 itself; chunk ``k >= 1`` goes to worker ``(k - 1) % num_workers``.
Every worker walks the same plan and computes only its own chunks, at most
``per_worker_buffer_size`` ahead of the consumer, checking for a new start position
between sub-chunks. The main process takes
chunks in order ``k = 0, 1, 2, ...`` from whoever owns each, so the element order,
and the iterator state (``{"next_index": i}``), are those of a single process, for every
worker count.

Transport. Results are pickled with protocol 5: NumPy arrays travel out of band through a
per-worker shared-memory block (one slot per buffered chunk), the small pickle through a
pipe; the main process copies a chunk out of its slot in one ``memcpy`` and frees the slot.
The shared-memory blocks are unlinked as soon as each worker has attached (with ``fork``,
at once), so nothing can leak even if a process is killed. A worker's exception reaches
the caller as the original exception, with the worker's traceback attached as its cause;
a worker that dies (for example ``SIGKILL``) makes ``next`` raise ``WorkerDiedError``.
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from multiprocessing import shared_memory

from cairn.data._iter_dataset import (
    DatasetIterator,
    IterDataset,
    MapRootIterDataset,
    ReadOptions,
    _ChunkedRootIterator,
    chunk_plan,
    read_chunk,
)
from cairn.data._map_dataset import (
    MapDataset,
    StageProfile,
    _int_at_least,
    add_bad_records,
    bad_record_counts,
    stage_list,
)

__all__ = ["MultiprocessingOptions", "MPPrefetchIterDataset", "WorkerDiedError", "RemoteTraceback"]

_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class MultiprocessingOptions:
    """Worker processes for ``mp_prefetch``.

    Attributes:
      num_workers: worker processes (0 = no workers; ``mp_prefetch`` is then a no-op).
      per_worker_buffer_size: chunks each worker may compute ahead of the consumer.
      start_method: ``"fork"`` (default where available: starts in milliseconds, and the
        pipeline need not be picklable) or ``"spawn"`` / ``"forkserver"`` (the pipeline
        and its functions must then be picklable).
      slot_bytes: shared-memory bytes per buffered chunk; a larger chunk goes through the
        pipe instead (slower, still correct). Memory is only used as it is written.
    """

    num_workers: int = 0
    per_worker_buffer_size: int = 2
    start_method: str | None = None
    slot_bytes: int = 64 << 20

    def __post_init__(self):
        for name, lo in (("num_workers", 0), ("per_worker_buffer_size", 1), ("slot_bytes", 1)):
            v = getattr(self, name)
            if not _int_at_least(v, lo):
                raise ValueError(f"MultiprocessingOptions.{name} must be an int >= {lo}, got {v!r}")
        if self.start_method not in (None, "fork", "spawn", "forkserver"):
            raise ValueError(
                f"MultiprocessingOptions.start_method must be 'fork', 'spawn', 'forkserver' or None, got {self.start_method!r}"
            )


class WorkerDiedError(RuntimeError):
    """A worker process exited unexpectedly (killed, crashed, out of memory)."""


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback; set as ``__cause__`` of re-raised errors."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


class MPPrefetchIterDataset(IterDataset):
    def __init__(
        self, parent: IterDataset, options: MultiprocessingOptions, worker_init_fn: Callable | None
    ):
        self._parent = parent
        self._parents = (parent,)
        self._options = options
        self._init_fn = worker_init_fn
        node = parent
        while not isinstance(node, MapRootIterDataset):
            if len(node._parents) != 1:
                raise ValueError(
                    f"mp_prefetch() needs a pipeline that starts with MapDataset.to_iter_dataset(); "
                    f"found {node._stage_name()!r}, which has {len(node._parents)} inputs. Put mp_prefetch "
                    "on each input instead."
                )
            node = node._parents[0]

    def _stage_name(self) -> str:
        return f"mp_prefetch(num_workers={self._options.num_workers})"

    def _make_iter(self, rf):
        opts, init = self._options, self._init_fn

        def factory(root: MapRootIterDataset) -> DatasetIterator:
            return MPRootIterator(root._ds, root._read_options, opts, init, root._debug)

        return self._parent._make_iter(factory)


# ====================================================================== worker side


def _close_quietly(conns):
    for c in conns:
        try:
            c.close()
        except Exception:
            pass


class _Stop(Exception):
    pass


class _Worker:
    """The loop of one worker process: compute own chunks, obey control messages."""

    def __init__(self, w, n, ds, cap, length, conn, buf, slot_bytes, slots):
        self.w, self.n, self.ds, self.cap, self.length = w, n, ds, cap, length
        self.conn, self.buf, self.slot_bytes = conn, buf, slot_bytes
        self.free = list(range(slots))
        self.inline_out = 0  # chunks sent through the pipe and not yet acknowledged
        self.gen = None
        self.plan = None
        self.k = 0
        self.restarted = False
        # Between sub-chunks of about this many records the worker checks for a new
        # start position, so set_state() never waits for a whole stale chunk. Each
        # sub-chunk is one batched read (one vectorised shuffle, one source call), so
        # they should not be small: 512 records keeps the per-call cost below ~2% while a
        # stale sub-chunk still ends within milliseconds.
        self.sub = max(1, 512 // max(1, ds._records_per_element()))
        self.stages = stage_list(ds)

    def handle(self, msg) -> None:
        kind = msg[0]
        if kind == "free":
            if msg[1] >= 0:
                self.free.append(msg[1])
            else:
                self.inline_out -= 1
        elif kind == "start":
            self.gen = msg[1]
            self.plan = chunk_plan(msg[2], self.length, self.cap)
            self.k = 0
            self.restarted = True
        elif kind == "stop":
            raise _Stop

    def poll_messages(self, timeout: float | None) -> bool:
        """Handle waiting messages (blocking up to ``timeout`` for the first)."""
        got = False
        while self.conn.poll(timeout):
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                raise _Stop from None
            self.handle(msg)
            got, timeout = True, 0
        return got

    def next_bounds(self):
        while True:
            b = next(self.plan, None)
            if b is None:
                return None
            # Chunk 0 of every start position is computed by the main process itself
            # (fast first element after a start or set_state); chunk k >= 1 is worker
            # (k - 1) % n's.
            mine = self.k >= 1 and (self.k - 1) % self.n == self.w
            self.k += 1
            if mine:
                return b

    def run(self, parent_pid: int) -> None:
        while True:
            can_work = self.plan is not None and len(self.free) > self.inline_out
            if not can_work:
                if not self.poll_messages(1.0) and os.getppid() != parent_pid:
                    return
                continue
            self.poll_messages(0)
            if not (self.plan is not None and len(self.free) > self.inline_out):
                continue
            bounds = self.next_bounds()
            if bounds is None:
                self.conn.send(("end", self.gen, self.k))
                self.plan = None
                continue
            self.compute(self.k - 1, bounds)

    def compute(self, chunk_k: int, bounds) -> None:
        gen = self.gen
        t0 = time.perf_counter()
        values: list = []
        err = None
        self.restarted = False
        prof = StageProfile(self.ds)
        bad_before = bad_record_counts(self.stages)
        try:
            for a in range(bounds[0], bounds[1], self.sub):
                vals, err = read_chunk(self.ds, a, min(a + self.sub, bounds[1]), prof)
                values.extend(vals)
                if err is not None:
                    break
                self.poll_messages(0)
                if self.restarted:  # set_state moved the iterator: drop this stale chunk
                    return
            pbufs: list = []
            data = pickle.dumps(values, protocol=5, buffer_callback=pbufs.append)
        except _Stop:
            raise
        except BaseException as e:
            _send_error(self.conn, gen, chunk_k, e)
            self.plan = None
            return
        raws = [b.raw() for b in pbufs]
        sizes = [r.nbytes for r in raws]
        total = sum(-(-x // _ALIGN) * _ALIGN for x in sizes)
        bad = [b - a for a, b in zip(bad_before, bad_record_counts(self.stages))]
        dt = (time.perf_counter() - t0, prof.as_list(), bad if any(bad) else None)
        if self.free and total <= self.slot_bytes:
            slot = self.free.pop()
            off = slot * self.slot_bytes
            for r in raws:
                self.buf[off : off + r.nbytes] = r
                off += -(-r.nbytes // _ALIGN) * _ALIGN
            self.conn.send(("chunk", gen, chunk_k, slot, data, sizes, dt, err is not None))
        else:
            self.inline_out += 1
            self.conn.send(
                (
                    "chunk",
                    gen,
                    chunk_k,
                    -1,
                    pickle.dumps(values, protocol=4),
                    None,
                    dt,
                    err is not None,
                )
            )
        if err is not None:
            _send_error(self.conn, gen, chunk_k, err)
            self.plan = None


def _worker_main(w, n, ds, cap, length, conn, shm_ref, slot_bytes, slots, init_fn, close_conns):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _close_quietly(close_conns)
    parent_pid = os.getppid()
    shm = shared_memory.SharedMemory(name=shm_ref) if isinstance(shm_ref, str) else shm_ref
    try:
        if init_fn is not None:
            init_fn(w, n)
        conn.send(("ready", w))
    except BaseException as e:  # report init failures like chunk failures
        _send_error(conn, -1, -1, e)
        return
    worker = _Worker(w, n, ds, cap, length, conn, shm.buf, slot_bytes, slots)
    try:
        worker.run(parent_pid)
    except (_Stop, BrokenPipeError, EOFError, OSError):
        return


def _send_error(conn, gen, k, e):
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        payload = pickle.dumps(e)
        pickle.loads(payload)
    except Exception:
        payload = None
    try:
        conn.send(("error", gen, k, payload, tb, f"{type(e).__name__}: {e}"))
    except (BrokenPipeError, OSError):
        pass


# ====================================================================== main side


class _Workers:
    """The processes, pipes and shared memory of one iterator; closed by a finalizer."""

    def __init__(self):
        self.procs: list = []
        self.conns: list = []
        self.shms: list = []
        self.unlinked: list[bool] = []
        self.closed = False

    def unlink(self, w: int) -> None:
        if not self.unlinked[w]:
            self.unlinked[w] = True
            try:
                self.shms[w].unlink()
            except FileNotFoundError:
                pass

    def send(self, w: int, msg: tuple) -> None:
        """Send ``msg`` to worker ``w``. A worker that died cannot take it; that is not an
        error here: the consumer reports the death (``WorkerDiedError``) when it next
        waits for that worker's chunk."""
        try:
            self.conns[w].send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            pass

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        for c in self.conns:
            try:
                c.send(("stop",))
            except Exception:
                pass
        deadline = time.monotonic() + 2.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(1.0)
            if p.is_alive():
                p.kill()
                p.join(1.0)
        _close_quietly(self.conns)
        for w, s in enumerate(self.shms):
            self.unlink(w)
            try:
                s.close()
            except Exception:
                pass


_SIGNAL_NAMES = {-s.value: s.name for s in signal.Signals}


class MPRootIterator(_ChunkedRootIterator):
    """Same elements and state as ``MapRootIterator``, computed by worker processes."""

    _who = "mp_prefetch iterator"
    _reads_in_next = False  # workers read (the main process only the first chunk)

    def __init__(
        self,
        ds: MapDataset,
        read_options: ReadOptions,
        options: MultiprocessingOptions,
        init_fn,
        debug=False,
    ):
        super().__init__(
            ds,
            read_options,
            f"mp_prefetch({options.num_workers} workers)",
            debug,
        )
        self._opts = options
        self._init_fn = init_fn
        self._n = options.num_workers
        self._w: _Workers | None = None
        self._gen = 0
        self._broken: BaseException | None = None
        self._worker_time = [0.0] * self._n
        self._worker_chunks = [0] * self._n
        self._main_time = 0.0
        self._main_chunks = 0
        self._stats.capacity = self._n * options.per_worker_buffer_size
        self._stages = stage_list(ds)
        self._reset(0)

    # ------------------------------------------------------------ control
    def _reset(self, start: int) -> None:
        super()._reset(start)
        self._start = start
        self._k = 0
        self._ended = False
        self._error_from: int | None = None
        self._gen += 1
        if self._w is not None:
            for w in range(len(self._w.conns)):
                self._w.send(w, ("start", self._gen, start))

    def _launch(self) -> None:
        opts = self._opts
        method = opts.start_method or ("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        ctx = mp.get_context(method)
        ws = _Workers()
        self._finalizer = weakref.finalize(self, ws.shutdown)
        self._w = ws
        slots = opts.per_worker_buffer_size
        parent_ends = []
        if method == "fork":
            # Keep the workers' garbage collector off the parent's objects: otherwise a
            # full collection in a worker writes to (and so copies) every page of them.
            gc.freeze()
        try:
            for w in range(self._n):
                mine, theirs = ctx.Pipe(duplex=True)
                shm = shared_memory.SharedMemory(create=True, size=slots * opts.slot_bytes)
                ws.shms.append(shm)
                ws.unlinked.append(False)
                parent_ends.append(mine)
                shm_ref = shm if method == "fork" else shm.name
                close = list(parent_ends) if method == "fork" else []
                p = ctx.Process(
                    target=_worker_main,
                    args=(
                        w,
                        self._n,
                        self._ds,
                        self._cap,
                        self._len,
                        theirs,
                        shm_ref,
                        opts.slot_bytes,
                        slots,
                        self._init_fn,
                        close,
                    ),
                    daemon=True,
                    name=f"cairn-data-worker-{w}",
                )
                with warnings.catch_warnings():
                    # JAX warns on every fork; workers never call JAX unless a map function
                    # does, and then start_method="spawn" is required (see the docs).
                    warnings.filterwarnings(
                        "ignore", message=".*os.fork\\(\\) was called", category=RuntimeWarning
                    )
                    p.start()
                theirs.close()
                ws.procs.append(p)
                ws.conns.append(mine)
                if method == "fork":
                    ws.unlink(w)  # the child already maps it
                mine.send(("start", self._gen, self._start))
        finally:
            if method == "fork":
                gc.unfreeze()

    def _fail(self, err: BaseException) -> BaseException:
        self._broken = err
        if self._w is not None:
            self._w.shutdown()
        return err

    def _died(self, w: int) -> WorkerDiedError:
        p = self._w.procs[w]
        p.join(0.5)
        code = p.exitcode
        how = (
            f"was killed by {_SIGNAL_NAMES.get(code, f'signal {-code}')}"
            if code is not None and code < 0
            else f"exited with code {code}"
        )
        return WorkerDiedError(
            f"cairn.data worker {w} of {self._n} (pid {p.pid}) {how} while computing the pipeline "
            f"{self._ds._stage_name()!r}; the iterator cannot continue. Restore a new iterator from "
            "the last get_state() to resume."
        )

    def _worker_error(self, w: int, msg) -> BaseException:
        _, gen, ek, payload, tb, text = msg
        exc = None
        if payload is not None:
            try:
                exc = pickle.loads(payload)
            except Exception:
                exc = None
        if exc is None:
            exc = RuntimeError(f"error in cairn.data worker {w}: {text}")
        where = "in worker_init_fn" if ek == -1 else f"chunk {ek}"
        exc.__cause__ = RemoteTraceback(
            f'\n"""\nTraceback from cairn.data worker {w} ({where}):\n{tb}"""'
        )
        return exc

    def _recv(self, w: int):
        ws = self._w
        conn = ws.conns[w]
        sentinels = {p.sentinel: i for i, p in enumerate(ws.procs)}
        while True:
            if conn.poll():
                try:
                    return conn.recv()
                except (EOFError, OSError):
                    raise self._fail(self._died(w)) from None
            ready = mpc.wait([conn, *sentinels], timeout=5.0)
            for r in ready:
                if r in sentinels:
                    i = sentinels[r]
                    if i == w and conn.poll():
                        continue
                    other = ws.conns[i]
                    try:  # a worker that reported an error before exiting: raise that error
                        while other.poll():
                            m = other.recv()
                            if m[0] == "error":
                                raise self._fail(self._worker_error(i, m))
                    except (EOFError, OSError):
                        pass
                    raise self._fail(self._died(i))

    def _fetch(self) -> bool:
        if self._ended:
            return False
        if self._broken is not None:
            raise RuntimeError(
                "this iterator stopped after an earlier error in a worker; call "
                "set_state(get_state()) to retry from the failing element"
            ) from self._broken
        if self._w is None:
            self._launch()
        if self._error_from is not None:
            w, bounds, k = self._error_from, None, self._k - 1
            self._error_from = None
        else:
            bounds = next(self._plan, None)
            k = self._k
            if k == 0 and bounds is not None:
                # The first chunk (one element) of a start position is computed here while
                # the workers start on the following chunks.
                self._k = 1
                t0 = time.perf_counter()
                self._buf, self._error = read_chunk(self._ds, *bounds, self._profile)
                self._main_time += time.perf_counter() - t0
                self._main_chunks += 1
                self._buf_start, self._buf_pos = bounds[0], 0
                return True
            w = (k - 1) % self._n
        while True:
            msg = self._recv(w)
            kind = msg[0]
            if kind == "ready":
                self._w.unlink(msg[1])
                continue
            if kind == "error":
                if msg[1] != self._gen and msg[1] != -1:
                    continue
                if bounds is None:  # the error follows a partial chunk: it is at the next element
                    self._next_index = self._buf_start + len(self._buf)
                raise self._fail(self._worker_error(w, msg))
            gen = msg[1]
            if kind == "chunk":
                _, gen, ck, slot, data, sizes, dt, err_follows = msg
                if gen != self._gen:
                    self._w.send(w, ("free", slot))
                    continue
                if err_follows:
                    self._error_from = w
                values = self._decode(w, slot, data, sizes)
                self._worker_time[w] += dt[0]
                self._profile.merge(dt[1])
                if dt[2] is not None:  # records the sources skipped in the worker
                    add_bad_records(self._stages, dt[2])
                self._worker_chunks[w] += 1
                assert ck == k and bounds is not None, (ck, k, bounds)
                self._k += 1
                self._buf = values
                self._buf_start = bounds[0]
                self._buf_pos = 0
                return True
            if kind == "end":
                if gen != self._gen:
                    continue
                self._ended = True
                return False

    def _decode(self, w: int, slot: int, data: bytes, sizes) -> list:
        if slot < 0:
            values = pickle.loads(data)
            self._w.send(w, ("free", -1))
            return values
        off = slot * self._opts.slot_bytes
        total = sum(-(-s // _ALIGN) * _ALIGN for s in sizes)
        block = bytearray(self._w.shms[w].buf[off : off + total])
        self._w.send(w, ("free", slot))
        view = memoryview(block)
        bufs = []
        pos = 0
        for s in sizes:
            bufs.append(view[pos : pos + s])
            pos += -(-s // _ALIGN) * _ALIGN
        return pickle.loads(data, buffers=bufs)

    # ------------------------------------------------------------ iterator protocol
    _chunk_failed = _fail

    def set_state(self, state: dict) -> None:
        i = self._checked_index(state)
        if self._broken is not None:  # start fresh workers at the restored position
            self._broken = None
            self._w = None
        self._reset(i)

    def close(self) -> None:
        if self._w is not None:
            self._w.shutdown()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers (empty before the first ``next``)."""
        return [p.pid for p in self._w.procs] if self._w is not None else []

    def _summary_extra(self) -> list[str]:
        lines = [
            f"  main process: {self._main_chunks} first chunks, {self._main_time:.4f} s computing"
        ]
        for w in range(self._n):
            lines.append(
                f"  worker {w}: {self._worker_chunks[w]} chunks, {self._worker_time[w]:.4f} s computing"
            )
        return lines
