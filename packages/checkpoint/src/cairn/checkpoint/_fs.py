"""Durable file helpers: fsync'd writes, checksummed JSON, atomic commit by rename."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from typing import Any

from cairn.checkpoint._errors import CheckpointCorruptError, CheckpointWriteError

COMMIT_MARKER = "COMMIT"
TMP_SUFFIX = ".cairn-tmp"
DELETE_SUFFIX = ".cairn-del"

# A checksummed JSON file is exactly HEAD + 64 hex digits + MID + body + TAIL, where body is
# the JSON text of the content and the digits are the SHA-256 of the body's bytes. The file
# is still plain JSON ({"checksum": ..., "body": ...}); every byte is covered: the body by
# the hash, the rest by an exact comparison.
_HEAD = b'{"checksum": "sha256:'
_MID = b'", "body": '
_TAIL = b"}\n"
_HEAD_LEN = len(_HEAD) + 64 + len(_MID)
_HEX = frozenset(b"0123456789abcdef")


def _write_error(err: OSError, what: str) -> CheckpointWriteError:
    code = err.errno if err.errno is not None else errno.EIO
    return CheckpointWriteError(code, f"cannot {what}: {err.strerror or err}")


def fsync_dir(path: str) -> None:
    """Flush a directory entry table to disk (needed after creating or renaming entries)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        raise _write_error(err, f"sync directory {path}") from err


def write_durable(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync the file (the caller fsyncs the directory).

    An ``OSError`` (a full disk gives none that names the file) becomes a
    :class:`CheckpointWriteError` with the same ``errno`` naming ``path``.
    """
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise _write_error(err, f"write {path}") from err


def dumps_checked(obj: Any) -> bytes:
    """``obj`` as checksummed JSON bytes (see ``_HEAD``)."""
    body = json.dumps(obj, indent=1, sort_keys=False).encode()
    return _HEAD + hashlib.sha256(body).hexdigest().encode() + _MID + body + _TAIL


def write_json_durable(path: str, obj: Any) -> None:
    write_durable(path, dumps_checked(obj))


def _looks_checked(data: bytes) -> bool:
    """Whether ``data`` is (a damaged) checksummed file: its fixed header bytes mostly agree.

    Old, unchecksummed files start with ``{`` and a newline or a key, and disagree with the
    header almost everywhere; a checksummed file with a few damaged header bytes still
    agrees in most places, so it is reported as corrupt rather than read as an old file.
    """
    fixed = list(enumerate(_HEAD)) + [(len(_HEAD) + 64 + i, c) for i, c in enumerate(_MID)]
    fixed = [(i, c) for i, c in fixed if i < len(data)]
    if len(fixed) < 8:
        return False
    bad = sum(data[i] != c for i, c in fixed)
    return bad * 4 <= len(fixed)


def corrupt(path: str, why: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{path} is corrupt: {why}; the checkpoint holding it is damaged", path)


def loads_checked(data: bytes, path: str, *, require_checksum: bool = False) -> tuple[Any, bool]:
    """Parse a file written by :func:`write_json_durable`, verifying its checksum; return
    (content, whether the file carried a checksum).

    A file without a checksum (written by format version 1) is parsed as plain JSON unless
    ``require_checksum``. Any damage raises :class:`CheckpointCorruptError` naming ``path``.
    """
    checked = _looks_checked(data)
    if checked:
        digest = data[len(_HEAD) : len(_HEAD) + 64]
        if (
            len(data) < _HEAD_LEN + len(_TAIL)
            or not data.startswith(_HEAD)
            or data[len(_HEAD) + 64 : _HEAD_LEN] != _MID
            or not set(digest) <= _HEX
            or not data.endswith(_TAIL)
        ):
            raise corrupt(path, "its checksum header or end is damaged or the file is truncated")
        body = data[_HEAD_LEN : -len(_TAIL)]
        got = hashlib.sha256(body).hexdigest()
        if got != digest.decode():
            raise corrupt(
                path, f"checksum mismatch (stored sha256 {digest.decode()[:16]}..., content {got[:16]}...)"
            )
    elif require_checksum:
        raise corrupt(path, "it lacks the checksum that this checkpoint's format version writes")
    else:
        body = data
    try:
        return json.loads(body), checked
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise corrupt(path, f"not valid JSON ({err})") from None


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
