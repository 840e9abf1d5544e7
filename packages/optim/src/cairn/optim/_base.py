"""Core protocol: GradientTransformation, chain, apply_updates and friends.

A transformation is a pair of pure functions ``init(params) -> state`` and
``update(updates, state, params=None, **extra_args) -> (updates, state)``, held
in a NamedTuple exactly as in Optax, so Optax transformations and ours compose.

Element-wise transformations of this package are *packed-aware*: their
``update`` callable carries a ``packed`` entry point that works on
:class:`~cairn.optim._packing.Packed` buffers. By default (per-parameter state) the
buffers are the leaves themselves, in their own shapes and shardings, so "packing" is
free; under :func:`~cairn.optim.pack` they are flat buffers per dtype, and :func:`chain`
packs the incoming pytree once, runs consecutive packed-aware members on the flat
buffers, and unpacks once at the end (or before a member that works per leaf).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from cairn.optim import _packing as pk
from cairn.optim._packing import Packed
from cairn.optim._placement import constrain_like_params, params_record, place_scalars
from cairn.optim._tree import structure_difference
from cairn.optim._types import ScalarOrSchedule

__all__ = [
    "GradientTransformation",
    "GradientTransformationExtraArgs",
    "EmptyState",
    "identity",
    "set_to_zero",
    "stateless",
    "stateless_with_tree_map",
    "apply_updates",
    "incremental_update",
    "periodic_update",
    "global_norm",
    "chain",
    "named_chain",
    "StateMismatchError",
    "ScalarOrSchedule",
    "with_extra_args_support",
    "init_empty_state",
]



class GradientTransformation(NamedTuple):
    """A pair of pure functions ``(init, update)`` (same shape as Optax's).

    Args:
      init: ``init(params) -> state``, builds the optimizer state for a parameter pytree.
      update: ``update(updates, state, params=None) -> (updates, state)``, turns gradients into
        updates and the next state.
    """

    init: Callable
    update: Callable

    def __repr__(self) -> str:
        """The factory calls that built it, arguments at their defaults left out, no addresses."""
        from cairn.optim import _repr  # the repr reads the public namespace: imported when shown

        return _repr.text_repr(self)

    def _repr_html_(self) -> str:
        from cairn.optim import _repr

        return _repr.html_repr(self)


class GradientTransformationExtraArgs(GradientTransformation):
    """A :class:`GradientTransformation` whose ``update`` takes extra keyword arguments
    (``update(updates, state, params=None, **extra_args)``): :func:`chain` passes them on.

    Args:
      init: ``init(params) -> state``, as for :class:`GradientTransformation`.
      update: ``update(updates, state, params=None, **extra_args) -> (updates, state)``; extra
        keyword arguments (``value``, ``grad``, ``value_fn``...) are passed on by :func:`chain`.
    """

    __slots__ = ()


class EmptyState(NamedTuple):
    """State of a stateless transformation."""


def init_empty_state(params: Any) -> EmptyState:
    """An ``init`` for stateless transformations: ignores ``params`` and returns
    :class:`EmptyState`.

    Args:
      params: the parameter pytree (unused).
    """
    del params
    return EmptyState()


# --- packed machinery ---


class PackedUpdate:
    """The ``update`` of a packed-aware transformation.

    ``fn(updates: Packed, state, params: Packed | None, **extra) -> (Packed, state)``.
    Calling it with ordinary pytrees packs, runs ``fn`` and unpacks.
    """

    __slots__ = ("fn", "needs_params", "__name__", "init_fn", "state_type", "__weakref__")

    def __init__(self, fn: Callable, needs_params: bool = False, name: str = "update",
                 init_fn: Callable | None = None) -> None:
        self.fn = fn
        self.needs_params = needs_params
        self.__name__ = name
        self.init_fn = init_fn  # for error messages: the state type init() makes
        self.state_type: type | None = None  # the type of the state init() made, once it has run

    def check_state(self, state: Any) -> None:
        """Raise :class:`StateMismatchError` when ``state`` is not of the type ``init`` made."""
        st = self.state_type
        if st is not None and type(state) is not st:
            raise StateMismatchError("", self.__name__, st.__name__,
                                     type(state).__name__)


    def packed(self, updates: Packed, state: Any, params: Packed | None = None,
               **extra: Any) -> tuple[Packed, Any]:
        return self.fn(updates, state, params, **extra)

    def __call__(self, updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any,
                 Any]:
        if isinstance(updates, Packed):
            pp = None
            if params is not None and self.needs_params:
                pp = pk.pack(params, updates.layout, what="params")
            return self.fn(updates, state, pp, **extra)
        layout = pk.find_layout(state) or pk.layout_of(updates, use_sharding=False, per_leaf=True)
        u = pk.pack(updates, layout)
        pp = None
        if params is not None and self.needs_params:
            pp = pk.pack(params, layout, what="params")
        elif self.needs_params and params is None:
            raise ValueError("this transformation needs `params` in update(updates, state, params)")
        self.check_state(state)
        with state_errors(GradientTransformation(cast(Callable, self.init_fn), self), state, updates):
            out, new_state = self.fn(u, state, pp, **extra)
        return pk.unpack(out, pk.find_offsets(new_state, layout)), new_state


def packed_transformation(init_fn: Callable, update_fn: Callable, *, needs_params: bool = False,
                          name: str = "update") -> GradientTransformation:
    """Build a packed-aware transformation.

    ``init_fn(layout, params) -> state``; ``update_fn(u: Packed, state, p: Packed|None, **extra)``.
    """

    def init(params):
        # default: per-parameter state (one array per parameter, its shape and sharding);
        # packed params, or init under optim.pack(tx), give flat buffers per dtype
        packed = isinstance(params, Packed) or pk.packing_state()
        state = init_fn(pk.layout_of(params, per_leaf=not packed), params)
        if isinstance(params, Packed):
            # packed-params mode never unpacks: the per-leaf runtime offsets are not needed
            state = pk.strip_offsets(state)
        upd.state_type = type(state)
        return place_scalars(state, params)

    upd = PackedUpdate(update_fn, needs_params, name, init)
    return GradientTransformation(init, upd)


def is_packed_aware(tx: Any) -> bool:
    return isinstance(getattr(tx, "update", None), PackedUpdate)


def _accepts_extra(tx) -> bool:
    upd = tx.update
    if isinstance(upd, PackedUpdate) or getattr(upd, "_cairn_extra", False):
        return True
    return type(tx).__name__ == "GradientTransformationExtraArgs"  # ours or Optax's


def call_update(tx: Any, updates: Any, state: Any, params: Any,
                extra: dict[str, Any]) -> tuple[Any, Any]:
    """Call ``tx.update`` passing extra args only when it accepts them."""
    if extra and _accepts_extra(tx):
        return tx.update(updates, state, params, **extra)
    return tx.update(updates, state, params)


def with_extra_args_support(tx: GradientTransformation) -> GradientTransformation:
    """``tx`` whose ``update`` accepts (and ignores) extra keyword arguments, as a
    :class:`GradientTransformationExtraArgs`; ``tx`` itself when it already accepts them.

    Args:
      tx: a :class:`GradientTransformation`.

    >>> import jax.numpy as jnp
    >>> tx = with_extra_args_support(stateless(lambda u, p: u))
    >>> float(tx.update(jnp.ones(()), tx.init(None), value=3.0)[0])
    1.0
    """
    if isinstance(tx, GradientTransformationExtraArgs):
        return tx
    if _accepts_extra(tx):
        return GradientTransformationExtraArgs(tx.init, tx.update)

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        del extra
        return tx.update(updates, state, params)

    return GradientTransformationExtraArgs(tx.init, update)


def mark_extra(fn: Callable) -> Callable:
    fn._cairn_extra = True  # type: ignore[attr-defined]
    return fn


# --- scalars and schedules ---


def check_scalar(name: str, value: Any, *, minimum: float | None = 0.0,
                 allow_none: bool = False) -> Any:
    """Validate a float hyperparameter (or leave a schedule alone)."""
    if value is None:
        if allow_none:
            return value
        raise ValueError(f"{name} must be a number or a schedule, got None")
    if callable(value):
        return value
    if isinstance(value, jax.core.Tracer):
        return value
    try:
        v = float(np.asarray(value))
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number or a schedule (step -> value), "
                        f"got {type(value).__name__}") from None
    if math.isnan(v):
        raise ValueError(f"{name} is NaN; expected a finite number")
    if minimum is not None and v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return value


def eval_schedule(name: str, value: Any, count: jax.Array) -> jax.Array:
    """Evaluate a float-or-schedule at ``count`` as a float32 scalar; NaN is an error when concrete."""
    if callable(value):
        out = jnp.asarray(value(count), dtype=jnp.float32)
        if not isinstance(out, jax.core.Tracer):
            v = float(out)
            if math.isnan(v):
                raise ValueError(f"the {name} schedule returned NaN at step {int(count)}")
        return out
    return jnp.asarray(value, dtype=jnp.float32)


# --- simple transforms ---


def identity() -> GradientTransformation:
    """Leave updates unchanged: :math:`u \\leftarrow u`."""

    def update(u, state, p=None, **extra):
        return u, state

    return packed_transformation(lambda layout, params: EmptyState(), update, name="identity")


class _ZeroUpdate(PackedUpdate):
    """Update of :func:`set_to_zero`; partition/freeze recognise it and skip all work."""

    __slots__ = ()
    _cairn_zero = True

    def __call__(self, updates, state, params=None, **extra):
        if isinstance(updates, Packed):
            return updates.map(jnp.zeros_like), state
        return jax.tree.map(jnp.zeros_like, updates), state


def set_to_zero() -> GradientTransformation:
    """Replace updates by zeros (frozen parameters): :math:`u \\leftarrow 0`."""

    def update(u, state, p=None, **extra):
        return u.map(jnp.zeros_like), state

    return GradientTransformation(init_empty_state, _ZeroUpdate(update, False, "set_to_zero"))


def stateless(f: Callable[[Any, Any], Any]) -> GradientTransformation:
    """Wrap ``f(updates, params) -> updates`` as a stateless transformation.

    Args:
      f: ``f(updates, params) -> updates`` on whole pytrees (``params`` may be None).
    """

    @mark_extra
    def update(updates, state, params=None, **extra):
        return f(updates, params), state

    return GradientTransformation(init_empty_state, update)


def stateless_with_tree_map(f: Callable[[Any, Any], Any]) -> GradientTransformation:
    """Wrap a per-leaf ``f(update, param) -> update`` as a stateless transformation.

    Args:
      f: ``f(update, param) -> update`` on one leaf (``param`` is None when no params are passed).
    """

    @mark_extra
    def update(updates, state, params=None, **extra):
        if params is None:
            return jax.tree.map(lambda u: f(u, None), updates), state
        return jax.tree.map(f, updates, params), state

    return GradientTransformation(init_empty_state, update)


def need_params(params: Any, name: str) -> None:
    """Raise the error every params-reading transformation gives when ``params`` is None."""
    if params is None:
        raise ValueError(f"{name} needs `params` in update(updates, state, params)")


def per_leaf(name: str, f: Callable, *, needs_params: bool) -> GradientTransformation:
    """A stateless transformation mapping ``f(u, p)`` (``f(u)`` without params) over the leaves."""

    @mark_extra
    def update(updates, state, params=None, **extra):
        if not needs_params:
            return jax.tree.map(f, updates), state
        need_params(params, name)
        return jax.tree.map(f, updates, params), state

    return GradientTransformation(init_empty_state, update)


# --- tree helpers ---


def _check_same_structure(a, b, what_a: str, what_b: str):
    ta, tb = jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b)
    if ta != tb:  # type: ignore[operator]
        raise ValueError(f"{what_b} tree does not match {what_a}: "
                         + structure_difference(a, b, what_a, what_b))


def apply_updates(params: Any, updates: Any) -> Any:
    """Return ``params + updates`` leaf-wise, keeping each param's dtype.

    :math:`\\theta \\leftarrow \\theta + u`. Works on pytrees and on
    :class:`Packed` buffers (one add per buffer).

    Args:
      params: the parameter pytree (or a :class:`Packed` one).
      updates: a pytree with the structure of ``params`` (``None`` leaves where ``params`` has
        them), or :class:`Packed`.

    >>> import jax.numpy as jnp
    >>> apply_updates({"w": jnp.ones(2)}, {"w": jnp.full(2, -0.5)})["w"].tolist()
    [0.5, 0.5]

    Returns:
      the updated parameters, each leaf in its original dtype.
    """
    if isinstance(params, Packed) or isinstance(updates, Packed):
        if not isinstance(params, Packed):
            updates = pk.unpack(updates)
        else:
            updates = pk.pack(updates, params.layout, what="updates", cast=True)
            return Packed(params.layout, [(p + u).astype(p.dtype) for p, u in
                                          zip(params.buffers, updates.buffers)], params.offsets)
    _check_same_structure(params, updates, "params", "updates")
    return jax.tree.map(_add_leaf, params, updates, is_leaf=lambda x: x is None)


def _add_leaf(p, u):
    if p is None:
        return None
    if (isinstance(p, jax.Array) and isinstance(u, jax.Array) and p.dtype == u.dtype
            and p.shape == u.shape):
        return jax.lax.add(p, u)  # what the line below computes, without jnp dispatch
    return jnp.asarray(p + u).astype(jnp.asarray(p).dtype)


def incremental_update(new_tensors: Any, old_tensors: Any, step_size: jax.typing.ArrayLike) -> Any:
    """Polyak averaging: :math:`\\text{old} \\leftarrow s\\,\\text{new} + (1-s)\\,\\text{old}`.

    Args:
      new_tensors: the new values (e.g. the online network's params).
      old_tensors: the running average, same structure as ``new_tensors``.
      step_size: :math:`s \\in [0, 1]`, the weight of the new values.

    Returns:
      the updated average, structured as ``old_tensors``.
    """
    _check_same_structure(old_tensors, new_tensors, "old_tensors", "new_tensors")
    return jax.tree.map(lambda n, o: step_size * n + (1.0 - step_size) * o,
                        new_tensors, old_tensors)


def periodic_update(new_tensors: Any, old_tensors: Any, steps: jax.typing.ArrayLike,
                    update_period: int) -> Any:
    """Return ``new_tensors`` when ``steps % update_period == 0`` else ``old_tensors``.

    Args:
      new_tensors: the values to take on an update step.
      old_tensors: the current values, same structure as ``new_tensors``.
      steps: the current int step.
      update_period: update when ``steps`` is a multiple of this.
    """
    _check_same_structure(old_tensors, new_tensors, "old_tensors", "new_tensors")
    return jax.lax.cond(jnp.mod(steps, update_period) == 0,
                        lambda _: new_tensors, lambda _: old_tensors, None)


def global_norm(updates: Any) -> jax.Array:
    """:math:`\\sqrt{\\sum_i \\|u_i\\|_2^2}` over all leaves (one reduction per packed buffer).

    Args:
      updates: a pytree of arrays (or :class:`Packed`); complex leaves count :math:`|u|^2`.

    Returns:
      a float32 scalar (0 for an empty tree).
    """
    bufs: Sequence[jax.Array]
    if isinstance(updates, Packed):
        bufs = updates.buffers
    else:
        bufs = jax.tree_util.tree_leaves(updates)
    if not bufs:
        return jnp.zeros((), jnp.float32)
    total = sum(jnp.sum(jnp.real(jnp.conj(b) * b).astype(jnp.float32)) for b in bufs)
    return jnp.sqrt(total)


# --- chain ---


class StateMismatchError(TypeError, ValueError):
    """An optimizer state that was not made by this transformation's ``init``.

    The message names the chain position (``0/1``: member 1 of the chain that is member 0
    of the outer chain), the state type that position expects and the one it was given.

    Args:
      path: the chain position as ``"0/1"`` (member 1 of the chain at member 0), or ``""`` at the
        top.
      name: the transformation that got the wrong state.
      expected: the state type that position expects.
      given: the state type it was given.
      detail: optional text appended to the message.
    """

    def __init__(self, path: str, name: str, expected: str, given: str, detail: str = "") -> None:
        self.path, self.name, self.expected, self.given = path, name, expected, given
        self.detail = detail
        where = f"at chain position {path} ({name})" if path else f"in {name}"
        super().__init__(
            f"optimizer state mismatch {where}: expected {expected}, got {given}; "
            f"pass the state made by this optimizer's init() (a state from another optimizer "
            f"does not fit){': ' + detail if detail else ''}")

    def at(self, position: int) -> StateMismatchError:
        """The same error one chain level up: ``position`` prefixed to ``path``.

        Args:
          position: the index of the failing member in the enclosing chain.
        """
        path = f"{position}/{self.path}" if self.path else str(position)
        return StateMismatchError(path, self.name, self.expected, self.given, self.detail)


def _tx_name(tx) -> str:
    upd = getattr(tx, "update", None)
    name = getattr(upd, "__name__", None) or type(tx).__name__
    return "a chain" if name in ("chain", "update_packed") else name


def _expected_state_type(tx, like) -> str:
    try:
        st = jax.eval_shape(tx.init, pk.unpack(like) if isinstance(like, Packed) else like)
    except Exception:  # noqa: BLE001 - the expected type is only a hint in the message
        return "a different state"
    return type(st).__name__


class state_errors:
    """Turn the errors of a transformation fed a foreign state into a
    :class:`StateMismatchError` naming the chain position and both state types."""

    def __init__(self, tx: Any, state: Any, like: Any, position: int | None = None) -> None:
        self.tx, self.state, self.like, self.position = tx, state, like, position

    def __enter__(self):
        return self

    def __exit__(self, typ, err, tb):
        if err is None:
            return False
        if isinstance(err, StateMismatchError):
            if self.position is not None:
                raise err.at(self.position) from None
            return False
        if not isinstance(err, (AttributeError, KeyError, IndexError)):
            return False
        expected = _expected_state_type(self.tx, self.like)
        given = type(self.state).__name__
        if expected == given and not isinstance(err, AttributeError):
            return False
        path = "" if self.position is None else str(self.position)
        raise StateMismatchError(path, _tx_name(self.tx), expected, given,
                                 f"{type(err).__name__}: {err}") from err


class _ChainParams:
    """The params as a chain's members read them: per layout as :class:`Packed` buffers
    for the packed-aware members (pytree params as :class:`~cairn.optim._packing.LazyParams`,
    packed only if a member reads their buffers: add_decayed_weights does not, its term
    stays pending until the unpack), and as a pytree for the others; each made once."""

    def __init__(self, params):
        self.params = params
        self._packed: dict[Any, Packed] = {}
        self._tree = None

    def packed(self, layout: pk.Layout) -> Packed | None:
        if self.params is None:
            return None
        if layout not in self._packed:
            self._packed[layout] = (pk.pack(self.params, layout, what="params")
                                    if isinstance(self.params, Packed)
                                    else pk.LazyParams(layout, self.params))
        return self._packed[layout]

    def tree(self):
        if isinstance(self.params, pk.LazyParams):
            return self.params.tree
        if not isinstance(self.params, Packed):  # a pytree, or None
            return self.params
        if self._tree is None:
            self._tree = pk.unpack(self.params)
        return self._tree


def _run_packed(tx, u: Packed, s, params: _ChainParams, extra):
    """One packed-aware chain member on packed updates."""
    tx.update.check_state(s)
    pp = params.packed(u.layout) if tx.update.needs_params else None
    if tx.update.needs_params and pp is None:
        raise ValueError("a transformation in this chain needs `params` in update()")
    return tx.update.packed(u, s, pp, **extra)


def run_chain(txs: tuple, updates: Any, state: Any, params: Any, extra: dict[str, Any], *,
              want_packed: bool,
              allow_pending: bool = False) -> tuple[Any, tuple]:
    """Run ``txs`` in order, staying packed across consecutive packed-aware members.

    With ``allow_pending`` (a chain nested in a chain) packed updates may come back
    with a pending weight-decay term (:class:`~cairn.optim._packing.PendingDecay`);
    otherwise packed updates are returned materialised.
    """
    if not isinstance(state, tuple) or len(state) != len(txs):
        given = (f"a {type(state).__name__} of {len(state)} entries"
                 if isinstance(state, tuple) else f"a {type(state).__name__}")
        raise StateMismatchError("", "chain", f"a tuple of {len(txs)} member states", given)
    state_layout = pk.find_layout(state)
    chain_params = _ChainParams(params)
    cur, new_states = updates, []
    last_layout = updates.layout if isinstance(updates, Packed) else None
    for i, (tx, s) in enumerate(zip(txs, state)):
        with state_errors(tx, s, updates, position=i):
            if is_packed_aware(tx):
                if not isinstance(cur, Packed):
                    cur = pk.pack(cur, state_layout or pk.find_layout(s) or pk.layout_of(
                        cur, use_sharding=False, per_leaf=True))
                last_layout = cur.layout
                cur, s = _run_packed(tx, cur, s, chain_params, extra)
            else:
                if isinstance(cur, Packed):
                    cur = pk.unpack(cur, pk.find_offsets(state, cur.layout))
                cur, s = call_update(tx, cur, s, chain_params.tree(), extra)
        new_states.append(s)
    new_state = tuple(new_states)
    if not want_packed:
        if isinstance(cur, Packed):
            cur = pk.unpack(cur, pk.find_offsets(new_state, cur.layout))
        return cur, new_state
    if not isinstance(cur, Packed):
        cur = pk.pack(cur, last_layout or pk.layout_of(cur))
    if isinstance(cur, pk.PendingDecay) and not allow_pending:
        cur = Packed(cur.layout, cur.buffers, cur.offsets)
    return cur, new_state


class _ChainUpdate(PackedUpdate):
    """The ``update`` of :func:`chain`: :func:`run_chain` over its members, then (under a
    multi-device jit) the params' layout, recorded at ``init``, on the updates."""

    __slots__ = ("txs", "params_record")

    def __init__(self, txs: tuple):
        def update_packed(u, state, p=None, **extra):
            return run_chain(txs, u, state, p, extra, want_packed=True)

        needs = any(t.update.needs_params if is_packed_aware(t) else True for t in txs)
        super().__init__(update_packed, needs, "chain")
        self.txs = txs
        self.params_record = None

    def __call__(self, updates, state, params=None, **extra):
        u, s = run_chain(self.txs, updates, state, params, extra,
                         want_packed=isinstance(updates, Packed))
        return constrain_like_params(u, s, self.params_record)

    def packed(self, updates, state, params=None, **extra):
        return run_chain(self.txs, updates, state, params, extra, want_packed=True,
                         allow_pending=True)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` one after another; the state is a tuple of their states.

    Consecutive packed-aware members share one pack and one unpack.

    Args:
      transforms: the transformations to apply, first to last.

    >>> import jax.numpy as jnp
    >>> from cairn.optim import scale
    >>> tx = chain(scale(2.0), scale(-0.5))
    >>> u, _ = tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))
    >>> u["w"].tolist()
    [-1.0, -1.0]

    Raises:
      TypeError: a member has no ``init``/``update``.
    """
    txs = tuple(transforms)
    for i, t in enumerate(txs):
        if not (hasattr(t, "init") and hasattr(t, "update")):
            raise TypeError(f"chain member {i} is not a GradientTransformation: {type(t).__name__}")
    upd = _ChainUpdate(txs)

    def init(params):
        upd.params_record = params_record(params)
        return place_scalars(tuple(t.init(params) for t in txs), params)

    return GradientTransformation(init, upd)


def named_chain(*transforms: tuple[str, GradientTransformation]) -> GradientTransformation:
    """Like :func:`chain` but the state is a dict keyed by the given names.

    Args:
      transforms: ``(name, transformation)`` pairs, applied in order; names must be unique.

    Raises:
      ValueError: two transforms share a name.
    """
    names = [n for n, _ in transforms]
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain names must be unique, got {names}")
    inner = chain(*[t for _, t in transforms])
    inner_update = cast(PackedUpdate, inner.update)

    def init(params):
        return dict(zip(names, inner.init(params)))

    def _tuple(state):
        missing = [n for n in names if n not in state]
        if missing:
            raise ValueError(f"named_chain state is missing entries {missing}")
        return tuple(state[n] for n in names)

    class _NamedUpdate(PackedUpdate):
        __slots__ = ()

        def __call__(self, updates, state, params=None, **extra):
            u, s = inner.update(updates, _tuple(state), params, **extra)
            return u, dict(zip(names, s))

        def packed(self, updates, state, params=None, **extra):
            u, s = inner_update.packed(updates, _tuple(state), params, **extra)
            return u, dict(zip(names, s))

    return GradientTransformation(init, _NamedUpdate(lambda *a, **k: None,
                                                     inner_update.needs_params, "named_chain"))
