"""Exceptions raised by cairn.checkpoint."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path and the cause."""


class ChecksumError(CheckpointError):
    """Stored bytes of a leaf do not match their crc32c checksum (the file was corrupted)."""


class TargetMismatchError(CheckpointError, ValueError):
    """The restore target disagrees with the checkpoint; the message lists every difference."""
