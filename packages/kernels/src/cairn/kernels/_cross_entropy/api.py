"""``linear_softmax_cross_entropy_loss``: the loss of a final projection without the logits.

Tokamax's name and arguments. Implementations under op ``"linear_softmax_cross_entropy_loss"``:
``xla`` (token-chunked, the gradient computed with the loss under differentiation),
``pallas_triton`` and ``pallas_mosaic_gpu`` (fused forward kernels: the projection and an
online logsumexp over vocabulary blocks; the chunked XLA backward).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn.core_array import QArray
from cairn.kernels import _registry
from cairn.kernels._cross_entropy.xla import cross_entropy_xla
from cairn.kernels._quantized.common import split_scale
from cairn.kernels._registry import (
    call,
    register_builtin,
)

__all__ = ["linear_softmax_cross_entropy_loss"]

OP = "linear_softmax_cross_entropy_loss"
REDUCTIONS = ("sum", "mean")


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _bucket(x: Any, labels: Any, weights: Any, **kwargs: Any) -> tuple[Any, ...]:
    return (_pow2(x.shape[0]), x.shape[1], weights.shape[1], jnp.dtype(x.dtype).name, kwargs.get("reduction", "sum"))


def _xla_default(x: Any, labels: Any, weights: Any, **_: Any) -> dict[str, Any]:
    # A CPU: chunks of about 2M float32 logits (8 MiB, cache-sized). A GPU: about 64M (256
    # MiB), since every token chunk reads the whole weight, and the gradient pass adds its
    # share into the whole float32 [hidden, vocab] weight gradient: 16-row chunks of a
    # 128256 vocabulary made both 512 times over (0.07x of the naive form on an H200)
    budget = 2 * 1024 * 1024 if _registry.backend() == "cpu" else 64 * 1024 * 1024
    per = max(128, (budget // max(1, x.shape[0])) // 128 * 128)  # a multiple of 128 columns
    rows = max(8, min(budget // 2048, (budget // max(1, weights.shape[1])) // 8 * 8))  # a multiple of 8
    return {"block_v": int(min(per, budget // 256)), "block_b": int(rows)}


def _xla_configs(*_: Any, **__: Any) -> list[dict[str, Any]]:
    return [{"block_v": v, "block_b": b} for v in (1024, 4096) for b in (32, 128, 512)]


register_builtin(
    OP, bucket=_bucket, xla=cross_entropy_xla, xla_configs=_xla_configs, xla_default_config=_xla_default,
    gpu={"pallas_triton": "cairn.kernels._cross_entropy.pallas_triton",
         "pallas_mosaic_gpu": "cairn.kernels._cross_entropy.pallas_mosaic"},
)


def _check(x: Any, labels: Any, weights: Any, reduction: str, precision: Any) -> None:
    xs, ls, ws = tuple(np.shape(x)), tuple(np.shape(labels)), tuple(weights.shape)
    if len(xs) != 2:
        raise ValueError(f"x must be 2-d [tokens, hidden], got shape {xs}")
    if len(ws) != 2 or ws[0] != xs[1]:
        raise ValueError(f"weights must be [hidden={xs[1]}, vocab], got shape {ws}")
    if ls != (xs[0],):
        raise ValueError(f"labels must have shape ({xs[0]},) (one label per token of x), got {ls}")
    if not jnp.issubdtype(jnp.result_type(labels), jnp.integer):
        raise TypeError(f"labels must be integer class indices, got dtype {jnp.result_type(labels)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def linear_softmax_cross_entropy_loss(
    x: jax.Array,
    labels: jax.Array,
    weights: jax.Array | QArray,
    *,
    reduction: str = "sum",
    precision: Any = None,
    implementation: str | tuple[str, ...] | None = None,
) -> jax.Array:
    """``reduction_i(logsumexp(x_i @ weights) - (x_i @ weights)[labels_i])`` without the logits.

    The ``[tokens, vocab]`` logits are never stored. The loss alone: the XLA
    implementation walks the vocabulary in chunks with an online logsumexp, the Triton
    kernel keeps each block's logits on chip. Under differentiation the XLA
    implementation computes the gradient with the loss, one token chunk (all its logits)
    at a time, so a training step costs the naive form's three matmuls; the Triton
    implementation's backward recomputes each vocabulary chunk. Peak extra memory is one
    chunk of logits instead of all of them (and their gradient).

    Args:
      x: ``[tokens, hidden]``, the last hidden states.
      labels: integer ``[tokens]``, class indices in ``[0, vocab)``.
      weights: ``[hidden, vocab]`` projection, or a ``QArray`` of it: with a per-vocabulary
        column (or per-tensor) scale its integer values enter the matmuls and the scale
        multiplies each chunk's logits (``xla`` implementation; no weight gradient);
        other layouts are dequantized first.
      reduction: ``"sum"`` (Tokamax's default) or ``"mean"`` over tokens.
      precision: ``jax.lax`` precision of the projections.
      implementation: ``"xla"``, ``"pallas_triton"``, ``"pallas_mosaic_gpu"``, a sequence, or ``None``.

    Returns:
      The scalar float32 loss.

    Raises:
      ValueError: shapes that do not fit (naming ``x``, ``labels`` or ``weights``), an
        unknown ``reduction`` or implementation, a config that does not fit.
      TypeError: non-integer ``labels``.

    >>> import jax.numpy as jnp
    >>> loss = linear_softmax_cross_entropy_loss(jnp.ones((2, 3)), jnp.array([0, 1]), jnp.zeros((3, 4)))
    >>> round(float(loss), 4)  # 2 tokens x log(4)
    2.7726
    """
    _check(x, labels, weights, reduction, precision)
    if isinstance(weights, QArray):
        values, scale = split_scale(weights, contracting=(0,))
        if scale is not None:  # integer values in the matmuls, the column scale on the logits
            col = jnp.broadcast_to(scale, (1, weights.shape[1]))
            return call(OP, x, labels, values, implementation=implementation, reduction=reduction,
                        precision=precision, col_scale=col)
        weights = values.astype(x.dtype)
    return call(OP, x, labels, weights, implementation=implementation, reduction=reduction, precision=precision)
