"""How a manager names its step directories (Orbax's ``ocp.step`` name formats).

Core: :class:`CheckpointManagerOptions` holds one; the manager builds and parses names
with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@runtime_checkable
class NameFormat(Protocol):
    """A step-directory naming scheme: ``build_name(step)`` gives the directory name."""

    def build_name(self, step: int) -> str:
        """The directory name of ``step``.

        Args:
          step: the step number (>= 0).
        """
        ...


@dataclass(frozen=True)
class StandardNameFormat:
    """``<step_prefix>_<step>`` or ``<step>``, zero-padded to ``step_format_fixed_length``.

    Args:
      step_prefix: text before ``_<step>`` (``None``: the bare number).
      step_format_fixed_length: digits to pad the step to (``None``: no padding).
      single_host_load_and_broadcast: Orbax lists steps on one process and broadcasts the
        list; here every process lists the shared directory itself (accepted, same result).
    """

    step_prefix: str | None = None
    step_format_fixed_length: int | None = None
    single_host_load_and_broadcast: bool = False

    def build_name(self, step: int) -> str:
        """The directory name of ``step`` (``ckpt_0007`` for prefix ``ckpt``, length 4).

        Args:
          step: the step number (>= 0).
        """
        digits = str(int(step)).zfill(self.step_format_fixed_length) if self.step_format_fixed_length else str(int(step))
        return f"{self.step_prefix}_{digits}" if self.step_prefix else digits

    def pattern(self) -> re.Pattern[str]:
        """Matches a directory name of this format; group 1 is the step."""
        prefix = re.escape(self.step_prefix + "_") if self.step_prefix else ""
        return re.compile(prefix + r"(\d+)")


def standard_name_format(step_prefix: str | None = None, step_format_fixed_length: int | None = None,
                         single_host_load_and_broadcast: bool = False) -> StandardNameFormat:
    """The default naming scheme (Orbax's ``ocp.step.standard_name_format``).

    Args:
      step_prefix: text before ``_<step>`` (``None``: the bare number).
      step_format_fixed_length: digits to pad the step to (``None``: no padding).
      single_host_load_and_broadcast: see :class:`StandardNameFormat`.

    >>> standard_name_format("ckpt", 4).build_name(7)
    'ckpt_0007'
    """
    return StandardNameFormat(step_prefix, step_format_fixed_length, single_host_load_and_broadcast)
