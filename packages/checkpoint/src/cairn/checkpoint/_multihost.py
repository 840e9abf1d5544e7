"""Process coordination through JAX's distributed runtime (no-ops with one process)."""

from __future__ import annotations

import itertools
import time

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


def all_gather(key: str, value: str, timeout_s: float, what: str) -> list[str]:
    """Every process's ``value`` under the key-value-store prefix ``key`` (unique per call
    and the same on every process), in process order.

    Raises :class:`SyncTimeoutError` naming the processes whose value did not arrive
    within ``timeout_s`` (``what`` says which sync point it was).
    """
    n = jax.process_count()
    if n == 1:
        return [value]
    from cairn.checkpoint._errors import SyncTimeoutError

    client = _client()
    me = jax.process_index()
    client.key_value_set(f"{key}/{me}", value)
    deadline = time.monotonic() + timeout_s
    out: list[str | None] = [None] * n
    out[me] = value
    for i in range(n):
        if out[i] is not None:
            continue
        ms = max(int((deadline - time.monotonic()) * 1000), 1)
        try:
            out[i] = client.blocking_key_value_get(f"{key}/{i}", ms)
        except Exception as err:  # noqa: BLE001 - the runtime raises XlaRuntimeError
            if "DEADLINE_EXCEEDED" not in str(err) and time.monotonic() < deadline:
                raise
    missing = [i for i, v in enumerate(out) if v is None]
    if missing:
        arrived = [i for i in range(n) if i not in missing]
        raise SyncTimeoutError(
            f"cairn.checkpoint: process(es) {missing} of {n} did not reach {what} within "
            f"{timeout_s:g} s (process {me} waited; processes that arrived: {arrived})",
            missing,
        )
    return [v for v in out if v is not None]


def delete_key(key: str) -> None:
    """Remove ``key`` from the distributed key-value store (no-op with one process)."""
    if jax.process_count() > 1:
        _client().key_value_delete(key)
