"""``optim.pack``: the opt-in to packed optimizer state (one flat buffer per dtype).

By default every element-wise transformation keeps its state per parameter: ``mu`` and
``nu`` are trees with the parameters' structure, each array with its parameter's shape
and sharding, keyed by the parameter's path. ``pack(tx)`` instead keeps the state of
the element-wise members of ``tx`` as flat 1-D buffers, one per dtype (and per
sharding of the parameters at ``init``), which is faster for many tiny replicated leaves
(one kernel per buffer instead of one per leaf), at a price:

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

from cairn.optim import _packing as pk
from cairn.optim._base import GradientTransformation

__all__ = ["pack"]


def _is_transformation(x) -> bool:
    return callable(getattr(x, "init", None)) and callable(getattr(x, "update", None))


def pack(tx_or_tree, layout: pk.Layout | None = None, *, what: str = "updates",
         cast: bool = False):
    """Opt in to packed state: ``pack(tx)``; or pack a pytree: ``pack(tree, layout)``.

    ``pack(tx)`` returns ``tx`` with an ``init`` that builds the state of its element-wise
    members as flat buffers, one per dtype; ``update`` follows the state it is given. The
    numbers are the same as ``tx``'s; what it trades away (sharding, per-path keys) is in
    the module docstring and docs/optim.md.

    ``pack(tree, layout)`` packs ``tree`` into the buffers of ``layout`` (one concatenate
    per group); errors name the path of a leaf of the wrong shape or dtype.

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
