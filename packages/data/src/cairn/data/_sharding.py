"""Which part of the data this process reads: ``ShardOptions`` and friends (Grain's names)."""

from __future__ import annotations

import dataclasses

__all__ = ["ShardOptions", "NoSharding", "ShardByJaxProcess"]


@dataclasses.dataclass(frozen=True)
class ShardOptions:
    """Read shard ``shard_index`` of ``shard_count`` contiguous, near-equal shards.

    With ``drop_remainder`` every shard has ``len // shard_count`` records (the rest is
    dropped) so all hosts see the same number of batches.

    Args:
      shard_index: this shard's index, in ``[0, shard_count)``.
      shard_count: the number of shards, >= 1.
      drop_remainder: give every shard ``len // shard_count`` records.

    >>> ShardOptions(shard_index=1, shard_count=4).shard_index
    1
    """

    shard_index: int
    shard_count: int
    drop_remainder: bool = False

    def __post_init__(self):
        for name in ("shard_index", "shard_count"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"ShardOptions.{name} must be an int, got {v!r}")
        if self.shard_count < 1:
            raise ValueError(f"ShardOptions.shard_count must be >= 1, got {self.shard_count}")
        if not 0 <= self.shard_index < self.shard_count:
            raise ValueError(
                f"ShardOptions.shard_index must be in [0, {self.shard_count}), got {self.shard_index}"
            )


def NoSharding() -> ShardOptions:  # noqa: N802 (Grain's name)
    """Every process reads all the data (shard 0 of 1)."""
    return ShardOptions(shard_index=0, shard_count=1, drop_remainder=False)


def ShardByJaxProcess(drop_remainder: bool = False) -> ShardOptions:  # noqa: N802 (Grain's name)
    """Shard ``jax.process_index()`` of ``jax.process_count()`` (imports JAX when called).

    Args:
      drop_remainder: give every process ``len // process_count`` records (the rest is dropped).

    Raises:
      ImportError: JAX is not installed.
    """
    try:
        import jax
    except ImportError as e:  # pragma: no cover - exercised only without JAX
        raise ImportError(
            "ShardByJaxProcess needs JAX: pip install 'cairn-data[jax]', or use ShardOptions(...)"
        ) from e
    return ShardOptions(
        shard_index=jax.process_index(),
        shard_count=jax.process_count(),
        drop_remainder=drop_remainder,
    )
