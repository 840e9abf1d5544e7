"""Dot-product attention, masks and ``MultiHeadAttention`` (grouped-query, KV cache).

Layout: queries ``(*batch, q_len, num_heads, head_dim)``, keys and values
``(*batch, kv_len, num_kv_heads, head_dim)`` with ``num_heads % num_kv_heads == 0``
(grouped-query attention: query head ``h`` reads kv head ``h // (num_heads //
num_kv_heads)``). Masks are boolean, True = attend, broadcastable to
``(*batch, num_heads, q_len, kv_len)``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax import lax

from cairn.nn import _checks
from cairn.nn._dropout import _own_stream, draw_key
from cairn.nn._linear import (
    DType,
    Initializer,
    LinearGeneral,
    check_input,
    default_bias_init,
    default_kernel_init,
    promote_dtype,
    sharding_kw,
)
from cairn.nn._module import Module
from cairn.nn._normalization import LayerNorm
from cairn.nn._rngs import Rngs
from cairn.nn._rope import apply_rotary_embedding
from cairn.nn._variables import Cache, Intermediate

__all__ = [
    "MultiHeadAttention",
    "combine_masks",
    "dot_product_attention",
    "dot_product_attention_weights",
    "make_attention_mask",
    "make_causal_mask",
]


# --- masks ---


def make_attention_mask(
    query_input: jax.Array,
    key_input: jax.Array,
    pairwise_fn: Callable[[jax.Array, jax.Array], jax.Array] = jnp.multiply,
    extra_batch_dims: int = 0,
    dtype: DType = jnp.float32,
) -> jax.Array:
    """``mask[..., 1, q, k] = pairwise_fn(query_input[..., q], key_input[..., k])``.

    The usual padding mask is ``make_attention_mask(q_ids > 0, k_ids > 0)``.

    Args:
      query_input: ``(..., q)`` query-side values (e.g. ``q_ids > 0``).
      key_input: ``(..., k)`` key-side values.
      pairwise_fn: combines a query and a key value (default: multiply, an AND for booleans).
      extra_batch_dims: leading axes to add to the result.
      dtype: the mask's dtype.

    Returns:
      ``(..., 1, q, k)``.
    """
    m = pairwise_fn(
        jnp.expand_dims(query_input, axis=-1), jnp.expand_dims(key_input, axis=-2)
    )
    m = jnp.expand_dims(m, axis=-3)
    m = m.reshape((1,) * extra_batch_dims + m.shape)
    return m.astype(dtype)


def make_causal_mask(x: jax.Array, extra_batch_dims: int = 0, dtype: DType = jnp.float32) -> jax.Array:
    """Causal mask ``(*batch, 1, len, len)`` for ``x`` of shape ``(*batch, len)``.

    Args:
      x: ``(*batch, len)`` (only the shape is read).
      extra_batch_dims: leading axes to add.
      dtype: the mask's dtype.
    """
    idx = jnp.broadcast_to(jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape)
    return make_attention_mask(idx, idx, jnp.greater_equal, extra_batch_dims, dtype)


def combine_masks(*masks: jax.Array | None, dtype: DType = jnp.float32) -> jax.Array | None:
    """Logical AND of the non-``None`` masks (all of equal rank), or ``None``.

    Args:
      masks: attention masks of equal rank, or None (skipped).
      dtype: the result's dtype.
    """
    ms = [m for m in masks if m is not None]
    if not ms:
        return None
    if len({m.ndim for m in ms}) != 1:
        raise ValueError(f"combine_masks: masks must have equal rank, got shapes {[m.shape for m in ms]}")
    out = ms[0].astype(bool)
    for m in ms[1:]:
        out = jnp.logical_and(out, m.astype(bool))
    return out.astype(dtype)


# --- functions ---


def _check_qkv(query, key, value=None):
    if query.ndim < 3 or key.ndim != query.ndim:
        raise ValueError(
            "attention expects query (*batch, q_len, heads, head_dim) and key/value of the same "
            f"rank; got query {tuple(query.shape)}, key {tuple(key.shape)}"
        )
    if query.shape[:-3] != key.shape[:-3]:
        raise ValueError(
            f"attention: batch dims differ, query {tuple(query.shape)} vs key {tuple(key.shape)}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"attention: query and key depths must match (head_dim), got query "
            f"{tuple(query.shape)} vs key {tuple(key.shape)}"
        )
    h, hk = query.shape[-2], key.shape[-2]
    if h % hk:
        raise ValueError(
            f"attention: num_heads {h} must be a multiple of num_kv_heads {hk} (query "
            f"{tuple(query.shape)}, key {tuple(key.shape)})"
        )
    if value is not None and (
        value.shape[:-1] != key.shape[:-1]
    ):
        raise ValueError(
            f"attention: key and value lengths must match (their shapes agree except in the "
            f"last axis), got key {tuple(key.shape)} and value {tuple(value.shape)}"
        )


def dot_product_attention_weights(
    query: jax.Array,
    key: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: DType | None = None,
    precision: Any = None,
    module: Module | None = None,
    promote_dtype: Callable[..., Any] = promote_dtype,
    is_causal: bool = False,
) -> jax.Array:
    r"""Attention weights ``softmax(q k^T / sqrt(d) + bias)`` over the unmasked keys.

    .. math::
       w_{hqk} = \frac{m_{hqk}\, e^{s_{hqk}}}{\sum_{k'} m_{hqk'}\, e^{s_{hqk'}}},\qquad
       s_{hqk} = \frac{q_{qh} \cdot k_{k,g(h)}}{\sqrt{d}} + b_{hqk}

    with ``m`` the mask (and ``k <= q`` when ``is_causal``; top-left aligned) and ``g(h)``
    the kv head of query head ``h``. The softmax runs in float32 (at least); fully masked
    rows give zero weights rather than NaN. Dropout (when ``dropout_rate > 0`` and not
    ``deterministic``) zeroes weights and rescales the rest by ``1 / (1 - dropout_rate)``.

    Args:
      query: ``(*batch, q_len, num_heads, head_dim)``.
      key: ``(*batch, kv_len, num_kv_heads, head_dim)``; ``num_kv_heads`` divides ``num_heads``.
      bias: broadcastable to ``(*batch, num_heads, q_len, kv_len)``, added to the logits.
      mask: boolean, broadcastable like ``bias``; True = attend.
      broadcast_dropout: one dropout mask shared over the batch axes.
      dropout_rng: PRNG key of the attention-weight dropout.
      dropout_rate: the dropout rate.
      deterministic: no dropout.
      dtype: computation dtype (``None``: promote ``query`` and ``key``).
      precision: einsum precision.
      promote_dtype: the promotion function.
      module: if given, the weights are sown: ``module.sow(Intermediate, 'attention_weights', w)``.
      is_causal: add the causal mask.

    Returns:
      The weights, ``(*batch, num_heads, q_len, kv_len)``, in the computation dtype.

    Raises:
      ValueError: shapes that do not fit (rank, batch, head_dim, heads); dropout without a key.

    >>> import jax.numpy as jnp
    >>> q = jnp.ones((1, 2, 1, 4)); k = jnp.ones((1, 3, 1, 4))
    >>> dot_product_attention_weights(q, k, is_causal=True)[0, 0].tolist()
    [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]]
    """
    _check_qkv(query, key)
    query, key = promote_dtype((query, key), dtype=dtype)
    dt = query.dtype
    *batch, q_len, h, d = query.shape
    kv_len, hk = key.shape[-3], key.shape[-2]
    g = h // hk
    q = query.reshape(*batch, q_len, hk, g, d) / jnp.sqrt(jnp.asarray(d, dt))
    logits = jnp.einsum("...qkgd,...lkd->...kgql", q, key, precision=precision)
    logits = logits.reshape(*batch, h, q_len, kv_len).astype(jnp.promote_types(jnp.float32, dt))
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)
    valid = None
    if mask is not None:
        valid = jnp.broadcast_to(mask.astype(bool), logits.shape)
    if is_causal:
        causal = jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None]
        valid = causal if valid is None else jnp.logical_and(valid, causal)
    if valid is not None:
        big_neg = jnp.finfo(logits.dtype).min
        logits = jnp.where(valid, logits, big_neg)
    w = jax.nn.softmax(logits, axis=-1)
    if valid is not None:
        w = jnp.where(valid, w, 0.0)
    if module is not None:
        module.sow(Intermediate, "attention_weights", w)
    if dropout_rate > 0.0 and not deterministic:
        w = _weight_dropout(w, len(batch), dropout_rng, dropout_rate, broadcast_dropout)
    return w.astype(dt)


def _weight_dropout(
    w: jax.Array, n_batch: int, rng: jax.Array | None, rate: float, broadcast: bool
) -> jax.Array:
    """Zeroes each weight with probability ``rate`` and rescales the rest by ``1 / (1 - rate)``;
    with ``broadcast`` one mask ``(heads, q_len, kv_len)`` serves every batch entry."""
    if rng is None:
        raise ValueError("dot_product_attention: dropout_rate > 0 needs a dropout_rng key")
    keep = 1.0 - rate
    dshape = (1,) * n_batch + w.shape[-3:] if broadcast else w.shape
    km = jax.random.bernoulli(rng, keep, dshape)
    return jnp.where(km, w / keep, 0.0)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: DType | None = None,
    precision: Any = None,
    module: Module | None = None,
    promote_dtype: Callable[..., Any] = promote_dtype,
    is_causal: bool = False,
) -> jax.Array:
    """``softmax(q k^T / sqrt(d) + bias, mask) v``, output ``(*batch, q_len, heads, head_dim_v)``.

    The weights are :func:`dot_product_attention_weights`'s (same arguments). Grouped-query
    attention is native: ``key``/``value`` may have fewer heads than ``query`` (a
    divisor); nothing is materialised per query head.

    Args:
      query: ``(*batch, q_len, num_heads, head_dim)``.
      key: ``(*batch, kv_len, num_kv_heads, head_dim)``.
      value: ``(*batch, kv_len, num_kv_heads, head_dim_v)``.
      bias: as for :func:`dot_product_attention_weights`.
      mask: as for :func:`dot_product_attention_weights`.
      broadcast_dropout: as for :func:`dot_product_attention_weights`.
      dropout_rng: as for :func:`dot_product_attention_weights`.
      dropout_rate: as for :func:`dot_product_attention_weights`.
      deterministic: as for :func:`dot_product_attention_weights`.
      dtype: as for :func:`dot_product_attention_weights`.
      precision: as for :func:`dot_product_attention_weights`.
      module: as for :func:`dot_product_attention_weights`.
      promote_dtype: as for :func:`dot_product_attention_weights`.
      is_causal: as for :func:`dot_product_attention_weights`.

    Returns:
      ``(*batch, q_len, num_heads, head_dim_v)`` in the computation dtype.

    Raises:
      ValueError: shapes that do not fit together (see
        :func:`dot_product_attention_weights`; also ``value`` differing from ``key``
        outside the last axis), or dropout without ``dropout_rng``.

    >>> import jax.numpy as jnp
    >>> q = jnp.ones((2, 5, 4, 8)); kv = jnp.ones((2, 7, 2, 8))
    >>> dot_product_attention(q, kv, kv).shape
    (2, 5, 4, 8)
    """
    _check_qkv(query, key, value)
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    w = dot_product_attention_weights(
        query, key, bias, mask, broadcast_dropout, dropout_rng, dropout_rate, deterministic,
        dtype, precision, module, promote_dtype, is_causal,
    )
    *batch, h, q_len, kv_len = w.shape
    hk = key.shape[-2]
    w = w.reshape(*batch, hk, h // hk, q_len, kv_len)
    out = jnp.einsum("...kgql,...lkd->...qkgd", w, value, precision=precision)
    return out.reshape(*batch, q_len, h, value.shape[-1])


@functools.lru_cache(maxsize=128)
def _accepted_kwargs(fn) -> frozenset[str] | None:
    """Keyword names ``fn`` accepts, or None when it takes ``**kwargs`` (accepts all)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return frozenset(sig.parameters)


# --- module ---


class _Sizes(NamedTuple):
    """``MultiHeadAttention``'s validated sizes (see :func:`_mha_sizes`)."""

    num_heads: int
    num_kv_heads: int
    in_features: int
    in_kv_features: int
    qkv_features: int
    out_features: int
    head_dim: int
    dropout_rate: float
    rope_base: float


def _mha_sizes(
    num_heads: Any,
    in_features: Any,
    qkv_features: Any,
    out_features: Any,
    num_kv_heads: Any,
    in_kv_features: Any,
    num_key_value_heads: Any,
    dropout_rate: Any,
    rope_base: Any,
    use_rope: bool,
) -> _Sizes:
    """Checks ``MultiHeadAttention``'s size arguments (in this order) and fills defaults."""
    if num_kv_heads is not None and num_key_value_heads is not None and (
        num_kv_heads != num_key_value_heads
    ):
        raise ValueError(
            f"MultiHeadAttention: num_kv_heads={num_kv_heads} and num_key_value_heads="
            f"{num_key_value_heads} disagree"
        )
    name = "MultiHeadAttention"
    num_heads = _checks.positive_int(name, "num_heads", num_heads)
    in_features = _checks.positive_int(name, "in_features", in_features)
    qkv_features = _checks.optional_positive_int(name, "qkv_features", qkv_features)
    out_features = _checks.optional_positive_int(name, "out_features", out_features)
    in_kv_features = _checks.optional_positive_int(name, "in_kv_features", in_kv_features)
    kvh = num_kv_heads if num_kv_heads is not None else num_key_value_heads
    kvh = num_heads if kvh is None else _checks.positive_int(name, "num_kv_heads", kvh)
    dropout_rate = _checks.rate(name, "dropout_rate", dropout_rate)
    rope_base = _checks.positive_float(name, "rope_base", rope_base)
    qkv_features = in_features if qkv_features is None else qkv_features
    if qkv_features % num_heads:
        raise ValueError(
            f"MultiHeadAttention: qkv_features {qkv_features} must be divisible by num_heads "
            f"{num_heads}"
        )
    if num_heads % kvh:
        raise ValueError(
            f"MultiHeadAttention: num_heads {num_heads} must be divisible by num_kv_heads {kvh}"
        )
    head_dim = int(qkv_features) // int(num_heads)
    if use_rope and head_dim % 2:
        raise ValueError(f"MultiHeadAttention: use_rope needs an even head_dim, got {head_dim}")
    return _Sizes(
        num_heads=int(num_heads),
        num_kv_heads=int(kvh),
        in_features=int(in_features),
        in_kv_features=int(in_kv_features if in_kv_features is not None else in_features),
        qkv_features=int(qkv_features),
        out_features=int(out_features if out_features is not None else in_features),
        head_dim=head_dim,
        dropout_rate=float(dropout_rate),
        rope_base=float(rope_base),
    )


class MultiHeadAttention(Module):
    """Multi-head (and grouped-query) dot-product attention with projections.

    .. math::
       q = x_q W_q,\\quad k = x_k W_k,\\quad v = x_v W_v,\\quad
       y = \\mathrm{attention\\_fn}(q, k, v)\\, W_{out}

    The projections are ``LinearGeneral`` layers to ``(heads, head_dim)`` (keys and values
    have ``num_kv_heads`` heads, query head ``h`` reads kv head ``h // (num_heads //
    num_kv_heads)``); queries and keys are optionally normalised per head (LayerNorm
    without bias) and rotated with RoPE before the attention. Parameters live at
    ``query/``, ``key/``, ``value/``, ``out/`` (``kernel``, ``bias``) and, with
    ``normalize_qk``, ``query_ln/scale`` and ``key_ln/scale``.

    Args:
      num_heads: query heads.
      in_features: size of the query input's last axis.
      qkv_features: total projected size, ``num_heads * head_dim`` (default ``in_features``).
      out_features: output size (default ``in_features``).
      num_kv_heads: key/value heads; must divide ``num_heads``; default ``num_heads``
        (plain multi-head attention); 1 is multi-query.
      in_kv_features: size of the key and value inputs' last axis (default ``in_features``).
      num_key_value_heads: an alias of ``num_kv_heads`` (Hugging Face's name).
      dtype: computation dtype (``None``: promote the inputs).
      param_dtype: parameter dtype.
      precision: matmul precision of every projection and of the attention.
      kernel_init: initialiser of the query, key and value kernels.
      bias_init: initialiser of their biases.
      out_kernel_init: initialiser of the output kernel (default ``kernel_init``).
      out_bias_init: initialiser of the output bias (default ``bias_init``).
      use_bias: add biases to the projections.
      kernel_metadata: metadata of the query, key and value kernels.
      bias_metadata: metadata of their biases.
      out_kernel_metadata: metadata of the output kernel.
      out_bias_metadata: metadata of the output bias.
      query_ln_scale_metadata: metadata of ``query_ln``'s scale (``normalize_qk``).
      key_ln_scale_metadata: metadata of ``key_ln``'s scale (``normalize_qk``).
      attention_fn: ``fn(query, key, value, *, mask, is_causal, dropout_rng, dropout_rate,
        broadcast_dropout, deterministic, dtype, precision, module)`` returning
        ``(*batch, q_len, num_heads, head_dim)``. Keyword arguments the function does not
        declare are not passed, so a kernel library's plain ``fn(q, k, v, *, mask=None,
        is_causal=False)`` plugs in directly. Keys/values arrive with ``num_kv_heads``.
      decode: use and update the KV cache created by :meth:`init_cache`.
      use_rope: rotate queries and keys with RoPE (``rope_base``) at their positions;
        during decode the positions continue from the cache index.
      normalize_qk: LayerNorm (no bias) on each query and key head (ViT-22B).
      rope_base: RoPE's base frequency (``> 0``).
      dropout_rate: attention-weight dropout rate; keys come from the ``dropout`` stream.
      broadcast_dropout: one dropout mask shared over the batch axes.
      deterministic: no dropout.
      rngs: the parameter (and dropout) key streams.
      keep_rngs: keep a fork of ``rngs`` for dropout at call time.

    Raises:
      TypeError: a size that is not an int.
      ValueError: a size that is not positive, ``num_kv_heads`` and
        ``num_key_value_heads`` that disagree, ``qkv_features`` not divisible by
        ``num_heads``, ``num_heads`` not divisible by ``num_kv_heads``, ``dropout_rate``
        outside ``[0, 1]``, ``rope_base <= 0``, or ``use_rope`` with an odd ``head_dim``.

    Decoding: ``init_cache((batch, max_length, in_features))`` allocates ``cached_key``,
    ``cached_value`` ``(batch, max_length, num_kv_heads, head_dim)`` and ``cache_index``.
    Each ``decode=True`` call appends its ``L`` new keys/values (``L`` may be more than one,
    e.g. a prompt) at ``cache_index`` and lets query ``i`` attend to cached positions
    ``<= cache_index + i``; the result equals the full causal forward.

    >>> import jax
    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> mha = nn.MultiHeadAttention(4, 16, num_kv_heads=2, rngs=nn.Rngs(0))
    >>> x = jax.random.normal(jax.random.key(0), (2, 5, 16))
    >>> full = mha(x, is_causal=True)
    >>> full.shape
    (2, 5, 16)
    >>> mha.init_cache((2, 8, 16))
    >>> prompt = mha(x[:, :3], decode=True)
    >>> steps = [mha(x[:, t : t + 1], decode=True) for t in (3, 4)]
    >>> bool(jnp.allclose(jnp.concatenate([prompt, *steps], axis=1), full, atol=1e-5))
    True
    """

    query_ln: LayerNorm | None
    key_ln: LayerNorm | None
    cached_key: Cache | None
    cached_value: Cache | None
    cache_index: Cache | None

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        *,
        num_key_value_heads: int | None = None,
        dtype: DType | None = None,
        param_dtype: DType = jnp.float32,
        broadcast_dropout: bool = True,
        dropout_rate: float = 0.0,
        deterministic: bool | None = None,
        precision: Any = None,
        kernel_init: Initializer = default_kernel_init,
        out_kernel_init: Initializer | None = None,
        bias_init: Initializer = default_bias_init,
        out_bias_init: Initializer | None = None,
        use_bias: bool = True,
        attention_fn: Callable[..., jax.Array] = dot_product_attention,
        decode: bool | None = None,
        normalize_qk: bool = False,
        use_rope: bool = False,
        rope_base: float = 10000.0,
        rngs: Rngs,
        keep_rngs: bool = True,
        kernel_metadata: Mapping[str, Any] = {},
        out_kernel_metadata: Mapping[str, Any] = {},
        bias_metadata: Mapping[str, Any] = {},
        out_bias_metadata: Mapping[str, Any] = {},
        query_ln_scale_metadata: Mapping[str, Any] = {},
        key_ln_scale_metadata: Mapping[str, Any] = {},
    ) -> None:
        sizes = _mha_sizes(
            num_heads, in_features, qkv_features, out_features, num_kv_heads, in_kv_features,
            num_key_value_heads, dropout_rate, rope_base, bool(use_rope),
        )
        self.num_heads = sizes.num_heads
        self.num_kv_heads = sizes.num_kv_heads
        self.in_features = sizes.in_features
        self.in_kv_features = sizes.in_kv_features
        self.qkv_features = sizes.qkv_features
        self.out_features = sizes.out_features
        self.head_dim = sizes.head_dim
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.broadcast_dropout = bool(broadcast_dropout)
        self.dropout_rate = sizes.dropout_rate
        self.deterministic = deterministic
        self.precision = precision
        self.use_bias = bool(use_bias)
        self.attention_fn = attention_fn
        self.decode = decode
        self.normalize_qk = bool(normalize_qk)
        self.use_rope = bool(use_rope)
        self.rope_base = sizes.rope_base
        # the attribute order fixes the parameter order: query, key, value, *_ln, out
        self._build_projections(
            rngs, kernel_init, bias_init, out_kernel_init or kernel_init,
            out_bias_init or bias_init, kernel_metadata, bias_metadata,
            out_kernel_metadata, out_bias_metadata,
            (query_ln_scale_metadata, key_ln_scale_metadata),
        )
        self.rngs = (
            _own_stream(rngs, "dropout", "MultiHeadAttention")
            if keep_rngs and self.dropout_rate > 0
            else None
        )
        self.cached_key = None
        self.cached_value = None
        self.cache_index = None

    def _build_projections(
        self,
        rngs: Rngs,
        kernel_init: Initializer,
        bias_init: Initializer,
        out_kernel_init: Initializer,
        out_bias_init: Initializer,
        kernel_metadata: Mapping[str, Any],
        bias_metadata: Mapping[str, Any],
        out_kernel_metadata: Mapping[str, Any],
        out_bias_metadata: Mapping[str, Any],
        ln_scale_metadata: tuple[Mapping[str, Any], Mapping[str, Any]] = ({}, {}),
    ) -> None:
        """Creates ``query``, ``key``, ``value``, ``query_ln``/``key_ln`` and ``out``.

        They draw their keys from ``rngs`` in that order, so the order is part of the
        initial values (and their paths are the checkpoint layout).
        """
        common: dict[str, Any] = dict(
            use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
            precision=self.precision, rngs=rngs,
        )

        def proj(in_f: int, heads: int) -> LinearGeneral:
            return LinearGeneral(
                in_f, (heads, self.head_dim), kernel_init=kernel_init, bias_init=bias_init,
                kernel_metadata=kernel_metadata, bias_metadata=bias_metadata, **common,
            )

        self.query = proj(self.in_features, self.num_heads)
        self.key = proj(self.in_kv_features, self.num_kv_heads)
        self.value = proj(self.in_kv_features, self.num_kv_heads)
        if self.normalize_qk:
            self.query_ln = self._head_norm(rngs, ln_scale_metadata[0])
            self.key_ln = self._head_norm(rngs, ln_scale_metadata[1])
        else:
            self.query_ln = None
            self.key_ln = None
        self.out = LinearGeneral(
            (self.num_heads, self.head_dim), self.out_features, axis=(-2, -1),
            kernel_init=out_kernel_init, bias_init=out_bias_init,
            kernel_metadata=out_kernel_metadata, bias_metadata=out_bias_metadata, **common,
        )

    def _head_norm(self, rngs: Rngs, scale_metadata: Mapping[str, Any]) -> LayerNorm:
        """LayerNorm without bias over one head's ``head_dim`` (``normalize_qk``)."""
        return LayerNorm(
            self.head_dim, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
            rngs=rngs, scale_metadata=scale_metadata,
        )

    # --- cache ---
    def init_cache(self, input_shape: tuple[int, ...], dtype: DType = jnp.float32) -> None:
        """Allocates an empty KV cache for inputs of shape ``(*batch, max_length, features)``.

        ``cached_key`` and ``cached_value`` get shape ``(*batch, max_length, num_kv_heads,
        head_dim)`` and ``dtype``, ``cache_index`` (int32) starts at 0; calling it again
        empties the cache.

        Args:
          input_shape: ``(*batch, max_length, features)``, the shape of the inputs decoded.
          dtype: the cache's dtype.

        Raises:
          ValueError: ``input_shape`` has fewer than two axes.
        """
        input_shape = tuple(int(s) for s in input_shape)
        if len(input_shape) < 2:
            raise ValueError(
                f"MultiHeadAttention.init_cache expects (*batch, max_length, features), got "
                f"{input_shape}"
            )
        shape = input_shape[:-1] + (self.num_kv_heads, self.head_dim)
        self.cached_key = Cache(jnp.zeros(shape, dtype))
        self.cached_value = Cache(jnp.zeros(shape, dtype))
        self.cache_index = Cache(jnp.array(0, dtype=jnp.int32))

    # --- call ---
    def set_view(self, deterministic: bool | None = None, decode: bool | None = None) -> None:
        """The ``nn.view`` hook.

        Args:
          deterministic: if True, disables attention dropout.
          decode: if True, the module runs in autoregressive decode mode (its cache is
            made by ``init_cache``).
        """
        if deterministic is not None:
            self.deterministic = deterministic
        if decode is not None:
            self.decode = decode

    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
        deterministic: bool | None = None,
        rngs: Rngs | jax.Array | None = None,
        sow_weights: bool = False,
        decode: bool | None = None,
        is_causal: bool = False,
        positions: jax.Array | None = None,
        out_sharding: Any = None,
        qkv_sharding: Any = None,
    ) -> jax.Array:
        """Attends from ``inputs_q`` to ``inputs_k``/``inputs_v``; returns ``(*batch, q_len, out_features)``.

        Args:
          inputs_q: queries ``(*batch, q_len, in_features)``.
          inputs_k: keys ``(*batch, kv_len, in_kv_features)`` (default ``inputs_q``:
            self-attention); inputs_v: values (default ``inputs_k``).
          mask: boolean, True = attend, broadcastable to ``(*batch, num_heads, q_len,
            kv_len)`` (during decode ``kv_len`` is the cache's ``max_length``).
          deterministic: no dropout (default: the constructor's, set by
            ``model.train()``/``model.eval()``); rngs: the dropout key or streams for this
            call (default: the stream kept at construction).
          sow_weights: record the attention weights as ``Intermediate``
            ``attention_weights``.
          decode: append to the KV cache and attend to it (default: the constructor's).
          is_causal: query ``i`` attends to keys ``<= i`` (implied while decoding).
          positions: RoPE positions ``(q_len,)`` (default ``arange(q_len)``, or the cache
            positions while decoding).
          out_sharding: the output's sharding (explicit mesh axes), passed to the output
            projection; None to let JAX infer it.
          qkv_sharding: the sharding of the projected queries, keys and values
            ``(*batch, len, heads, head_dim)``, passed to their projections.

        Raises:
          ValueError: inputs of fewer than two axes or the wrong feature size,
            ``inputs_v`` without ``inputs_k``, ``decode`` without :meth:`init_cache`,
            a decode input that does not fit the cache or overflows it, or dropout with
            ``deterministic`` unset.
          TypeError: ``attention_fn`` does not accept an argument this call needs.
        """
        xq, xk, xv = self._check_inputs(inputs_q, inputs_k, inputs_v)
        q = self.query(xq, **sharding_kw(qkv_sharding))
        k = self.key(xk, **sharding_kw(qkv_sharding))
        v = self.value(xv, **sharding_kw(qkv_sharding))
        if self.normalize_qk:
            q = cast(LayerNorm, self.query_ln)(q)
            k = cast(LayerNorm, self.key_ln)(k)

        decode = self.decode if decode is None else decode
        if decode:
            q, k, v, mask = self._decode_step(q, k, v, mask, positions)
            is_causal = False  # folded into the decode mask
        elif self.use_rope:
            q_len = q.shape[-3]
            q = apply_rotary_embedding(q, positions, base=self.rope_base)
            k = apply_rotary_embedding(
                k, positions if k.shape[-3] == q_len else None, base=self.rope_base
            )

        det, dropout_rng = self._dropout_key(deterministic, rngs)
        kwargs = dict(
            mask=mask,
            is_causal=is_causal,
            dropout_rng=dropout_rng,
            dropout_rate=self.dropout_rate,
            broadcast_dropout=self.broadcast_dropout,
            deterministic=det,
            dtype=self.dtype,
            precision=self.precision,
            module=self if sow_weights else None,
        )
        x = self.attention_fn(q, k, v, **_fit_kwargs(self.attention_fn, kwargs))
        return self.out(x, **sharding_kw(out_sharding))

    def _check_inputs(
        self, inputs_q: jax.Array, inputs_k: jax.Array | None, inputs_v: jax.Array | None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Fills the key/value defaults and checks the ranks and feature sizes."""
        name = "MultiHeadAttention"
        if inputs_k is None:
            if inputs_v is not None:
                raise ValueError(f"{name}: inputs_k cannot be None when inputs_v is given")
            inputs_k = inputs_q
        if inputs_v is None:
            inputs_v = inputs_k
        xq = check_input(name, inputs_q, min_ndim=2)
        xk = check_input(name, inputs_k, min_ndim=2)
        xv = check_input(name, inputs_v, min_ndim=2)
        if xq.shape[-1] != self.in_features:
            raise ValueError(
                f"{name} expected last axis {self.in_features}, got {xq.shape[-1]} in query "
                f"input of shape {tuple(xq.shape)}"
            )
        for nm, x in (("key", xk), ("value", xv)):
            if x.shape[-1] != self.in_kv_features:
                raise ValueError(
                    f"{name} expected last axis {self.in_kv_features}, got {x.shape[-1]} in {nm} "
                    f"input of shape {tuple(x.shape)}"
                )
        return xq, xk, xv

    def _decode_step(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        mask: jax.Array | None,
        positions: jax.Array | None,
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """One KV-cache step: writes the new keys/values at ``cache_index`` and advances it.

        Takes the projected ``q`` ``(*batch, L, num_heads, head_dim)`` and ``k``/``v``
        ``(*batch, L, num_kv_heads, head_dim)`` of ``L`` new tokens (RoPE, when on, is
        applied here at positions ``cache_index + arange(L)`` unless ``positions`` is
        given). Returns ``q``, the whole cached keys and values ``(*batch, max_length,
        num_kv_heads, head_dim)`` and the mask ``(*batch, 1, L, max_length)`` that lets
        query ``i`` see cached positions ``<= cache_index + i`` (AND ``mask``).
        """
        name = "MultiHeadAttention"
        if self.cache_index is None:
            raise ValueError(f"{name}: decode=True but the cache is empty; call init_cache first")
        q_len = q.shape[-3]
        cached_key, cached_value = cast(Cache, self.cached_key), cast(Cache, self.cached_value)
        ck = cached_key[...]
        *cbatch, max_len, _, _ = ck.shape
        if tuple(k.shape[:-3]) != tuple(cbatch) or k.shape[-3] != q_len:
            raise ValueError(
                f"{name}: decode input of key shape {tuple(k.shape)} does not fit the cache "
                f"{tuple(ck.shape)} (batch dims must match; self-attention only)"
            )
        idx = self.cache_index[...]
        if not isinstance(idx, jax.core.Tracer) and int(idx) + q_len > max_len:
            raise ValueError(
                f"{name}: cache overflow, index {int(idx)} + {q_len} new tokens > max_length "
                f"{max_len}"
            )
        qpos = idx + jnp.arange(q_len, dtype=jnp.int32)
        if self.use_rope:
            pos = qpos if positions is None else positions
            q = apply_rotary_embedding(q, pos, base=self.rope_base)
            k = apply_rotary_embedding(k, pos, base=self.rope_base)
        zero = jnp.zeros((), jnp.int32)
        start = (zero,) * len(cbatch) + (idx, zero, zero)
        k = lax.dynamic_update_slice(ck, k.astype(ck.dtype), start)
        v = lax.dynamic_update_slice(cached_value[...], v.astype(ck.dtype), start)
        cached_key[...] = k
        cached_value[...] = v
        self.cache_index[...] = idx + q_len
        dmask = jnp.arange(max_len, dtype=jnp.int32)[None, :] <= qpos[:, None]  # (q, max_len)
        dmask = jnp.broadcast_to(dmask, tuple(cbatch) + (1, q_len, max_len))
        mask = dmask if mask is None else jnp.logical_and(mask.astype(bool), dmask)
        return q, k, v, mask

    def _dropout_key(
        self, deterministic: bool | None, rngs: Rngs | jax.Array | None
    ) -> tuple[bool, jax.Array | None]:
        """The call's effective ``deterministic`` and its dropout key (None when off)."""
        det = self.deterministic if deterministic is None else deterministic
        if self.dropout_rate <= 0.0:
            return True, None
        if det is None:
            raise ValueError(
                "MultiHeadAttention: dropout_rate > 0 but deterministic is None; pass it or "
                "call model.train() / model.eval()"
            )
        if det:
            return det, None
        return det, draw_key(rngs, self.rngs, "dropout", "MultiHeadAttention")


def _fit_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` less the names ``fn`` does not declare.

    Raises ``TypeError`` when a left-out argument would change the result (a mask, a
    dropout key, ``is_causal=True`` or a module to sow into).
    """
    accepted = _accepted_kwargs(fn)
    if accepted is None:
        return kwargs
    dropped = [k for k, val in kwargs.items() if k not in accepted and _matters(k, val)]
    if dropped:
        raise TypeError(
            f"MultiHeadAttention: attention_fn {getattr(fn, '__name__', fn)!r}"
            f" does not accept {dropped}, which this call needs"
        )
    return {k: val for k, val in kwargs.items() if k in accepted}


def _matters(name: str, value: Any) -> bool:
    """Whether dropping keyword ``name`` would change the result."""
    if name in ("mask", "dropout_rng", "module"):
        return value is not None
    if name == "is_causal":
        return bool(value)
    return False
