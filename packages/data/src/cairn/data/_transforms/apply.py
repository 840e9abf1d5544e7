"""``apply_transformations`` / ``ds.apply``: Grain's transform objects applied as dataset steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._dataset import IterDataset, MapDataset

# import cycle (labelled): base classes <-> transformations, by design
from cairn.data._transforms.flat_map import FlatMapIterDataset, FlatMapMapDataset

__all__ = ["apply_transformations"]


def _has(t: Any, method: str) -> bool:
    return callable(getattr(t, method, None))


def _apply_one(ds: Any, t: Any) -> Any:
    """One transform object as its step, recognised by its method (``Batch`` by its
    ``batch_size``), in Grain's order of precedence."""
    if isinstance(t, type):
        raise TypeError(f"apply_transformations: pass a transform object, got the class {t.__name__}")
    if isinstance(getattr(t, "batch_size", None), int):
        return ds.batch(t.batch_size, drop_remainder=t.drop_remainder, batch_fn=getattr(t, "batch_fn", None))
    if _has(t, "map"):
        return ds.map(t)
    if _has(t, "random_map"):
        return ds.random_map(t)
    if _has(t, "map_with_index"):
        return ds.map_with_index(t)
    if _has(t, "filter"):
        return ds.filter(t)
    if _has(t, "flat_map"):
        return FlatMapMapDataset(ds, t) if isinstance(ds, MapDataset) else FlatMapIterDataset(ds, t)
    raise NotImplementedError(
        f"apply_transformations: {type(t).__name__} is not a transformation a dataset can apply "
        "(expected a Map, RandomMap, MapWithIndex, Filter, FlatMap or Batch object)"
    )


def apply_transformations(ds: MapDataset | IterDataset, transformations: Any) -> MapDataset | IterDataset:
    """``ds`` with each of ``transformations`` applied in order as the matching step.

    ``Map`` -> ``map``, ``RandomMap`` -> ``random_map`` (the seed set by ``.seed``),
    ``MapWithIndex`` -> ``map_with_index``, ``Filter`` -> ``filter``, ``FlatMap`` ->
    ``FlatMapMapDataset`` / ``FlatMapIterDataset``, ``Batch`` -> ``batch``.

    Args:
      ds: a ``MapDataset`` or ``IterDataset``.
      transformations: one transform object or a sequence of them.

    Raises:
      TypeError: if ``ds`` is not a dataset.
      NotImplementedError: for an object that is none of those transforms.

    >>> import cairn.data as grain
    >>> class Inc(grain.transforms.Map):
    ...     def map(self, x):
    ...         return x + 1
    >>> list(apply_transformations(grain.MapDataset.range(5), [Inc(), grain.Batch(2)]))[0].tolist()
    [1, 2]
    """
    if not isinstance(ds, MapDataset | IterDataset):
        raise TypeError(f"apply_transformations: expected a MapDataset or IterDataset, got {type(ds).__name__}")
    if not isinstance(transformations, Sequence):
        transformations = [transformations]
    for t in transformations:
        ds = _apply_one(ds, t)
    return ds
