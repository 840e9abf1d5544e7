"""One pytree in one directory: ``save``, ``restore``, ``metadata`` (and the background
saver that ``AsyncCheckpointer`` and ``CheckpointManager`` share)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Self

from cairn.checkpoint import _fs, _multihost, _ownership, _restore, _tree
from cairn.checkpoint._errors import (
    CheckpointError,
    CheckpointExistsError,
    background_error,
)
from cairn.checkpoint._restore import LeafMetadata


class _Background:
    """Runs one save tail at a time; its error is re-raised by every ``wait`` until the
    thread that started the save (the owner) has been handed it: waiters in other threads
    see it too, but only the owner's ``wait`` clears it."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._owner: int | None = None
        self._what = ""

    def start(self, fn: Callable[[], None], what: str) -> None:
        self.wait()

        def run() -> None:
            try:
                fn()
            except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
                self._error = err

        self._what = what
        self._owner = threading.get_ident()
        self._thread = threading.Thread(target=run, name=f"cairn-checkpoint {what}", daemon=False)
        self._thread.start()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        thread = self._thread
        if thread is not None:
            thread.join()
            if self._thread is thread:
                self._thread = None
        err = self._error
        if err is not None:
            if self._owner is None or threading.get_ident() == self._owner:
                self._error = None
            raise background_error(err, f"background save of {self._what} failed: {err}") from err


def _prepare_tmp(final: str, force: bool, timeout_s: float = 600.0) -> str:
    """Create this save's owner-named temporary directory next to ``final`` (primary), after
    removing leftovers of dead writers of ``final``; every process learns its name."""
    if os.path.exists(final) and not force:
        raise CheckpointExistsError(f"checkpoint {final} already exists (pass force=True to replace it)")
    tmp = ""
    if _multihost.is_primary():
        parent, base = os.path.split(final)
        _ownership.cleanup_incomplete(parent, final=base)
        tmp = _ownership.claim(final)
    tmp = _multihost.broadcast(f"tmp {final}", tmp, timeout_s)
    _multihost.barrier(f"prepare {final}", timeout_s)
    return tmp


def _commit(tmp: str, final: str, force: bool, verify: Callable[[str], Any], timeout_s: float = 600.0) -> None:
    """Rename ``tmp`` to ``final`` once every process wrote its part, then ``verify`` the
    committed directory (raising if it is not intact) before anyone reports success."""
    _multihost.barrier(f"written {final}", timeout_s)
    if _multihost.is_primary():
        if force and os.path.exists(final):
            _fs.remove_tree(final)
        _fs.commit(tmp, final, {"time": time.time(), "format": _tree.FORMAT, "version": _tree.FORMAT_VERSION})
        _ownership.release(tmp, remove=False)
        verify_committed(final, verify)
    _multihost.barrier(f"committed {final}", timeout_s)


def verify_committed(final: str, verify: Callable[[str], Any]) -> None:
    """Re-read the marker and metadata of a just-committed directory; raise if damaged."""
    try:
        _fs.read_json(os.path.join(final, _fs.COMMIT_MARKER), require_checksum=True)
        verify(final)
    except (OSError, CheckpointError) as err:
        raise CheckpointError(
            f"{final} was committed but does not verify (was it changed or deleted meanwhile?): {err}"
        ) from err


def write_and_commit(write: Callable[[], None], tmp: str, final: str, force: bool,
                     verify: Callable[[str], Any], timeout_s: float = 600.0) -> None:
    """``write`` into ``tmp`` and commit; on failure the primary deletes ``tmp``."""
    try:
        write()
        _commit(tmp, final, force, verify, timeout_s)
    except BaseException:
        if _multihost.is_primary():
            _ownership.release(tmp, remove=True)
        raise


def save(
    directory: str | os.PathLike,
    tree: Any,
    *,
    force: bool = False,
    compression: str | None = None,
) -> None:
    """Save a pytree to ``directory`` and return once it is durably committed.

    Leaves may be ``jax.Array`` (sharded or not; every process writes the shards it owns),
    NumPy arrays and scalars, and Python ``bool``/``int``/``float``/``complex``/``str``.
    Keys on disk are the :mod:`cairn.core_array` path strings (``"layers/0/w"``).

    The data goes to ``<directory>.<owner>.cairn-tmp`` (``<owner>`` names this host and
    process, so no other process removes it while this one lives); after every file and
    directory is fsync'd a ``COMMIT`` marker is written and the directory renamed, so
    ``directory`` either holds a complete checkpoint or does not exist. The committed
    marker and metadata are read back and verified before ``save`` returns. Every JSON
    file carries a SHA-256 checksum; a failed write raises :class:`CheckpointWriteError`
    (an ``OSError`` with the original ``errno``) naming the file. ``compression`` is ``None`` (default) or
    ``"zstd"`` / ``"zstd:<level>"``.

    Args:
      directory: the checkpoint directory to create (its parent must exist or be creatable).
      tree: the pytree to save.
      force: replace an existing ``directory`` instead of raising.
      compression: ``None``, ``"zstd"`` or ``"zstd:<level>"`` for array chunks.

    >>> import tempfile, numpy as np
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> save(d, {"w": np.arange(3.0), "step": 7, "name": "run-1", "ids": [4, (5, None)]})
    >>> restore(d)
    {'w': array([0., 1., 2.]), 'step': 7, 'name': 'run-1', 'ids': [4, (5, None)]}
    """
    final = os.path.abspath(os.fspath(directory))
    snap = _tree.snapshot(tree, copy_host=False, compression=compression)
    tmp = _prepare_tmp(final, force)
    write_and_commit(
        lambda: _tree.write(snap, tmp, compression=compression), tmp, final, force, _restore.check_dir
    )


def restore(
    directory: str | os.PathLike,
    target: Any = None,
    *,
    paths: str | Sequence[str] | None = None,
    partial: bool = False,
    cast: bool = False,
    mesh: Any = None,
) -> Any:
    """Read a checkpoint written by :func:`save`.

    Without ``target`` the tree comes back as saved: its lists, tuples, dicts (in their
    insertion order, int keys included) and ``None`` s are rebuilt (a namedtuple comes back
    as a dict of its fields, as in Orbax; other pytree nodes as nested dicts keyed by path
    component), NumPy arrays and Python scalars as they were, and each ``jax.Array`` with
    its saved ``NamedSharding`` (the same mesh shape and axis names over ``jax.devices()``
    in order) when the device count matches the saved mesh, else on the first local device.
    Checkpoints written before the structure was stored, and restores with ``paths=`` give
    nested dicts keyed by path component.

    With ``target`` (a pytree whose leaves are ``jax.Array``, ``jax.ShapeDtypeStruct``,
    :class:`~cairn.core_array.ArraySpec`, a ``jax.sharding.Sharding``, NumPy arrays or
    scalars) the result has the target's structure, and each array gets the target's
    sharding (another mesh or device count than at save time is fine: each process reads
    only the regions its devices need) and dtype (a dtype change needs ``cast=True``).
    ``ArraySpec`` leaves with a ``sharding`` use ``mesh``. Every mismatch (missing, extra or
    differently shaped paths) is listed in one :class:`TargetMismatchError`; ``partial=True``
    skips checkpoint paths that the target lacks.

    ``paths`` (a regex or list of regexes, full match on the path string) restores only the
    matching paths; with a target, non-matching target leaves are returned unchanged.

    Args:
      directory: a committed checkpoint (or a manager step's item directory).
      target: an optional pytree giving the result's structure, shapes, dtypes and shardings.
      paths: a regex or list of regexes (full match); only matching paths are read.
      partial: skip checkpoint paths the target lacks instead of raising.
      cast: allow a target dtype other than the saved one.
      mesh: the ``jax.sharding.Mesh`` for ``ArraySpec`` target leaves that carry a sharding.
    """
    _require_committed(os.fspath(directory))
    return _restore.restore_dir(
        directory, target, paths=paths, partial=partial, cast=cast, mesh=mesh
    )


def metadata(directory: str | os.PathLike) -> dict[str, LeafMetadata]:
    """Every saved path with its kind, shape, dtype and sharding, without reading array data.

    Args:
      directory: a committed checkpoint.

    >>> import tempfile, numpy as np
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> save(d, {"w": np.zeros((2, 3), np.float32)})
    >>> m = metadata(d)["w"]
    >>> m.shape, m.dtype, m.kind
    ((2, 3), 'float32', 'numpy')
    """
    directory = os.fspath(directory)
    _require_committed(directory)
    return _restore.metadata_of(directory)


def _require_committed(directory: str) -> None:
    """A checkpoint is readable if it, or the manager step holding it, has a COMMIT marker."""
    if not os.path.isdir(directory):
        if _ownership.pending(directory):
            raise CheckpointError(f"checkpoint {directory} is incomplete: its save never committed")
        raise FileNotFoundError(f"no checkpoint at {directory}")
    parent = os.path.dirname(os.path.abspath(directory))
    if not (_fs.is_committed(directory) or _fs.is_committed(parent)):
        raise CheckpointError(
            f"{directory} is not a committed checkpoint (no {_fs.COMMIT_MARKER} marker)"
        )


class _BackgroundSaver:
    """Lifecycle shared by the savers that commit in a ``_Background`` held as ``self._bg``."""

    _bg: _Background

    def wait_until_finished(self) -> None:
        """Block until the pending save is committed; re-raise its error if it failed."""
        self._bg.wait()

    def check_for_errors(self) -> None:
        """Re-raise a finished background save's error without waiting for a running one."""
        if not self._bg.busy():
            self._bg.wait()

    def close(self) -> None:
        self._bg.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
