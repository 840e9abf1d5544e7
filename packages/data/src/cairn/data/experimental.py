"""Grain's ``grain.experimental`` names that cairn.data has.

``device_put`` with Grain's signature, thread prefetching as a dataset class, the
RAM-budget performance picker, packing, interleaving, the checkpoint test helper,
``batch_and_pad`` and pipeline-wide ``DatasetOptions`` (``WithOptionsIterDataset``).
JAX is imported only when ``device_put``'s elements flow.

>>> import cairn.data as grain
>>> ds = grain.experimental.ThreadPrefetchIterDataset(
...     grain.MapDataset.range(3).to_iter_dataset(), prefetch_buffer_size=2)
>>> list(ds)
[0, 1, 2]
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cairn.data._dataset import IterDataset
from cairn.data._device import device_put as _device_put
from cairn.data._options import DatasetOptions
from cairn.data._packing import FirstFitPackIterDataset
from cairn.data._performance import PerformanceConfig, pick_performance_config
from cairn.data._testing import assert_equal_output_after_checkpoint
from cairn.data._transforms.apply import apply_transformations
from cairn.data._transforms.flat_map import FlatMapIterDataset, FlatMapMapDataset
from cairn.data._transforms.interleave import InterleaveIterDataset
from cairn.data._transforms.limit import LimitIterDataset
from cairn.data._transforms.options import WithOptionsIterDataset
from cairn.data._transforms.prefetch import PrefetchIterDataset
from cairn.data._transforms.repeat import RepeatIterDataset
from cairn.data._transforms.to_iter import MapRootIterDataset
from cairn.data._transforms.window_shuffle import WindowShuffleIterDataset, WindowShuffleMapDataset
from cairn.data._transforms.zip import ZipIterDataset, ZipMapDataset
from cairn.data._tree import batch_and_pad
from cairn.data.transforms import FlatMap as FlatMapTransform
from cairn.data.transforms import MapWithIndex as MapWithIndexTransform

__all__ = [
    "DatasetOptions",
    "FirstFitPackIterDataset",
    "FlatMapIterDataset",
    "FlatMapMapDataset",
    "FlatMapTransform",
    "InterleaveIterDataset",
    "LimitIterDataset",
    "MapWithIndexTransform",
    "PerformanceConfig",
    "RepeatIterDataset",
    "ThreadPrefetchIterDataset",
    "WindowShuffleIterDataset",
    "WindowShuffleMapDataset",
    "WithOptionsIterDataset",
    "ZipIterDataset",
    "ZipMapDataset",
    "apply_transformations",
    "assert_equal_output_after_checkpoint",
    "batch_and_pad",
    "device_put",
    "multithread_prefetch",
    "pick_performance_config",
]


class ThreadPrefetchIterDataset(PrefetchIterDataset):
    """``parent`` computed up to ``prefetch_buffer_size`` elements ahead in a background
    thread (the class behind ``IterDataset.prefetch``; ``0`` passes ``parent`` through).

    Args:
      parent: the input ``IterDataset``.
      prefetch_buffer_size: elements computed ahead, >= 0 (0 returns ``parent``).

    Raises:
      ValueError: for a negative or non-int ``prefetch_buffer_size``.
    """

    def __new__(cls, parent: IterDataset, *, prefetch_buffer_size: int) -> Any:
        if isinstance(prefetch_buffer_size, bool) or not isinstance(prefetch_buffer_size, int) \
                or prefetch_buffer_size < 0:
            raise ValueError(
                f"ThreadPrefetchIterDataset: prefetch_buffer_size must be an int >= 0, got {prefetch_buffer_size!r}"
            )
        if prefetch_buffer_size == 0:
            return parent
        return super().__new__(cls)

    def __init__(self, parent: IterDataset, *, prefetch_buffer_size: int) -> None:
        super().__init__(parent, prefetch_buffer_size)

    def __getnewargs_ex__(self) -> tuple[tuple, dict]:
        return (self._parent,), {"prefetch_buffer_size": self._args[0]}


def device_put(
    ds: IterDataset, device: Any, *, cpu_buffer_size: int = 4, device_buffer_size: int = 2
) -> IterDataset:
    """Put every element on ``device`` (anything ``jax.device_put`` takes), prefetching.

    Elements are computed ``cpu_buffer_size`` ahead in one thread and copied to the
    device ``device_buffer_size`` ahead in another, so both overlap the training step.
    The iterator state is the input's.

    Args:
      ds: the pipeline (an ``IterDataset``).
      device: a ``jax.Device`` or ``jax.sharding.Sharding``.
      cpu_buffer_size: host elements computed ahead (0: none).
      device_buffer_size: elements already on the device, ahead (at least 1).

    Raises:
      TypeError: if ``ds`` is not an ``IterDataset``.
      ValueError: for negative buffer sizes.
    """
    if not isinstance(ds, IterDataset):
        raise TypeError(f"device_put() expects an IterDataset, got {type(ds).__name__}")
    ds = ThreadPrefetchIterDataset(ds, prefetch_buffer_size=cpu_buffer_size)
    return _device_put(ds, device, buffer_size=max(1, device_buffer_size))


def multithread_prefetch(
    ds: IterDataset, num_threads: int, buffer_size: int, sequential_slice: bool = False
) -> IterDataset:
    """``ds``'s elements, in the same order, computed ahead by ``num_threads`` threads.

    A pipeline that is ``MapDataset.to_iter_dataset()`` (with folded ``map`` / ``filter``
    steps) is read by ``num_threads`` reader threads, each ``buffer_size`` chunks ahead
    (``ReadOptions``); any other pipeline is computed ahead in one background thread,
    ``num_threads * buffer_size`` elements ahead (iterator steps carry state from one
    element to the next, so they cannot be split between threads). The output and the
    iterator state are those of ``ds``.

    Args:
      ds: the pipeline.
      num_threads: reader threads; 0 returns ``ds``.
      buffer_size: chunks (or elements) ahead per thread, at least 1.
      sequential_slice: Grain's choice of which elements each thread reads; only
        ``False`` (the default) is accepted, since the output order never changes here.

    Raises:
      TypeError: if ``ds`` is not an ``IterDataset``.
      ValueError: for a negative ``num_threads``, a ``buffer_size`` below 1 or
        ``sequential_slice=True``.

    >>> import cairn.data as grain
    >>> ds = grain.MapDataset.range(10).to_iter_dataset().filter(lambda x: x % 2)
    >>> list(multithread_prefetch(ds, num_threads=2, buffer_size=1))
    [1, 3, 5, 7, 9]
    """
    if not isinstance(ds, IterDataset):
        raise TypeError(f"multithread_prefetch() expects an IterDataset, got {type(ds).__name__}")
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 0:
        raise ValueError(f"multithread_prefetch(): num_threads must be an int >= 0, got {num_threads!r}")
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
        raise ValueError(f"multithread_prefetch(): buffer_size must be an int >= 1, got {buffer_size!r}")
    if sequential_slice:
        raise ValueError("multithread_prefetch(): sequential_slice=True is not supported (the input order is kept)")
    if num_threads == 0:
        return ds
    if isinstance(ds, MapRootIterDataset):
        opts = dataclasses.replace(ds._read_options, num_threads=num_threads, prefetch_buffer_size=buffer_size)
        return MapRootIterDataset(ds._ds, opts, ds._debug_flag, ds._allow_nones)
    return ThreadPrefetchIterDataset(ds, prefetch_buffer_size=num_threads * buffer_size)
