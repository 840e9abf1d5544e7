"""The traces of a quantized function, one per call signature, and their compiled replays.

``quantize(fn)`` traces ``fn`` once per signature (the argument structure, the shapes and
dtypes of the array leaves, the values of the other leaves) and re-evaluates that
program through the provider on every call. Inside a trace (``jit``, ``grad``, ``vmap``)
the re-evaluation is itself traced, once. An eager call would run it op by op, a
dispatch per primitive; instead it calls a ``jax.jit`` of the re-evaluation, compiled
once per signature and per provider configuration.

Nothing a call can change is baked into a compiled replay: the weights and the other
array leaves are its arguments, and so are the arrays the provider reads while
rewriting (its calibrated static scales, its random keys); the provider's rules and
modes are part of the cache key. A provider that records Python state while rewriting
(calibration, GPTQ and AWQ statistics) is never compiled. The cache keeps the
``MAX_ENTRIES`` signatures used last; older ones are dropped with their executables.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["Trace", "TraceCache", "MAX_ENTRIES", "concrete"]

MAX_ENTRIES = 32


class Trace:
    """One signature's program: ``closed`` (the jaxpr), ``out_tree``, the leaf kinds and
    weight paths, module paths and names, the outputs that are inputs (``forwarded``) or constants (``literals``),
    and its compiled replays by provider configuration (which return the other outputs
    only: a forwarded weight is not copied, a constant stays what the program returns)."""

    def __init__(self, closed: Any, out_tree: Any, kinds: Sequence[str], weight_paths: Sequence[str],
                 weight_modules: Sequence[str], statics: list[Any], weight_names: Sequence[str] | None = None) -> None:
        from jax.extend.core import Literal

        self.closed = closed
        self.out_tree = out_tree
        jaxpr = closed.jaxpr
        self.n_out = len(jaxpr.outvars)
        position = {v: k for k, v in enumerate(jaxpr.invars)}
        # output index -> input index, for outputs that are inputs unchanged (a model's weights)
        self.forwarded = {i: position[v] for i, v in enumerate(jaxpr.outvars) if not isinstance(v, Literal) and v in position}
        # output index -> value, for outputs that are constants of the program (a Python number)
        self.literals = {i: v.val for i, v in enumerate(jaxpr.outvars) if isinstance(v, Literal)}
        self.kinds = tuple(kinds)
        self.weight_paths = tuple(weight_paths)
        self.weight_modules = tuple(weight_modules)
        self.weight_names = tuple(weight_paths if weight_names is None else weight_names)
        self.statics = statics  # held, so that an id used in the key is not reused while the entry lives
        self.unchecked = True  # the provider's unused-rule check has not passed on this program yet
        self.replays: dict[tuple, Callable] = {}


class TraceCache:
    """A least-recently-used map from call signatures to :class:`Trace`\\ s (at most ``size``,
    by default ``MAX_ENTRIES``)."""

    def __init__(self, size: int | None = None) -> None:
        self.size = MAX_ENTRIES if size is None else size
        self._entries: collections.OrderedDict[tuple, Trace] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple, make: Callable[[], Trace]) -> Trace:
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            return hit
        entry = self._entries[key] = make()
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return entry


def concrete(leaves: Sequence[Any]) -> bool:
    """Whether no leaf (nor a ``QArray``'s part) is a tracer: the call is eager."""
    import jax

    return not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(list(leaves)))


@contextlib.contextmanager
def provider_arrays(provider: Any, arrays: dict[str, Any]) -> Iterator[None]:
    """The provider's replay arrays swapped for ``arrays`` (the compiled replay's arguments)."""
    saved = {name: getattr(provider, name) for name in arrays}
    try:
        for name, value in arrays.items():
            setattr(provider, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(provider, name, value)


def compiled_replay(entry: Trace, provider: Any, run: Callable[[Trace, list[Any]], list]) -> tuple[Callable, dict[str, Any]] | None:
    """``(jitted(dynamic_leaves, arrays), arrays)`` for ``provider`` as it is now, or ``None``
    when the provider must run op by op. ``run(entry, dynamic)`` re-evaluates the program;
    ``jitted`` returns its outputs but the forwarded and constant ones."""
    names = getattr(provider, "_replay_arrays", None)
    if names is None:
        return None
    key = provider._replay_key()
    if key is None:
        return None
    arrays = {name: getattr(provider, name) for name in names}
    jitted = entry.replays.get(key)
    if jitted is None:
        import jax

        def replay(dynamic: list[Any], arrays: dict[str, Any]) -> list:
            with provider_arrays(provider, arrays):
                outs = run(entry, dynamic)
            return [o for i, o in enumerate(outs) if i not in entry.forwarded and i not in entry.literals]

        if len(entry.replays) >= 4:  # a provider reconfigured again and again: keep the latest few
            entry.replays.pop(next(iter(entry.replays)))
        jitted = entry.replays[key] = jax.jit(replay)
    return jitted, arrays
