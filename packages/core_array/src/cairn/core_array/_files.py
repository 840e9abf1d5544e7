"""Durable files: the one atomic write and the one checksummed-JSON format of the stack.

A file written with :func:`atomic_write` (and its ``_bytes`` / ``_text`` / ``_json`` forms)
is either absent, the previous version, or the complete new version: never a mix. The
steps, and what a crash at each one leaves at ``path``:

1. write a fresh temporary sibling ``.<name>.<random>.tmp`` (same directory, so the rename
   stays on one file system): a crash leaves ``path`` untouched and a stray temporary;
2. ``fsync`` the temporary: a crash leaves ``path`` untouched;
3. ``os.replace`` it onto ``path`` (atomic on POSIX): a crash before the directory is synced
   may, after a power loss, show either the old or the new file, each complete;
4. ``fsync`` the directory: from here on the new file survives a power loss.

Each writer has its own temporary, so concurrent writers never see each other's half
files; the last rename wins. On an exception the temporary is removed and ``path`` is left
as it was. :func:`atomic_rename` is step 3 and 4 for a file or directory already written
(and synced) under another name, as a checkpoint or an export directory is committed.

The checksummed-JSON format (:func:`dumps_checksummed_json`) is plain JSON,
``{"checksum": "sha256:<64 hex digits>", "body": <content>}``, laid out so that every byte is
checked: the body by its SHA-256, the fixed header and end by exact comparison.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

__all__ = [
    "CorruptFileError",
    "atomic_rename",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "dumps_checksummed_json",
    "fsync_dir",
    "fsync_file",
    "fsync_tree",
    "loads_checksummed_json",
    "read_checksummed_json",
    "write_checksummed_json",
    "write_synced",
]

# A checksummed JSON file is exactly HEAD + 64 hex digits + MID + body + TAIL, where body is
# the JSON text of the content and the digits are the SHA-256 of the body's bytes.
_HEAD = b'{"checksum": "sha256:'
_MID = b'", "body": '
_TAIL = b"}\n"
_HEAD_LEN = len(_HEAD) + 64 + len(_MID)
_HEX = frozenset(b"0123456789abcdef")


class CorruptFileError(ValueError):
    """A file is damaged: bad JSON, a checksum mismatch, a truncated or altered header.

    The message holds both arguments, which stay readable as attributes.

    Args:
      path: the damaged file.
      reason: what is wrong with it (``"checksum mismatch: ..."``, ``"not JSON: ..."``).
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path} is corrupt: {reason}")
        self.path = path
        self.reason = reason


def _named(err: OSError, what: str, path: str | os.PathLike) -> OSError:
    """``err`` again with a message naming ``path`` (a full disk's error names no file)."""
    code = err.errno if err.errno is not None else errno.EIO
    return OSError(code, f"cannot {what} {os.fspath(path)}: {err.strerror or err}", os.fspath(path))


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file's content to disk.

    Args:
      path: the file.

    Raises:
      OSError: naming ``path`` and keeping the original ``errno``.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        raise _named(err, "sync", path) from err


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entry table to disk (needed after creating or renaming entries).

    Args:
      path: the directory; ``""`` means the current one.

    Raises:
      OSError: naming ``path`` and keeping the original ``errno``.
    """
    path = os.fspath(path) or "."
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as err:
        raise _named(err, "open directory", path) from err
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP):  # file systems that cannot sync a directory
            raise _named(err, "sync directory", path) from err
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """Flush every file and directory under ``root`` (and ``root`` itself) to disk.

    What a directory needs before :func:`atomic_rename` commits it under its final name.

    Args:
      root: the directory.
    """
    for d, _dirs, files in os.walk(os.fspath(root), topdown=False):
        for f in files:
            fsync_file(os.path.join(d, f))
        fsync_dir(d)


def write_synced(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it, in place (no rename).

    For files inside a temporary directory that is itself committed by
    :func:`atomic_rename` (a checkpoint step, an export); elsewhere use :func:`atomic_write_bytes`.

    Args:
      path: the file (created or truncated).
      data: its content.

    Raises:
      OSError: naming ``path`` and keeping the original ``errno`` (``ENOSPC`` for a full disk).
    """
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise _named(err, "write", path) from err


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Produce ``path`` atomically with ``write(temporary_path)``, which writes the whole file.

    For writers that want a file name (``safetensors.serialize_file``, ``pyarrow``); the
    steps and guarantees are in this module's docstring.

    Args:
      path: the target; its directory must exist.
      write: called once with the temporary's path; it creates and fills that file.

    Raises:
      OSError: a sync or rename failed (naming the file); whatever ``write`` raises.
    """
    path = os.fspath(path)
    parent, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=parent)
    os.close(fd)
    try:
        write(tmp)
        fsync_file(tmp)
        try:
            os.replace(tmp, path)
        except OSError as err:
            raise _named(err, "rename onto", path) from err
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    fsync_dir(parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (see this module's docstring).

    Args:
      path: the target; its directory must exist.
      data: the new content.

    Raises:
      OSError: naming ``path`` (``ENOSPC`` for a full disk); ``path`` is then unchanged.

    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "a.bin")
    >>> atomic_write_bytes(p, b"xy"); open(p, "rb").read()
    b'xy'
    """

    def write(tmp: str) -> None:
        try:
            with open(tmp, "wb") as f:
                f.write(data)
        except OSError as err:
            raise _named(err, "write", path) from err

    atomic_write(path, write)


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """Replace ``path`` with ``text`` atomically (:func:`atomic_write_bytes` of its encoding).

    Args:
      path: the target; its directory must exist.
      text: the new content.
      encoding: how ``text`` is encoded.
    """
    atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 1, sort_keys: bool = False) -> None:
    """Replace ``path`` with ``obj`` as plain JSON text (and a final newline), atomically.

    Args:
      path: the target; its directory must exist.
      obj: a JSON-able value.
      indent: spaces per nesting level (None: one line), as for :func:`json.dumps`.
      sort_keys: write object keys sorted, as for :func:`json.dumps`.

    Raises:
      TypeError: ``obj`` is not JSON-able (``path`` untouched).
    """
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")


def atomic_rename(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename a finished (synced) file or directory ``src`` onto ``dst`` and sync the parents.

    ``os.replace`` semantics: an existing file ``dst`` is replaced, an existing non-empty
    directory is not (``OSError``).

    Args:
      src: the written temporary.
      dst: its final name.
    """
    try:
        os.replace(src, dst)
    except OSError as err:
        raise _named(err, f"rename {os.fspath(src)} onto", dst) from err
    src_parent = os.path.dirname(os.path.abspath(src))
    dst_parent = os.path.dirname(os.path.abspath(dst))
    fsync_dir(dst_parent)
    if src_parent != dst_parent:
        fsync_dir(src_parent)


def dumps_checksummed_json(obj: Any) -> bytes:
    """``obj`` as checksummed JSON bytes: ``{"checksum": "sha256:<hex>", "body": <obj>}``.

    Args:
      obj: a JSON-able value.

    >>> dumps_checksummed_json({"a": 1})[:21]
    b'{"checksum": "sha256:'
    >>> loads_checksummed_json(dumps_checksummed_json({"a": 1}), "x.json")
    ({'a': 1}, True)
    """
    body = json.dumps(obj, indent=1, sort_keys=False).encode()
    return _HEAD + hashlib.sha256(body).hexdigest().encode() + _MID + body + _TAIL


def _looks_checked(data: bytes) -> bool:
    """Whether ``data`` is (a damaged) checksummed file: its fixed header bytes mostly agree.

    Plain JSON starts with ``{`` and a newline or a key and disagrees with the header almost
    everywhere; a checksummed file with a few damaged header bytes still agrees in most
    places, so it is reported as corrupt rather than read as plain JSON.
    """
    fixed = list(enumerate(_HEAD)) + [(len(_HEAD) + 64 + i, c) for i, c in enumerate(_MID)]
    fixed = [(i, c) for i, c in fixed if i < len(data)]
    if len(fixed) < 8:
        return False
    bad = sum(data[i] != c for i, c in fixed)
    return bad * 4 <= len(fixed)


def loads_checksummed_json(data: bytes, path: str, *, require_checksum: bool = True) -> tuple[Any, bool]:
    """Parse and verify bytes written by :func:`dumps_checksummed_json`.

    Args:
      data: the file's bytes.
      path: the file's name, for messages.
      require_checksum: if false, plain JSON without the checksum wrapper is accepted too
        (files of older formats).

    Returns:
      ``(content, whether the bytes carried a checksum)``.

    Raises:
      CorruptFileError: naming ``path`` and saying what is wrong (checksum mismatch,
        damaged header or end, missing checksum, invalid JSON).
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
            raise CorruptFileError(path, "its checksum header or end is damaged or the file is truncated")
        body = data[_HEAD_LEN : -len(_TAIL)]
        got = hashlib.sha256(body).hexdigest()
        if got != digest.decode():
            raise CorruptFileError(
                path, f"checksum mismatch (stored sha256 {digest.decode()[:16]}..., content {got[:16]}...)"
            )
    elif require_checksum:
        raise CorruptFileError(path, "it lacks the sha256 checksum header it was written with")
    else:
        body = data
    try:
        return json.loads(body), checked
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise CorruptFileError(path, f"not valid JSON ({err})") from None


def write_checksummed_json(path: str | os.PathLike, obj: Any) -> None:
    """Replace ``path`` atomically with ``obj`` as checksummed JSON.

    Args:
      path: the target; its directory must exist.
      obj: a JSON-able value.
    """
    atomic_write_bytes(path, dumps_checksummed_json(obj))


def read_checksummed_json(path: str | os.PathLike, *, require_checksum: bool = True) -> Any:
    """Read and verify a checksummed JSON file.

    Args:
      path: the file.
      require_checksum: as for :func:`loads_checksummed_json`.

    Raises:
      FileNotFoundError: no such file.
      CorruptFileError: the file is damaged (the message names it and the damage).
    """
    with open(path, "rb") as f:
        data = f.read()
    return loads_checksummed_json(data, os.fspath(path), require_checksum=require_checksum)[0]
