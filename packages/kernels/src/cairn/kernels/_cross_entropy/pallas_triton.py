"""Linear softmax cross-entropy, the Pallas Triton forward kernel.

One program per block of ``block_b`` tokens loops over vocabulary blocks of ``block_v``
columns; each block's logits ``x[tokens] @ w[:, cols]`` accumulate over hidden blocks of
``block_h`` in float32 and fold into the running max, sum of exponentials and label logit
(online logsumexp), so logits never leave the chip. It writes ``logsumexp`` and the label
logit per token; the backward is the chunked XLA backward of ``_cross_entropy_xla``.
Sizes that are not multiples of the blocks are zero-padded in the wrapper (padded
vocabulary columns are masked to ``-inf``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from cairn.kernels._cross_entropy.xla import make_loss
from cairn.kernels._registry import Implementation
from cairn.kernels._tiling import checked_config, pad_to_multiple

DEFAULT_CONFIG = {"block_b": 32, "block_v": 128, "block_h": 64, "block_v_bwd": 2048, "num_warps": 4, "num_stages": 2}


def check_config(config: Mapping[str, Any]) -> dict[str, int]:
    """The config with defaults filled in; raises ``ValueError`` naming a bad key."""
    return checked_config(config, DEFAULT_CONFIG, blocks=("block_b", "block_v", "block_h"), counts=("block_v_bwd",))


def _kernel(x_ref, w_ref, lab_ref, lse_ref, ll_ref, *, bb, bv, bh, nv, nh, v, precision):
    lab = lab_ref[...]

    def vbody(j, carry):
        m, s, ll = carry

        def hbody(h, acc):
            x = x_ref[:, pl.ds(h * bh, bh)]
            w = w_ref[pl.ds(h * bh, bh), pl.ds(j * bv, bv)]
            return acc + jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)

        logits = lax.fori_loop(0, nh, hbody, jnp.zeros((bb, bv), jnp.float32))
        cols = j * bv + lax.broadcasted_iota(jnp.int32, (bb, bv), 1)
        logits = jnp.where(cols < v, logits, -jnp.inf)
        new_m = jnp.maximum(m, jnp.max(logits, axis=1))
        s = s * jnp.exp(m - new_m) + jnp.sum(jnp.exp(logits - new_m[:, None]), axis=1)
        ll = ll + jnp.sum(jnp.where(cols == lab[:, None], logits, 0.0), axis=1)
        return new_m, s, ll

    init = (jnp.full((bb,), -jnp.inf, jnp.float32), jnp.zeros((bb,), jnp.float32), jnp.zeros((bb,), jnp.float32))
    m, s, ll = lax.fori_loop(0, nv, vbody, init)
    lse_ref[...] = m + jnp.log(s)
    ll_ref[...] = ll


def stats_triton(x: Any, labels: Any, w: Any, *, cfg: Any, interpret: Any, precision: Any=None) -> Any:
    """``(logsumexp, label_logit)`` per token from the Triton kernel."""
    b = x.shape[0]
    v = w.shape[1]
    bb, bv, bh = cfg["block_b"], cfg["block_v"], cfg["block_h"]
    xp = pad_to_multiple(pad_to_multiple(x, 0, bb), 1, bh)
    wp = pad_to_multiple(pad_to_multiple(w, 0, bh), 1, bv)
    lab = pad_to_multiple(labels.astype(jnp.int32), 0, bb)
    bp, hp = xp.shape
    kernel = functools.partial(
        _kernel, bb=bb, bv=bv, bh=bh, nv=wp.shape[1] // bv, nh=hp // bh, v=v, precision=precision
    )
    lse, ll = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((bp,), jnp.float32), jax.ShapeDtypeStruct((bp,), jnp.float32)),
        grid=(bp // bb,),
        in_specs=[
            pl.BlockSpec((bb, hp), lambda i: (i, 0)),
            pl.BlockSpec((hp, wp.shape[1]), lambda i: (0, 0)),
            pl.BlockSpec((bb,), lambda i: (i,)),
        ],
        out_specs=(pl.BlockSpec((bb,), lambda i: (i,)), pl.BlockSpec((bb,), lambda i: (i,))),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        name="cairn_linear_softmax_cross_entropy_fwd",
    )(xp, wp, lab)
    return lse[:b], ll[:b]


def cross_entropy_triton(
    x: jax.Array,
    labels: jax.Array,
    weights: jax.Array,
    *,
    config: Mapping[str, Any],
    interpret: bool = False,
    reduction: str = "sum",
    precision: Any = None,
) -> jax.Array:
    """The Pallas Triton implementation (Triton forward, chunked XLA backward)."""
    cfg = check_config(config)
    stats = functools.partial(stats_triton, cfg=cfg, interpret=interpret, precision=precision)
    block_v = min(cfg["block_v_bwd"], weights.shape[1])
    return make_loss(stats, block_v, precision)(x, labels, weights, reduction)


def configs(*_: Any, **__: Any) -> list[dict[str, Any]]:
    return [
        {**DEFAULT_CONFIG, "block_b": bb, "block_v": bv, "block_h": bh}
        for bb in (32, 64) for bv in (64, 128) for bh in (32, 64)
    ]


def supports(x: Any, labels: Any, weights: Any, *, col_scale: Any = None, **_: Any) -> str | None:
    if col_scale is not None:
        return "quantized weights run on the xla implementation"
    if jnp.dtype(x.dtype) != jnp.dtype(weights.dtype):
        return f"x and weights dtypes differ ({jnp.dtype(x.dtype).name}, {jnp.dtype(weights.dtype).name})"
    return None


IMPLEMENTATION = Implementation(
    "linear_softmax_cross_entropy_loss", "pallas_triton", cross_entropy_triton, frozenset({"gpu"}), configs=configs,
    default_config=lambda *a, **k: dict(DEFAULT_CONFIG), supports=supports,
)
