"""Flax NNX's functional training helpers: ``GraphDef.apply`` (call a module given as
GraphDef + States, get the output and the new states) and ``TrainState``."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from cairn.nn._graph import GraphDef, merge, split
from cairn.nn._state import State


class ApplyCaller:
    """``graphdef.apply(*states)``: calling it (or one of the module's methods through
    attribute access) runs the module rebuilt from the states and returns ``(output,
    (graphdef, new_state))``; the states given are not changed."""

    def __init__(self, graphdef: GraphDef, states: tuple, path: tuple = ()) -> None:
        self._graphdef = graphdef
        self._states = states
        self._path = path

    def __getattr__(self, name: str) -> ApplyCaller:
        if name.startswith("__"):
            raise AttributeError(name)
        return ApplyCaller(self._graphdef, self._states, (*self._path, name))

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, tuple[GraphDef, State]]:
        states = [State.from_flat({p: v.copy() for p, v in s._flat.items()})
                  for s in self._states]
        module = merge(self._graphdef, *states)
        fn: Any = module
        for name in self._path:
            fn = getattr(fn, name)
        out = fn(*args, **kwargs)
        graphdef, new_state = split(module)
        return out, (graphdef, new_state)


def _apply(self: GraphDef, state: State, *states: State) -> ApplyCaller:
    """Call the module ``merge(self, state, *states)`` functionally: see
    :class:`ApplyCaller`.

    Args:
      state: the first State.
      *states: the others.
    """
    return ApplyCaller(self, (state, *states))


GraphDef.apply = _apply  # type: ignore[attr-defined]


class TrainState:
    """A functional training state (Flax NNX's ``TrainState``): a frozen dataclass and
    pytree of ``graphdef``, ``params`` (a State), ``opt_state``, ``step`` and the
    transformation ``tx`` (static). Subclasses add fields by annotation
    (``batch_stats: nn.State``); every subclass is a frozen dataclass and a pytree too.

    Args:
      graphdef: the model's :class:`GraphDef`.
      params: the trained variables, a :class:`State`.
      opt_state: the transformation's state.
      step: the number of updates taken.
      tx: the Optax-style transformation (static).

    >>> import optax, jax.numpy as jnp
    >>> from cairn import nn
    >>> gd, params = nn.split(nn.Linear(2, 1, rngs=nn.Rngs(0)))
    >>> ts = nn.TrainState.create(gd, params=params, tx=optax.sgd(0.1))
    >>> y, _ = ts.apply("params")(jnp.ones((1, 2)))
    >>> int(ts.apply_gradients(jax.tree.map(jnp.ones_like, ts.params)).step)
    1
    """

    graphdef: GraphDef
    params: State
    opt_state: Any
    step: Any
    tx: Any = dataclasses.field(metadata={"static": True})

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        _make_pytree_dataclass(cls)

    @classmethod
    def create(cls, graphdef: GraphDef, *, params: State, tx: Any, step: int = 0,
               **kwargs: Any) -> TrainState:
        """A new state: ``opt_state = tx.init(params)``, ``step`` as an array.

        Args:
          graphdef: the module's GraphDef.
          params: the trained State.
          tx: an Optax-style gradient transformation.
          step: the starting step.
          **kwargs: the subclass's extra fields.
        """
        # a dataclass made at class creation (_make_pytree_dataclass), which mypy cannot see
        return cls(graphdef=graphdef, params=params, opt_state=tx.init(params),  # type: ignore[call-arg]
                   step=jax.numpy.asarray(step), tx=tx, **kwargs)

    def apply(self, state: State | str, *states: State | str) -> ApplyCaller:
        """``graphdef.apply`` with States given directly or by field name.

        Args:
          state: a State, or the name of a field holding one (``"params"``).
          states: more States or field names (``"batch_stats"``...).
        """
        out = []
        for s in (state, *states):
            if isinstance(s, str):
                name, s = s, getattr(self, s)
                if not isinstance(s, State):
                    raise TypeError(
                        f"{type(self).__name__}.{name} is a {type(s).__name__}, expected a State"
                    )
            out.append(s)
        return ApplyCaller(self.graphdef, tuple(out))

    def apply_gradients(self, grads: State, **kwargs: Any) -> TrainState:
        """One step: ``updates = tx.update(grads, opt_state, params)``, ``params +=
        updates``, ``step + 1`` (a new TrainState; ``kwargs`` replace other fields).

        Args:
          grads: gradients with the structure of ``params``.
          kwargs: other fields to replace in the new TrainState.
        """
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        params = jax.tree_util.tree_map(lambda p, u: p + u, self.params, updates)
        return dataclasses.replace(  # type: ignore[type-var]
            self, params=params, opt_state=opt_state, step=self.step + 1, **kwargs
        )

    def replace(self, **changes: Any) -> TrainState:
        """A copy with ``changes`` applied.

        Args:
          changes: field names and their new values.
        """
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


def _make_pytree_dataclass(cls: type) -> None:
    dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    meta = [f.name for f in fields if f.metadata.get("static")]
    data = [f.name for f in fields if not f.metadata.get("static")]
    jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


_make_pytree_dataclass(TrainState)
