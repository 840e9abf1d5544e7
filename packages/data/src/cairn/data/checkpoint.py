"""Saving an iterator's position with a checkpoint manager (Grain's ``grain.checkpoint``).

``CheckpointSave(iterator)`` / ``CheckpointRestore(iterator)`` are argument objects
that wrap the iterator as ``.item``; cairn.checkpoint's ``CheckpointManager`` stores
such an item as the iterator's ``get_state()`` (through core_array's ``Checkpointable``,
no import between the packages)::

    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(params), ds=grain.checkpoint.CheckpointSave(it)))
    mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(params), ds=grain.checkpoint.CheckpointRestore(it)))

``CheckpointHandler`` writes and reads the state as ``process_<i>-of-<n>.json`` in a
directory, for code that calls a handler itself.

With Orbax: when ``orbax.checkpoint`` is already imported at the first use of
``CheckpointSave`` / ``CheckpointRestore``, those names give subclasses of Orbax's
``CheckpointArgs`` registered with ``CheckpointHandler``, so an Orbax
``CheckpointManager`` saves the iterator too (Orbax is never imported from here: it
would import JAX).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

__all__ = ["CheckpointHandler", "CheckpointRestore", "CheckpointSave"]

# Resolved by the module ``__getattr__`` below on every access (plain or Orbax-registered).
CheckpointSave: Any
CheckpointRestore: Any


@dataclasses.dataclass
class _Save:
    """Save ``item``'s state (an iterator with ``get_state``).

    Args:
      item: the iterator whose state is saved.
    """

    item: Any


@dataclasses.dataclass
class _Restore:
    """Restore into ``item`` (an iterator with ``set_state``); the restore gives ``item``.

    Args:
      item: the iterator to restore into.
    """

    item: Any


_orbax_args: dict[str, type] = {}


def _orbax_registered() -> dict[str, type]:
    """Orbax-registered argument classes, made once Orbax is imported (else ``{}``)."""
    ocp = sys.modules.get("orbax.checkpoint")
    if _orbax_args or ocp is None:
        return _orbax_args
    for name, plain, kw in (("CheckpointSave", _Save, "for_save"),
                            ("CheckpointRestore", _Restore, "for_restore")):
        cls: type = dataclasses.dataclass(
            type(name, (ocp.args.CheckpointArgs,), {"__annotations__": {"item": Any},
                                                     "__doc__": plain.__doc__,
                                                     "__module__": __name__})
        )
        _orbax_args[name] = ocp.args.register_with_handler(CheckpointHandler, **{kw: True})(cls)
    return _orbax_args


def __getattr__(name: str) -> Any:
    """``CheckpointSave`` / ``CheckpointRestore``: Orbax-registered once Orbax is imported."""
    if name in ("CheckpointSave", "CheckpointRestore"):
        return _orbax_registered().get(name) or (_Save if name == "CheckpointSave" else _Restore)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _process() -> tuple[int, int]:
    """This process's index and the process count (0 of 1 unless JAX is in use)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return 0, 1
    return int(jax.process_index()), int(jax.process_count())


def _state_file(directory: Any) -> str:
    i, n = _process()
    return os.path.join(os.fspath(directory), f"process_{i}-of-{n}.json")


def _item(item: Any, args: Any, who: str, method: str) -> Any:
    x = item if item is not None else getattr(args, "item", None)
    if not callable(getattr(x, method, None)):
        raise TypeError(f"CheckpointHandler.{who}: needs an iterator with {method}(), got {type(x).__name__}")
    return x


class CheckpointHandler:
    """Writes an iterator's state as JSON, one file per process, and reads it back."""

    def save(self, directory: Any, item: Any = None, args: Any = None) -> None:
        """Write ``item.get_state()`` (or ``args.item``'s) to ``directory``.

        Args:
          directory: the checkpoint directory (created if missing); each process writes its own
            file.
          item: the iterator to save (with ``get_state``); None takes ``args.item``.
          args: a :class:`PyGrainCheckpointSave` (Orbax style), used when ``item`` is None.

        Raises:
          TypeError: if there is no iterator with ``get_state`` or its state is not JSON-able.
        """
        it = _item(item, args, "save", "get_state")
        os.makedirs(os.fspath(directory), exist_ok=True)
        text = json.dumps(it.get_state(), indent=2)
        with open(_state_file(directory), "w", encoding="utf-8") as f:
            f.write(text)

    def restore(self, directory: Any, item: Any = None, args: Any = None) -> Any:
        """Read this process's state from ``directory`` into ``item`` and return ``item``.

        Args:
          directory: the checkpoint directory this process's state file is read from.
          item: the iterator to restore (with ``set_state``); None takes ``args.item``.
          args: a :class:`PyGrainCheckpointRestore` (Orbax style), used when ``item`` is None.

        Raises:
          TypeError: if there is no iterator with ``set_state``.
          FileNotFoundError: if ``directory`` holds no state for this process.
        """
        it = _item(item, args, "restore", "set_state")
        path = _state_file(directory)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"CheckpointHandler.restore: no iterator state at {path}")
        with open(path, encoding="utf-8") as f:
            it.set_state(json.load(f))
        return it

    def structure(self, directory: Any) -> None:
        """No tree structure (Orbax handler interface).

        Args:
          directory: the checkpoint directory (unused).
        """

    def metadata(self, directory: Any) -> None:
        """No metadata (Orbax handler interface).

        Args:
          directory: the checkpoint directory (unused).
        """

    def finalize(self, directory: Any) -> None:
        """Nothing to finalize: ``save`` writes the file completely (Orbax handler interface).

        Args:
          directory: the checkpoint directory (unused).
        """

    def close(self) -> None:
        """Nothing to release (Orbax handler interface)."""

    @classmethod
    def typestr(cls) -> str:
        """The handler's name as Orbax records it."""
        return f"{cls.__module__}.{cls.__qualname__}"
