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
    "WithOptionsIterDataset",
    "ZipIterDataset",
    "ZipMapDataset",
    "apply_transformations",
    "assert_equal_output_after_checkpoint",
    "batch_and_pad",
    "device_put",
    "pick_performance_config",
]


class ThreadPrefetchIterDataset(PrefetchIterDataset):
    """``parent`` computed up to ``prefetch_buffer_size`` elements ahead in a background
    thread (the class behind ``IterDataset.prefetch``; ``0`` passes ``parent`` through).

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
