"""Loggers of checkpoint events (Orbax's ``ocp.logging``).

A ``CheckpointManager(..., logger=...)`` hands each save's and restore's
:mod:`~cairn.checkpoint.logging.step_statistics` to its logger as a dict;
:class:`StandardLogger` (the default) writes it to Python's ``logging`` at INFO level,
:class:`CompositeLogger` passes it to several loggers. Subclass :class:`AbstractLogger`
to send the entries elsewhere.

>>> import logging
>>> class Collect(AbstractLogger):
...     def __init__(self):
...         self.entries = []
...     def log_entry(self, entry):
...         self.entries.append(entry)
>>> c = Collect()
>>> CompositeLogger(c).log_entry({"step": 3, "event_type": "save"})
>>> c.entries
[{'step': 3, 'event_type': 'save'}]
"""

from __future__ import annotations

import logging
from typing import Any

from cairn.checkpoint.logging import step_statistics

_log = logging.getLogger("cairn.checkpoint")


class AbstractLogger:
    """Base of checkpoint loggers: ``log_entry(entry)`` receives one event's statistics."""

    def log_entry(self, entry: dict[str, Any]) -> None:
        """Record one event.

        Args:
          entry: the event's statistics (``dataclasses.asdict`` of a ``*StepStatistics``).
        """
        raise NotImplementedError(f"{type(self).__name__} must define log_entry(entry)")


class StandardLogger(AbstractLogger):
    """Writes each entry to Python's ``logging`` (logger ``cairn.checkpoint``, INFO), as
    ``"<event_type> step statistics: {...}"``, the dict last on the line."""

    def log_entry(self, entry: dict[str, Any]) -> None:
        """Log ``entry`` at INFO level.

        Args:
          entry: the event's statistics.
        """
        if not isinstance(entry, dict):
            raise TypeError(f"log_entry takes a dict of statistics, got {type(entry).__name__}")
        _log.info("cairn.checkpoint %s step statistics: %r", entry.get("event_type", "event"), entry)


class CompositeLogger(AbstractLogger):
    """Passes each entry to every one of ``loggers``, in order.

    Args:
      *loggers: the loggers (each an :class:`AbstractLogger` or has ``log_entry``).
    """

    def __init__(self, *loggers: AbstractLogger) -> None:
        bad = [type(lg).__name__ for lg in loggers if not callable(getattr(lg, "log_entry", None))]
        if bad:
            raise TypeError(f"CompositeLogger takes loggers with log_entry(entry), got {bad}")
        self._loggers = loggers

    def log_entry(self, entry: dict[str, Any]) -> None:
        """Give ``entry`` to every logger.

        Args:
          entry: the event's statistics.
        """
        for lg in self._loggers:
            lg.log_entry(entry)


__all__ = ["AbstractLogger", "CompositeLogger", "StandardLogger", "step_statistics"]
