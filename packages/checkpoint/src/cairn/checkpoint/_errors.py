"""Exceptions raised by cairn.checkpoint."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path and the cause."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """A file of a committed checkpoint is damaged (checksum mismatch, unreadable, truncated).

    The message names the file and says which checkpoint (or manager step) is corrupt;
    ``path`` is that file.

    Args:
      message: what is wrong, naming the file and the checkpoint.
      path: the damaged file, if known.
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class ChecksumError(CheckpointCorruptError):
    """Stored bytes of a leaf do not match their crc32c checksum (the file was corrupted)."""


class CheckpointWriteError(OSError, CheckpointError):
    """Writing a checkpoint file failed (disk full, read-only, I/O error).

    An ``OSError`` whose ``errno`` is the original one (``errno.ENOSPC`` for a full disk)
    and whose message names the file or leaf being written; chained from the original error.
    """


class TargetMismatchError(CheckpointError, ValueError):
    """The restore target disagrees with the checkpoint; the message lists every difference."""


class SyncTimeoutError(CheckpointError, TimeoutError):
    """Some processes of a multi-process run did not reach a sync point in time.

    The message names the sync point and the process indices that did not arrive;
    ``missing`` is that list.

    Args:
      message: the sync point and who did not arrive.
      missing: the process indices that did not arrive.
    """

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


class CheckpointExistsError(FileExistsError, ValueError):
    """A save (without ``force``) into a checkpoint that already exists; also a
    ``ValueError``, the class Orbax raises for it."""


class StepAlreadyExistsError(CheckpointExistsError):
    """A save of a step that is already committed (intact) in the tier it would go to."""


_TYPED: dict[type, type] = {}


def background_error(err: BaseException, message: str) -> CheckpointError:
    """The error a background save's failure ``err`` is re-raised as: a
    :class:`CheckpointError` carrying ``message`` that is also of ``err``'s own type (so
    ``except SystemError`` and ``except CheckpointError`` both catch it); a plain
    ``CheckpointError`` when ``err`` is not an ``Exception`` or its type cannot be combined
    (a layout conflict, a constructor that takes other arguments)."""
    if isinstance(err, OSError) and err.errno is not None:
        return CheckpointWriteError(err.errno, message)  # keeps errno (ENOSPC...)
    cls = type(err)
    if isinstance(err, CheckpointError) or not isinstance(err, Exception):
        return CheckpointError(message)
    try:
        typed = _TYPED.get(cls)
        if typed is None:
            typed = type(cls.__name__, (CheckpointError, cls), {"__module__": CheckpointError.__module__,
                                                                 "__doc__": f"A CheckpointError that is a {cls.__name__}."})
            _TYPED[cls] = typed
        return typed(message)
    except Exception:  # noqa: BLE001 - an exception type that cannot be combined: the plain error
        return CheckpointError(message)
