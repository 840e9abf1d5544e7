"""``pick_performance_config``: worker count and read-ahead sized from a RAM budget."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import numpy as np

from cairn.data._dataset import IterDataset, MapDataset, ReadOptions
from cairn.data._multiprocessing import MultiprocessingOptions

__all__ = ["PerformanceConfig", "pick_performance_config"]

_DEFAULT_BUDGET_MB = 1024
_MAX_CHUNK_RECORDS = 1024


@dataclasses.dataclass
class PerformanceConfig:
    """What :func:`pick_performance_config` chose: pass ``read_options`` to
    ``to_iter_dataset`` and ``multiprocessing_options`` to ``mp_prefetch``.

    Args:
      multiprocessing_options: the worker settings for ``mp_prefetch`` (None: no workers).
      read_options: the read settings for ``to_iter_dataset`` (None: the defaults).
    """

    multiprocessing_options: MultiprocessingOptions | None = None
    read_options: ReadOptions | None = None


def _nbytes(x: Any) -> int:
    """Bytes held by one element (array buffers, plus Python object sizes)."""
    if isinstance(x, np.ndarray):
        return int(x.nbytes)
    if isinstance(x, dict):
        return sum(_nbytes(v) for v in x.values())
    if isinstance(x, list | tuple):
        return sum(_nbytes(v) for v in x)
    return sys.getsizeof(x)


def _sample(ds: MapDataset | IterDataset, count: int) -> list:
    if isinstance(ds, MapDataset):
        return [ds[i] for i in range(min(count, len(ds)))]
    it = iter(ds)
    out = []
    try:
        for _ in range(count):
            out.append(next(it))
    except StopIteration:
        pass
    finally:
        it.close()
    return out


def pick_performance_config(
    ds: MapDataset | IterDataset,
    *,
    ram_budget_mb: int | None = None,
    max_workers: int | None = None,
    max_buffer_size: int | None = None,
    samples_to_check: int = 5,
) -> PerformanceConfig:
    """Size read-ahead and worker processes so buffered elements fit in ``ram_budget_mb``.

    Reads ``samples_to_check`` elements of ``ds`` to estimate an element's size ``s``;
    ``ram_budget_mb / s`` elements may then be in flight. Half of them go to the read-ahead
    of ``to_iter_dataset`` (a chunk of at most 1024 records, at most ``max_buffer_size``
    chunks ahead), the other half to workers (one chunk each, at most ``max_workers``,
    default: the CPU count). The result is a plan from sizes only: measure before trusting
    it for speed.

    Args:
      ds: the pipeline (a ``MapDataset`` is sampled by index, an ``IterDataset`` by a
        fresh iterator that is closed afterwards).
      ram_budget_mb: memory for buffered elements (default 1024).
      max_workers: upper bound on worker processes (default ``os.cpu_count()``).
      max_buffer_size: upper bound on chunks read ahead (default 8).
      samples_to_check: elements to read for the size estimate.

    Raises:
      ValueError: for a non-positive budget, bound or sample count, or an empty ``ds``.

    >>> cfg = pick_performance_config(MapDataset.range(100), ram_budget_mb=1, max_workers=2)
    >>> cfg.multiprocessing_options.num_workers, cfg.read_options.num_threads
    (2, 1)
    """
    if not isinstance(ds, MapDataset | IterDataset):
        raise TypeError(f"pick_performance_config: ds must be a MapDataset or IterDataset, got {type(ds).__name__}")
    budget = _DEFAULT_BUDGET_MB if ram_budget_mb is None else ram_budget_mb
    for name, v in (("ram_budget_mb", budget), ("max_workers", max_workers),
                    ("max_buffer_size", max_buffer_size), ("samples_to_check", samples_to_check)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"pick_performance_config: {name} must be a positive int, got {v!r}")
    sample = _sample(ds, samples_to_check)
    if not sample:
        raise ValueError("pick_performance_config: ds has no elements to measure")
    elem = max(1, sum(_nbytes(x) for x in sample) // len(sample))
    fit = budget * 2**20 // elem
    chunk = int(max(1, min(_MAX_CHUNK_RECORDS, fit // 4)))
    buffers = int(max(1, min(max_buffer_size or 8, fit // 2 // chunk)))
    workers = int(max(1, min(max_workers or os.cpu_count() or 1, fit // 2 // chunk)))
    return PerformanceConfig(
        multiprocessing_options=MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=1),
        read_options=ReadOptions(num_threads=1, prefetch_buffer_size=buffers, chunk_records=chunk),
    )
