"""Transformations that need each leaf's shape (norms, factored moments): computed per leaf."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cairn.optim import _validate
from cairn.optim._base import EmptyState, GradientTransformation, init_empty_state, mark_extra
from cairn.optim._placement import full_like_param, replicated_like, zeros_for_axes
from cairn.optim._transforms import safe_increment

__all__ = [
    "scale_by_factored_rms", "scale_by_trust_ratio", "scale_by_novograd", "scale_by_sm3",
    "scale_by_param_block_rms", "scale_by_param_block_norm", "clip_by_block_rms",
    "adaptive_grad_clip", "centralize",
]


def _need_params(params, name):
    if params is None:
        raise ValueError(f"{name} needs `params` in update(updates, state, params)")


def _per_leaf(name, f, *, needs_params: bool):
    """A stateless transformation mapping ``f(u, p)`` (``f(u)`` without params) over the leaves."""

    @mark_extra
    def update(updates, state, params=None, **extra):
        if not needs_params:
            return jax.tree.map(f, updates), state
        _need_params(params, name)
        return jax.tree.map(f, updates, params), state

    return GradientTransformation(init_empty_state, update)


def _safe_norm(x, min_norm, axis=None, keepdims=False):
    """Norm with a gradient-safe floor: ``max(||x||, min_norm)``."""
    sq = jnp.sum(jnp.real(jnp.conj(x) * x), axis=axis, keepdims=keepdims)
    norm = jnp.sqrt(jnp.where(sq > min_norm ** 2, sq, 1.0))
    return jnp.where(sq > min_norm ** 2, norm, min_norm)


class FactoredState(NamedTuple):
    count: jax.Array
    v_row: object
    v_col: object
    v: object


def _factored_dims(shape, factored, min_dim):
    if not factored or len(shape) < 2:
        return None
    order = np.argsort(shape)
    if shape[order[-2]] < min_dim:
        return None
    return int(order[-2]), int(order[-1])


def _decay_rate_pow(i, exponent=0.8):
    t = jnp.asarray(i + 1, jnp.float32)
    return 1.0 - t ** (-exponent)


def scale_by_factored_rms(factored: bool = True, decay_rate=0.8, step_offset=0,
                          min_dim_size_to_factor: int = 128, epsilon=1e-30,
                          decay_rate_fn=_decay_rate_pow):
    """Adafactor scaling (Shazeer & Stern 2018).

    With :math:`\\beta_t = 1-(t+1)^{-0.8}` and :math:`G = g^2+\\epsilon`: for matrices whose two
    largest dims are >= ``min_dim_size_to_factor``, :math:`R_t = \\beta_t R_{t-1} + (1-\\beta_t)
    \\mathrm{mean}_{cols}(G)`, :math:`C_t` likewise over rows, and
    :math:`u = g / \\sqrt{R_t C_t / \\mathrm{mean}(R_t)}`; otherwise
    :math:`v_t = \\beta_t v_{t-1} + (1-\\beta_t) G`, :math:`u = g/\\sqrt{v_t}`.
    """
    _validate.check("scale_by_factored_rms", {"step_offset": _validate.COUNT, "epsilon": _validate.NONNEG},
                    decay_rate=decay_rate, step_offset=step_offset,
                    min_dim_size_to_factor=min_dim_size_to_factor, epsilon=epsilon)

    def init(params):
        def per(p):
            # each factor takes the parameter's sharding along the axes it keeps
            dims = _factored_dims(p.shape, factored, min_dim_size_to_factor)
            z1 = replicated_like(p, jnp.zeros((1,), p.dtype))
            if dims is not None:
                d1, d0 = dims
                axes = range(p.ndim)
                return (zeros_for_axes(p, [a for a in axes if a != d0]),
                        zeros_for_axes(p, [a for a in axes if a != d1]), z1)
            return z1, z1, full_like_param(p)

        leaves, td = jax.tree_util.tree_flatten(params)
        parts = [per(p) for p in leaves]
        return FactoredState(jnp.zeros([], jnp.int32),
                             jax.tree_util.tree_unflatten(td, [q[0] for q in parts]),
                             jax.tree_util.tree_unflatten(td, [q[1] for q in parts]),
                             jax.tree_util.tree_unflatten(td, [q[2] for q in parts]))

    @mark_extra
    def update(updates, state, params=None, **extra):
        _need_params(params, "scale_by_factored_rms")
        beta = decay_rate_fn(state.count - step_offset, decay_rate)
        gl, td = jax.tree_util.tree_flatten(updates)
        rows = td.flatten_up_to(state.v_row)
        cols = td.flatten_up_to(state.v_col)
        vs = td.flatten_up_to(state.v)
        outs, nr, nc, nv = [], [], [], []
        for g, vr, vc, v in zip(gl, rows, cols, vs):
            dims = _factored_dims(g.shape, factored, min_dim_size_to_factor)
            g2 = jnp.real(jnp.conj(g) * g) + epsilon
            if dims is not None:
                d1, d0 = dims
                r = (beta * vr + (1.0 - beta) * jnp.mean(g2, axis=d0)).astype(vr.dtype)
                c = (beta * vc + (1.0 - beta) * jnp.mean(g2, axis=d1)).astype(vc.dtype)
                rd1 = d1 - 1 if d1 > d0 else d1
                row_factor = (r / jnp.mean(r, axis=rd1, keepdims=True)) ** -0.5
                col_factor = c ** -0.5
                out = g * jnp.expand_dims(row_factor, d0) * jnp.expand_dims(col_factor, d1)
                nr.append(r)
                nc.append(c)
                nv.append(v)
            else:
                nv_ = (beta * v + (1.0 - beta) * g2).astype(v.dtype)
                out = g * nv_ ** -0.5
                nr.append(vr)
                nc.append(vc)
                nv.append(nv_)
            outs.append(out.astype(g.dtype))
        un = lambda xs: jax.tree_util.tree_unflatten(td, xs)  # noqa: E731
        return un(outs), FactoredState(safe_increment(state.count), un(nr), un(nc), un(nv))

    return GradientTransformation(init, update)


def scale_by_trust_ratio(min_norm=0.0, trust_coefficient=1.0, eps=0.0):
    """LARS/LAMB trust ratio per leaf: :math:`u \\leftarrow u\\cdot c\\,\\|\\theta\\|/(\\|u\\|+\\epsilon)`
    (1 where either norm is 0)."""
    _validate.check("scale_by_trust_ratio", min_norm=min_norm, trust_coefficient=trust_coefficient, eps=eps)

    def f(u, p):
        pn = _safe_norm(p, min_norm)
        un = _safe_norm(u, min_norm)
        ratio = trust_coefficient * pn / (un + eps)
        ratio = jnp.where((pn == 0.0) | (un == 0.0), jnp.array(1.0, p.dtype), ratio)
        return (u * ratio).astype(u.dtype)

    return _per_leaf("scale_by_trust_ratio", f, needs_params=True)


class ScaleByNovogradState(NamedTuple):
    count: jax.Array
    mu: object
    nu: object


def scale_by_novograd(b1=0.9, b2=0.25, eps=1e-8, eps_root=0.0, weight_decay=0.0, mu_dtype=None):
    """NovoGrad: per-leaf :math:`n_t = \\beta_2 n_{t-1} + (1-\\beta_2)\\|g_t\\|^2` (:math:`n_1 =
    \\|g_1\\|^2`), :math:`m_t = \\beta_1 m_{t-1} + g_t/(\\sqrt{n_t+\\epsilon_{root}}+\\epsilon) +
    \\lambda\\theta` (:math:`m_1` without the :math:`\\beta_1` term), :math:`u_t = m_t`."""
    _validate.check("scale_by_novograd", b1=b1, b2=b2, eps=eps, eps_root=eps_root, weight_decay=weight_decay)

    def init(params):
        mu = jax.tree.map(lambda p: full_like_param(p, 0.0, mu_dtype), params)
        nu = jax.tree.map(lambda p: replicated_like(p, jnp.zeros([], p.dtype)), params)
        return ScaleByNovogradState(jnp.zeros([], jnp.int32), mu, nu)

    @mark_extra
    def update(updates, state, params=None, **extra):
        _need_params(params, "scale_by_novograd")
        count = safe_increment(state.count)
        first = count == 1

        def per_nu(g, n):
            sq = jnp.sum(jnp.real(jnp.conj(g) * g))
            return jnp.where(first, sq, b2 * n + (1 - b2) * sq).astype(n.dtype)

        nu = jax.tree.map(per_nu, updates, state.nu)

        def per_mu(g, p, n, m):
            add = g / (jnp.sqrt(n + eps_root) + eps) + weight_decay * p
            return jnp.where(first, add, b1 * m + add).astype(m.dtype)

        mu = jax.tree.map(per_mu, updates, params, nu, state.mu)
        out = jax.tree.map(lambda m, g: m.astype(g.dtype), mu, updates)
        return out, ScaleByNovogradState(count, mu, nu)

    return GradientTransformation(init, update)


class ScaleBySM3State(NamedTuple):
    mu: object
    nu: object


def scale_by_sm3(b1=0.9, b2=1.0, eps=1e-8):
    """SM3 (Anil et al. 2019): one accumulator per axis; the per-element accumulator is
    :math:`a = g^2 + \\min_i \\mu_i` (broadcast), :math:`\\mu_i \\leftarrow \\max` of :math:`a`
    over the other axes, update :math:`\\nu_t = \\beta_1 \\nu_{t-1} + (1-\\beta_1) g/\\sqrt{a+\\epsilon}`."""
    _validate.check("scale_by_sm3", {"b2": _validate.UNIT}, b1=b1, b2=b2, eps=eps)

    def init(params):
        def per(p):
            return [zeros_for_axes(p, [i]) for i in range(p.ndim)]

        leaves, td = jax.tree_util.tree_flatten(params)
        mu = [per(p) for p in leaves]
        return ScaleBySM3State(jax.tree_util.tree_unflatten(td, mu),
                               jax.tree.map(full_like_param, params))

    @mark_extra
    def update(updates, state, params=None, **extra):
        gl, td = jax.tree_util.tree_flatten(updates)
        mus = td.flatten_up_to(state.mu)
        nus = td.flatten_up_to(state.nu)
        new_mu, new_nu = [], []
        c0 = (1.0 - b2) if b2 != 1.0 else 1.0
        for g, ms, n0 in zip(gl, mus, nus):
            exp = [jnp.reshape(ms[i], [1] * i + [g.shape[i]] + [1] * (g.ndim - i - 1))
                   for i in range(g.ndim)]
            if g.ndim < 2:
                acc = c0 * g ** 2 + b2 * (exp[0] if exp else 0.0)
            else:
                mn = exp[0]
                for e in exp[1:]:
                    mn = jnp.minimum(mn, e)
                acc = c0 * g ** 2 + b2 * mn
            inv = jnp.where(acc > 0, jax.lax.rsqrt(acc + eps), 0.0)
            n = ((1 - b1) * (g * inv) + b1 * n0).astype(n0.dtype)
            if g.ndim < 2:
                nm = [acc] if g.ndim == 1 else []
            else:
                nm = [jnp.max(acc, axis=tuple(j for j in range(g.ndim) if j != i))
                      for i in range(g.ndim)]
            new_mu.append([m.astype(g.dtype) for m in nm])
            new_nu.append(n)
        un = lambda xs: jax.tree_util.tree_unflatten(td, xs)  # noqa: E731
        nu = un(new_nu)
        return nu, ScaleBySM3State(un(new_mu), nu)

    return GradientTransformation(init, update)


def scale_by_param_block_rms(min_scale=1e-3):
    """:math:`u \\leftarrow u\\cdot\\max(\\mathrm{rms}(\\theta), s_{min})` per leaf."""
    _validate.check("scale_by_param_block_rms", {"min_scale": _validate.NONNEG}, min_scale=min_scale)

    def f(u, p):
        rms = jnp.sqrt(jnp.mean(jnp.real(jnp.conj(p) * p)))
        return (u * jnp.maximum(rms, min_scale)).astype(u.dtype)

    return _per_leaf("scale_by_param_block_rms", f, needs_params=True)


def scale_by_param_block_norm(min_scale=1e-3):
    """:math:`u \\leftarrow u\\cdot\\max(\\|\\theta\\|_2, s_{min})` per leaf."""
    _validate.check("scale_by_param_block_norm", {"min_scale": _validate.NONNEG}, min_scale=min_scale)

    def f(u, p):
        return (u * _safe_norm(p, min_scale)).astype(u.dtype)

    return _per_leaf("scale_by_param_block_norm", f, needs_params=True)


def clip_by_block_rms(threshold):
    """Per leaf: :math:`u \\leftarrow u / \\max(1, \\mathrm{rms}(u)/c)`."""
    _validate.check("clip_by_block_rms", {"threshold": _validate.Rule(lo=0.0, lo_open=True, inf_ok=True)},
                    threshold=threshold)

    def f(u):
        rms = jnp.sqrt(jnp.mean(jnp.real(jnp.conj(u) * u)))
        denom = jnp.maximum(1.0, rms / threshold)
        return (u / denom).astype(u.dtype)

    return _per_leaf("clip_by_block_rms", f, needs_params=False)


def _unitwise_norm(x, axis=None):
    if axis is not None:
        return jnp.sqrt(jnp.sum(x * x, axis=axis, keepdims=True))
    if x.ndim <= 1:
        return jnp.sqrt(jnp.sum(x * x))
    if x.ndim in (2, 3):
        ax = 0
    elif x.ndim == 4:  # conv kernels HWIO
        ax = (0, 1, 2)
    elif x.ndim == 5:  # 3-D conv kernels DHWIO
        ax = (0, 1, 2, 3)
    else:
        raise ValueError(f"adaptive_grad_clip: unsupported parameter rank {x.ndim} "
                         f"(shape {x.shape}); pass `axis`")
    return jnp.sqrt(jnp.sum(x * x, axis=ax, keepdims=True))


def adaptive_grad_clip(clipping, eps=1e-3, axis=None):
    """AGC (Brock et al. 2021): :math:`u \\leftarrow u\\cdot\\min(1, \\lambda\\max(\\|\\theta\\|,
    \\epsilon)/\\|u\\|)` with unit-wise norms."""
    _validate.check("adaptive_grad_clip", {"clipping": _validate.NONNEG}, clipping=clipping, eps=eps)

    def f(g, p):
        g_norm = _unitwise_norm(g, axis)
        p_norm = _unitwise_norm(p, axis)
        max_norm = jnp.maximum(p_norm, eps) * clipping
        trigger = g_norm < max_norm
        clipped = g * (max_norm / jnp.maximum(g_norm, 1e-6))
        return jnp.where(trigger, g, clipped).astype(g.dtype)

    return _per_leaf("adaptive_grad_clip", f, needs_params=True)


def centralize():
    """Gradient centralisation: subtract the mean over all axes but the first, for ndim > 1."""

    def f(u):
        if u.ndim <= 1:
            return u
        return u - jnp.mean(u, axis=tuple(range(1, u.ndim)), keepdims=True)

    return _per_leaf("centralize", f, needs_params=False)


_ = EmptyState
