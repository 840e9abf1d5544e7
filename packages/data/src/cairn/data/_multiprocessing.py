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

Liveness. Each worker keeps a heartbeat in the first bytes of its shared-memory block:
the chunk and the elements it is computing and since when. With
``per_element_timeout_s`` set, the main process, while it waits for a worker, checks
that heartbeat and kills a worker stuck on its elements for longer than the timeout per
element (``WorkerTimeoutError``, naming the worker, its pid and the elements). Workers
exit when the main process dies, even inside a long map function: a parent-death signal
(``prctl(PR_SET_PDEATHSIG)`` on Linux) plus a thread that watches the pipe to the main
process and the parent pid.

Fork safety. A source whose reader runs native threads (``_fork_safe = False``, e.g.
``ArrayRecordDataSource``: array_record and riegeli start thread pools and a background
cleaner that stay alive after the readers are closed) must never be read in a process
forked from one where those threads ran: a mutex held by a thread at the fork stays
locked forever in the child. Such pipelines start their workers with ``forkserver`` (a
fresh process that forks clean workers), or ``spawn``; never ``fork``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import pkgutil
import select
import signal
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from cairn.data import _transforms
from cairn.data._arguments import int_at_least

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._dataset import DatasetIterator, IterDataset, MapDataset, ReadOptions
from cairn.data._stats import StageProfile, add_bad_records, bad_record_counts, stage_list

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._transforms.to_iter import (
    ChunkedRootIterator,
    MapRootIterDataset,
    chunk_plan,
    read_chunk,
)

__all__ = [
    "MultiprocessingOptions",
    "MPPrefetchIterDataset",
    "RemoteTraceback",
    "WorkerDiedError",
    "WorkerTimeoutError",
]

_ALIGN = 64
_HEADER = 64  # heartbeat at the start of each worker's shared-memory block


@dataclasses.dataclass(frozen=True)
class MultiprocessingOptions:
    """Worker processes for ``mp_prefetch``.

    Args:
      num_workers: worker processes (0 = no workers; ``mp_prefetch`` is then a no-op).
      per_worker_buffer_size: chunks each worker may compute ahead of the consumer.
      start_method: ``None`` (default) picks ``"fork"`` where available (starts in
        milliseconds, and the pipeline need not be picklable), except for pipelines that
        read a source that is not fork-safe (``ArrayRecordDataSource``, whose native
        reader threads can leave a mutex locked in a forked child): those use
        ``"forkserver"``. ``"spawn"`` / ``"forkserver"``: the pipeline and its functions
        must be picklable (``cloudpickle`` is used for lambdas and local functions when
        it is installed). ``"fork"`` with a source that is not fork-safe is an error.
      slot_bytes: shared-memory bytes per buffered chunk; a larger chunk goes through the
        pipe instead (slower, still correct). Memory is only used as it is written.
      per_element_timeout_s: ``None`` (default): no limit. A number of seconds: a worker
        that spends longer than this per element on the elements it is computing (a
        batched read of ``n`` elements gets ``n`` times this) is killed, and ``next``
        raises :class:`WorkerTimeoutError` naming the worker, its pid and the elements.
        It guards against map functions that never return and native deadlocks; set it
        well above the slowest element's time. The first element after each start or
        ``set_state`` is computed by the calling process and is not covered.
    """

    num_workers: int = 0
    per_worker_buffer_size: int = 2
    start_method: str | None = None
    slot_bytes: int = 64 << 20
    per_element_timeout_s: float | None = None

    def __post_init__(self):
        for name, lo in (("num_workers", 0), ("per_worker_buffer_size", 1), ("slot_bytes", 1)):
            v = getattr(self, name)
            if not int_at_least(v, lo):
                raise ValueError(f"MultiprocessingOptions.{name} must be an int >= {lo}, got {v!r}")
        if self.start_method not in (None, "fork", "spawn", "forkserver"):
            raise ValueError(
                f"MultiprocessingOptions.start_method must be 'fork', 'spawn', 'forkserver' or None, got {self.start_method!r}"
            )
        t = self.per_element_timeout_s
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t <= 0
        ):
            raise ValueError(
                "MultiprocessingOptions.per_element_timeout_s must be None or a finite number of "
                f"seconds > 0, got {t!r}"
            )


class WorkerDiedError(RuntimeError):
    """A worker process exited unexpectedly (killed, crashed, out of memory)."""


class WorkerTimeoutError(WorkerDiedError):
    """A worker was alive but stuck past ``per_element_timeout_s``; it has been killed.

    Attributes: ``worker_index``, ``pid``, ``elements`` (``range`` of the element
    positions, in the ``MapDataset``, that the worker was computing), ``elapsed_s``.

    Args:
      msg: the error text.
      worker_index: the stuck worker's index.
      pid: its process id.
      elements: the ``range`` of element positions (in the ``MapDataset``) it was computing.
      elapsed_s: how long it had been computing them, in seconds.
    """

    def __init__(
        self, msg: str, worker_index: int, pid: int, elements: range, elapsed_s: float
    ) -> None:
        super().__init__(msg)
        self.worker_index, self.pid, self.elements, self.elapsed_s = (
            worker_index,
            pid,
            elements,
            elapsed_s,
        )

    def __reduce__(self):
        return (type(self), (str(self), self.worker_index, self.pid, self.elements, self.elapsed_s))


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback; set as ``__cause__`` of re-raised errors.

    Args:
      tb: the worker's formatted traceback text.
    """

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def fork_unsafe_sources(ds: MapDataset) -> list[str]:
    """``repr`` of each source in the pipeline that must not be read in a forked worker."""
    out = []
    for d in stage_list(ds):
        src = getattr(d, "_source", None)
        if src is not None and getattr(src, "_fork_safe", True) is False:
            out.append(repr(src))
    return out


def _resolve_start_method(requested: str | None, fork_safe: bool) -> str:
    methods = mp.get_all_start_methods()
    if requested is not None:
        return requested
    if fork_safe and "fork" in methods:
        return "fork"
    return "forkserver" if "forkserver" in methods else "spawn"


_preloaded = False


def _preload_forkserver(ctx: Any) -> None:
    """Have the forkserver import cairn.data (and NumPy) and every transformation module
    once (a pickled pipeline names its classes by those modules), so that each worker
    forked from it starts in milliseconds instead of importing them again. Only possible
    before this process's forkserver starts. The main script is *not* preloaded (Python's
    default): its module-level code could open a reader and start native threads in the
    forkserver itself; each worker imports it after the fork instead."""
    global _preloaded
    if not _preloaded:
        _preloaded = True
        from multiprocessing import forkserver

        if getattr(forkserver._forkserver, "_forkserver_pid", None) is None:
            steps = [
                f"{_transforms.__name__}.{m.name}"
                for m in pkgutil.iter_modules(_transforms.__path__)
            ]
            ctx.set_forkserver_preload(["cairn.data", *steps])


def _dumps_for_workers(obj, method: str, ds: MapDataset) -> bytes:
    """Pickle the pipeline (and worker_init_fn) for a spawned / forkserver worker; fall
    back to cloudpickle (lambdas, local functions) when it is installed."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - retried with cloudpickle, else re-raised below
        first = e
    try:
        import cloudpickle
    except ImportError:
        cloudpickle = None
    if cloudpickle is not None:
        try:
            return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001
            first = e
    raise TypeError(
        f"mp_prefetch with start_method={method!r} sends the pipeline {ds._stage_name()!r} and "
        f"its functions to the workers by pickling, which failed: {type(first).__name__}: "
        f"{first}. Define its functions at module level (not lambdas or local functions), "
        "or install cloudpickle."
        + (
            " (start_method 'forkserver' was chosen because the pipeline reads a source that "
            "is not fork-safe.)"
            if method == "forkserver"
            else ""
        )
    ) from first


class MPPrefetchIterDataset(IterDataset):
    """``IterDataset.mp_prefetch``: the pipeline's ``MapDataset`` root computed by workers."""

    def __init__(
        self, parent: IterDataset, options: MultiprocessingOptions, worker_init_fn: Callable | None
    ) -> None:
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
        not_fork_safe = fork_unsafe_sources(node._ds)
        if options.start_method == "fork" and not_fork_safe:
            raise ValueError(
                f"mp_prefetch(start_method='fork') cannot read {not_fork_safe[0]}: its "
                "native reader threads can leave a lock held in a forked worker, which then "
                "hangs. Use start_method=None (forkserver for such sources), 'forkserver' or "
                "'spawn'."
            )

    def _stage_name(self) -> str:
        return f"mp_prefetch(num_workers={self._options.num_workers})"

    def _make_iter(self, rf):
        opts, init = self._options, self._init_fn

        def factory(root: MapRootIterDataset) -> DatasetIterator:
            return MPRootIterator(root._ds, root._read_options, opts, init, root._debug)

        return self._parent._make_iter(factory)


# --- worker side ---


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

    def __init__(self, w, n, ds, cap, length, conn, buf, slot_bytes, slots) -> None:
        self.w, self.n, self.ds, self.cap, self.length = w, n, ds, cap, length
        self.conn, self.buf, self.slot_bytes = conn, buf, slot_bytes
        self.beat = _heartbeat(buf)
        self.free = list(range(slots))
        self.inline_out = 0  # chunks sent through the pipe and not yet acknowledged
        self.gen: int | None = None
        self.plan: Iterator[tuple[int, int]] | None = None
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

    def next_bounds(self) -> tuple[int, int] | None:
        plan = self.plan
        assert plan is not None  # run() asks only while a start position is set
        while True:
            b = next(plan, None)
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
        beat = self.beat
        try:
            for a in range(bounds[0], bounds[1], self.sub):
                b = min(a + self.sub, bounds[1])
                beat[3] = 0.0  # the main process reads [chunk, a, b] only while [3] is set
                beat[:3] = (chunk_k, a, b)
                beat[3] = time.monotonic()
                try:
                    vals, err = read_chunk(self.ds, a, b, prof)
                finally:
                    beat[3] = 0.0
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
                self.buf[_HEADER + off : _HEADER + off + r.nbytes] = r
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


def _heartbeat(buf) -> np.ndarray:
    """[chunk, first element, end element, monotonic start time or 0 when idle]."""
    return np.ndarray((4,), np.float64, buffer=buf[:32])


_PR_SET_PDEATHSIG = 1


def _exit_with_parent(main_pid: int | None, conn, pdeathsig: bool) -> None:
    """Make this worker exit when the main process dies, even while busy in user code.

    Linux: the kernel sends SIGKILL when the parent dies (``PR_SET_PDEATHSIG``; it fires
    when the *thread* that started the worker exits, so it is only used when that was
    the main thread, or the single-threaded forkserver). Everywhere: a daemon thread
    exits the process when the parent pid changes or the pipe to the main process hangs
    up (only the main process holds its end).
    """
    if pdeathsig and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    parent_pid = os.getppid()
    if main_pid is not None and parent_pid != main_pid:  # died before the signal was armed
        os._exit(1)
    fd = conn.fileno()

    def watch():
        hup = select.POLLHUP | getattr(select, "POLLRDHUP", 0)
        poller = select.poll() if hasattr(select, "poll") else None
        if poller is not None:
            poller.register(fd, hup)
        while True:
            if poller is not None:
                events = poller.poll(250)
                if any(ev & hup for _, ev in events):
                    os._exit(1)
            else:
                time.sleep(0.25)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="cairn-data-parent-watch").start()


def _worker_main(
    w,
    n,
    ds,
    cap,
    length,
    conn,
    shm_ref,
    slot_bytes,
    slots,
    init_fn,
    close_conns,
    main_pid,
    pdeathsig,
):
    # Ctrl-C and SIGTERM are the main process's to handle: a scheduler that signals the whole
    # process group (preemption) must reach the training loop's handler, which saves and
    # exits, not end the workers under it (they exit when the main process does)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _close_quietly(close_conns)
    parent_pid = os.getppid()
    _exit_with_parent(main_pid, conn, pdeathsig)
    shm = shared_memory.SharedMemory(name=shm_ref) if isinstance(shm_ref, str) else shm_ref
    try:
        if isinstance(ds, bytes):  # pickled for a spawned / forkserver worker
            ds, init_fn = pickle.loads(ds)
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


# --- main side ---


class _Workers:
    """The processes, pipes and shared memory of one iterator; closed by a finalizer."""

    def __init__(self) -> None:
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
            if p.is_alive():  # a worker ignores SIGTERM (see _worker_main): stop it with SIGKILL
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


class MPRootIterator(ChunkedRootIterator):
    """Same elements and state as ``MapRootIterator``, computed by worker processes."""

    _who = "mp_prefetch iterator"
    _reads_in_next = False  # workers read (the main process only the first chunk)

    def __init__(
        self,
        ds: MapDataset,
        read_options: ReadOptions,
        options: MultiprocessingOptions,
        init_fn: Callable[[int, int], None] | None,
        debug: bool = False,
    ) -> None:
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

    # --- control ---
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
        method = _resolve_start_method(opts.start_method, not fork_unsafe_sources(self._ds))
        ctx: Any = mp.get_context(method)  # a concrete context: it has .Process
        if method == "forkserver":
            _preload_forkserver(ctx)
        payload = None
        if method != "fork":  # pickled once, with a clear error, rather than per worker
            payload = _dumps_for_workers((self._ds, self._init_fn), method, self._ds)
        # PR_SET_PDEATHSIG fires when the thread that started the worker exits: safe only
        # from the main thread (a prefetch thread may end while the iterator lives on) or
        # from the forkserver, which is single-threaded.
        pdeathsig = method == "forkserver" or threading.current_thread() is threading.main_thread()
        main_pid = None if method == "forkserver" else os.getpid()
        self._method = method
        ws = _Workers()
        weakref.finalize(self, ws.shutdown)  # the registry keeps it until it runs
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
                shm = shared_memory.SharedMemory(
                    create=True, size=_HEADER + slots * opts.slot_bytes
                )
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
                        self._ds if payload is None else payload,
                        self._cap,
                        self._len,
                        theirs,
                        shm_ref,
                        opts.slot_bytes,
                        slots,
                        self._init_fn if payload is None else None,
                        close,
                        main_pid,
                        pdeathsig,
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

    @property
    def _ws(self) -> _Workers:
        """The running workers (read only after ``_launch``)."""
        ws = self._w
        assert ws is not None
        return ws

    def _fail(self, err: BaseException) -> BaseException:
        self._broken = err
        if self._w is not None:
            self._w.shutdown()
        return err

    def _died(self, w: int) -> WorkerDiedError:
        p = self._ws.procs[w]
        p.join(0.5)
        code = p.exitcode
        how = (
            f"was killed by {_SIGNAL_NAMES.get(code, f'signal {-code}')}"
            if code is not None and code < 0
            else f"exited with code {code}"
        )
        hint = ""
        if getattr(self, "_method", "fork") != "fork" and code == 1:
            hint = (
                f" Workers started with {self._method!r} re-import the main script: if it "
                "starts the pipeline at import time, guard that code with "
                "`if __name__ == '__main__':` (the worker's own traceback is on stderr)."
            )
        return WorkerDiedError(
            f"cairn.data worker {w} of {self._n} (pid {p.pid}) {how} while computing the pipeline "
            f"{self._ds._stage_name()!r}; the iterator cannot continue. Restore a new iterator from "
            f"the last get_state() to resume.{hint}"
        )

    def _worker_error(self, w: int, msg) -> BaseException:
        _, _, ek, payload, tb, text = msg
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

    def _stuck(self, w: int) -> WorkerTimeoutError | None:
        """Worker ``w``'s timeout error if it has been on its elements for longer than
        ``per_element_timeout_s`` each (it is then killed), else None."""
        limit = self._opts.per_element_timeout_s
        assert limit is not None  # _recv checks for stuck workers only with a timeout set
        beat = _heartbeat(self._ws.shms[w].buf)
        t0 = float(beat[3])
        k, a, b = (int(x) for x in beat[:3])
        if t0 == 0.0 or float(beat[3]) != t0:  # idle, or moved on while we read
            return None
        elapsed = time.monotonic() - t0
        if elapsed <= limit * max(1, b - a):
            return None
        p = self._ws.procs[w]
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.join(1.0)
        what = f"element {a}" if b - a == 1 else f"elements {a}..{b - 1} (one batched read)"
        return WorkerTimeoutError(
            f"cairn.data worker {w} of {self._n} (pid {p.pid}) was stuck for {elapsed:.1f} s on "
            f"{what} of chunk {k} of the pipeline {self._ds._stage_name()!r}, longer than "
            f"per_element_timeout_s={limit} per element; it was killed. Restore a new iterator "
            "from the last get_state() to resume (or skip the element with set_state).",
            w,
            p.pid,
            range(a, b),
            elapsed,
        )

    def _recv(self, w: int):
        ws = self._ws
        conn = ws.conns[w]
        sentinels = {p.sentinel: i for i, p in enumerate(ws.procs)}
        limit = self._opts.per_element_timeout_s
        poll_s = 5.0 if limit is None else min(5.0, max(0.02, limit / 10))
        while True:
            if conn.poll():
                try:
                    return conn.recv()
                except (EOFError, OSError):
                    raise self._fail(self._died(w)) from None
            ready = mpc.wait([conn, *sentinels], timeout=poll_s)
            if not ready and limit is not None:
                err = self._stuck(w)
                if err is not None:
                    raise self._fail(err)
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
                self._ws.unlink(msg[1])
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
                    self._ws.send(w, ("free", slot))
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
            self._ws.send(w, ("free", -1))
            return values
        off = _HEADER + slot * self._opts.slot_bytes
        total = sum(-(-s // _ALIGN) * _ALIGN for s in sizes)
        block = bytearray(self._ws.shms[w].buf[off : off + total])
        self._ws.send(w, ("free", slot))
        view = memoryview(block)
        bufs = []
        pos = 0
        for s in sizes:
            bufs.append(view[pos : pos + s])
            pos += -(-s // _ALIGN) * _ALIGN
        return pickle.loads(data, buffers=bufs)

    # --- iterator protocol ---
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
