"""``IterDataset.prefetch``: the input iterator runs ``buffer_size`` elements ahead in a
background thread."""

from __future__ import annotations

import queue
import threading
from typing import Any

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._dataset import DatasetIterator

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._transforms.common import UnaryIterDataset

__all__ = ["PrefetchIterDataset", "ThreadPrefetchIterator"]


_END = object()


class ThreadPrefetchIterator(DatasetIterator):
    """Runs the parent iterator in a background thread, ``buffer_size`` elements ahead."""

    def __init__(
        self, parent: DatasetIterator, buffer_size: int, name: str = "prefetch", debug: bool = False
    ) -> None:
        super().__init__((parent,), name, debug)
        self._p = parent
        self._size = buffer_size
        self._stats.capacity = buffer_size
        self._state = parent.get_state()
        self._thread: threading.Thread | None = None
        self._done = False

    def _start(self) -> None:
        self._q: queue.Queue = queue.Queue(self._size)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._work, args=(self._q, self._stop), daemon=True, name="cairn-data-prefetch"
        )
        self._thread.start()

    def _work(self, q: queue.Queue, stop: threading.Event) -> None:
        p = self._p
        while not stop.is_set():
            item: tuple[Any, dict | None, BaseException | None]
            try:
                x = next(p)
                item = (x, p.get_state(), None)
            except StopIteration:
                item = (_END, p.get_state(), None)
            except BaseException as e:  # handed to the consumer, which re-raises it
                item = (_END, None, e)
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[0] is _END:
                return

    def _next(self):
        if self._done:
            raise StopIteration
        if self._thread is None:
            self._start()
        self._stats.fill_sum += self._q.qsize()
        self._stats.fill_n += 1
        x, state, err = self._q.get()
        if err is not None:
            self._halt()
            self._done = True
            raise err
        if x is _END:
            self._state = state
            self._done = True
            self._thread = None
            raise StopIteration
        self._state = state
        return x

    def get_state(self) -> dict:
        return self._state

    def _halt(self) -> None:
        if self._thread is not None:
            self._stop.set()
            try:
                while True:
                    self._q.get_nowait()
            except queue.Empty:
                pass
            self._thread.join()
            self._thread = None

    def set_state(self, state: dict) -> None:
        self._halt()
        try:
            self._p.set_state(state)
        except BaseException:  # the thread read ahead: put the input back where we are
            self._p.set_state(self._state)
            raise
        self._state = self._p.get_state()
        self._done = False

    def close(self) -> None:
        self._halt()
        super().close()


class PrefetchIterDataset(UnaryIterDataset):
    """``IterDataset.prefetch``: args ``(buffer_size,)``."""

    _iterator = ThreadPrefetchIterator

    def _stage_name(self):
        (size,) = self._args
        return f"prefetch({size})"
