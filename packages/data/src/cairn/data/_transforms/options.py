"""``WithOptionsIterDataset``: pipeline-wide ``DatasetOptions`` for the steps below it."""

from __future__ import annotations

from collections.abc import Callable

from cairn.data._dataset import DatasetIterator, IterDataset, MapDataset
from cairn.data._options import DatasetOptions, options_scope

__all__ = ["WithOptionsIterDataset"]


class WithOptionsIterDataset(IterDataset):
    """``parent`` with ``options`` in effect for every step below (Grain's name).

    The elements and the iterator state are the parent's. Options set in an outer
    ``WithOptionsIterDataset`` win over those set here.

    Args:
      parent: the input dataset (``IterDataset`` or ``MapDataset``).
      options: the :class:`DatasetOptions` in effect below this step.

    Raises:
      TypeError: if ``options`` is not a ``DatasetOptions`` or ``parent`` not a dataset.

    >>> import logging
    >>> from cairn.data import MapDataset
    >>> from cairn.data.experimental import DatasetOptions, WithOptionsIterDataset
    >>> ds = MapDataset.range(2000).to_iter_dataset().filter(lambda x: x < 10)
    >>> strict = WithOptionsIterDataset(ds, DatasetOptions(filter_raise_threshold_ratio=0.9))
    >>> list(strict)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: filter(<lambda>) skipped 9... % of the last seen ... elements ...
    """

    def __init__(self, parent: IterDataset | MapDataset, options: DatasetOptions) -> None:
        if isinstance(parent, MapDataset):
            parent = parent.to_iter_dataset()
        if not isinstance(options, DatasetOptions):
            raise TypeError(f"WithOptionsIterDataset: options must be a DatasetOptions, got {type(options).__name__}")
        super().__init__(parent)
        self._options = options

    def _make_iter(self, root_factory: Callable | None) -> DatasetIterator:
        with options_scope(self._options):
            return self._parent._make_iter(root_factory)

    def _stage_name(self) -> str:
        return f"with_options({self._options})"
