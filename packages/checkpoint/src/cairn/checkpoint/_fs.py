"""Durable file helpers: fsync'd writes, checksummed JSON, atomic commit by rename."""

from __future__ import annotations

import os
import shutil
from typing import Any

from cairn.checkpoint._errors import CheckpointCorruptError, CheckpointWriteError
from cairn.core_array import (
    CorruptFileError,
    dumps_checksummed_json,
    loads_checksummed_json,
    write_checksummed_json,
    write_synced,
)
from cairn.core_array import fsync_dir as _fsync_dir

COMMIT_MARKER = "COMMIT"
TMP_SUFFIX = ".cairn-tmp"
DELETE_SUFFIX = ".cairn-del"


def fsync_dir(path: str) -> None:
    """Flush a directory entry table to disk (needed after creating or renaming entries)."""
    try:
        _fsync_dir(path)
    except OSError as err:
        raise CheckpointWriteError(err.errno, err.strerror) from err


def write_durable(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync the file (the caller fsyncs the directory).

    An ``OSError`` (a full disk gives none that names the file) becomes a
    :class:`CheckpointWriteError` with the same ``errno`` naming ``path``.
    """
    try:
        write_synced(path, data)
    except OSError as err:
        raise CheckpointWriteError(err.errno, err.strerror) from err


def copy_tree_durable(src: str, dst: str, skip: tuple[str, ...] = ()) -> None:
    """Copy the files under ``src`` into the existing directory ``dst``, each file and
    directory fsync'd; top-level entries named in ``skip`` are left out."""
    for root, dirs, files in os.walk(src):
        rel = os.path.relpath(root, src)
        out = dst if rel == "." else os.path.join(dst, rel)
        os.makedirs(out, exist_ok=True)
        for name in files:
            if rel == "." and name in skip:
                continue
            with open(os.path.join(root, name), "rb") as f:
                write_durable(os.path.join(out, name), f.read())
        fsync_dir(out)
        dirs.sort()


def write_json_durable(path: str, obj: Any) -> None:
    """``obj`` as checksummed JSON (:func:`cairn.core_array.dumps_checksummed_json`), fsync'd."""
    write_durable(path, dumps_checksummed_json(obj))


def write_json_atomic(path: str, obj: Any) -> None:
    """Replace ``path`` atomically with ``obj`` as checksummed JSON (a file outside a step directory)."""
    try:
        write_checksummed_json(path, obj)
    except OSError as err:
        raise CheckpointWriteError(err.errno, err.strerror) from err


def corrupt(path: str, why: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{path} is corrupt: {why}; the checkpoint holding it is damaged", path)


def loads_checked(data: bytes, path: str, *, require_checksum: bool = False) -> tuple[Any, bool]:
    """Parse a file written by :func:`write_json_durable`, verifying its checksum; return
    (content, whether the file carried a checksum).

    A file without a checksum (written by format version 1) is parsed as plain JSON unless
    ``require_checksum``. Any damage raises :class:`CheckpointCorruptError` naming ``path``.
    """
    try:
        content, checked = loads_checksummed_json(data, path, require_checksum=False)
    except CorruptFileError as err:
        raise corrupt(path, err.reason) from None
    if require_checksum and not checked:
        raise corrupt(path, "it lacks the checksum that this checkpoint's format version writes")
    return content, checked


def read_json(path: str, *, require_checksum: bool = False) -> Any:
    """Read and verify a checksummed JSON file (``FileNotFoundError`` if it is missing)."""
    return read_json_checked(path, require_checksum=require_checksum)[0]


def read_json_checked(path: str, *, require_checksum: bool = False) -> tuple[Any, bool]:
    """(content, whether the file carried a checksum) of a JSON file written here."""
    with open(path, "rb") as f:
        data = f.read()
    return loads_checked(data, path, require_checksum=require_checksum)


def is_committed(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMMIT_MARKER))


def commit(tmp_dir: str, final_dir: str, info: dict) -> None:
    """Make ``tmp_dir`` visible as ``final_dir``: marker + fsyncs, then rename + parent fsync."""
    write_json_durable(os.path.join(tmp_dir, COMMIT_MARKER), info)
    fsync_dir(tmp_dir)
    os.rename(tmp_dir, final_dir)  # as cairn.core_array.atomic_rename, but errors stay CheckpointWriteError
    fsync_dir(os.path.dirname(os.path.abspath(final_dir)))


def remove_tree(path: str) -> None:
    """Delete a directory so that a crash midway never leaves a listable half: rename first."""
    if not os.path.exists(path):
        return
    doomed = path.rstrip("/") + DELETE_SUFFIX
    if os.path.exists(doomed):
        shutil.rmtree(doomed, ignore_errors=True)
    os.rename(path, doomed)
    fsync_dir(os.path.dirname(os.path.abspath(doomed)))
    shutil.rmtree(doomed, ignore_errors=True)
