"""``nn.EMA``: an exponential moving average of a model's variables (Flax NNX's
``nnx.EMA``), a module, so it goes through ``nn.jit`` with the model and optimizer."""

from __future__ import annotations

from typing import Any, TypeVar, cast

import jax.numpy as jnp

from cairn.nn._filters import path_str
from cairn.nn._graph import merge, split, state
from cairn.nn._module import Dict, List, Module
from cairn.nn._state import State
from cairn.nn._variables import Variable

M = TypeVar("M")


def _nest(flat: dict[tuple, Variable]) -> Module:
    """The variables of ``flat`` (path -> Variable) as nested ``nn.Dict`` / ``nn.List``
    modules with the same paths (a level keyed 0..n-1 is a List)."""
    tree: dict = {}
    for p, v in flat.items():
        d = tree
        for k in p[:-1]:
            d = d.setdefault(k, {})
        d[p[-1]] = v

    def build(d: dict) -> Module:
        kids = {k: build(x) if isinstance(x, dict) else x for k, x in d.items()}
        if kids and sorted(kids, key=str) == sorted(range(len(kids)), key=str):
            return List([kids[i] for i in range(len(kids))])
        return Dict({str(k): x for k, x in kids.items()})

    return build(tree)


class EMA(Module):
    """An exponential moving average of the variables of ``params`` (a module, a State
    or a pytree of modules) matching ``only``: ``update(model)`` sets each average to
    ``decay * average + (1 - decay) * value``; ``apply_to(model)`` is a model of the
    same structure whose tracked variables are the averages (the same Variable objects:
    it follows later updates).

    Args:
      params: what to average (its variables are copied as the starting averages).
      decay: the weight of the old average, in [0, 1].
      only: a filter of the variables to track (default: all).
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).

    Raises:
      ValueError: ``decay`` outside [0, 1].

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> model = nn.Linear(2, 2, use_bias=False, rngs=nn.Rngs(0))
    >>> ema = nn.EMA(model, decay=0.9)
    >>> model.kernel.value = model.kernel[...] * 2
    >>> ema.update(model)
    >>> ema.apply_to(model).kernel is ema.params.kernel
    True
    """

    def __init__(self, params: Any, decay: float, *, only: Any = ..., graph: bool | None = None) -> None:
        if not 0.0 <= float(decay) <= 1.0:
            raise ValueError(f"EMA: decay must be in [0, 1], got {decay!r}")
        self.decay = float(decay)
        self.only = only
        tracked = state(params, only)
        if not isinstance(tracked, State):
            raise TypeError(f"EMA: params must hold modules or Variables, got {type(params).__name__}")
        self.params = _nest({p: v.copy() for p, v in tracked._flat.items()})

    def _mine(self) -> dict[str, Variable]:
        return {path_str(p): v for p, v in cast(State, state(self.params))._flat.items()}

    def update(self, updates: Any) -> None:
        """Move each average towards the matching variable of ``updates``.

        Args:
          updates: a module (or State) with the structure of the averaged ``params``.

        Raises:
          ValueError: ``updates`` lacks a tracked variable.
        """
        new = cast(State, state(updates, self.only))
        new_flat = {path_str(p): v for p, v in new._flat.items()}
        for key, avg in self._mine().items():
            if key not in new_flat:
                raise ValueError(f"EMA.update: the updates have no variable at {key!r}")
            value = jnp.asarray(new_flat[key][...])
            avg.value = (self.decay * avg[...] + (1.0 - self.decay) * value).astype(avg.dtype)

    def apply_to(self, model: M) -> M:
        """A model of ``model``'s structure whose tracked variables are the averages
        (shared with this EMA); the others are ``model``'s own.

        Args:
          model: a model with the structure of the averaged ``params``.

        Raises:
          ValueError: ``model`` lacks a tracked variable.
        """
        gd, st = split(cast(Any, model))
        flat = dict(st._flat)
        by_key = {path_str(p): p for p in flat}
        for key, avg in self._mine().items():
            if key not in by_key:
                raise ValueError(f"EMA.apply_to: the model has no variable at {key!r}")
            flat[by_key[key]] = avg
        return cast(M, merge(gd, State.from_flat(flat)))
