"""A dynamic batcher per model version, on a worker pool shared by all models.

Requests queue on the event loop. A batch starts when an execution slot is free (at most
``max_concurrent_batches`` per model) and either the queued rows reach
``max_batch_size`` or ``max_queue_delay`` seconds have passed since the batch could first
have run (the oldest request's arrival, or the slot freeing if it had to wait); while a
batch runs, new requests gather for the next one, so batches grow with load. A batch
concatenates the requests along axis 0, pads up to the next of the model's
``batch_buckets`` (the sizes it has compiled), runs on the shared pool (or on the loop
itself for a model that computes in well under a millisecond, where the thread hop would
cost more than the model), and hands each request its own rows. Each row depends only on
its own inputs, so a request's outputs equal running it alone. If a batch raises, each of
its requests is run alone, so only the request that makes the model fail gets the error.
A full queue refuses new requests (the server answers 503 with Retry-After).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class BatchingConfig:
    """Dynamic batching options for a model (names after Triton's ``dynamic_batching``).

    Args:
      enabled: False runs every request alone (still queued, bounded and pooled).
      max_batch_size: rows per execution; None = the model's own ``max_batch_size``
        (a larger value is capped at the model's).
      batch_buckets: sizes to pad a batch up to; None = the model's ``batch_buckets``;
        ``()`` = no padding.
      max_queue_delay: seconds a request may wait for others to fill a batch (Triton's
        ``max_queue_delay_microseconds``, TF Serving's ``batch_timeout_micros``).
      max_queue_size: queued requests beyond this are refused (503 with Retry-After).
      max_concurrent_batches: executions of this model at once (TF Serving's
        ``num_batch_threads``).
      run_inline: True runs batches on the event loop itself, False on the worker pool;
        None (default) decides by measurement: on the loop while a batch's mean compute
        time stays under ``inline_below`` seconds (a thread hop and the GIL hand-over
        cost more than such a model), on the pool otherwise. Either way a batch collects
        every request that arrived in the same loop iteration.
      inline_below: the compute time (seconds) under which ``run_inline=None`` runs inline.

    >>> BatchingConfig(max_queue_delay=0.002).max_queue_size
    256
    """

    enabled: bool = True
    max_batch_size: int | None = None
    batch_buckets: tuple[int, ...] | None = None
    max_queue_delay: float = 0.0
    max_queue_size: int = 256
    max_concurrent_batches: int = 1
    run_inline: bool | None = None
    inline_below: float = 0.0005

    def __post_init__(self) -> None:
        if self.max_batch_size is not None and self.max_batch_size < 0:
            raise ValueError(f"BatchingConfig.max_batch_size must be >= 0, got {self.max_batch_size}")
        if self.max_queue_delay < 0:
            raise ValueError(f"BatchingConfig.max_queue_delay must be >= 0 seconds, got {self.max_queue_delay}")
        if self.max_queue_size < 1 or self.max_concurrent_batches < 1:
            raise ValueError(
                "BatchingConfig.max_queue_size and max_concurrent_batches must be >= 1, "
                f"got {self.max_queue_size} and {self.max_concurrent_batches}"
            )
        if self.batch_buckets is not None:
            buckets = tuple(sorted(int(b) for b in self.batch_buckets))
            if any(b < 1 for b in buckets):
                raise ValueError(f"BatchingConfig.batch_buckets must be positive, got {self.batch_buckets}")
            object.__setattr__(self, "batch_buckets", buckets)


class QueueFull(Exception):
    """The model's queue is full; retry after ``retry_after`` seconds.

    Args:
      message: the error text.
      retry_after: the seconds a client should wait before retrying (sent as ``Retry-After``).
    """

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(Exception):
    """The model version is being unloaded and takes no new requests."""


class ModelError(Exception):
    """The model raised (or returned something malformed) while running this request."""


@dataclasses.dataclass
class Timing:
    """Where a request's time went (seconds)."""

    queue: float
    compute: float
    batch: int
    padded: int


@dataclasses.dataclass
class _Item:
    inputs: Mapping[str, np.ndarray]
    rows: int
    future: asyncio.Future[tuple[dict[str, np.ndarray], Timing]]
    enqueued: float


Observer = Callable[[int, int, float, list[float]], None]


class DynamicBatcher:
    """Queues, batches and runs requests for one model version (event-loop thread only).

    Args:
      model: a ServableModel (``__call__`` on a dict of arrays batched on axis 0).
      config: :class:`BatchingConfig`.
      executor: the worker pool shared by all models.
      observe: called on the loop after each execution with
        ``(rows, padded_rows, compute_seconds, queue_seconds_per_request)``.
    """

    def __init__(self, model: Any, config: BatchingConfig, executor: concurrent.futures.Executor, observe: Observer | None = None) -> None:
        self.model = model
        model_max = int(getattr(model, "max_batch_size", 0) or 0)
        self.batchable = config.enabled and model_max > 0
        cap = model_max if config.max_batch_size is None else min(config.max_batch_size, model_max)
        self.max_batch_size = max(1, cap) if self.batchable else 1
        buckets = getattr(model, "batch_buckets", ()) if config.batch_buckets is None else config.batch_buckets
        self.buckets = tuple(sorted(b for b in buckets or () if b <= model_max)) if self.batchable else ()
        self.config = config
        self._executor = executor
        self._observe = observe
        self._loop = asyncio.get_running_loop()
        self._queue: collections.deque[_Item] = collections.deque()
        self._rows = 0
        self._in_flight = 0
        self._timer: asyncio.TimerHandle | None = None
        self._deferred = False
        self._slot_freed = 0.0
        self._inline = config.run_inline is True
        self._mean_compute: float | None = None
        self._closed = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def queued(self) -> int:
        """Requests waiting (not yet in a running batch)."""
        return len(self._queue)

    def submit(self, inputs: Mapping[str, np.ndarray], rows: int) -> asyncio.Future[tuple[dict[str, np.ndarray], Timing]]:
        """Queue one request of ``rows`` rows; the future resolves to (outputs, timing).

        Raises:
          Unavailable: the batcher is closing.
          QueueFull: ``max_queue_size`` requests are already waiting.
        """
        if self._closed:
            raise Unavailable("this model version is being unloaded")
        if len(self._queue) >= self.config.max_queue_size:
            raise QueueFull(f"the queue holds {len(self._queue)} requests (max_queue_size)")
        future = self._loop.create_future()
        self._queue.append(_Item(inputs, rows, future, time.perf_counter()))
        self._rows += rows
        self._idle.clear()
        if not self._deferred:  # dispatch after this loop iteration's other reads: they may join the batch
            self._deferred = True
            self._loop.call_soon(self._dispatch)
        return future

    async def close(self) -> None:
        """Take no new requests; return when every queued and running request is answered."""
        self._closed = True
        self._dispatch()
        await self._idle.wait()

    # --- scheduling (loop thread) ---

    def _dispatch(self) -> None:
        self._deferred = False
        while self._queue and self._in_flight < self.config.max_concurrent_batches:
            delay = self.config.max_queue_delay
            if self.batchable and delay > 0 and self._rows < self.max_batch_size and not self._closed:
                # the delay counts from when the batch could first have run: from the oldest
                # request's arrival, or from when a slot freed if it waited for one (so under
                # saturation the clients just answered can join, instead of batches splitting)
                wait = max(self._queue[0].enqueued, self._slot_freed) + delay - time.perf_counter()
                if wait > 0:
                    if self._timer is None:
                        self._timer = self._loop.call_later(wait, self._on_timer)
                    return
            items = self._take()
            self._in_flight += 1
            if self._inline:
                self._complete(items, *self._execute(items, time.perf_counter()), redispatch=False)
                if self._queue and not self._deferred:  # one batch per loop iteration: its answers
                    self._deferred = True  # go out (and new requests come in) before the next
                    self._loop.call_soon(self._dispatch)
                break
            else:
                self._executor.submit(self._run, items, time.perf_counter())
        if not self._queue and self._in_flight == 0:
            self._idle.set()

    def _on_timer(self) -> None:
        self._timer = None
        self._dispatch()

    def _take(self) -> list[_Item]:
        items = [self._queue.popleft()]
        rows = items[0].rows
        while self._queue and rows + self._queue[0].rows <= self.max_batch_size:
            item = self._queue.popleft()
            items.append(item)
            rows += item.rows
        self._rows -= rows
        return items

    def _complete(self, items: list[_Item], results: list[Any], timing: Timing, redispatch: bool = True) -> None:
        self._in_flight -= 1
        self._slot_freed = time.perf_counter()
        mean = self._mean_compute
        self._mean_compute = timing.compute if mean is None else 0.8 * mean + 0.2 * timing.compute
        if self.config.run_inline is None:
            self._inline = self._mean_compute < self.config.inline_below
        waits = []
        for item, result in zip(items, results):
            waits.append(timing.queue - item.enqueued)
            if item.future.done():
                continue
            if isinstance(result, BaseException):
                item.future.set_exception(result)
            else:
                item.future.set_result((result, dataclasses.replace(timing, queue=timing.queue - item.enqueued)))
        if self._observe is not None:
            self._observe(timing.batch, timing.padded, timing.compute, waits)
        if redispatch:
            self._dispatch()

    # --- execution (worker thread) ---

    def _run(self, items: list[_Item], started: float) -> None:
        results, timing = self._execute(items, started)
        self._loop.call_soon_threadsafe(self._complete, items, results, timing)

    def _execute(self, items: list[_Item], started: float) -> tuple[list[Any], Timing]:
        rows = sum(item.rows for item in items)
        padded = rows
        t0 = time.perf_counter()
        try:
            if self.batchable:
                padded = self._bucket(rows)
                results: list[Any] = self._run_batch(items, rows, padded)
            else:
                results = [self._call(items[0].inputs, None)]
        except Exception as e:  # noqa: BLE001 - each request's own error follows
            if len(items) > 1:
                results = [self._run_alone(item) for item in items]
            else:
                results = [e if isinstance(e, ModelError) else ModelError(f"{type(e).__name__}: {e}")]
        return results, Timing(queue=started, compute=time.perf_counter() - t0, batch=rows, padded=padded)

    def _bucket(self, rows: int) -> int:
        i = bisect.bisect_left(self.buckets, rows)
        return self.buckets[i] if i < len(self.buckets) else rows

    def _run_batch(self, items: list[_Item], rows: int, padded: int) -> list[dict[str, np.ndarray]]:
        if len(items) == 1 and rows == padded:
            return [self._call(items[0].inputs, rows)]
        batch = {}
        for name in items[0].inputs:
            parts = [item.inputs[name] for item in items]
            if padded > rows:
                first = parts[0]
                parts.append(np.zeros((padded - rows, *first.shape[1:]), first.dtype))
            batch[name] = np.concatenate(parts, axis=0)
        outputs = self._call(batch, padded)
        results, start = [], 0
        for item in items:
            results.append({k: v[start : start + item.rows] for k, v in outputs.items()})
            start += item.rows
        return results

    def _run_alone(self, item: _Item) -> dict[str, np.ndarray] | ModelError:
        try:
            if item.rows in self.buckets or not self.buckets:
                return self._call(item.inputs, item.rows)
            return self._run_batch([item], item.rows, self._bucket(item.rows))[0]
        except ModelError as e:
            return e
        except Exception as e:  # noqa: BLE001
            return ModelError(f"{type(e).__name__}: {e}")

    def _call(self, inputs: Mapping[str, np.ndarray], rows: int | None) -> dict[str, np.ndarray]:
        outputs = self.model(inputs)
        if not isinstance(outputs, Mapping):
            raise ModelError(f"the model returned {type(outputs).__name__}, expected a dict of arrays")
        result = {}
        for name, value in outputs.items():
            array = np.asarray(value)
            if rows is not None and (array.ndim == 0 or array.shape[0] != rows):
                raise ModelError(f"output '{name}' has shape {array.shape}, expected {rows} rows on axis 0")
            result[name] = array
        return result
