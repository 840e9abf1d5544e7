"""Gated linear unit, the XLA implementation: one matmul for both projections.

``weights[k, 2, n]`` is viewed as ``[k, 2n]`` (a free reshape), so ``x @ w`` is one dot
that produces the value and gate projections together (the plain composition runs two
dots and reads ``x`` twice); the activation and the product fuse into the dot's
epilogue. The backward keeps the projections in the operands' dtype and runs both
transposed dots at that dtype with float32 accumulation, as JAX's derivative of the plain
bf16 composition does (differentiating the float32-accumulated dot directly would run the
backward's dots in float32: half the speed on a GPU's tensor cores).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp


def apply(h: jax.Array, activation: Callable[[jax.Array], jax.Array] | None, n: int) -> jax.Array:
    a, b = h[..., :n], h[..., n:]
    return (activation(a) if activation is not None else a) * b


def glu_xla(
    x: jax.Array,
    weights: jax.Array,
    *,
    config: Mapping[str, Any],
    interpret: bool = False,
    activation: Callable[[jax.Array], jax.Array] | None = None,
    precision: Any = None,
) -> jax.Array:
    """The XLA implementation on ``x[m, k]`` and ``weights[k, 2, n]`` (no config keys)."""
    del config, interpret
    return _glu(x, weights, activation, precision)


def _project(x: jax.Array, weights: jax.Array, precision: Any) -> jax.Array:
    k, _, n = weights.shape
    return jnp.dot(x, weights.reshape(k, 2 * n), precision=precision, preferred_element_type=jnp.float32)


def _glu_fwd(x: jax.Array, weights: jax.Array, activation: Any, precision: Any) -> tuple[jax.Array, tuple]:
    h = _project(x, weights, precision)
    out = apply(h, activation, weights.shape[2]).astype(jnp.result_type(x, weights))
    return out, (x, weights, h.astype(jnp.result_type(x, weights)))


def _glu_bwd(activation: Any, precision: Any, res: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w, h = res
    n = w.shape[2]
    _, vjp = jax.vjp(lambda h: apply(h, activation, n), h.astype(jnp.float32))
    (dh,) = vjp(g.astype(jnp.float32))
    return glu_input_grads(x, w, dh, precision)


def glu_input_grads(x: jax.Array, w: jax.Array, dh: jax.Array, precision: Any) -> tuple[jax.Array, jax.Array]:
    """``(dx, dw)`` from the projections' cotangent ``dh[m, 2n]``: both dots at the operands'
    dtype (``dh`` rounded to it, as autodiff of the plain composition has it) with float32
    accumulation."""
    k, _, n = w.shape
    dtype = jnp.result_type(x, w)
    dh = dh.astype(dtype)
    wf = w.reshape(k, 2 * n).astype(dtype)
    dx = jnp.dot(dh, wf.T, precision=precision, preferred_element_type=jnp.float32)
    dw = jnp.dot(x.astype(dtype).T, dh, precision=precision, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.reshape(k, 2, n).astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _glu(x: jax.Array, weights: jax.Array, activation: Any, precision: Any) -> jax.Array:
    return _glu_fwd(x, weights, activation, precision)[0]


_glu.defvjp(_glu_fwd, _glu_bwd)
