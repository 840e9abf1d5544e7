"""Big request and response bodies are parsed and written off the event loop, in worker processes.

``json.loads`` of a 64 MB body, and turning its lists into arrays, takes seconds and holds
the GIL the whole time: on the event loop it stalls every connection (health checks
included), and in a thread it stalls the loop just the same. So a JSON body (or the JSON
part of a binary one) larger than :data:`OFFLOAD_BYTES`, and a JSON answer whose arrays
are that large, is handled by a small pool of worker processes (``spawn``: nothing of the
server's threads or JAX state is forked). The loop only hands the bytes over and takes
the arrays back, both pickled at memory speed by the pool's own threads.

The pool starts at the first big body. Where worker processes cannot start (a script
that calls ``serve()`` without an ``if __name__ == "__main__":`` guard cannot be
re-imported by ``spawn``), the work runs on a thread instead, correct but holding the
GIL, and a warning says so once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

log = logging.getLogger("cairn.serving")
T = TypeVar("T")

#: bodies (the JSON part) larger than this are parsed in a worker process.
OFFLOAD_BYTES = 1 << 20


class Offloader:
    """Runs pure, picklable functions of big bodies in worker processes (module docstring).

    Args:
      workers: processes in the pool (started at the first call).
    """

    def __init__(self, workers: int = 2) -> None:
        self.workers = workers
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._broken = False

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker process (on a thread where processes cannot start);
        its exception, if any, is raised here (it must pickle: ``ProtocolError`` does)."""
        loop = asyncio.get_running_loop()
        if not self._broken:
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
            try:
                return await loop.run_in_executor(self._pool, fn, *args)
            except BrokenProcessPool as e:
                self._broken = True
                log.warning("big request bodies are parsed on a thread, not in worker processes (they stall the server meanwhile): %s", e)
        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cairn-serving-parse")
        return await loop.run_in_executor(self._threads, fn, *args)

    def shutdown(self) -> None:
        """Stop the workers (what runs is abandoned)."""
        for pool in (self._pool, self._threads):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._threads = None
