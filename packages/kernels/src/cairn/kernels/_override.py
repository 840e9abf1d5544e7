"""``override``: choose the implementation and config of kernel ops for a block of code.

The active overrides live in a :class:`contextvars.ContextVar`, so each thread and each
asyncio task sees its own stack, and nested blocks stack (the innermost wins).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class _Frame:
    op: str | None
    implementation: str | tuple[str, ...] | None
    config: Mapping[str, Any] | None


_STACK: contextvars.ContextVar[tuple[_Frame, ...]] = contextvars.ContextVar(
    "cairn_kernels_override", default=()
)


@contextlib.contextmanager
def override(
    implementation: str | Sequence[str] | None = None,
    config: Mapping[str, Any] | None = None,
    *,
    op: str | None = None,
) -> Iterator[None]:
    """Use ``implementation`` (and/or ``config``) for kernel calls inside the block.

    Args:
      implementation: an implementation name (``"xla"``, ``"pallas_triton"``,
        ``"pallas_mosaic_gpu"``) or a sequence tried in order; ``None`` leaves the choice
        to the other rules (autotune cache, preference order).
      config: config keys for the chosen implementation (e.g. ``{"block_k": 64}``);
        keys the implementation does not know raise when the op is called.
      op: restrict the override to one op (``"dot_product_attention"``); ``None`` means
        every op.

    An explicit ``implementation=``/``config=`` argument of a call still wins over the
    block. Blocks nest: the innermost block that names an implementation (or a config)
    for the op decides it. Thread-safe: each thread and task has its own stack.

    Raises:
      ValueError: if neither ``implementation`` nor ``config`` is given.

    Example:
      >>> import cairn.kernels as ck
      >>> with ck.override("xla", op="dot_product_attention"):
      ...     ck.active_override("dot_product_attention")
      ('xla', None)
    """
    if implementation is None and config is None:
        raise ValueError("override(): give implementation= and/or config=")
    impl = (
        implementation
        if implementation is None or isinstance(implementation, str)
        else tuple(implementation)
    )
    frame = _Frame(op, impl, None if config is None else dict(config))
    token = _STACK.set(_STACK.get() + (frame,))
    try:
        yield
    finally:
        _STACK.reset(token)


def active_override(op: str) -> tuple[str | tuple[str, ...] | None, Mapping[str, Any] | None]:
    """The ``(implementation, config)`` the active override blocks give ``op`` (``None`` if unset).

    Args:
      op: the op name.
    """
    impl: str | tuple[str, ...] | None = None
    config: Mapping[str, Any] | None = None
    for frame in reversed(_STACK.get()):
        if frame.op is not None and frame.op != op:
            continue
        if impl is None and frame.implementation is not None:
            impl = frame.implementation
        if config is None and frame.config is not None:
            config = frame.config
    return impl, config
