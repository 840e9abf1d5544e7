"""``device_put``: move batches onto JAX devices ahead of the training step."""

from __future__ import annotations

from typing import Any

from cairn.data._dataset import IterDataset
from cairn.data._transforms.map import MapIterDataset as _MapIterDataset
from cairn.data._transforms.prefetch import PrefetchIterDataset as _PrefetchIterDataset

__all__ = ["device_put"]


class _PutOnDevice:
    """Picklable ``jax.device_put`` with a fixed target; imports JAX on first use."""

    def __init__(self, target: Any):
        self._target = target

    def __call__(self, batch: Any) -> Any:
        import jax

        return jax.device_put(batch, self._target)

    def __repr__(self) -> str:
        return f"jax.device_put(target={self._target!r})"


def device_put(ds: IterDataset, device: Any = None, *, buffer_size: int = 2) -> IterDataset:
    """Put every element on ``device`` (a ``jax.Device`` or ``jax.sharding.Sharding``).

    The transfer runs in a background thread ``buffer_size`` elements ahead, so the host
    to device copy overlaps the training step. JAX is imported only when elements flow,
    and this step always runs in the main process (after ``mp_prefetch``). The iterator
    state is the input's state.

    Args:
      ds: the input ``IterDataset``.
      device: a ``jax.Device`` or ``jax.sharding.Sharding``; None uses the default device.
      buffer_size: elements transferred ahead.

    Raises:
      TypeError: ``ds`` is not an ``IterDataset``.
    """
    if not isinstance(ds, IterDataset):
        raise TypeError(f"device_put() expects an IterDataset, got {type(ds).__name__}")
    return _PrefetchIterDataset(_MapIterDataset(ds, _PutOnDevice(device)), buffer_size)
