"""Attention through cuDNN's fused kernel: ``jax.nn.dot_product_attention(implementation="cudnn")``.

On NVIDIA GPUs cuDNN's flash attention is the fastest path for the plain cases (16-bit
inputs, causal or full, grouped-query heads, head dim up to 128); this implementation hands
those calls to it, so default dispatch on a GPU is never slower than what a user would call
instead. Everything cuDNN's fused kernel does not take (soft-capping, local windows,
lengths and segment ids, a bias or a dense mask, dropout, float32) is refused by
:func:`supports` with the reason, and dispatch moves on to the Pallas kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from cairn.kernels._attention.common import AttentionSpec
from cairn.kernels._registry import Implementation, backend

_HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def run(q: jax.Array, k: jax.Array, v: jax.Array, *, config: Mapping[str, Any], interpret: bool,
        **kw: Any) -> jax.Array:
    """``Implementation.fn`` of ``cudnn`` (no config keys)."""
    del config, interpret
    spec: AttentionSpec = kw["spec"]
    return jax.nn.dot_product_attention(q, k, v, scale=spec.scale, is_causal=spec.is_causal, implementation="cudnn")


@functools.cache
def _nvidia_here() -> bool:
    """A CUDA GPU is this process's default device (cuDNN is asked for its version at
    lowering, so cross-compiling for a GPU from a CPU host cannot use it)."""
    if jax.default_backend() != "gpu":
        return False
    return "nvidia" in jax.devices()[0].device_kind.lower()


def supports(q: jax.Array, k: jax.Array, v: jax.Array, **kw: Any) -> str | None:
    """``None``, or why cuDNN's fused attention cannot take these arguments."""
    spec: AttentionSpec = kw["spec"]
    refusals = (
        (kw.get("bias") is not None or kw.get("mask") is not None, "a bias or dense mask is not taken here"),
        (kw.get("dropout_rate", 0.0) > 0.0, "dropout is not taken here"),
        (spec.soft_cap is not None, "cuDNN's fused attention has no logits soft-capping"),
        (spec.window is not None, "local windows are not taken here"),
        (spec.use_segments, "lengths and segment ids are not taken here"),
        (any(jnp.dtype(x.dtype) not in _HALF for x in (q, k, v)), "cuDNN's fused attention takes float16/bfloat16"),
        (q.shape[-1] != v.shape[-1] or q.shape[-1] > 128 or q.shape[-1] % 8,
         f"head dims {q.shape[-1]}/{v.shape[-1]}: equal, a multiple of 8 and at most 128"),
        (backend() != "gpu" or not _nvidia_here(), "cuDNN runs on an NVIDIA GPU present in this process only"),
    )
    for refused, reason in refusals:
        if refused:
            return reason
    return None


IMPLEMENTATION = Implementation(
    op="dot_product_attention",
    name="cudnn",
    fn=run,
    platforms=frozenset({"gpu"}),
    configs=lambda *a, **k: [{}],
    default_config=lambda *a, **k: {},
    supports=supports,
)
