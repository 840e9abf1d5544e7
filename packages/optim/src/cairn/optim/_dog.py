"""DoG (Ivgi et al. 2023) and DoWG (Khaled et al. 2023): step sizes from the distance travelled."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from cairn.optim import _tree, _validate
from cairn.optim._adding import add_decayed_weights
from cairn.optim._base import GradientTransformation, ScalarOrSchedule, chain, identity
from cairn.optim._scaling import learning_rate_step
from cairn.optim._types import resolve_annotations

__all__ = ["DoGState", "DoWGState", "scale_by_dog", "dog", "scale_by_dowg", "dowg"]

InitStep = tuple[Literal["distance", "learning_rate", "heuristic"], float]


class DoGState(NamedTuple):
    """The state of :func:`scale_by_dog`.

    Args:
      is_init_step: bool scalar, True before the first update.
      init_params: the params at init, :math:`x_0`.
      max_dist: :math:`\\bar r_t = \\max_{i\\le t} \\|x_i - x_0\\|` (at least the initial distance).
      sum_sq_norm_grads: :math:`\\sum_i \\|g_i\\|^2`.
    """
    is_init_step: jax.Array
    init_params: Any
    max_dist: jax.Array  # :math:`\bar r_t = \max_{i\le t} \|x_i - x_0\|` (at least r_eps)
    sum_sq_norm_grads: jax.Array  # :math:`\sum_i \|g_i\|^2`


def scale_by_dog(init_step: InitStep = ("heuristic", 1e-6),
                 eps: float = 1e-8) -> GradientTransformation:
    """Distance over Gradients: :math:`u = \\eta_t g`, :math:`\\eta_t = \\bar r_t /
    \\sqrt{\\sum_{i\\le t}\\|g_i\\|^2 + \\epsilon}` (global norms over the whole tree).

    Args:
      init_step: how the first step is set: ``("distance", r)`` starts :math:`\\bar r` at r;
        ``("heuristic", c)`` at :math:`c(1+\\|x_0\\|)`; ``("learning_rate", lr)`` makes the
        first step size lr (and :math:`\\bar r` starts at 0).
      eps: added under the square root.

    Raises:
      ValueError: an unknown ``init_step`` kind.
    """
    kind, value = init_step
    if kind not in ("distance", "learning_rate", "heuristic"):
        raise ValueError(f"scale_by_dog: init_step kind must be 'distance', 'learning_rate' or "
                         f"'heuristic', got {kind!r}")

    def init(params: Any) -> DoGState:
        r0: Any = {"distance": value, "learning_rate": 0.0}.get(kind)
        if kind == "heuristic":
            r0 = value * (1 + _tree.norm(params))
        dt = _tree.dtype(params, "lowest")
        return DoGState(jnp.asarray(True), params, jnp.asarray(r0, dt), jnp.asarray(0.0, dt))

    def update(updates: Any, state: DoGState, params: Any = None) -> tuple[Any, DoGState]:
        if params is None:
            raise ValueError("scale_by_dog needs `params` in update(updates, state, params)")
        r = jnp.maximum(state.max_dist, _tree.norm(_tree.sub(state.init_params, params)))
        sq = state.sum_sq_norm_grads + _tree.norm(updates, squared=True)
        lr = r / jnp.sqrt(sq + eps)
        if kind == "learning_rate":
            lr = jnp.where(state.is_init_step, value, lr)
        return _tree.scale(lr, updates), DoGState(jnp.asarray(False), state.init_params, r, sq)

    return GradientTransformation(init, update)


def dog(learning_rate: ScalarOrSchedule = 1.0, init_step: InitStep = ("heuristic", 1e-6),
        eps: float = 1e-8, weight_decay: float | None = None,
        mask: Any = None) -> GradientTransformation:
    """DoG: ``chain(add_decayed_weights(weight_decay, mask) if weight_decay is not None,
    scale_by_dog(init_step, eps), scale_by_learning_rate(learning_rate))`` (a learning rate
    of 1 is the method; other values scale its step).

    Args:
      learning_rate: scales DoG's step (1, the default, is the method itself); a float or a
        schedule.
      init_step: how the first step is set, as for :func:`scale_by_dog`: ``("distance", r)``,
        ``("heuristic", c)`` or ``("learning_rate", lr)``.
      eps: added to the denominator.
      weight_decay: :math:`\\lambda`, added to the gradient as :math:`\\lambda\\theta` first; None
        for none.
      mask: which leaves get weight decay (see :func:`add_decayed_weights`); None means all.

    Example:
      >>> import jax.numpy as jnp
      >>> from cairn.optim import contrib
      >>> tx = contrib.dog(init_step=("learning_rate", 0.1))
      >>> p = jnp.array([1.0, 2.0])
      >>> u, _ = tx.update(jnp.array([1.0, 1.0]), tx.init(p), p)
      >>> u.tolist()
      [-0.10000000149011612, -0.10000000149011612]
    """
    _validate.check("dog", learning_rate=learning_rate, eps=eps, weight_decay=weight_decay)
    decay = add_decayed_weights(weight_decay, mask) if weight_decay is not None else identity()
    return chain(decay, scale_by_dog(init_step, eps), learning_rate_step(learning_rate))


class DoWGState(NamedTuple):
    """The state of :func:`scale_by_dowg`.

    Args:
      init_params: the params at init, :math:`x_0`.
      weighted_sq_norm_grads: :math:`\\sum_i \\bar r_i^2 \\|g_i\\|^2`.
      estim_sq_dist: :math:`\\bar r_t^2`, the squared distance estimate.
    """
    init_params: Any
    weighted_sq_norm_grads: jax.Array  # :math:`\sum_i \bar r_i^2 \|g_i\|^2`
    estim_sq_dist: jax.Array  # :math:`\bar r_t^2`


def scale_by_dowg(init_estim_sq_dist: float | None = None,
                  eps: float = 1e-4) -> GradientTransformation:
    """Distance over Weighted Gradients: :math:`\\eta_t = \\bar r_t^2 /
    (\\sqrt{\\sum_i \\bar r_i^2\\|g_i\\|^2} + \\epsilon)` with :math:`\\bar r_t^2 =
    \\max(\\bar r_{t-1}^2, \\|x_t - x_0\\|^2)`, starting at ``init_estim_sq_dist`` (``eps``).

    Args:
      init_estim_sq_dist: the initial :math:`\\bar r_0^2`; None starts at ``eps``.
      eps: :math:`\\epsilon`, added to the denominator.
    """
    def init(params: Any) -> DoWGState:
        dt = _tree.dtype(params, "lowest")
        r0 = eps if init_estim_sq_dist is None else init_estim_sq_dist
        return DoWGState(params, jnp.asarray(0.0, dt), jnp.asarray(r0, dt))

    def update(updates: Any, state: DoWGState, params: Any = None) -> tuple[Any, DoWGState]:
        if params is None:
            raise ValueError("scale_by_dowg needs `params` in update(updates, state, params)")
        r2 = jnp.maximum(state.estim_sq_dist,
                         _tree.norm(_tree.sub(state.init_params, params), squared=True))
        w = r2 * _tree.norm(updates, squared=True) + state.weighted_sq_norm_grads
        lr = r2 / (jnp.sqrt(w) + eps)
        return _tree.scale(lr, updates), DoWGState(state.init_params, w, r2)

    return GradientTransformation(init, update)


def dowg(learning_rate: ScalarOrSchedule = 1.0, init_estim_sq_dist: float | None = None,
         eps: float = 1e-4, weight_decay: float | None = None,
         mask: Any = None) -> GradientTransformation:
    """DoWG, chained like :func:`dog`.

    Args:
      learning_rate: scales DoWG's step (1, the default, is the method itself); a float or a
        schedule.
      init_estim_sq_dist: the initial :math:`\\bar r_0^2`; None starts at ``eps``.
      eps: added to the denominator (and the default initial squared distance).
      weight_decay: :math:`\\lambda`, added to the gradient as :math:`\\lambda\\theta` first; None
        for none.
      mask: which leaves get weight decay (see :func:`add_decayed_weights`); None means all.
    """
    _validate.check("dowg", learning_rate=learning_rate, eps=eps, weight_decay=weight_decay)
    decay = add_decayed_weights(weight_decay, mask) if weight_decay is not None else identity()
    return chain(decay, scale_by_dowg(init_estim_sq_dist, eps),
                 learning_rate_step(learning_rate))


resolve_annotations(globals())  # learning_rate: ScalarOrSchedule as an object, as Optax
