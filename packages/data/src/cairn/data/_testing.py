"""Checkpoint consistency check (Grain's ``assert_equal_output_after_checkpoint``)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

__all__ = ["assert_equal_output_after_checkpoint"]


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or (
        hasattr(x, "__array__") and hasattr(x, "shape") and hasattr(x, "dtype")
    )


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if _is_array(a) or _is_array(b):  # NumPy arrays, and device arrays (device_put)
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))
    return bool(a == b)


def assert_equal_output_after_checkpoint(
    ds: Any, restore_ds: Any = None, max_steps: int | None = None
) -> None:
    """Check that restoring from the state after every step replays the same stream.

    Iterates ``ds`` once, recording ``get_state()`` before each element (after a JSON
    round trip, as a checkpoint would store it). Then, for every recorded step ``i``, a
    fresh iterator of ``restore_ds`` (default ``ds``; pass e.g. the same pipeline with a
    different number of workers) is restored from state ``i`` and must yield exactly
    elements ``i, i+1, ...`` to the end. Right after ``set_state`` its ``get_state()``
    must return the restored state (a checkpoint taken right after resuming must
    neither skip nor repeat data). Raises ``AssertionError`` naming the first step and
    element that differ.

    Args:
      ds: the dataset (``MapDataset`` or ``IterDataset``) to check.
      restore_ds: the dataset restored from the states; None uses ``ds``.
      max_steps: check only the first this many steps; None checks the whole stream.

    Raises:
      AssertionError: a restored iterator yields a different element or state.
    """
    restore_ds = ds if restore_ds is None else restore_ds
    it = iter(ds)
    states: list[Any] = []
    values: list[Any] = []
    try:
        while max_steps is None or len(values) < max_steps:
            states.append(json.loads(json.dumps(it.get_state())))
            try:
                values.append(next(it))
            except StopIteration:
                break
        else:
            states.append(json.loads(json.dumps(it.get_state())))
    finally:
        close = getattr(it, "close", None)
        if close:
            close()
    expected_end = max_steps is None
    for i, st in enumerate(states):
        it2 = iter(restore_ds)
        try:
            it2.set_state(st)
            again = json.loads(json.dumps(it2.get_state()))
            if again != st:
                raise AssertionError(
                    f"restored from the state before element {i}: get_state() right after "
                    f"set_state returned {again!r}, expected the restored state {st!r}"
                )
            for j in range(i, len(values)):
                try:
                    got = next(it2)
                except StopIteration:
                    raise AssertionError(
                        f"restored from the state before element {i}: the stream ended at element {j}, "
                        f"expected {len(values)} elements"
                    ) from None
                if not _equal(got, values[j]):
                    raise AssertionError(
                        f"restored from the state before element {i}: element {j} differs: "
                        f"got {got!r}, expected {values[j]!r}"
                    )
            if expected_end:
                extra = next(it2, _SENTINEL)
                if extra is not _SENTINEL:
                    raise AssertionError(
                        f"restored from the state before element {i}: got an extra element {extra!r} "
                        f"after the {len(values)} expected"
                    )
        finally:
            close = getattr(it2, "close", None)
            if close:
                close()


_SENTINEL = object()
