"""SHA-256 of every file of a model directory, checked before anything is deserialised.

Nothing in a serialized ``jax.export`` artifact or a JSON manifest detects corruption: a
flipped byte either loads silently or fails deep inside a deserialiser with whatever
exception that code raises. So every file is hashed at export and re-hashed at load, and
a mismatch names the file.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

__all__ = ["ModelFormatError", "ModelIntegrityError", "sha256_file", "digest_files", "verify_files", "MANIFEST"]

MANIFEST = "manifest.json"
_BLOCK = 1 << 20


class ModelFormatError(ValueError):
    """A model directory that cannot be used: malformed, of an unknown format version, or
    made by an incompatible JAX. ``file`` is the file at fault (relative path) or ``None``.

    Args:
      message: the error text.
      file: the file at fault (relative to the model directory), or None.
    """

    def __init__(self, message: str, file: str | None = None) -> None:
        super().__init__(message)
        self.file = file


class ModelIntegrityError(ModelFormatError):
    """A file of a model directory is missing, truncated or altered (its size or SHA-256
    differs from the manifest's).

    Args:
      message: the error text.
      file: the file at fault (relative to the model directory), or None.
    """


def sha256_file(path: str) -> str:
    """The hex SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _walk(root: str) -> list[str]:
    out = []
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for f in sorted(files):
            out.append(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"))
    return out


def digest_files(root: str) -> dict[str, dict]:
    """``{relative path: {"sha256", "size"}}`` for every file under ``root`` but the manifest."""
    return {
        rel: {"sha256": sha256_file(os.path.join(root, rel)), "size": os.path.getsize(os.path.join(root, rel))}
        for rel in _walk(root)
        if rel != MANIFEST
    }


def verify_files(root: str, files: Mapping[str, Mapping]) -> None:
    """Check that every listed file exists with its recorded size and SHA-256.

    Raises:
      ModelIntegrityError: naming the first file that is missing, of the wrong size
        (truncated or grown) or whose digest differs.
    """
    for rel, entry in files.items():
        if not isinstance(rel, str) or rel.startswith("/") or ".." in rel.split("/"):
            raise ModelFormatError(f"manifest lists an unsafe file path {rel!r}", MANIFEST)
        full = os.path.join(root, *rel.split("/"))
        if not os.path.isfile(full):
            raise ModelIntegrityError(f"{rel}: missing from the model directory {root}", rel)
        size = os.path.getsize(full)
        if size != entry.get("size"):
            raise ModelIntegrityError(
                f"{rel}: {size} bytes, the manifest records {entry.get('size')} (truncated or altered)", rel
            )
        digest = sha256_file(full)
        if digest != entry.get("sha256"):
            raise ModelIntegrityError(
                f"{rel}: SHA-256 {digest[:16]}... differs from the manifest's {str(entry.get('sha256'))[:16]}... "
                "(the file is corrupted or was modified after export)", rel
            )
