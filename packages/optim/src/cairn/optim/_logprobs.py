"""Log-probabilities of given tokens under a model's logits, per token and per sequence.

The post-training losses (:mod:`cairn.optim._preference_losses`,
:mod:`cairn.optim._policy_losses`) take log-probabilities, not logits: these two
functions make them.

**Alignment.** ``logits[..., t, :]`` is the distribution that scores
``tokens[..., t]``: the two are *aligned*, nothing is shifted here. A causal
language model's output at position ``t`` predicts the input token at ``t + 1``,
so for a model run on ``input_ids`` pass ``logits[..., :-1, :]``,
``input_ids[..., 1:]`` and ``mask[..., 1:]``.

**Dtype.** The result is float32 for bfloat16/float16/float32 logits (float64
for float64 logits): a log-probability rounded to bfloat16 is off by about
``|log p| * 2**-8`` (0.02 at ``log p = -5``), which moves an importance ratio
``exp(log p - log p_old)`` by 2% and would trip a PPO clip on its own.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["sequence_logprobs", "token_logprobs"]



def bool_mask(fn: str, mask: Any, shape: tuple, like: str) -> jax.Array:
    """``mask`` (bool or 0/1, or None for all) as a bool array of ``shape``, the shape of the
    argument named ``like``; a ValueError naming ``fn`` otherwise."""
    if mask is None:
        return jnp.ones(shape, bool)
    m = jnp.asarray(mask)
    if m.shape != shape:
        raise ValueError(f"{fn}: `mask` must have the shape of `{like}` {shape}, got {m.shape}")
    return m != 0

def _checked(fn: str, logits, tokens, mask) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(logits in >= 32 bits, tokens, boolean mask)`` after the shape and dtype checks."""
    x = jnp.asarray(logits)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{fn}: `logits` must have a floating dtype, got {x.dtype}")
    if x.ndim < 2:
        raise ValueError(
            f"{fn}: `logits` must have shape [..., T, V] (at least 2 axes), got {x.shape}"
        )
    tok = jnp.asarray(tokens)
    if not jnp.issubdtype(tok.dtype, jnp.integer):
        raise TypeError(f"{fn}: `tokens` must have an integer dtype, got {tok.dtype}")
    if tok.shape != x.shape[:-1]:
        raise ValueError(
            f"{fn}: `tokens` must have logits' shape without the vocabulary axis, i.e. "
            f"{x.shape[:-1]}, got {tok.shape} (logits.shape={x.shape})"
        )
    m = bool_mask(fn, mask, tok.shape, "tokens")
    if not isinstance(tokens, jax.core.Tracer) and not isinstance(mask, jax.core.Tracer):
        _check_token_range(fn, tokens, mask, x.shape[-1])
    if x.dtype.itemsize < 4:
        x = x.astype(jnp.float32)
    return x, tok, m


def _check_token_range(fn: str, tokens, mask, vocab: int) -> None:
    """Raise when a concrete *selected* token lies outside ``[0, vocab)``.

    Unselected positions may hold anything (``-100`` padding, as Hugging Face labels do)."""
    t = np.asarray(tokens)
    sel = np.ones(t.shape, bool) if mask is None else np.asarray(mask) != 0
    bad = sel & ((t < 0) | (t >= vocab))
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{fn}: `tokens` must lie in [0, {vocab}) (the vocabulary size, logits' last "
            f"axis) where `mask` selects them; tokens{list(where)} = {int(t[where])}"
        )


def token_logprobs(
    logits: jax.typing.ArrayLike,
    tokens: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    r"""Per-token log-probabilities :math:`\log \operatorname{softmax}(x_t)_{y_t}`.

    .. math:: \ell_t = m_t \Bigl(x_{t, y_t} - \log \sum_v e^{x_{t, v}}\Bigr)

    computed as the gathered logit minus a max-shifted log-sum-exp, so the
    ``[..., T, V]`` log-softmax is never materialised. ``logits[..., t, :]``
    scores ``tokens[..., t]`` (aligned, see the module docstring for a causal
    LM's shift).

    Args:
      logits: floating ``[..., T, V]``.
      tokens: integer ``[..., T]``, in ``[0, V)`` where ``mask`` is set (elsewhere
        anything, e.g. ``-100`` padding).
      mask: ``[..., T]`` bool or 0/1 (nonzero selects); None selects every token.

    Returns:
      ``[..., T]`` float32 (float64 for float64 logits); 0 where ``mask`` is
      unset, with gradient 0 there.

    Raises:
      TypeError: non-floating ``logits`` or non-integer ``tokens``.
      ValueError: mismatched shapes, or (when concrete) a selected token outside
        ``[0, V)``.

    >>> from cairn.optim import losses
    >>> logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
    >>> lp = losses.token_logprobs(logits, jnp.array([[0, 2]]))
    >>> print(np.asarray(lp, float).round(4))
    [[-0.6931 -0.2231]]
    """
    fn = "token_logprobs"
    x, tok, m = _checked(fn, logits, tokens, mask)
    return _token_logprobs(x, tok, m)


def _token_logprobs(x: jax.Array, tok: jax.Array, m: jax.Array) -> jax.Array:
    safe_tok = jnp.where(m, tok, 0).astype(jnp.int32)
    picked = jnp.take_along_axis(x, safe_tok[..., None], axis=-1)[..., 0]
    lp = picked - jax.nn.logsumexp(x, axis=-1)
    return jnp.where(m, lp, 0.0)


def sequence_logprobs(
    logits: jax.typing.ArrayLike,
    tokens: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike | None = None,
    *,
    average: bool = False,
) -> jax.Array:
    r"""Log-probability of each sequence's selected tokens, summed or length-averaged.

    .. math::

        \log \pi(y) = \sum_t m_t \log \operatorname{softmax}(x_t)_{y_t},
        \qquad \text{average: } \frac{1}{\sum_t m_t} \sum_t m_t \log \operatorname{softmax}(x_t)_{y_t}

    ``mask`` selects the completion tokens (the prompt and the padding are left
    out). DPO and IPO use the sum (the sequence log-likelihood); SimPO and ORPO
    use the average.

    ``logits[..., t, :]`` scores ``tokens[..., t]``: aligned, not shifted. For a
    causal LM run on ``input_ids`` (output ``t`` predicts input ``t + 1``):
    ``sequence_logprobs(logits[:, :-1], input_ids[:, 1:], completion_mask[:, 1:])``.

    A row with no selected token gives 0 (the empty sum; the average divides by
    ``max(count, 1)``), with gradient 0: a trainer should reject empty
    completions before they get here (``mask.sum(-1) == 0``).

    Args:
      logits: floating ``[..., T, V]``.
      tokens: integer ``[..., T]``, in ``[0, V)`` where ``mask`` is set.
      mask: ``[..., T]`` bool or 0/1 (nonzero selects); None selects every token.
      average: divide by the number of selected tokens of each sequence.

    Returns:
      ``[...]`` float32 (float64 for float64 logits), one value per sequence.

    Raises:
      TypeError: non-floating ``logits`` or non-integer ``tokens``.
      ValueError: mismatched shapes, or (when concrete) a selected token outside
        ``[0, V)``.

    >>> from cairn.optim import losses
    >>> logits = jnp.log(jnp.array([[[0.5, 0.5], [0.25, 0.75], [0.9, 0.1]]]))
    >>> tokens, mask = jnp.array([[0, 1, 0]]), jnp.array([[0, 1, 1]])
    >>> total = losses.sequence_logprobs(logits, tokens, mask)     # log 0.75 + log 0.9
    >>> mean = losses.sequence_logprobs(logits, tokens, mask, average=True)
    >>> print(np.asarray(total, float).round(4), np.asarray(mean, float).round(4))
    [-0.393] [-0.1965]
    """
    fn = "sequence_logprobs"
    x, tok, m = _checked(fn, logits, tokens, mask)
    total = jnp.sum(_token_logprobs(x, tok, m), axis=-1)
    if not average:
        return total
    count = jnp.sum(m, axis=-1).astype(total.dtype)
    return total / jnp.maximum(count, 1.0)
