"""Record every kernel call, and list the kernel ops of a traced function.

Each :func:`cairn.kernels._registry.call` runs inside
``jax.named_scope("cairn_kernels.<op>.<implementation>")`` and reports a
:class:`KernelCall` to the recorders active in this context. :func:`ops_in` traces a
function once (no compilation, no FLOPs) and returns the calls it made, which
``cairn-autotune`` then autotunes offline.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

SCOPE_PREFIX = "cairn_kernels."
_SCOPE_RE = re.compile(r"cairn_kernels\.(\w+)\.(\w+)")


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One kernel call as traced.

    Attributes:
      op: the op name (``"dot_product_attention"``).
      implementation: the implementation chosen (``"xla"``, ``"pallas_triton"``, ...).
      config: the config it ran with.
      args: ``jax.ShapeDtypeStruct`` (or ``None``) per positional argument.
      kwargs: keyword arguments; arrays as ``jax.ShapeDtypeStruct``, the rest as given.
      interpret: whether it ran in Pallas interpret mode.
    """

    op: str
    implementation: str
    config: Mapping[str, Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    interpret: bool = False

    def describe(self) -> str:
        """A one-line text form: op, implementation, config, argument shapes and dtypes."""
        shapes = ", ".join(_spec_text(a) for a in self.args)
        extra = {
            k: _spec_text(v) if isinstance(v, jax.ShapeDtypeStruct) else v
            for k, v in self.kwargs.items()
        }
        return f"{self.op}[{self.implementation}] config={json.dumps(dict(self.config), sort_keys=True)} ({shapes}) {extra}"


def _spec_text(x: Any) -> str:
    if isinstance(x, jax.ShapeDtypeStruct):
        return f"{np.dtype(x.dtype).name}{list(x.shape)}"
    return repr(x)


def abstract(x: Any) -> Any:
    """``jax.ShapeDtypeStruct`` for an array (or tracer), the value itself otherwise."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
    return x


_RECORDERS: contextvars.ContextVar[tuple[list[KernelCall], ...]] = contextvars.ContextVar(
    "cairn_kernels_recorders", default=()
)


def record(entry: KernelCall) -> None:
    """Hand ``entry`` to every recorder active in this context (cheap when none is)."""
    for sink in _RECORDERS.get():
        sink.append(entry)


@contextlib.contextmanager
def recording() -> Iterator[list[KernelCall]]:
    """Collect the :class:`KernelCall` of every kernel call made (and traced) in the block.

    Example:
      >>> import jax.numpy as jnp
      >>> import cairn.kernels as ck
      >>> q = jnp.zeros((1, 4, 2, 8))
      >>> with ck.recording() as calls:
      ...     _ = ck.dot_product_attention(q, q, q)
      >>> [(c.op, c.implementation) for c in calls]
      [('dot_product_attention', 'xla')]
    """
    sink: list[KernelCall] = []
    token = _RECORDERS.set(_RECORDERS.get() + (sink,))
    try:
        yield sink
    finally:
        _RECORDERS.reset(token)


def ops_in(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[KernelCall]:
    """The kernel calls ``fn(*args, **kwargs)`` makes, found by tracing it once.

    ``fn`` is traced with :func:`jax.make_jaxpr` (arguments may be arrays or
    ``jax.ShapeDtypeStruct``); kernel calls inside ``jax.grad``, ``jax.vmap``, ``scan``
    bodies and nested ``jit`` are found too, in call order.

    Args:
      fn: any JAX-traceable function.
      *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).
      **kwargs: its keyword arguments (static).

    Returns:
      One :class:`KernelCall` per traced kernel call.
    """
    with recording() as calls:
        jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
    return list(calls)


def scopes_in(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[tuple[str, str]]:
    """The ``(op, implementation)`` pairs named in the jaxpr's scopes, in order of first use.

    The named scopes survive into lowered HLO and profiles, so this works on a
    traced program alone (no recorder needed).
    """
    closed = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
    found: list[tuple[str, str]] = []
    for jaxpr in _jaxprs(closed.jaxpr):
        for eqn in jaxpr.eqns:
            # transforms wrap scopes (``vmap(cairn_kernels.op.impl)``), so search, not split
            for op, impl in _SCOPE_RE.findall(str(eqn.source_info.name_stack)):
                if (op, impl) not in found:
                    found.append((op, impl))
    return found


def _jaxprs(jaxpr: Any) -> Iterator[Any]:
    yield jaxpr
    for eqn in jaxpr.eqns:
        for sub in _param_jaxprs(eqn.params):
            yield from _jaxprs(sub)


def _param_jaxprs(params: Mapping[str, Any]) -> Iterator[Any]:
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                yield v.jaxpr
            elif hasattr(v, "eqns"):
                yield v
