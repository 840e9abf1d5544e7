"""SGD with Polyak's step size (Loizou et al. 2021; ``sps+``: Garrigos et al. 2023)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from cairn.optim import _tree
from cairn.optim._base import (
    EmptyState,
    GradientTransformation,
    GradientTransformationExtraArgs,
    ScalarOrSchedule,
    chain,
)
from cairn.optim._momentum import sgd
from cairn.optim._types import resolve_annotations

__all__ = ["scale_by_polyak", "polyak_sgd"]

_TINY = 2.220446049250313e-16  # float64 machine epsilon: below it the step is 0


def scale_by_polyak(f_min: float = 0.0, max_learning_rate: float = 1.0, eps: float = 0.0,
                    variant: str = "sps") -> GradientTransformation:
    """:math:`u \\leftarrow \\min\\left(\\frac{f(x) - f^\\star}{\\|u\\|^2 + \\epsilon},
    \\gamma_{max}\\right) u` with ``value=f(x)`` passed to ``update``; ``variant="sps+"``
    uses :math:`(f(x)-f^\\star)_+`. A zero denominator gives a step of 0.

    Args:
      f_min: :math:`f^\\star`, a lower bound on the objective.
      max_learning_rate: :math:`\\gamma_{max}`, the largest step.
      eps: :math:`\\epsilon`, added to the denominator.
      variant: ``"sps"`` or ``"sps+"``.

    Raises:
      ValueError: an unknown ``variant``; ``update`` without ``value``.
    """
    if variant not in ("sps", "sps+"):
        raise ValueError(f"scale_by_polyak: variant must be 'sps' or 'sps+', got {variant!r}")

    def init(params: Any) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: Any, state: EmptyState, params: Any = None, *, value: Any = None,
               **extra: Any) -> tuple[Any, EmptyState]:
        del params, extra
        if value is None:
            raise ValueError("scale_by_polyak: update(...) needs value=f(params)")
        sq = _tree.norm(updates, squared=True)
        gap = jnp.asarray(value - f_min).astype(sq.dtype)
        if variant == "sps+":
            gap = jax.nn.relu(gap)
        step = jnp.where(sq + eps <= _TINY, 0.0, jnp.minimum(gap / (sq + eps), max_learning_rate))
        return _tree.scale(step, updates), state

    return GradientTransformationExtraArgs(init, update)


def polyak_sgd(max_learning_rate: float = 1.0, scaling: ScalarOrSchedule = 1.0,
               f_min: float = 0.0, eps: float = 0.0,
               variant: str = "sps") -> GradientTransformation:
    """SGD with the Polyak step: ``chain(sgd(scaling), scale_by_polyak(...))``, i.e.
    :math:`x \\leftarrow x - s\\min\\left(\\frac{f(x)-f^\\star}{\\|s g\\|^2+\\epsilon},
    \\gamma_{max}\\right) g`; ``update`` needs ``value=f(x)``.

    Args:
      max_learning_rate: :math:`\\gamma_{max}`, the largest Polyak step.
      scaling: :math:`s`, a float or a schedule multiplying the step.
      f_min: :math:`f^\\star`, a lower bound on the objective (0 for non-negative losses).
      eps: :math:`\\epsilon`, added to the denominator.
      variant: ``"sps"`` or ``"sps+"`` (the step clipped at 0 from below), see
        :func:`scale_by_polyak`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from cairn import optim
      >>> f = lambda x: jnp.sum(x ** 2)
      >>> tx = optim.polyak_sgd()
      >>> x = jnp.array([1.0, 2.0, 3.0])
      >>> v, g = jax.value_and_grad(f)(x)
      >>> u, _ = tx.update(g, tx.init(x), x, value=v)
      >>> float(f(x + u))   # step 14 / 56 = 0.25: x halves
      3.5
    """
    return chain(sgd(learning_rate=scaling),
                 scale_by_polyak(f_min=f_min, max_learning_rate=max_learning_rate, eps=eps,
                                 variant=variant))


resolve_annotations(globals())  # learning_rate: ScalarOrSchedule as an object, as Optax
