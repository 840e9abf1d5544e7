"""Pipeline-wide options (Grain's ``DatasetOptions``) and the filter-ratio check they drive.

``WithOptionsIterDataset(ds, DatasetOptions(...))`` makes the options visible to every
iterator built below it while ``iter(...)`` builds the pipeline (a context variable, read
once per iterator at construction; nothing per element). Nested options merge: the
fields a user set in the outer ``WithOptionsIterDataset`` win, then those set in the
inner one, then the defaults.

Nothing here imports another ``cairn.data`` module, so every module may use it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

__all__ = ["DatasetOptions", "FilterRatioCheck", "current_options", "options_scope"]

_log = logging.getLogger("cairn.data")

# the window of elements a filter's dropped share is measured on (Grain's: 1000)
FILTER_WINDOW = 1000


def _ratio(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(f"DatasetOptions.{name} must be None or a number in [0, 1], got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True, init=False)
class DatasetOptions:
    """Options of a whole pipeline, applied with ``WithOptionsIterDataset``.

    Attributes:
      filter_warn_threshold_ratio: log a warning (logger ``cairn.data``, once per
        iterator) when a filter drops at least this share of a window of 1000 elements
        it has seen; ``None`` turns the check off. Default 0.9.
      filter_raise_threshold_ratio: raise ``ValueError`` instead when the dropped share
        reaches this; ``None`` (the default) turns it off.

    >>> DatasetOptions(filter_raise_threshold_ratio=0.5).merge(
    ...     DatasetOptions(filter_warn_threshold_ratio=None))
    DatasetOptions(filter_warn_threshold_ratio=None, filter_raise_threshold_ratio=0.5)
    """

    filter_warn_threshold_ratio: float | None
    filter_raise_threshold_ratio: float | None
    _user_set: frozenset = dataclasses.field(repr=False, compare=False)

    _DEFAULTS = {"filter_warn_threshold_ratio": 0.9, "filter_raise_threshold_ratio": None}

    def __init__(self, **fields: Any) -> None:
        """Set the named fields; the others keep their defaults.

        Args:
          fields: ``filter_warn_threshold_ratio`` and/or ``filter_raise_threshold_ratio`` (see
            above).

        Raises:
          TypeError: for an unknown field name.
          ValueError: for a ratio that is not None or in [0, 1].
        """
        unknown = sorted(set(fields) - set(self._DEFAULTS))
        if unknown:
            raise TypeError(f"DatasetOptions: unknown field(s) {unknown}; known: {sorted(self._DEFAULTS)}")
        for name, default in self._DEFAULTS.items():
            object.__setattr__(self, name, _ratio(fields.get(name, default), name))
        object.__setattr__(self, "_user_set", frozenset(fields))

    def merge(self, other: DatasetOptions | None) -> DatasetOptions:
        """These options over ``other``: a field set here wins, then one set in ``other``,
        then the default.

        Args:
          other: options to fall back on; None returns ``self``.
        """
        if other is None:
            return self
        chosen = {n: getattr(other, n) for n in other._user_set}
        chosen.update({n: getattr(self, n) for n in self._user_set})
        return DatasetOptions(**chosen)


_CURRENT: contextvars.ContextVar[DatasetOptions | None] = contextvars.ContextVar("cairn_data_options", default=None)


def current_options() -> DatasetOptions:
    """The options in effect while an iterator is being built (defaults outside any scope)."""
    return _CURRENT.get() or DatasetOptions()


@contextlib.contextmanager
def options_scope(options: DatasetOptions) -> Iterator[None]:
    """Make ``options`` (merged under any outer scope's) current while building iterators."""
    outer = _CURRENT.get()
    token = _CURRENT.set(outer.merge(options) if outer is not None else options)
    try:
        yield
    finally:
        _CURRENT.reset(token)


class FilterRatioCheck:
    """Counts a filter's kept and dropped elements over windows of ``FILTER_WINDOW`` and
    warns or raises (per ``DatasetOptions``) when a window's dropped share is too high."""

    __slots__ = ("name", "warn", "fail", "kept", "dropped", "warned")

    def __init__(self, name: str, options: DatasetOptions) -> None:
        self.name = name
        self.warn = options.filter_warn_threshold_ratio
        self.fail = options.filter_raise_threshold_ratio
        self.kept = self.dropped = 0
        self.warned = False

    @property
    def active(self) -> bool:
        """Whether any threshold is set (else callers skip the counting)."""
        return self.warn is not None or self.fail is not None

    def add(self, kept: int, dropped: int) -> None:
        """Count ``kept`` / ``dropped`` elements; check the window once it is full.

        Raises:
          ValueError: when the window's dropped share reaches ``filter_raise_threshold_ratio``.
        """
        self.kept += kept
        self.dropped += dropped
        seen = self.kept + self.dropped
        if seen < FILTER_WINDOW:
            return
        share = self.dropped / seen
        self.kept = self.dropped = 0
        if self.fail is not None and share >= self.fail:
            raise ValueError(
                f"{self.name} skipped {share * 100:.2f} % of the last seen {seen} elements "
                f"(DatasetOptions.filter_raise_threshold_ratio={self.fail}); check the filter, or "
                "set the threshold to None in WithOptionsIterDataset if this is intended"
            )
        if self.warn is not None and share >= self.warn and not self.warned:
            self.warned = True
            _log.warning(
                "%s skipped %.2f %% of the last seen %d elements (DatasetOptions."
                "filter_warn_threshold_ratio=%s); check the filter, or set the threshold to None "
                "in WithOptionsIterDataset if this is intended. Warned once per iterator.",
                self.name, share * 100, seen, self.warn,
            )
