"""Parameter groups (``partition``), ``flatten``, and traced hyperparameters
(``inject_hyperparams``); masking is in ``_masking``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from cairn.optim._adding import AddDecayedWeightsState
from cairn.optim._base import (
    EmptyState,
    GradientTransformation,
    call_update,
    eval_schedule,
    mark_extra,
)
from cairn.optim._masking import is_zero_tx, leaves_like, select_leaves
from cairn.optim._packed_state import safe_increment
from cairn.optim._rules import resolve_per_leaf
from cairn.optim._scaling import ScaleByLearningRateState

__all__ = [
    "partition", "multi_transform", "flatten", "inject_hyperparams", "get_hyperparams",
    "set_hyperparams", "PartitionState", "InjectHyperparamsState",
]


class PartitionState(NamedTuple):
    """One inner state per label (frozen labels hold an EmptyState).

    Args:
      inner_states: dict from label to that label's inner state.
    """

    inner_states: dict


def partition(transforms: Mapping[Any, GradientTransformation], param_labels: Any,
              *, mask_compatible_extra_args: bool = False) -> GradientTransformation:
    """Apply a different transformation to each group of parameters.

    ``param_labels`` is a pytree of labels (or a prefix of the params tree), a
    callable ``params -> labels``, or **path-regex rules** in the ``core_array`` path
    convention: a mapping ``{pattern: label}`` or a list of ``(pattern, label)``,
    matched with ``re.fullmatch`` in order, **first matching rule wins**. A mapping
    whose keys are exactly the top-level keys of the params dict is read as a label
    tree, as in Optax.

    Each group's transformation sees only its own leaves (the others are ``None``), so
    its state holds only that group. A group mapped to :func:`set_to_zero` (or
    :func:`freeze`) costs no compute and no state: its updates are zeros.

    Errors name the path: a parameter matched by no rule, a rule that matches no
    parameter (or only parameters claimed by earlier rules), or a label missing from
    ``transforms``. A transform whose label no parameter uses is kept with an empty state
    (as Optax: one ``transforms`` dict may serve models without some of the groups).

    Args:
      transforms: mapping from label to the transformation for that group.
      param_labels: the label of each parameter: a pytree of labels (or a prefix), a callable
        ``params -> labels``, or path-regex rules ``{pattern: label}`` / ``[(pattern, label)]``.
      mask_compatible_extra_args: accepted for Optax compatibility and ignored.
    """
    transforms = dict(transforms)
    del mask_compatible_extra_args
    cache: dict = {}

    def labels_for(tree):
        leaves, td = jax.tree_util.tree_flatten(tree)
        key = (td, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", ""))) for x in leaves))
        if key not in cache:
            labs = resolve_per_leaf(param_labels, tree, what="partition labels", mask_mode=False)
            from cairn.core_array import tree_paths

            paths = tree_paths(tree)
            for p, lab in zip(paths, labs):
                if lab not in transforms:
                    raise ValueError(f"partition: parameter at path {p!r} has label {lab!r} "
                                     f"which is not a key of transforms {sorted(map(str, transforms))}")
            cache[key] = labs
        return cache[key]

    def init(params):
        labs = labels_for(params)
        states = {}
        for lab, tx in transforms.items():
            if is_zero_tx(tx):
                states[lab] = EmptyState()
            else:
                states[lab] = tx.init(select_leaves(params, [x == lab for x in labs]))
        return PartitionState(states)

    @mark_extra
    def update(updates, state, params=None, **extra):
        labs = labels_for(updates)
        leaves, td = jax.tree_util.tree_flatten(updates)
        out = list(leaves)
        new_states = {}
        for lab, tx in transforms.items():
            keep = [x == lab for x in labs]
            if is_zero_tx(tx):
                for i, k in enumerate(keep):
                    if k:
                        out[i] = jnp.zeros_like(leaves[i])
                new_states[lab] = state.inner_states[lab]
                continue
            sub_u = select_leaves(updates, keep)
            sub_p = select_leaves(params, keep) if params is not None else None
            u_l, new_states[lab] = call_update(tx, sub_u, state.inner_states[lab], sub_p, extra)
            for i, v in enumerate(leaves_like(td, u_l)):
                if keep[i]:
                    out[i] = v
        return jax.tree_util.tree_unflatten(td, out), PartitionState(new_states)

    return GradientTransformation(init, update)


multi_transform = partition


class FlattenState(NamedTuple):
    inner_state: Any


def flatten(inner: GradientTransformation) -> GradientTransformation:
    """Run ``inner`` on all leaves raveled into one vector (``jax.flatten_util.ravel_pytree``).

    Args:
      inner: the transformation run on the single raveled vector (its state is built for that
        vector).
    """

    def init(params):
        flat, _ = ravel_pytree(params)
        return FlattenState(inner.init(flat))

    @mark_extra
    def update(updates, state, params=None, **extra):
        flat_u, unravel = ravel_pytree(updates)
        flat_p = ravel_pytree(params)[0] if params is not None else None
        u, s = call_update(inner, flat_u, state.inner_state, flat_p, extra)
        return unravel(u), FlattenState(s)

    return GradientTransformation(init, update)


# --- hyperparameters ---


class InjectHyperparamsState(NamedTuple):
    """``count``, the ``hyperparams`` used at the last step (traced scalars), the inner state.

    Args:
      count: int32 scalar, steps taken (the argument of scheduled hyperparameters).
      hyperparams: dict from hyperparameter name to the traced scalar used at the last step.
      inner_state: the state of the transformation built with those hyperparameters.
    """

    count: jax.Array  # type: ignore[assignment]
    hyperparams: dict
    inner_state: Any


def inject_hyperparams(inner_factory: Callable[..., GradientTransformation],
                       static_args: str | tuple[str, ...] = (),
                       hyperparam_dtype: jax.typing.DTypeLike | None = None) -> Callable[...,
                       GradientTransformation]:
    """Turn the numeric arguments of ``inner_factory`` into traced state.

    ``inject_hyperparams(adam)(learning_rate=1e-3)`` builds the optimizer with its numeric
    hyperparameters stored in ``state.hyperparams``; callables are schedules evaluated
    at the step count. Changing a value in the state (:func:`set_hyperparams`) does not
    recompile.

    Args:
      inner_factory: an optimizer factory (``adam``, ``sgd``...) whose arguments become
        hyperparameters.
      static_args: names of numeric arguments to keep static (baked into the transformation, not
        stored in the state).
      hyperparam_dtype: dtype of the stored hyperparameters; None uses float32 for floats and the
        value's own dtype otherwise.

    Returns:
      a factory with ``inner_factory``'s signature that builds the wrapped transformation.
    """
    if isinstance(static_args, str):
        static_args = (static_args,)
    sig = inspect.signature(inner_factory)

    def wrapped(*args, **kwargs) -> GradientTransformation:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        other, numeric, scheds = {}, {}, {}
        for k, v in bound.arguments.items():
            if sig.parameters[k].kind == inspect.Parameter.VAR_KEYWORD:
                other.update(v)
                continue
            if k in static_args:
                other[k] = v
            elif callable(v) and not isinstance(v, GradientTransformation):
                scheds[k] = v
            elif isinstance(v, (int, float, np.ndarray, jax.Array, np.number)) and not isinstance(
                    v, bool):
                numeric[k] = v
            else:
                other[k] = v

        def _dtype(v):
            if hyperparam_dtype is not None:
                return hyperparam_dtype
            return jnp.float32 if isinstance(v, float) or jnp.issubdtype(
                np.asarray(v).dtype, np.floating) else np.asarray(v).dtype

        def values_at(count, stored):
            hp = dict(stored)
            for k, fn in scheds.items():
                hp[k] = eval_schedule(k, fn, count)
            return hp

        def init(params):
            hp = {k: jnp.asarray(v, _dtype(v)) for k, v in numeric.items()}
            hp = values_at(jnp.zeros([], jnp.int32), hp)
            inner = inner_factory(**other, **hp)
            return InjectHyperparamsState(jnp.zeros([], jnp.int32), hp, inner.init(params))

        @mark_extra
        def update(updates, state, params=None, **extra):
            hp = values_at(state.count, state.hyperparams)
            inner = inner_factory(**other, **hp)
            u, s = call_update(inner, updates, state.inner_state, params, extra)
            return u, InjectHyperparamsState(safe_increment(state.count), hp, s)

        return GradientTransformation(init, update)

    return wrapped


_HP_FIELDS = {ScaleByLearningRateState: ("learning_rate",),
              AddDecayedWeightsState: ("weight_decay",)}


def _walk(node, path, visit):
    """Rebuild ``node`` bottom-up calling ``visit(path, node)`` on every state node."""
    node = visit(path, node)
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return type(node)(*[_walk(getattr(node, f), f"{path}/{f}" if path else f, visit)
                            for f in node._fields])
    if isinstance(node, (tuple, list)):
        return type(node)(_walk(x, f"{path}/{i}" if path else str(i), visit)
                          for i, x in enumerate(node))
    if isinstance(node, dict):
        return {k: _walk(v, f"{path}/{k}" if path else str(k), visit) for k, v in node.items()}
    return node


def _collect(state) -> list[tuple[str, str, Any]]:
    found: list[tuple[str, str, Any]] = []

    def visit(path, node):
        if isinstance(node, InjectHyperparamsState):
            for k, v in node.hyperparams.items():
                found.append((path, k, v))
        for cls, fields in _HP_FIELDS.items():
            if isinstance(node, cls):
                for f in fields:
                    found.append((path, f, getattr(node, f)))
        return node

    _walk(state, "", visit)
    return found


def get_hyperparams(state: Any) -> dict[str, jax.Array]:
    """The current hyperparameters stored anywhere in an optimizer state.

    Returns ``{"learning_rate": ..., "weight_decay": ...}``; a name that occurs more
    than once (e.g. two partition groups) is reported as ``"<state path>/<name>"``.

    Args:
      state: an optimizer state (or any pytree of states) built with :func:`inject_hyperparams`
        somewhere inside.

    >>> import jax.numpy as jnp
    >>> from cairn import optim
    >>> tx = optim.adamw(1e-3)
    >>> float(get_hyperparams(tx.init({"w": jnp.ones(2)}))["learning_rate"])
    0.0010000000474974513
    """
    found = _collect(state)
    counts: dict[str, int] = {}
    for _, k, _ in found:
        counts[k] = counts.get(k, 0) + 1
    out = {}
    for path, k, v in found:
        out[k if counts[k] == 1 else (f"{path}/{k}" if path else k)] = v
    return out


def set_hyperparams(state: Any, values: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
    """Return ``state`` with hyperparameters replaced (same dtype and shape: no recompile).

    Keys are names (``learning_rate``: every occurrence) or the path-qualified keys of
    :func:`get_hyperparams`. Unknown keys raise ``KeyError`` listing the known ones.
    A hyperparameter given as a schedule is recomputed from the schedule at the next step.

    Args:
      state: an optimizer state holding injected hyperparameters.
      values: mapping from name (or path-qualified key) to the new value.
      kwargs: more name-value pairs, merged over ``values``.

    Raises:
      KeyError: an unknown name.
      ValueError: a value is NaN.
    """
    values = dict(values or {})
    values.update(kwargs)
    known = get_hyperparams(state)
    names = {k for _, k, _ in _collect(state)}
    for k in values:
        if k not in known and k not in names:
            raise KeyError(f"no hyperparameter {k!r} in this state; known: {sorted(known)}")
    for k, v in values.items():
        if isinstance(v, (int, float)) and (v != v):
            raise ValueError(f"hyperparameter {k!r} set to NaN")

    def new_value(path, name, old):
        q = f"{path}/{name}" if path else name
        if q in values:
            v = values[q]
        elif name in values:
            v = values[name]
        else:
            return old
        return jnp.asarray(v, dtype=jnp.asarray(old).dtype).reshape(jnp.shape(old))

    def visit(path, node):
        if isinstance(node, InjectHyperparamsState):
            hp = {k: new_value(path, k, v) for k, v in node.hyperparams.items()}
            return node._replace(hyperparams=hp)
        for cls, fields in _HP_FIELDS.items():
            if isinstance(node, cls):
                fresh = {f: new_value(path, f, getattr(node, f)) for f in fields}
                return cast(Any, node)._replace(**fresh)
        return node

    return _walk(state, "", visit)
