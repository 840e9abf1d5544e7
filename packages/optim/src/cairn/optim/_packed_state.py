"""The packed-buffer backend of the element-wise transformations, and ``optim.pack``.

Every element-wise transformation (``_adam``, ``_rms``, ``_momentum``, ...) writes its
update equation once, on "buffers", with the helpers here (:func:`state_zeros`,
:func:`step_buffers`, :class:`BiasCorrection`). By default the buffers are the
per-parameter arrays: every moment lives in the state per parameter, a tree with the
params' structure (``mu/layers/0/kernel``), each array in its parameter's shape and
sharding, so a sharded model's optimizer state is sharded exactly like it.

``pack(tx)`` instead keeps the state of the element-wise members of ``tx`` as flat 1-D
buffers, one per dtype (and per sharding of the parameters at ``init``), which is faster
for many tiny replicated leaves (one kernel per buffer instead of one per leaf), at a
price:

- **sharding**: a buffer concatenates many parameters, so it cannot follow any one
  parameter's sharding; under ``jit`` XLA lays it out as it likes (often replicated:
  each device then holds every moment whole);
- **paths**: the state is keyed by buffer (``0/mu/float32``, ``0/mu/offset_0``), not by
  parameter path, so a checkpoint of it cannot be read per layer, restored into a model
  that gained or lost a parameter, or resharded one moment at a time.

``pack(tree, layout)`` packs a pytree into the buffers of a layout (packed-params mode,
:func:`~cairn.optim.layout_of`), as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn.optim import _packing as pk
from cairn.optim._base import GradientTransformation, eval_schedule
from cairn.optim._packing import Packed
from cairn.optim._placement import full_like_param

__all__ = ["pack"]


def _is_transformation(x) -> bool:
    return callable(getattr(x, "init", None)) and callable(getattr(x, "update", None))


def pack(tx_or_tree: Any, layout: pk.Layout | None = None, *, what: str = "updates",
         cast: bool = False) -> Any:
    """Opt in to packed state: ``pack(tx)``; or pack a pytree: ``pack(tree, layout)``.

    ``pack(tx)`` returns ``tx`` with an ``init`` that builds the state of its element-wise
    members as flat buffers, one per dtype; ``update`` follows the state it is given. The
    numbers are the same as ``tx``'s; what it trades away (sharding, per-path keys) is in
    the module docstring and docs/optim.md.

    ``pack(tree, layout)`` packs ``tree`` into the buffers of ``layout`` (one concatenate
    per group); errors name the path of a leaf of the wrong shape or dtype.

    Args:
      tx_or_tree: a transformation (to opt it in to packed state) or a pytree of arrays (to pack).
      layout: the :class:`Layout` to pack a pytree into; None when packing a transformation.
      what: the name used for the tree in error messages.
      cast: cast leaves whose dtype differs from the layout's instead of raising TypeError.

    >>> import jax.numpy as jnp
    >>> from cairn import optim
    >>> params = {"a": jnp.ones(3), "b": jnp.ones((2, 2))}
    >>> tx = optim.pack(optim.adam(1e-3))
    >>> tx.init(params)[0].mu
    Packed(2 leaves: float32: float32[7])
    >>> sorted(optim.adam(1e-3).init(params)[0].mu)
    ['a', 'b']
    """
    if layout is None:
        if not _is_transformation(tx_or_tree):
            raise TypeError(f"pack: pass a gradient transformation (pack(tx)) or a pytree and "
                            f"a layout (pack(tree, layout)); got {type(tx_or_tree).__name__} "
                            f"and no layout")
        return _packed(tx_or_tree)
    return pk.pack(tx_or_tree, layout, what=what, cast=cast)


def _packed(tx) -> GradientTransformation:
    def init(params):
        with pk.pack_state():
            return tx.init(params)

    return GradientTransformation(init, tx.update)


_I32_MAX = np.iinfo(np.int32).max


def safe_increment(count: jax.Array) -> jax.Array:
    """``count + 1`` as int32, saturating at the int32 maximum instead of wrapping.

    Args:
      count: an int32 step counter.
    """
    return jnp.where(count < _I32_MAX, count + 1, _I32_MAX).astype(jnp.int32)


def is_python_number(x: Any) -> bool:
    return isinstance(x, (int, float, np.number)) and not isinstance(x, bool)


def _dt(dtype):
    return None if dtype is None else jnp.dtype(dtype)


def state_zeros(params: Any, layout: Any, dtype: jax.typing.DTypeLike | None = None,
                fill: float = 0.0, offsets: Any = False) -> Any:
    """One moment of state filled with ``fill``: per parameter (the default: a tree with the
    params' structure, each array with its parameter's shape and sharding) or packed (flat
    buffers per dtype, when ``layout`` is a grouped one)."""
    if layout.shaped:
        leaves = jax.tree_util.tree_leaves(params)
        return jax.tree_util.tree_unflatten(
            layout.treedef, [full_like_param(x, fill, _dt(dtype)) for x in leaves])
    p = pk.zeros(layout, _dt(dtype), fill)
    return p.with_offsets(pk.make_offsets(layout)) if offsets else p


def _like(old, layout, bufs):
    return pk.state_like(old, layout, bufs)


def _bufs(s):
    """The buffers of a state moment already checked by :func:`check_moment`."""
    return s.buffers if isinstance(s, Packed) else jax.tree_util.tree_leaves(s)


def check_moment(u: Packed, s: jax.typing.ArrayLike, name: str) -> None:
    pk.state_buffers(s, u.layout, what=f"{name}: state")


class BiasCorrection:
    """Bias correction denominators ``1 - decay**count`` in a dtype, computed once per step
    and reused by every leaf (not once per leaf: 1,000 leaves would otherwise trace and
    compile 1,000 copies of the same scalar expression). ``next`` uses ``count + 1``."""

    def __init__(self, count: jax.Array) -> None:
        self.count = count
        self._next: BiasCorrection | None = None
        self._cache: dict = {}

    def __call__(self, decay: float, dtype: jax.typing.DTypeLike | None) -> jax.Array:
        key = (id(decay), jnp.dtype(dtype))
        if key not in self._cache:
            self._cache[key] = (decay, (1 - decay ** self.count).astype(dtype))
        return self._cache[key][1]

    @property
    def next(self) -> BiasCorrection:
        if self._next is None:
            self._next = BiasCorrection(safe_increment(self.count))
        return self._next


def plus(x: Any, c: Any) -> jax.Array:
    """``x + c``, skipped for a Python zero (the default ``eps_root``): the same numbers for
    the non-negative ``x`` it is used on, one op less per leaf to trace and compile."""
    if isinstance(c, (int, float)) and c == 0:
        return x
    return x + c


def abs_sq(x: Any) -> jax.Array:
    return jnp.real(jnp.conj(x) * x) if jnp.iscomplexobj(x) else x * x


def _store(x, dtype_like):
    return x.astype(dtype_like.dtype)


def step_buffers(u: Packed, states: tuple[Packed, ...], step: Callable) -> tuple[Packed, tuple]:
    """Run ``step(g, *olds) -> (out, *news)`` on every packed buffer.

    ``out`` is cast to the update's dtype and each new state buffer to its old
    buffer's dtype. Returns ``(updates, new_states)`` as :class:`Packed`.
    """
    outs: list[jax.Array] = []
    news: list[list[jax.Array]] = [[] for _ in states]
    for g, *olds in zip(u.buffers, *(_bufs(s) for s in states)):
        out, *vals = step(g, *olds)
        outs.append(out.astype(g.dtype))
        for new, val, old in zip(news, vals, olds):
            new.append(_store(val, old))
    return Packed(u.layout, outs), tuple(_like(s, u.layout, bufs)
                                         for s, bufs in zip(states, news))


def mu_hat(b1: float, m: Any, g: Any, bc: BiasCorrection, nesterov: bool) -> jax.Array:
    """Bias-corrected first moment (Nesterov's look-ahead form when ``nesterov``)."""
    if nesterov:
        return (b1 * m / bc.next(b1, m.dtype)
                + (1 - b1) * g / bc(b1, g.dtype))
    return m / bc(b1, m.dtype)


def current_value(name: str, value: Any, stored: jax.Array, count: jax.Array) -> jax.Array:
    """The value of a float-or-schedule hyperparameter (learning rate, weight decay) at a
    step: the schedule at ``count``, the ``stored`` state value for a Python number (so
    :func:`~cairn.optim.set_hyperparams` can change it without recompiling), or a traced
    value as given (e.g. from :func:`~cairn.optim.inject_hyperparams`: it wins)."""
    if callable(value):
        return eval_schedule(name, value, count)
    if is_python_number(value):
        return stored
    return jnp.asarray(value, jnp.float32)
