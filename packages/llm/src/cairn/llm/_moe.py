"""The mixture-of-experts MLP (Qwen3-MoE): top-k softmax routing, experts through ``ragged_dot``.

For tokens ``x [N, hidden]``, router kernel ``R [hidden, E]`` and experts ``e`` with
SwiGLU weights ``G_e, U_e [hidden, m]``, ``D_e [m, hidden]``::

    p = softmax(x R)                         # [N, E], in float32
    w, idx = top_k(p, k)                     # each token's k experts and their probabilities
    w = w / sum(w)   if norm_topk_prob       # renormalized over the chosen k
    y = sum_j w_j * D_idx_j(act(x G_idx_j) * (x U_idx_j))

The ``N * k`` (token, expert) pairs are sorted by expert, so each expert's rows are one
consecutive group, and the three matmuls are ``cairn.kernels.ragged_dot`` over the stacked
``[E, in, out]`` kernels with the group sizes; the weighted rows are added back to their
tokens. No token is dropped (no capacity factor), as in the reference implementation.

:func:`load_balancing_loss` is the auxiliary loss that keeps routing balanced in training
(Switch Transformer's, as transformers computes it for Qwen3-MoE and Mixtral).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

import cairn.kernels as ck
from cairn import nn
from cairn.llm import _initializers as initializers
from cairn.llm._activations import ACTIVATIONS
from cairn.llm._config import LlmConfig
from cairn.llm._projection import project

__all__ = ["MoE", "load_balancing_loss", "route"]


def route(router_logits: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """``(weights [N, k] float32, experts [N, k] int32)`` of router logits ``[N, E]``: the
    ``k`` largest softmax probabilities of each row (largest first), renormalized to sum
    to 1 when ``norm_topk_prob``."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def load_balancing_loss(router_logits: Sequence[jax.Array], k: int, mask: jax.Array | None = None) -> jax.Array:
    """The auxiliary load-balancing loss of the router logits of every MoE layer.

    With ``f_e`` the fraction of (token, top-k slot) assignments that go to expert ``e``
    and ``P_e`` the mean router probability of ``e``, both over every layer's tokens,
    ``loss = E * sum_e f_e * P_e`` (Switch Transformer, eqs. 4-6, as transformers computes
    it: ``f`` sums to ``k``; the loss is ``k`` when routing is uniform and grows as it
    concentrates). Gradients reach the routers through ``P``.

    Args:
      router_logits: one ``[N, E]`` array per MoE layer (the same ``N`` tokens).
      k: experts per token (``num_experts_per_tok``).
      mask: optional ``[N]`` weights (1 for real tokens, 0 for padding) excluding tokens.

    Returns:
      A float32 scalar (0 when there is no MoE layer).

    >>> import jax.numpy as jnp
    >>> float(load_balancing_loss([jnp.zeros((6, 4))], k=2))   # uniform router: k
    2.0
    """
    if not router_logits:
        return jnp.zeros((), jnp.float32)
    num_experts = router_logits[0].shape[-1]
    m = jnp.ones(router_logits[0].shape[0], jnp.float32) if mask is None else jnp.asarray(mask, jnp.float32)
    counts = jnp.zeros(num_experts, jnp.float32)
    prob_sum = jnp.zeros(num_experts, jnp.float32)
    for logits in router_logits:
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        _, chosen = jax.lax.top_k(probs, k)
        counts = counts + jnp.sum(jax.nn.one_hot(chosen, num_experts) * m[:, None, None], axis=(0, 1))
        prob_sum = prob_sum + jnp.sum(probs * m[:, None], axis=0)
    rows = len(router_logits) * jnp.sum(m)
    return num_experts * jnp.sum((counts / rows) * (prob_sum / rows))


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs, stacked: ``gate``, ``up [E, hidden, m]``, ``down [E, m, hidden]``."""

    def __init__(self, cfg: LlmConfig, *, dtype: Any, rngs: nn.Rngs) -> None:
        e, d, m = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size

        def param(shape: tuple[int, ...], names: tuple[str, ...]) -> nn.Param:
            init = initializers.normal(names)
            return nn.Param(init(rngs.params(), shape, dtype))

        self.gate = param((e, d, m), ("expert", "embed", "mlp"))
        self.up = param((e, d, m), ("expert", "embed", "mlp"))
        self.down = param((e, m, d), ("expert", "mlp", "embed"))


class MoE(nn.Module):
    """The sparse MLP block: ``router`` (``[hidden, E]``, no bias) and stacked ``experts``.

    ``moe(x [..., hidden]) -> (y [..., hidden], router_logits [N, E])`` with ``N`` the
    number of tokens (``x``'s leading dims flattened).
    """

    def __init__(self, cfg: LlmConfig, *, dtype: Any, rngs: nn.Rngs) -> None:
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, use_bias=False, dtype=dtype, param_dtype=dtype,
                                kernel_init=initializers.normal(("embed", None)),
                                rngs=rngs)
        self.experts = Experts(cfg, dtype=dtype, rngs=rngs)
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.act = cfg.hidden_act

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        tokens = x.reshape(-1, x.shape[-1])
        held = sorted(k for k in vars(self.experts) if k.endswith("_awq_scale"))
        if held:
            raise ValueError(f"MoE experts hold AWQ input scales {held}: the experts' ragged_dot does not apply "
                             "them; select dense projections only (attn and dense mlp kernels, lm_head)")
        logits = project(self.router, tokens)
        weights, chosen = route(logits, self.top_k, self.norm_topk_prob)
        gate, up, down = self.experts.gate[...], self.experts.up[...], self.experts.down[...]
        flat = chosen.reshape(-1)
        order = jnp.argsort(flat, stable=True)            # (token, slot) pairs grouped by expert
        token = order // self.top_k
        sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
        rows = tokens[token]
        h = ACTIVATIONS[self.act](ck.ragged_dot(rows, gate, sizes)) * ck.ragged_dot(rows, up, sizes)
        out = ck.ragged_dot(h, down, sizes)
        out = out * weights.reshape(-1)[order][:, None].astype(logits.dtype)
        y = jnp.zeros_like(tokens).at[token].add(out.astype(tokens.dtype))
        return y.reshape(x.shape), logits
