"""Line searches as transformations (Armijo backtracking; zoom for the strong Wolfe
conditions) and :func:`value_and_grad_from_state`, which reuses what they computed.

A line search scales the incoming direction :math:`u` by a step :math:`\\eta` chosen on
:math:`\\varphi(\\eta) = f(x + \\eta u)`; its ``update`` needs ``value=f(x)``, ``grad=\\nabla
f(x)`` and ``value_fn=f`` (extra keyword arguments that ``value_fn`` accepts are passed to it).
It stores :math:`f` and :math:`\\nabla f` at the accepted point, so the next iteration need not
compute them again.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cairn.optim import _tree
from cairn.optim._base import GradientTransformation, mark_extra
from cairn.optim._tree_state import get as tree_get
from cairn.optim._types import resolve_annotations

__all__ = [
    "BacktrackingLinesearchInfo", "ScaleByBacktrackingLinesearchState",
    "scale_by_backtracking_linesearch", "ZoomLinesearchInfo", "ScaleByZoomLinesearchState",
    "scale_by_zoom_linesearch", "value_and_grad_from_state",
]


def _value_fn_kwargs(name: str, value_fn: Callable, extra: dict[str, Any]) -> dict[str, Any]:
    """The extra keyword arguments that ``value_fn`` accepts; any other one is an error."""
    params = inspect.signature(value_fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(extra)
    unknown = sorted(k for k in extra if k not in params)
    if unknown:
        raise TypeError(f"{name}.update: keyword arguments {unknown} are not parameters of "
                        f"value_fn {getattr(value_fn, '__name__', value_fn)!r}")
    return dict(extra)


def _real_dtype(params: Any) -> Any:
    return jnp.real(jnp.empty((), jax.tree.leaves(params)[0].dtype)).dtype


# --- backtracking ---


class BacktrackingLinesearchInfo(NamedTuple):
    """Diagnostics of the last :func:`scale_by_backtracking_linesearch` step.

    Args:
      num_linesearch_steps: int32 scalar, how many step sizes were tried.
      decrease_error: float scalar; above 0 when no tried step gave sufficient (Armijo) decrease.
    """
    num_linesearch_steps: jax.Array
    decrease_error: jax.Array  # > 0: no step gave sufficient decrease


class ScaleByBacktrackingLinesearchState(NamedTuple):
    """The state of :func:`scale_by_backtracking_linesearch`.

    Args:
      learning_rate: float scalar, the step size accepted at the last step.
      value: float scalar, the objective value at the current parameters.
      grad: the gradient at the current parameters (None unless ``store_grad``).
      info: a :class:`BacktrackingLinesearchInfo` about the last search.
    """
    learning_rate: jax.Array
    value: jax.Array
    grad: Any  # None unless store_grad
    info: BacktrackingLinesearchInfo


def scale_by_backtracking_linesearch(
        max_backtracking_steps: int, slope_rtol: float = 1e-4, decrease_factor: float = 0.8,
        increase_factor: float = 1.5, max_learning_rate: float = 1.0, atol: float = 0.0,
        rtol: float = 0.0, store_grad: bool = False,
        verbose: bool = False) -> GradientTransformation:
    """Armijo backtracking: :math:`\\eta \\leftarrow \\text{decrease\\_factor}\\cdot\\eta` until
    :math:`\\max(f(x+\\eta u) - (1+\\text{rtol})f(x) - \\eta\\,c\\,\\langle u, \\nabla f\\rangle, 0)
    \\le \\text{atol}` (:math:`c` = ``slope_rtol``; NaN counts as failure), at most
    ``max_backtracking_steps`` reductions, starting from
    :math:`\\min(\\text{increase\\_factor}\\cdot\\eta_{prev}, \\text{max\\_learning\\_rate})`.
    A search that only met non-finite values returns a step of 0. ``store_grad`` also stores
    the gradient at the new point (for :func:`value_and_grad_from_state`).

    Args:
      max_backtracking_steps: the most step-size reductions per update.
      slope_rtol: :math:`c`, the fraction of the linear decrease the step must achieve.
      decrease_factor: multiplies the step size after each failed trial, in ``(0, 1)``.
      increase_factor: multiplies the previous step size to get the first trial.
      max_learning_rate: the largest first trial.
      atol: absolute slack in the decrease condition.
      rtol: relative slack (times :math:`f(x)`) in the decrease condition.
      store_grad: also store the gradient at the accepted point (``jax.grad`` of ``value_fn``; read
        by :func:`value_and_grad_from_state`).
      verbose: accepted for Optax compatibility and ignored.

    Example:
      >>> import jax.numpy as jnp
      >>> from cairn import optim
      >>> f = lambda x: jnp.sum(x ** 2)
      >>> tx = optim.chain(optim.sgd(1.0), optim.scale_by_backtracking_linesearch(20))
      >>> x = jnp.array([1.0])
      >>> u, s = tx.update(2 * x, tx.init(x), x, value=f(x), grad=2 * x, value_fn=f)
      >>> float(s[1].learning_rate)   # 1.0 overshoots to f = 1; 0.8 gives 0.36
      0.800000011920929
    """
    del verbose

    def init(params: Any) -> ScaleByBacktrackingLinesearchState:
        dt = _real_dtype(params)
        grad = jax.tree.map(jnp.zeros_like, params) if store_grad else None
        return ScaleByBacktrackingLinesearchState(
            jnp.asarray(1.0, dt), jnp.asarray(jnp.inf, dt), grad,
            BacktrackingLinesearchInfo(jnp.asarray(0), jnp.asarray(jnp.inf, dt)))

    @mark_extra
    def update(updates: Any, state: ScaleByBacktrackingLinesearchState, params: Any = None, *,
               value: Any, grad: Any, value_fn: Callable, **extra: Any) -> tuple[Any, Any]:
        f = functools.partial(value_fn, **_value_fn_kwargs(
            "scale_by_backtracking_linesearch", value_fn, extra))
        slope = jnp.real(_tree.vdot(updates, _tree.conj(grad)))

        def error(lr, new_value):
            e = new_value - (1.0 + rtol) * value - lr * slope_rtol * slope
            return jnp.maximum(jnp.where(jnp.isnan(e), jnp.inf, e), 0.0)

        def cond(c):
            return (c[2] > atol) & (c[3] <= max_backtracking_steps)

        def body(c):
            lr, _, _, it = c
            lr = jnp.where(it > 0, decrease_factor * lr, lr)
            v = f(_tree.add_scale(params, lr, updates))
            return lr, jnp.asarray(v, state.value.dtype), error(lr, v), it + 1

        lr0 = jnp.minimum(increase_factor * state.learning_rate, max_learning_rate)
        lr, v, err, it = jax.lax.while_loop(
            cond, body, (lr0.astype(state.value.dtype), jnp.asarray(value, state.value.dtype),
                         jnp.asarray(jnp.inf, state.value.dtype), jnp.asarray(0)))
        new_grad = None
        if store_grad:
            new_grad = jax.grad(f)(_tree.add_scale(params, lr, updates))
        lr_out = jnp.where(jnp.isinf(err), 0.0, lr).astype(state.learning_rate.dtype)
        info = BacktrackingLinesearchInfo(it, err.astype(state.value.dtype))
        return (_tree.scale(lr_out, updates),
                ScaleByBacktrackingLinesearchState(lr_out, v, new_grad, info))

    return GradientTransformation(init, update)


# --- zoom (strong Wolfe) ---


class ZoomLinesearchInfo(NamedTuple):
    """Diagnostics of the last :func:`scale_by_zoom_linesearch` step.

    Args:
      num_linesearch_steps: int32 scalar, how many step sizes were tried.
      decrease_error: float scalar; above 0 when sufficient decrease was not met at the returned
        step.
      curvature_error: float scalar; above 0 when the curvature condition was not met.
    """
    num_linesearch_steps: jax.Array
    decrease_error: jax.Array  # > 0: sufficient decrease not met at the returned step
    curvature_error: jax.Array  # > 0: the curvature condition not met


class ScaleByZoomLinesearchState(NamedTuple):
    """The state of :func:`scale_by_zoom_linesearch`.

    Args:
      learning_rate: float scalar, the step size accepted at the last step.
      value: float scalar, the objective value at the current parameters.
      grad: the gradient at the current parameters.
      info: a :class:`ZoomLinesearchInfo` about the last search.
    """
    learning_rate: jax.Array
    value: jax.Array
    grad: Any
    info: ZoomLinesearchInfo


class _Zoom(NamedTuple):
    it: jax.Array
    zooming: jax.Array  # False: still bracketing; True: shrinking [lo, hi]
    done: jax.Array
    trial: jax.Array  # next step to evaluate while bracketing
    prev: jax.Array  # previous bracketing step and its phi, phi'
    f_prev: jax.Array
    d_prev: jax.Array
    lo: jax.Array
    f_lo: jax.Array
    d_lo: jax.Array
    hi: jax.Array
    f_hi: jax.Array
    d_hi: jax.Array
    rec: jax.Array  # a third point for the cubic fit
    f_rec: jax.Array
    best: jax.Array  # the returned step, its value, gradient and errors
    f_best: jax.Array
    g_best: Any
    dec_best: jax.Array
    curv_best: jax.Array


def _cubic_min(a, fa, da, b, fb, c, fc):
    """Minimiser of the cubic through (a, fa, da), (b, fb), (c, fc); NaN when degenerate."""
    db, dc = b - a, c - a
    denom = (db * dc) ** 2 * (db - dc)
    r1, r2 = fb - fa - da * db, fc - fa - da * dc
    A = (dc ** 2 * r1 - db ** 2 * r2) / denom
    B = (-dc ** 3 * r1 + db ** 3 * r2) / denom
    disc = B * B - 3 * A * da
    out = a + (-B + jnp.sqrt(disc)) / (3 * A)
    return jnp.where((denom == 0) | (disc < 0) | (A == 0), jnp.nan, out)


def _quad_min(a, fa, da, b, fb):
    """Minimiser of the parabola through (a, fa, da), (b, fb); NaN when degenerate."""
    d = b - a
    c2 = (fb - fa - da * d) / (d * d)
    return jnp.where((d == 0) | (c2 <= 0), jnp.nan, a - da / (2 * c2))


def _interpolate(z: _Zoom) -> jax.Array:
    """Next trial inside [lo, hi]: cubic, else quadratic, else the midpoint (safeguarded)."""
    delta = z.hi - z.lo
    lo_, hi_ = jnp.minimum(z.lo, z.hi), jnp.maximum(z.lo, z.hi)
    width = hi_ - lo_
    cub = _cubic_min(z.lo, z.f_lo, z.d_lo, z.hi, z.f_hi, z.rec, z.f_rec)
    ok_c = jnp.isfinite(cub) & (cub > lo_ + 0.2 * width) & (cub < hi_ - 0.2 * width)
    quad = _quad_min(z.lo, z.f_lo, z.d_lo, z.hi, z.f_hi)
    ok_q = jnp.isfinite(quad) & (quad > lo_ + 0.1 * width) & (quad < hi_ - 0.1 * width)
    return jnp.where(ok_c, cub, jnp.where(ok_q, quad, z.lo + 0.5 * delta))


def _zoom_step(z: _Zoom, a, fa, da, ga, dec_ok, curv_ok, dec_err, curv_err, precision):
    """One transition of the bracketing/zoom machine after evaluating step ``a``."""
    accept = dec_ok & curv_ok
    # bracketing: [prev, a] holds a minimiser when a fails decrease or rises; [a, prev]
    # when the slope at a turned non-negative
    up = (~dec_ok) | ((z.it > 0) & (fa >= z.f_prev))
    down = (~up) & (~accept) & (da >= 0)
    start = (~z.zooming) & (up | down)
    # zooming: a replaces hi when it fails, else lo (hi moves to lo when the slope flips)
    zfail = (~dec_ok) | (fa >= z.f_lo)
    flip = (~zfail) & (da * (z.hi - z.lo) >= 0)
    lo = jnp.where(z.zooming, jnp.where(zfail, z.lo, a), jnp.where(up, z.prev, a))
    f_lo = jnp.where(z.zooming, jnp.where(zfail, z.f_lo, fa), jnp.where(up, z.f_prev, fa))
    d_lo = jnp.where(z.zooming, jnp.where(zfail, z.d_lo, da), jnp.where(up, z.d_prev, da))
    hi = jnp.where(z.zooming, jnp.where(zfail, a, jnp.where(flip, z.lo, z.hi)),
                   jnp.where(up, a, z.prev))
    f_hi = jnp.where(z.zooming, jnp.where(zfail, fa, jnp.where(flip, z.f_lo, z.f_hi)),
                     jnp.where(up, fa, z.f_prev))
    d_hi = jnp.where(z.zooming, jnp.where(zfail, da, jnp.where(flip, z.d_lo, z.d_hi)),
                     jnp.where(up, da, z.d_prev))
    zooming = z.zooming | start
    narrow = zooming & (jnp.abs(hi - lo) <= precision * jnp.maximum(1.0, jnp.abs(lo)))
    # the returned step: an accepted one, else the lowest value with sufficient decrease
    better = accept | (dec_ok & (fa < z.f_best))
    pick = lambda new, old: jnp.where(better, new, old)  # noqa: E731
    return _Zoom(
        z.it + 1, zooming, z.done | accept | narrow, z.trial, jnp.where(zooming, z.prev, a),
        jnp.where(zooming, z.f_prev, fa), jnp.where(zooming, z.d_prev, da), lo, f_lo, d_lo, hi,
        f_hi, d_hi, jnp.where(z.zooming, jnp.where(zfail | flip, z.hi, z.lo), z.prev),
        jnp.where(z.zooming, jnp.where(zfail | flip, z.f_hi, z.f_lo), z.f_prev), pick(a, z.best),
        pick(fa, z.f_best), jax.tree.map(pick, ga, z.g_best), pick(dec_err, z.dec_best),
        pick(curv_err, z.curv_best))


def scale_by_zoom_linesearch(
        max_linesearch_steps: int, max_learning_rate: float | None = None, tol: float = 0.0,
        increase_factor: float = 2.0, slope_rtol: float = 1e-4, curv_rtol: float = 0.9,
        approx_dec_rtol: float | None = 1e-6, stepsize_precision: float = 1e-5,
        initial_guess_strategy: str = "keep", verbose: bool = False) -> GradientTransformation:
    """A step satisfying the strong Wolfe conditions, found by bracketing then zooming
    (Nocedal and Wright, Algorithms 3.5 and 3.6, cubic/quadratic interpolation).

    With :math:`\\varphi(\\eta) = f(x+\\eta u)`: sufficient decrease
    :math:`\\varphi(\\eta) \\le \\varphi(0) + c_1\\eta\\varphi'(0)` (``slope_rtol`` :math:`c_1`;
    or, when ``approx_dec_rtol`` is set, the approximate form :math:`\\varphi(\\eta) \\le
    \\varphi(0) + \\epsilon|\\varphi(0)|` with :math:`\\varphi'(\\eta) \\le (2c_1-1)\\varphi'(0)`)
    and small curvature :math:`|\\varphi'(\\eta)| \\le c_2|\\varphi'(0)|` (``curv_rtol``), both up
    to ``tol``. The bracketing phase multiplies the step by ``increase_factor`` (capped at
    ``max_learning_rate``); the first trial is 1 (``initial_guess_strategy="one"``) or the
    previous step (``"keep"``). After ``max_linesearch_steps`` evaluations without success,
    the step with the lowest value that satisfied sufficient decrease is returned (0 if none).

    Args:
      max_linesearch_steps: the most function evaluations per update.
      max_learning_rate: cap on the step during bracketing; None for no cap.
      tol: slack allowed in both conditions.
      increase_factor: multiplies the step at each bracketing trial.
      slope_rtol: :math:`c_1` of the sufficient-decrease condition.
      curv_rtol: :math:`c_2` of the curvature condition.
      approx_dec_rtol: :math:`\\epsilon` of the approximate condition; None: exact one only.
      stepsize_precision: stop zooming once the bracket is narrower than this times max(1, lo).
      initial_guess_strategy: ``"one"`` (first trial 1) or ``"keep"`` (the previous step).
      verbose: accepted for Optax compatibility and ignored.
    Raises:
      ValueError: an unknown ``initial_guess_strategy``.
    """
    del verbose
    if initial_guess_strategy not in ("one", "keep"):
        raise ValueError("scale_by_zoom_linesearch: initial_guess_strategy must be 'one' or "
                         f"'keep', got {initial_guess_strategy!r}")
    cap = jnp.inf if max_learning_rate is None else max_learning_rate

    def init(params: Any) -> ScaleByZoomLinesearchState:
        dt = _real_dtype(params)
        inf = jnp.asarray(jnp.inf, dt)
        return ScaleByZoomLinesearchState(jnp.asarray(1.0, dt), inf,
                                          jax.tree.map(jnp.zeros_like, params),
                                          ZoomLinesearchInfo(jnp.asarray(0), inf, inf))

    @mark_extra
    def update(updates: Any, state: ScaleByZoomLinesearchState, params: Any = None, *,
               value: Any, grad: Any, value_fn: Callable, **extra: Any) -> tuple[Any, Any]:
        f = functools.partial(value_fn, **_value_fn_kwargs(
            "scale_by_zoom_linesearch", value_fn, extra))
        dt = state.value.dtype
        f0 = jnp.asarray(value, dt)
        d0 = jnp.real(_tree.vdot(updates, _tree.conj(grad))).astype(dt)

        def evaluate(z: _Zoom) -> _Zoom:
            a = jnp.where(z.zooming, _interpolate(z), z.trial).astype(dt)
            fa, ga = jax.value_and_grad(f)(_tree.add_scale(params, a, updates))
            fa = jnp.where(jnp.isnan(fa), jnp.inf, fa).astype(dt)
            da = jnp.real(_tree.vdot(updates, _tree.conj(ga))).astype(dt)
            dec_err = jnp.maximum(fa - f0 - slope_rtol * a * d0, 0.0)
            dec_ok = dec_err <= tol
            if approx_dec_rtol is not None:
                dec_ok |= (fa <= f0 + approx_dec_rtol * jnp.abs(f0)) & \
                    (da <= (2 * slope_rtol - 1) * d0)
            curv_err = jnp.maximum(jnp.abs(da) - curv_rtol * jnp.abs(d0), 0.0)
            z = _zoom_step(z, a, fa, da, ga, dec_ok, curv_err <= tol, dec_err, curv_err,
                           stepsize_precision)
            return z._replace(trial=jnp.minimum(a * increase_factor, cap).astype(dt))

        first = jnp.ones([], dt) if initial_guess_strategy == "one" else state.learning_rate
        zero, inf = jnp.zeros([], dt), jnp.asarray(jnp.inf, dt)
        z0 = _Zoom(jnp.asarray(0), jnp.asarray(False), jnp.asarray(False),
                   jnp.minimum(first, cap).astype(dt), zero, f0, d0, zero, f0, d0, zero, f0, d0,
                   zero, f0, zero, f0, grad, inf, inf)
        z = jax.lax.while_loop(lambda z: (~z.done) & (z.it < max_linesearch_steps), evaluate, z0)
        info = ZoomLinesearchInfo(z.it, z.dec_best, z.curv_best)
        return (_tree.scale(z.best, updates),
                ScaleByZoomLinesearchState(z.best, z.f_best, z.g_best, info))

    return GradientTransformation(init, update)


def value_and_grad_from_state(value_fn: Callable[..., Any]) -> Callable[..., tuple[Any, Any]]:
    """``jax.value_and_grad(value_fn)`` that reuses the value and gradient a line search stored.

    The returned ``f(params, *args, state=opt_state, **kwargs)`` reads ``value`` and ``grad``
    from the state (via :func:`cairn.optim.tree.get`); when the stored value is finite they are
    returned as they are, otherwise (first iteration) they are computed.

    Args:
      value_fn: the objective ``value_fn(params, *args, **kwargs) -> scalar``.

    Raises:
      ValueError: the state holds no ``value`` / ``grad`` (no line search that stores them).
    """
    def value_and_grad(params: Any, *args: Any, state: Any, **kwargs: Any) -> tuple[Any, Any]:
        value, grad = tree_get(state, "value"), tree_get(state, "grad")
        if value is None or grad is None:
            raise ValueError("value_and_grad_from_state: the optimizer state holds no 'value' "
                             "and 'grad'; use a line search that stores them (zoom, or "
                             "backtracking with store_grad=True)")
        return jax.lax.cond(jnp.isfinite(value), lambda *_: (value, grad),
                            lambda p, a, k: jax.value_and_grad(value_fn)(p, *a, **k),
                            params, args, kwargs)

    return value_and_grad


resolve_annotations(globals())  # learning_rate: ScalarOrSchedule as an object, as Optax
