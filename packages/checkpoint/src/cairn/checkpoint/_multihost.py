"""Process coordination through JAX's distributed runtime (no-ops with one process)."""

from __future__ import annotations

import itertools

import jax

_counter = itertools.count()


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def is_primary() -> bool:
    return jax.process_index() == 0


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "cairn.checkpoint: several JAX processes but jax.distributed is not initialized; "
            "call jax.distributed.initialize() before saving"
        )
    return client


def broadcast(name: str, value: str, timeout_s: float = 600.0) -> str:
    """Process 0's ``value`` on every process (each calls it, in the same order as barriers)."""
    if jax.process_count() == 1:
        return value
    client = _client()
    key = f"cairn_checkpoint/{next(_counter)}/value/{name}"
    if is_primary():
        client.key_value_set(key, value)
    return client.blocking_key_value_get(key, int(timeout_s * 1000))


def barrier(name: str, timeout_s: float = 600.0) -> None:
    """Block until every process reached the barrier ``name`` (a key-value-store barrier).

    Every process must call barriers in the same order; the name is made unique with a
    process-local counter that advances identically everywhere.
    """
    if jax.process_count() == 1:
        return
    client = _client()
    key = f"cairn_checkpoint/{next(_counter)}/{name}"
    client.wait_at_barrier(key, int(timeout_s * 1000))
