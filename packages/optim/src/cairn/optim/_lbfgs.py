"""L-BFGS (Nocedal 1980; Liu and Nocedal 1989): the two-loop recursion over the last m steps."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cairn.optim import _tree, _validate
from cairn.optim._base import GradientTransformation, ScalarOrSchedule, chain
from cairn.optim._linesearch import scale_by_zoom_linesearch
from cairn.optim._packed_state import safe_increment
from cairn.optim._scaling import learning_rate_step, scale
from cairn.optim._types import resolve_annotations

__all__ = ["ScaleByLBFGSState", "scale_by_lbfgs", "lbfgs"]


class ScaleByLBFGSState(NamedTuple):
    """The state of :func:`scale_by_lbfgs`.

    Args:
      count: int32 scalar, steps taken.
      params: the parameters of the previous call.
      updates: the gradient of the previous call.
      diff_params_memory: per leaf, shape ``(memory_size, *leaf.shape)``: the steps :math:`s_i =
        x_{i+1} - x_i`.
      diff_updates_memory: per leaf, shape ``(memory_size, *leaf.shape)``: the gradient differences
        :math:`y_i = g_{i+1} - g_i`.
      weights_memory: shape ``(memory_size,)``: :math:`\\rho_i = 1/\\langle y_i, s_i\\rangle` (0 for
        an empty slot).
    """
    count: jax.Array  # type: ignore[assignment]
    params: Any  # the params of the previous call
    updates: Any  # the gradient of the previous call
    diff_params_memory: Any  # per leaf, (m, *shape): the steps s_i = x_{i+1} - x_i
    diff_updates_memory: Any  # per leaf, (m, *shape): y_i = g_{i+1} - g_i
    weights_memory: jax.Array  # (m,): rho_i = 1 / <y_i, s_i> (0 for an empty slot)


def _two_loop(g: Any, s_mem: Any, y_mem: Any, rho: jax.Array, gamma: jax.Array,
              newest: jax.Array) -> Any:
    """:math:`H g` with :math:`H_0 = \\gamma I`, slots visited newest first then oldest first."""
    m = rho.shape[0]
    order = (newest - jnp.arange(m)) % m  # newest .. oldest

    def slot(mem: Any, i: jax.Array) -> Any:
        return jax.tree.map(lambda x: x[i], mem)

    def backward(q, i):
        a = rho[i] * jnp.real(_tree.vdot(slot(s_mem, i), q))
        q = _tree.cast_like(_tree.add_scale(q, -a, slot(y_mem, i)), q)
        return q, a

    q, alphas = jax.lax.scan(backward, g, order)
    r = _tree.scale(gamma, q)

    def forward(r, ia):
        i, a = ia
        b = rho[i] * jnp.real(_tree.vdot(slot(y_mem, i), r))
        return _tree.cast_like(_tree.add_scale(r, a - b, slot(s_mem, i)), r), None

    r, _ = jax.lax.scan(forward, r, (order[::-1], alphas[::-1]))
    return r


def scale_by_lbfgs(memory_size: int = 10,
                   scale_init_precond: bool = True) -> GradientTransformation:
    """The L-BFGS direction :math:`H_t g_t` (a descent direction once negated).

    The pair :math:`s = x_t - x_{t-1}`, :math:`y = g_t - g_{t-1}` enters the memory (the
    oldest of ``memory_size`` pairs leaves), then the two-loop recursion applies the inverse
    Hessian estimate with :math:`H_0 = \\gamma I`: :math:`\\gamma = \\langle s,y\\rangle /
    \\|y\\|^2` when ``scale_init_precond`` (and :math:`\\min(1, 1/\\|g_0\\|)` at the first step),
    else 1. Pairs with :math:`\\langle s, y\\rangle = 0` are ignored.

    Args:
      memory_size: how many :math:`(s, y)` pairs to keep.
      scale_init_precond: use :math:`\\gamma = \\langle s,y\\rangle/\\|y\\|^2` for :math:`H_0` (else
        1).

    Raises:
      ValueError: ``memory_size < 1``; ``update`` without ``params``.
    """
    if memory_size < 1:
        raise ValueError(f"scale_by_lbfgs: memory_size must be >= 1, got {memory_size}")

    def init(params: Any) -> ScaleByLBFGSState:
        mem = jax.tree.map(lambda p: jnp.zeros((memory_size, *jnp.shape(p)), jnp.result_type(p)),
                           params)
        z = jax.tree.map(jnp.zeros_like, params)
        return ScaleByLBFGSState(jnp.zeros([], jnp.int32), z, z, mem, mem, jnp.zeros(memory_size))

    def update(updates: Any, state: ScaleByLBFGSState,
               params: Any = None) -> tuple[Any, ScaleByLBFGSState]:
        if params is None:
            raise ValueError("scale_by_lbfgs needs `params` in update(updates, state, params)")
        started = state.count > 0
        s = jax.tree.map(lambda a, b: jnp.where(started, a - b, 0), params, state.params)
        y = jax.tree.map(lambda a, b: jnp.where(started, a - b, 0), updates, state.updates)
        sy = jnp.real(_tree.vdot(y, s))
        rho_new = jnp.where(started & (sy != 0), 1.0 / jnp.where(sy == 0, 1.0, sy), 0.0)
        slot = (state.count - 1) % memory_size
        s_mem = jax.tree.map(lambda mem, v: mem.at[slot].set(v), state.diff_params_memory, s)
        y_mem = jax.tree.map(lambda mem, v: mem.at[slot].set(v), state.diff_updates_memory, y)
        rho = state.weights_memory.at[slot].set(rho_new.astype(state.weights_memory.dtype))
        gamma: Any = 1.0
        if scale_init_precond:
            yy = _tree.norm(y, squared=True)
            first = jnp.minimum(1.0, 1.0 / _tree.norm(jax.lax.stop_gradient(updates)))
            gamma = jnp.where(started, jnp.where(yy > 0, sy / jnp.where(yy > 0, yy, 1.0), 1.0),
                              first)
        direction = _two_loop(updates, s_mem, y_mem, rho, gamma, slot)
        return direction, ScaleByLBFGSState(safe_increment(state.count), params, updates,
                                            s_mem, y_mem, rho)

    return GradientTransformation(init, update)


_DEFAULT_LINESEARCH = scale_by_zoom_linesearch(max_linesearch_steps=20,
                                               initial_guess_strategy="one")


def lbfgs(learning_rate: ScalarOrSchedule | None = None, memory_size: int = 10,
          scale_init_precond: bool = True,
          linesearch: GradientTransformation | None = _DEFAULT_LINESEARCH,
          ) -> GradientTransformation:
    """L-BFGS: ``chain(scale_by_lbfgs(...), scale(-1) or scale_by_learning_rate(lr),
    linesearch)``.

    ``linesearch`` defaults to ``scale_by_zoom_linesearch(max_linesearch_steps=20,
    initial_guess_strategy="one")`` (strong Wolfe conditions), as in Optax; ``None`` means no
    line search (then the step is ``learning_rate``, or 1). With a line search, ``update`` needs ``value=``, ``grad=`` and ``value_fn=``;
    use :func:`value_and_grad_from_state` to reuse the value and gradient it stores.

    Args:
      learning_rate: the step size without a line search (None means 1); a float or a schedule.
      memory_size: how many :math:`(s, y)` pairs to keep.
      scale_init_precond: start the two-loop recursion from :math:`H_0 = \\gamma I` with
        :math:`\\gamma = \\langle s,y\\rangle/\\|y\\|^2` (else :math:`H_0 = I`).
      linesearch: the line search to chain last; None for none.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from cairn import optim
      >>> f = lambda x: jnp.sum((x - 3.0) ** 2)
      >>> opt = optim.lbfgs()
      >>> x = jnp.zeros(2)
      >>> state = opt.init(x)
      >>> vg = optim.value_and_grad_from_state(f)
      >>> for _ in range(3):
      ...     v, g = vg(x, state=state)
      ...     u, state = opt.update(g, state, x, value=v, grad=g, value_fn=f)
      ...     x = optim.apply_updates(x, u)
      >>> [round(float(t), 4) for t in x]
      [3.0, 3.0]
    """
    _validate.check("lbfgs", {"learning_rate": _validate.LR}, learning_rate=learning_rate)  # None: a step of 1
    step = scale(-1.0) if learning_rate is None else learning_rate_step(learning_rate)
    parts = [scale_by_lbfgs(memory_size, scale_init_precond), step]
    return chain(*parts, *([] if linesearch is None else [linesearch]))


resolve_annotations(globals())  # learning_rate: ScalarOrSchedule as an object, as Optax
