"""The exceptions of cairn.llm, one per kind of bad input."""

from __future__ import annotations

__all__ = ["CheckpointError", "UnsupportedModelError"]


class UnsupportedModelError(ValueError):
    """A ``config.json`` whose ``model_type`` (or one of its options) no family supports."""


class CheckpointError(ValueError):
    """A checkpoint that does not fit its config: missing, unexpected or misshaped tensors,
    or a shard that cannot be read. The message names every tensor or file at fault."""
