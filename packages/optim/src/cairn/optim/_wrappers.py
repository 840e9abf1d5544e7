"""Wrappers: skipping non-finite steps, gradient accumulation, lookahead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp

from cairn.optim import _packing as pk
from cairn.optim import _validate
from cairn.optim._base import (
    GradientTransformation,
    PackedUpdate,
    call_update,
    is_packed_aware,
    mark_extra,
    packed_transformation,
)
from cairn.optim._packed_state import safe_increment, state_zeros
from cairn.optim._packing import Packed

__all__ = [
    "apply_if_finite", "ApplyIfFiniteState", "skip_not_finite", "apply_every", "ApplyEvery",
    "MultiSteps", "MultiStepsState", "lookahead", "LookaheadParams", "LookaheadState",
]


def _all_finite(tree) -> jax.Array:
    leaves = [x for x in jax.tree_util.tree_leaves(tree)]
    if not leaves:
        return jnp.array(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


class ApplyIfFiniteState(NamedTuple):
    """The state of :func:`apply_if_finite`: counters of non-finite steps and the inner state.

    Args:
      notfinite_count: int32 scalar, consecutive steps with a non-finite update (reset to 0 by a
        finite one).
      last_finite: bool scalar, whether the last update was finite (and so applied).
      total_notfinite: int32 scalar, all non-finite steps seen so far.
      inner_state: the wrapped transformation's state (left unchanged on a skipped step).
    """
    notfinite_count: jax.Array
    last_finite: jax.Array
    total_notfinite: jax.Array
    inner_state: Any


def apply_if_finite(inner: GradientTransformation,
                    max_consecutive_errors: int) -> GradientTransformation:
    """Skip steps whose updates contain NaN/Inf (zero updates, inner state kept) unless more
    than ``max_consecutive_errors`` happened in a row.

    Args:
      inner: the transformation to guard.
      max_consecutive_errors: after more than this many non-finite steps in a row, the update is
        applied anyway (so NaNs surface instead of stalling silently).
    """

    _validate.check("apply_if_finite", max_consecutive_errors=max_consecutive_errors)
    def init(params):
        return ApplyIfFiniteState(jnp.zeros([], jnp.int32), jnp.array(True, jnp.bool_),
                                  jnp.zeros([], jnp.int32), inner.init(params))

    @mark_extra
    def update(updates, state, params=None, **extra):
        isfinite = _all_finite(updates)
        nf = jnp.where(isfinite, jnp.zeros([], jnp.int32), state.notfinite_count + 1)

        def do(_):
            return call_update(inner, updates, state.inner_state, params, extra)

        def reject(_):
            return jax.tree.map(jnp.zeros_like, updates), state.inner_state

        new_u, new_s = jax.lax.cond(isfinite | (nf > max_consecutive_errors), do, reject, None)
        return new_u, ApplyIfFiniteState(
            nf, isfinite, jnp.where(isfinite, state.total_notfinite, state.total_notfinite + 1),
            new_s)

    return GradientTransformation(init, update)


def skip_not_finite(updates: Any, gradient_step: jax.Array, params: Any) -> tuple[jax.Array,
                    dict[str, jax.Array]]:
    """``should_skip_update_fn`` for :class:`MultiSteps`: skip when updates are not finite.

    Args:
      updates: the mini-step's gradients.
      gradient_step: the inner step count (unused).
      params: the current params (unused).

    Returns:
      ``(skip, info)``: ``skip`` a bool scalar, ``info`` a dict with ``should_skip`` and
        ``num_not_finite``.
    """
    del gradient_step, params
    finite = _all_finite(updates)
    num_not_finite = sum(jnp.sum(~jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(updates))
    return ~finite, dict(should_skip=~finite, num_not_finite=jnp.asarray(num_not_finite))


class ApplyEvery(NamedTuple):
    count: jax.Array  # type: ignore[assignment]
    grad_acc: Packed


def apply_every(k: int = 1) -> GradientTransformation:
    """Accumulate updates and emit their sum every ``k`` steps (zeros in between).

    Args:
      k: emit the accumulated sum every ``k`` steps (``k >= 1``; 1 passes updates through).
    """

    _validate.check("apply_every", k=k)
    def init(layout, params):
        return ApplyEvery(jnp.zeros([], jnp.int32),
                          state_zeros(params, layout, offsets=True))

    def update(u, state, p=None, **extra):
        c = state.count % k
        acc = c != 0
        olds = pk.state_buffers(state.grad_acc, u.layout, what="apply_every: state grad_acc")
        ga = [(acc * a + g).astype(a.dtype) for g, a in zip(u.buffers, olds)]
        emit = c == (k - 1)
        out = [(emit * a).astype(g.dtype) for g, a in zip(u.buffers, ga)]
        return Packed(u.layout, out), ApplyEvery(safe_increment(state.count) % k,
                                                 pk.state_like(state.grad_acc, u.layout, ga))

    return packed_transformation(init, update, name="apply_every")


class MultiStepsState(NamedTuple):
    """``mini_step`` within the current accumulation, ``gradient_step`` (inner steps taken),
    the inner state, the accumulator ``acc_grads`` (per parameter, or packed under
    :func:`~cairn.optim.pack`) and the skip state.

    Args:
      mini_step: int32 scalar, mini-steps accumulated since the last inner update.
      gradient_step: int32 scalar, inner updates taken.
      inner_opt_state: the inner optimizer's state.
      acc_grads: the gradient accumulator, one buffer per parameter (packed under
        :func:`~cairn.optim.pack`).
      skip_state: the state returned by ``should_skip_update_fn`` (``()`` without one).
    """

    mini_step: jax.Array
    gradient_step: jax.Array
    inner_opt_state: Any
    acc_grads: Any
    skip_state: Any = ()


class MultiSteps:
    """Gradient accumulation: run ``opt`` once every ``k`` mini-steps on the mean (or sum) of
    the gradients, emitting zero updates in between.

    One accumulator per parameter (its shape and sharding; one buffer per dtype group
    under :func:`~cairn.optim.pack`) is the only extra memory; the
    inner update runs under ``lax.cond`` only on the k-th mini-step. ``accumulator_dtype``
    defaults to float32, as in Optax (``None`` keeps each group's own dtype, e.g. a bf16
    accumulator for bf16 params); the accumulated mean is cast back to the gradients'
    dtype before the inner update.

    Args:
      opt: the inner transformation run on the accumulated gradient every ``k`` mini-steps.
      every_k_schedule: ``k`` as an int >= 1, or a callable from the inner step count (int32 scalar)
        to ``k``.
      use_grad_mean: average the ``k`` gradients if True (default), sum them if False.
      should_skip_update_fn: optional ``fn(updates, gradient_step, params) -> (skip, skip_state)``;
        a mini-step with ``skip`` True is not accumulated (e.g. :func:`skip_not_finite`).
      accumulator_dtype: dtype of the accumulator (default float32); None keeps each gradient
        group's own dtype.
    """

    def __init__(self, opt: GradientTransformation, every_k_schedule: int | Callable,
                 use_grad_mean: bool = True, should_skip_update_fn: Callable | None = None,
                 accumulator_dtype: jax.typing.DTypeLike | None = jnp.float32) -> None:
        _validate.check("MultiSteps", every_k_schedule=every_k_schedule)
        if not callable(every_k_schedule):
            k = int(every_k_schedule)  # _validate.check made sure it is a whole number >= 1
            self._k = lambda step: k
        else:
            self._k = every_k_schedule
        self._opt = opt
        self._mean = use_grad_mean
        self._skip = should_skip_update_fn
        self._acc_dtype = accumulator_dtype

    @property
    def inner_opt(self) -> GradientTransformation:
        return self._opt

    def __repr__(self) -> str:
        from cairn.optim import _repr

        return _repr.text_repr(self)

    def _repr_html_(self) -> str:
        from cairn.optim import _repr

        return _repr.html_repr(self)

    def init(self, params: Any) -> MultiStepsState:
        """The initial state: zero counters, the inner optimizer's state and a zero accumulator per
        parameter.

        Args:
          params: the parameter pytree (or a :class:`Packed` one).

        Returns:
          a :class:`MultiStepsState`.
        """
        packed = isinstance(params, Packed) or pk.packing_state()
        layout = pk.layout_of(params, per_leaf=not packed)
        acc = state_zeros(params, layout, self._acc_dtype, offsets=not isinstance(params, Packed))
        skip_state = ()
        if self._skip is not None:
            skip_state = jax.tree.map(jnp.zeros_like,
                                      self._skip(jax.tree.map(jnp.zeros_like, params),
                                                 jnp.zeros([], jnp.int32), params)[1])
        return MultiStepsState(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32),
                               self._opt.init(params), acc,
                               skip_state)

    def update(self, updates: Any, state: MultiStepsState, params: Any = None,
               **extra: Any) -> tuple[Any, MultiStepsState]:
        """Accumulate one mini-step's gradients; on the ``k``-th run the inner optimizer on their
        mean (or sum).

        Args:
          updates: the gradient pytree of this mini-step (or a :class:`Packed` one).
          state: the :class:`MultiStepsState` from :meth:`init` or the previous call.
          params: the current parameters, passed to the inner optimizer and to
            ``should_skip_update_fn``.
          extra: extra keyword arguments passed on to the inner ``update``.

        Returns:
          ``(updates, state)``: the inner optimizer's updates on the ``k``-th mini-step, zeros (same
            structure) otherwise.
        """
        was_packed = isinstance(updates, Packed)
        layout = (state.acc_grads.layout if isinstance(state.acc_grads, Packed) else
                  pk.layout_of(updates, use_sharding=False, per_leaf=True))
        g = pk.pack(updates, layout)
        acc0 = pk.state_buffers(state.acc_grads, layout, what="MultiSteps: state acc_grads")
        k = jnp.asarray(self._k(state.gradient_step), jnp.int32)
        skip = jnp.array(False)
        skip_state = state.skip_state
        if self._skip is not None:
            skip, skip_state = self._skip(updates, state.gradient_step, params)
        n = state.mini_step
        if self._mean:
            acc = [(a + (x.astype(a.dtype) - a) / (n + 1).astype(a.dtype)).astype(a.dtype)
                   for a, x in zip(acc0, g.buffers)]
        else:
            acc = [(a + x.astype(a.dtype)).astype(a.dtype) for a, x in zip(acc0, g.buffers)]
        final = (n + 1 >= k) & ~skip

        def emit(_):
            inner_in = Packed(layout, [a.astype(x.dtype) for a, x in zip(acc, g.buffers)])
            if is_packed_aware(self._opt):
                upd = cast(PackedUpdate, self._opt.update)
                pp = _maybe_pack(params, layout) if upd.needs_params else None
                u, s = upd.packed(inner_in, state.inner_opt_state, pp, **extra)
                u = pk.pack(u, layout) if not isinstance(u, Packed) else u
            else:
                u, s = call_update(self._opt, pk.unpack(inner_in), state.inner_opt_state,
                                   params, extra)
                u = pk.pack(u, layout, cast=True)
            zero_acc = [jnp.zeros_like(a) for a in acc]
            return (list(u.buffers), s, zero_acc, jnp.zeros([], jnp.int32),
                    safe_increment(state.gradient_step))

        def hold(_):
            zeros = [jnp.zeros_like(x) for x in g.buffers]
            new_n = jnp.where(skip, n, n + 1).astype(jnp.int32)
            kept = [jnp.where(skip, a0, a) for a0, a in zip(acc0, acc)]
            return zeros, state.inner_opt_state, kept, new_n, state.gradient_step

        out_bufs, inner_s, acc_bufs, mini, gstep = jax.lax.cond(final, emit, hold, None)
        out = Packed(layout, out_bufs)
        new_state = MultiStepsState(mini, gstep, inner_s,
                                    pk.state_like(state.acc_grads, layout, acc_bufs), skip_state)
        if was_packed:
            return out, new_state
        return pk.unpack(out, pk.find_offsets(state.acc_grads, layout)), new_state

    def has_updated(self, state: MultiStepsState) -> jax.Array:
        """Whether the last call emitted a real update.

        Args:
          state: a :class:`MultiStepsState` returned by :meth:`update`.

        Returns:
          bool scalar, True when the last call ran the inner optimizer (not a zero update).
        """
        return jnp.logical_and(state.mini_step == 0, state.gradient_step > 0)

    def gradient_transformation(self) -> GradientTransformation:
        return GradientTransformation(self.init, mark_extra(lambda u, s, p=None, **e:
                                                            self.update(u, s, p, **e)))


def _maybe_pack(params, layout):
    if params is None:
        return None
    return pk.pack(params, layout, what="params")


class LookaheadParams(NamedTuple):
    """The parameters :func:`lookahead` works on: the fast weights trained every step and the slow
    weights synced every ``sync_period`` steps.

    Args:
      fast: the fast parameter pytree (what the inner optimizer updates and the loss is evaluated
        at).
      slow: the slow parameter pytree, same structure as ``fast`` (the weights to evaluate or
        export).
    """
    fast: Any
    slow: Any

    @classmethod
    def init_synced(cls, params: Any) -> LookaheadParams:
        """Start lookahead with the fast and the slow weights equal.

        Args:
          params: the initial parameter pytree, used for both ``fast`` and ``slow``.

        Returns:
          ``LookaheadParams(fast=params, slow=params)``.
        """
        return cls(fast=params, slow=params)


class LookaheadState(NamedTuple):
    """The state of :func:`lookahead`.

    Args:
      fast_state: the inner (fast) optimizer's state.
      steps_since_sync: int32 scalar, fast steps since the slow weights were last synced.
    """
    fast_state: Any
    steps_since_sync: jax.Array


def lookahead(fast_optimizer: GradientTransformation, sync_period: int, slow_step_size: float,
              reset_state: bool = False) -> GradientTransformation:
    """Lookahead (Zhang et al. 2019) on :class:`LookaheadParams`: every ``sync_period`` steps
    the slow weights move :math:`\\phi \\leftarrow \\phi + \\alpha(\\theta - \\phi)` and the
    fast weights are reset to them.

    Args:
      fast_optimizer: the inner optimizer, run on the fast weights every step.
      sync_period: :math:`k \\ge 1`, fast steps between syncs of the slow weights.
      slow_step_size: :math:`\\alpha`, how far the slow weights move towards the fast ones at a
        sync.
      reset_state: re-initialise the fast optimizer's state at each sync.

    Raises:
      ValueError: ``sync_period < 1``.
    """
    _validate.check("lookahead", sync_period=sync_period, slow_step_size=slow_step_size)
    if sync_period < 1:
        raise ValueError(f"sync_period must be >= 1, got {sync_period}")

    def init(params):
        fast = getattr(params, "fast", params)
        return LookaheadState(fast_optimizer.init(fast), jnp.zeros([], jnp.int32))

    @mark_extra
    def update(updates, state, params=None, **extra):
        if not isinstance(params, LookaheadParams):
            raise TypeError("lookahead.update needs params=LookaheadParams(fast=..., slow=...)")
        u, fast_state = call_update(fast_optimizer, updates, state.fast_state, params.fast, extra)
        sync = (state.steps_since_sync == sync_period - 1)
        diff = jax.tree.map(lambda f, x, s: f + x - s, params.fast, u, params.slow)
        slow_u = jax.tree.map(lambda d: slow_step_size * sync * d, diff)
        fast_u = jax.tree.map(lambda x, d: x - sync * (1 - slow_step_size) * d, u, diff)
        if reset_state:
            fresh = fast_optimizer.init(params.fast)
            fast_state = jax.tree.map(lambda c, i: jnp.where(sync, i, c), fast_state, fresh)
        return LookaheadParams(fast_u, slow_u), LookaheadState(
            fast_state, (state.steps_since_sync + 1) % sync_period)

    return GradientTransformation(init, update)
