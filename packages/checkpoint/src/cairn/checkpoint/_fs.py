"""Durable file helpers: fsync'd writes, atomic commit by rename, temporary-directory names."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

COMMIT_MARKER = "COMMIT"
TMP_SUFFIX = ".cairn-tmp"
DELETE_SUFFIX = ".cairn-del"


def fsync_dir(path: str) -> None:
    """Flush a directory entry table to disk (needed after creating or renaming entries)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync the file (the caller fsyncs the directory)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_json_durable(path: str, obj: Any) -> None:
    write_durable(path, json.dumps(obj, indent=1, sort_keys=False).encode())


def read_json(path: str) -> Any:
    with open(path, "rb") as f:
        return json.loads(f.read())


def is_committed(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMMIT_MARKER))


def commit(tmp_dir: str, final_dir: str, info: dict) -> None:
    """Make ``tmp_dir`` visible as ``final_dir``: marker + fsyncs, then rename + parent fsync."""
    write_json_durable(os.path.join(tmp_dir, COMMIT_MARKER), info)
    fsync_dir(tmp_dir)
    os.rename(tmp_dir, final_dir)
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


def cleanup_incomplete(parent: str) -> list[str]:
    """Remove leftovers of interrupted saves/deletes in ``parent``; returns what was removed."""
    removed = []
    if not os.path.isdir(parent):
        return removed
    for name in os.listdir(parent):
        if name.endswith(TMP_SUFFIX) or name.endswith(DELETE_SUFFIX):
            full = os.path.join(parent, name)
            shutil.rmtree(full, ignore_errors=True)
            removed.append(full)
    return removed
