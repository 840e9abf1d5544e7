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

    Args:
      op: the op name (``"dot_product_attention"``).
      implementation: the implementation chosen (``"xla"``, ``"pallas_triton"``, ...).
      config: the config it ran with.
      args: ``jax.ShapeDtypeStruct`` (or ``None``) per positional argument.
      kwargs: keyword arguments; arrays as ``jax.ShapeDtypeStruct``, the rest as given.
      interpret: whether it ran in Pallas interpret mode.
      source: which dispatch rule chose the implementation and config (the first that
        gave either): ``"argument"`` (``implementation=``/``config=``), ``"override"``
        (a :func:`cairn.kernels.override` block), ``"cache"`` (an autotune cache file),
        ``"autotune"`` (measured in this process) or ``"default"`` (the heuristic for the
        shapes, dtype and backend, nothing measured).
      measured: for ``"cache"`` and ``"autotune"``, the entry's record (``date``,
        ``loadavg``, ``cpu_count``, versions, ...; absent fields for a schema-1 entry),
        its ``time_ms`` and, from a file, its path as ``file``; else empty.
    """

    op: str
    implementation: str
    config: Mapping[str, Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    interpret: bool = False
    source: str = "default"
    measured: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def describe_source(self) -> str:
        """Where the choice came from, in words (see :func:`describe_source`)."""
        return describe_source(self.source, self.measured)

    def describe(self) -> str:
        """A one-line text form: op, implementation, config, argument shapes and dtypes."""
        shapes = ", ".join(_spec_text(a) for a in self.args)
        extra = {
            k: _spec_text(v) if isinstance(v, jax.ShapeDtypeStruct) else v
            for k, v in self.kwargs.items()
        }
        return f"{self.op}[{self.implementation}] config={json.dumps(dict(self.config), sort_keys=True)} ({shapes}) {extra}"


_SOURCES = {
    "argument": "the implementation=/config= argument",
    "override": "an override block",
    "cache": "the autotune cache",
    "autotune": "autotuned in this process",
    "default": "the untuned default heuristic (nothing measured)",
}


def describe_source(source: str, measured: Mapping[str, Any] | None = None) -> str:
    """Where a kernel choice came from, in words: the rule, and for a measured choice when,
    on what and under what load it was measured.

    ``source`` and ``measured`` are :class:`KernelCall`'s fields (plain JSON works too).

    Args:
      source: the dispatch rule: ``"argument"``, ``"override"``, ``"cache"``, ``"autotune"`` or
        ``"default"``.
      measured: the measurement record (with ``file`` for a cache entry); None or empty when nothing
        was measured.

    Example:
      >>> describe_source("cache", {"file": "/c/cpu.json", "date": "2026-11-27T21:03:00Z",
      ...     "loadavg": [3.5, 2.0, 1.0], "cpu_count": 2, "jax_version": "0.10.2"})
      'the autotune cache /c/cpu.json (measured 2026-11-27T21:03:00Z under load 3.5 on 2 CPUs, jax 0.10.2)'
      >>> describe_source("default")
      'the untuned default heuristic (nothing measured)'
    """
    text = _SOURCES.get(source, source)
    m = dict(measured or {})
    if m.get("file"):
        text += f" {m['file']}"
    if source not in ("cache", "autotune"):
        return text
    if not m.get("date"):
        return text + " (no record of when or under what load: re-measure with cairn-kernels tune --force)"
    load = m.get("loadavg")
    under = f"under load {load[0]:g} on {m.get('cpu_count', '?')} CPUs" if load else "load unknown"
    return text + f" (measured {m['date']} {under}, jax {m.get('jax_version', '?')})"


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
