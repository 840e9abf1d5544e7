"""Big request and response bodies are parsed and written off the event loop, in worker processes.

``json.loads`` of a 64 MB body, and turning its lists into arrays, takes seconds and holds
the GIL the whole time: on the event loop it stalls every connection (health checks
included), and in a thread it stalls the loop just the same. So a JSON body (or the JSON
part of a binary one) larger than :data:`OFFLOAD_BYTES`, and a JSON answer whose arrays
are that large, is handled by a few worker processes.

A worker is ``python -c`` importing this module with the server's ``sys.path``: unlike
``multiprocessing``'s ``spawn`` it never re-imports the caller's ``__main__`` (a script
that calls ``serve()`` without an ``if __name__ == "__main__":`` guard would run again in
every worker), and nothing of the server's threads or JAX state is forked. Calls travel
as pickle protocol 5 frames over the worker's pipes with the body and the arrays out of
band: the server copies neither, and the GIL is released while the bytes move. Each of
the ``workers`` threads that wait on the pipes owns one process, started at its first
call; where none can start, the work runs on that thread instead (correct, but holding
the GIL), and a warning says so once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

log = logging.getLogger("cairn.serving")
T = TypeVar("T")

#: bodies (the JSON part) larger than this are parsed in a worker process.
OFFLOAD_BYTES = 1 << 20
_OUT_OF_BAND = 1 << 16  # byte strings larger than this travel outside the pickle
_WORKER = "import json, os, sys; sys.path[:] = json.loads(sys.argv[1]); from cairn.serving._offload import _worker_main; _worker_main()"


class WorkerDied(RuntimeError):
    """The worker process ended while handling a call (it is replaced at the next one)."""


def _write_all(fd: int, data: memoryview) -> None:
    while data.nbytes:
        data = data[os.write(fd, data) :]


def _read_exact(fd: int, n: int) -> np.ndarray:
    buf = np.empty(n, np.uint8)  # not zero-filled: its pages are touched once, by the read
    view, got = buf.data, 0
    while got < n:
        k = os.readv(fd, [view[got:]])
        if k == 0:
            raise EOFError("the other end closed the pipe")
        got += k
    return buf


def send(fd: int, obj: Any) -> None:
    """Write ``obj`` as one frame: counts and sizes, the pickle, then its out-of-band buffers."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    _write_all(fd, memoryview(struct.pack(f"<{len(views) + 2}Q", len(views), len(data), *(v.nbytes for v in views))))
    for part in (memoryview(data), *views):
        _write_all(fd, part)


def recv(fd: int) -> Any:
    """Read one frame written by :func:`send` (arrays come back over the frame's buffers)."""
    (count,) = struct.unpack("<Q", _read_exact(fd, 8).tobytes())
    sizes = struct.unpack(f"<{count + 1}Q", _read_exact(fd, 8 * (count + 1)).tobytes())
    data = _read_exact(fd, sizes[0])
    return pickle.loads(data.data, buffers=[_read_exact(fd, n) for n in sizes[1:]])


def _out_of_band(arg: Any) -> Any:
    if isinstance(arg, bytes | bytearray | memoryview) and memoryview(arg).nbytes > _OUT_OF_BAND:
        return pickle.PickleBuffer(arg)  # not copied into the pickle; arrives as a buffer
    return arg


def _worker_main() -> None:
    """A worker process: answer ``(fn, args)`` frames on stdin with ``(ok, value)`` frames."""
    out = os.dup(1)
    os.dup2(2, 1)  # a stray print goes to stderr, not into the frames
    while True:
        try:
            fn, args = recv(0)
            result = fn(*args)
            value = tuple(map(_out_of_band, result)) if type(result) is tuple else _out_of_band(result)
            reply: tuple[bool, Any] = (True, value)
        except EOFError:
            return
        except Exception as e:  # noqa: BLE001 - the caller re-raises it
            reply = (False, e)
        try:
            send(out, reply)
        except Exception as e:  # noqa: BLE001 - an unpicklable result or exception
            send(out, (False, RuntimeError(f"{type(e).__name__}: {e}")))


class _Process:
    """One worker process and its pipes (used by one thread at a time)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, json.dumps(sys.path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True
        )

    def call(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            send(self.proc.stdin.fileno(), (fn, tuple(_out_of_band(a) for a in args)))
            ok, value = recv(self.proc.stdout.fileno())
        except (EOFError, OSError) as e:
            self.close()
            raise WorkerDied(f"the body-parsing process ended ({type(e).__name__}: {e}; exit code {self.proc.poll()})") from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        self.proc.kill()
        self.proc.wait()


class Offloader:
    """Runs pure, picklable functions of big bodies in worker processes (module docstring).

    Args:
      workers: processes (and the threads that wait on them), started at first use.
    """

    def __init__(self, workers: int = 2) -> None:
        self._threads = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="cairn-serving-offload")
        self._local = threading.local()
        self._lock = threading.Lock()
        self._processes: list[_Process] = []
        self._closed = False
        self._no_processes = False

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker process; its exception, if any, is raised here (it
        must pickle: ``ProtocolError`` does). Raises ``WorkerDied`` if the process ended."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._call, fn, args)

    def _call(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        process = getattr(self._local, "process", None)
        if process is None or process.proc.poll() is not None:
            process = self._local.process = self._start()
        if process is None:
            return fn(*args)
        return process.call(fn, args)

    def _start(self) -> _Process | None:
        with self._lock:
            if self._closed or self._no_processes:
                return None
            try:
                process = _Process()
            except OSError as e:
                self._no_processes = True
                log.warning("big request bodies are parsed on a thread, not in worker processes (they stall the server meanwhile): %s", e)
                return None
            self._processes.append(process)
            return process

    def shutdown(self) -> None:
        """Stop the workers (calls in progress fail)."""
        with self._lock:
            self._closed = True
            processes, self._processes = self._processes, []
        for process in processes:
            process.close()
        self._threads.shutdown(wait=False, cancel_futures=True)
