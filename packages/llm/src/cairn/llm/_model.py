"""``CausalLM``: the one decoder of every family, built from cairn.nn modules.

``embed -> [norm -> attention -> (norm) -> +residual -> norm -> MLP -> (norm) -> +residual]
x layers -> norm -> logits``; which norms, biases, rotary tables, windows and caps a layer
has is read from the :class:`~cairn.llm.LlmConfig`. Attention runs through
``cairn.kernels.dot_product_attention`` (grouped-query heads, soft-capping) with a mask
built from positions, so full sequences, ragged prefill and per-row decode share one path.
The MLP of a mixture-of-experts layer is :class:`cairn.llm._moe.MoE` (``ragged_dot``).

Every parameter carries logical axis names for sharding: ``vocab``, ``embed``, ``heads``,
``kv_heads``, ``head_dim``, ``mlp``, ``expert`` (stacked expert kernels).

AWQ (``cairn.quant.awq_quantize_params``) stores a weight as ``Q(diag(s) W)`` and its
per-input-channel scale ``s`` beside it as ``kernel_awq_scale`` on the projection's module.
The forward applies it: the projection computes ``x (Q(diag(s) W) / s)``, the scale divided
out of the dequantized kernel's input rows, which equals ``(x / s) Q(diag(s) W)``. It is not
folded into the preceding RMSNorm: AWQ searches one scale per weight, so ``q``, ``k``, ``v``
(and ``gate``, ``up``) read one norm's output with three (two) different scales, and no fold
is exact. Dividing the kernel rather than the input keeps the dot's weight operand a computed
array, so a ``cairn.quant`` provider wrapping the model (``quantize_model``) does not divide
the input a second time.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import cairn.kernels as ck
from cairn import nn
from cairn.core_array import QArray
from cairn.llm import _initializers as initializers
from cairn.llm._activations import ACTIVATIONS
from cairn.llm._cache import KVCache, write
from cairn.llm._config import LlmConfig
from cairn.llm._moe import MoE, load_balancing_loss
from cairn.llm._projection import project, scaled_kernel
from cairn.llm._rope import apply_rope, rope_tables

__all__ = ["CausalLM", "attention_mask"]

_init, _zeros = initializers.normal, initializers.zeros


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * (offset + scale)`` over the last axis, statistics in float32.

    ``offset=0`` (Llama: the weight multiplies the normalized input cast back to its dtype)
    or ``1`` (Gemma: ``1 + weight`` multiplies in float32, then the cast).
    """

    def __init__(self, features: int, *, eps: float, offset: float, param_dtype: Any,
                 names: tuple[str, ...], rngs: nn.Rngs) -> None:
        init = nn.initializers.zeros if offset else nn.initializers.ones
        self.scale = nn.Param(nn.with_partitioning(init, names)(rngs.params(), (features,), param_dtype))
        self.eps = float(eps)
        self.offset = float(offset)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        w = self.scale[...]
        if self.offset:
            return (h * (self.offset + w.astype(jnp.float32))).astype(x.dtype)
        return w * h.astype(x.dtype)


def attention_mask(q_pos: jax.Array, kv_pos: jax.Array, window: int | None) -> jax.Array:
    """Boolean ``[B, 1, T, S]``: query at ``q_pos [B, T]`` sees key at ``kv_pos [B, S]`` when
    ``q - window < kv <= q`` (no lower bound without a window)."""
    q, kv = q_pos[:, :, None], kv_pos[:, None, :]
    mask = kv <= q
    if window is not None:
        mask = mask & (kv > q - window)
    return mask[:, None]


class Attention(nn.Module):
    """Grouped-query attention: ``q [B, T, heads, head_dim]``, ``k, v [B, S, kv_heads, head_dim]``."""

    def __init__(self, cfg: LlmConfig, layer: int, *, dtype: Any, rngs: nn.Rngs) -> None:
        d, n, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

        def proj(spec: str, shape: tuple, bias: tuple | None, names: tuple) -> nn.Einsum:
            return nn.Einsum(spec, shape, bias, dtype=dtype, param_dtype=dtype, kernel_init=_init(names),
                             bias_init=_zeros(names[-len(bias):] if bias else ()),
                             rngs=rngs)

        self.q = proj("btd,dnh->btnh", (d, n, hd), (n, hd) if cfg.qkv_bias else None, ("embed", "heads", "head_dim"))
        self.k = proj("btd,dnh->btnh", (d, kv, hd), (kv, hd) if cfg.qkv_bias else None, ("embed", "kv_heads", "head_dim"))
        self.v = proj("btd,dnh->btnh", (d, kv, hd), (kv, hd) if cfg.qkv_bias else None, ("embed", "kv_heads", "head_dim"))
        self.o = proj("btnh,nhd->btd", (n, hd, d), (d,) if cfg.o_bias else None, ("heads", "head_dim", "embed"))
        norm = {"eps": cfg.rms_norm_eps, "offset": cfg.norm_offset, "param_dtype": dtype, "names": ("head_dim",)}
        self.q_norm = RMSNorm(hd, **norm, rngs=rngs) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, **norm, rngs=rngs) if cfg.qk_norm else None
        self.scale = cfg.attention_scale
        self.soft_cap = cfg.attn_logit_softcapping
        self.window = cfg.window(layer)

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], q_pos: jax.Array,
                 cache: tuple[jax.Array, jax.Array] | None,
                 segment_ids: jax.Array | None = None,
                 query_start: int = 0) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """``x [B, T, hidden]`` at positions ``q_pos [B, T]``; ``cache``: this layer's
        ``(keys, values) [B, S, kv_heads, head_dim]`` (slot = position) or None;
        ``segment_ids [B, T]``: packed rows without a cache (0: padding); ``query_start``
        (no cache): only the tokens from there on query (every token is a key and value).

        Returns the output ``[B, T - query_start, hidden]`` and the keys and values attended
        to (the updated cache, or this call's own).
        """
        xq = x[:, query_start:] if query_start else x
        q, k, v = project(self.q, xq), project(self.k, x), project(self.v, x)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q_rope = (rope[0][:, query_start:], rope[1][:, query_start:]) if query_start else rope
        q, k = apply_rope(q, *q_rope), apply_rope(k, *rope)
        if cache is None:
            kv_pos = q_pos
        else:
            k, v = write(cache[0], k, q_pos), write(cache[1], v, q_pos)
            kv_pos = jnp.broadcast_to(jnp.arange(k.shape[1]), (k.shape[0], k.shape[1]))
        k_in, v_in = k.astype(q.dtype), v.astype(q.dtype)
        if query_start:
            # a window of queries over every key: the causal mask comes from the positions
            mask = attention_mask(q_pos[:, query_start:], kv_pos, self.window)
            if segment_ids is not None:
                same = segment_ids[:, query_start:, None] == segment_ids[:, None, :]
                mask = mask & (same & (segment_ids[:, query_start:, None] > 0))[:, None]
            out = ck.dot_product_attention(q, k_in, v_in, mask=mask, scale=self.scale, logits_soft_cap=self.soft_cap)
            return self._out(out), (k, v)
        if segment_ids is not None and self.window is None:
            # packed rows: causal within each segment; padding (0) becomes -1 in the queries and
            # -2 in the keys, so it matches nothing
            pad = segment_ids > 0
            seg = (jnp.where(pad, segment_ids, -1), jnp.where(pad, segment_ids, -2))
            out = ck.dot_product_attention(q, k_in, v_in, is_causal=True, segment_ids=seg, scale=self.scale,
                                           logits_soft_cap=self.soft_cap)
            return self._out(out), (k, v)
        mask = attention_mask(q_pos, kv_pos, self.window)
        if segment_ids is not None:
            mask = mask & ((segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, :, None] > 0))[:, None]
        out = ck.dot_product_attention(q, k_in, v_in, mask=mask, scale=self.scale, logits_soft_cap=self.soft_cap)
        return self._out(out), (k, v)

    def _out(self, out: jax.Array) -> jax.Array:
        """``o`` on the heads flattened: ``[B, T, heads*head_dim] x [heads*head_dim, hidden]``.

        The same product as ``self.o(out)``; contracting one flat axis lets XLA lay out the
        small activation rather than copy the ``[heads, head_dim, hidden]`` kernel into a
        transposed layout on every call (a full copy of the weight per decode step on CPU).
        """
        w = scaled_kernel(self.o, 2)  # an AWQ scale divided out of its [heads, head_dim] inputs
        w = self.o.kernel[...] if w is None else w
        if isinstance(w, QArray):  # a quantized weight (cairn.quant): float numerics, like cairn.nn's layers
            w = w.dequantize()
        flat = out.reshape(*out.shape[:2], -1)
        y = jnp.einsum("btf,fd->btd", flat.astype(self.o.dtype), w.reshape(-1, w.shape[-1]).astype(self.o.dtype))
        return y if self.o.bias is None else y + self.o.bias[...].astype(y.dtype)


class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` (SwiGLU, or GeGLU with a GELU activation)."""

    def __init__(self, cfg: LlmConfig, *, dtype: Any, rngs: nn.Rngs) -> None:
        d, m = cfg.hidden_size, cfg.intermediate_size

        def linear(i: int, o: int, names: tuple) -> nn.Linear:
            return nn.Linear(i, o, use_bias=cfg.mlp_bias, dtype=dtype, param_dtype=dtype,
                             kernel_init=_init(names), bias_init=_zeros(names[1:]),
                             rngs=rngs)

        self.gate, self.up, self.down = linear(d, m, ("embed", "mlp")), linear(d, m, ("embed", "mlp")), linear(m, d, ("mlp", "embed"))
        self.act = cfg.hidden_act

    def __call__(self, x: jax.Array) -> jax.Array:
        return project(self.down, ACTIVATIONS[self.act](project(self.gate, x)) * project(self.up, x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block; ``sandwich_norms`` adds a norm on each branch's output."""

    def __init__(self, cfg: LlmConfig, layer: int, *, dtype: Any, rngs: nn.Rngs) -> None:
        norm = {"eps": cfg.rms_norm_eps, "offset": cfg.norm_offset, "param_dtype": dtype, "names": ("embed",)}
        d = cfg.hidden_size
        self.input_norm = RMSNorm(d, **norm, rngs=rngs)
        self.attn = Attention(cfg, layer, dtype=dtype, rngs=rngs)
        self.post_attn_norm = RMSNorm(d, **norm, rngs=rngs) if cfg.sandwich_norms else None
        self.mlp_norm = RMSNorm(d, **norm, rngs=rngs)
        self.mlp = MoE(cfg, dtype=dtype, rngs=rngs) if cfg.is_moe_layer(layer) else MLP(cfg, dtype=dtype, rngs=rngs)
        self.post_mlp_norm = RMSNorm(d, **norm, rngs=rngs) if cfg.sandwich_norms else None

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], q_pos: jax.Array,
                 cache: tuple[jax.Array, jax.Array] | None,
                 segment_ids: jax.Array | None = None,
                 query_start: int = 0) -> tuple[jax.Array, tuple[jax.Array, jax.Array], Any]:
        """The layer's output (of the tokens from ``query_start``: the others are only keys
        and values), the keys and values attended to, and the router logits
        ``[B*T, num_experts]`` of a MoE layer (None for a dense one)."""
        h, kv = self.attn(self.input_norm(x), rope, q_pos, cache, segment_ids, query_start)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = (x[:, query_start:] if query_start else x) + h
        y = self.mlp(self.mlp_norm(x))
        h, router_logits = y if isinstance(y, tuple) else (y, None)  # a MoE block also gives its router logits
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        return x + h, kv, router_logits


def _check_room(cache: KVCache, added: Any) -> None:
    """Eagerly (concrete lengths), refuses a call that would write real tokens past the
    cache's end; under ``jit`` such tokens cannot be refused and are dropped, so callers
    size ``max_length`` for the longest row."""
    if isinstance(cache.lengths, jax.core.Tracer) or isinstance(added, jax.core.Tracer):
        return
    need = np.asarray(cache.lengths) + np.asarray(added)
    if need.max(initial=0) > cache.max_length:
        rows = np.flatnonzero(need > cache.max_length).tolist()
        raise ValueError(
            f"KVCache of max_length {cache.max_length} has no room: rows {rows} would hold "
            f"{need[rows].tolist()} tokens; make the cache longer (model.init_cache(batch, max_length))"
        )


def _check_start(start: Any, t: int, cache: KVCache | None) -> int:
    """``logits_start`` checked: an int in ``[0, T)``, and only for a full pass (no cache). 0 is
    not compared with ``T``, which may be symbolic (a ``jax.export`` with a symbolic length)."""
    if not isinstance(start, bool) and isinstance(start, (int, np.integer)) and start == 0:
        return 0
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or not 0 <= start < t:
        raise ValueError(f"CausalLM: logits_start must be an int in [0, {t}) (the row has {t} tokens), got {start!r}")
    if start and cache is not None:
        raise ValueError("CausalLM: logits_start is for a full pass; with a cache every new token's logits are returned")
    return int(start)


@functools.cache
def _graphdef(config: LlmConfig, dtype: Any) -> Any:
    """The structure of ``CausalLM(config, dtype=dtype)``, built abstractly once per pair."""
    graphdef, _ = nn.split(nn.abstract_model(lambda: CausalLM(config, dtype=dtype, rngs=nn.Rngs(0))))
    return graphdef


class CausalLM(nn.Module):
    """A decoder-only language model of any supported family.

    ``model(input_ids [B, T] int) -> logits [B, T, vocab] float32`` attends causally over
    the row (positions ``0 .. T-1``, or ``positions [B, T]``). With a :class:`KVCache`
    (:meth:`init_cache`), ``model(input_ids, cache=cache, lengths=None)`` returns
    ``(logits, cache)``: the tokens go at each row's own next positions, ``lengths [B]``
    says how many of the ``T`` tokens of each row are real (right padding; default all),
    and the returned cache holds ``cache.lengths + lengths`` tokens per row (at most
    ``max_length``: an eager call beyond it raises; under ``jit`` the overflow is dropped).

    Packed rows (training): ``segment_ids [B, T]`` int, with ``positions`` restarting per
    segment, keeps attention inside each segment (a token sees the earlier tokens of its own
    segment only); segment 0 is padding and sees nothing (its output is never a mean of
    other tokens). Without a sliding window this runs ``cairn.kernels``' causal attention
    with segment ids, which never forms the mask.

    ``logits_start=s`` (a full pass, no cache) returns the logits of positions ``s .. T-1``
    only, ``[B, T - s, vocab]``, equal to ``model(input_ids)[:, s:]``: every token is still
    attended to, but the last layer computes queries, MLP and the final norm only from ``s``
    and the vocabulary projection covers those positions alone (post-training scores
    completions, never the prompt: ``s`` is the shortest prompt's end). XLA does not move
    such a slice before the products itself.

    ``return_aux_loss=True`` (mixture-of-experts configs) appends the router
    load-balancing loss (:func:`cairn.llm.load_balancing_loss` over every MoE layer, padding
    past ``lengths`` excluded) to the result: ``(logits, aux_loss)``, or ``(logits, cache,
    aux_loss)`` with a cache. It is the unweighted loss; a trainer adds
    ``router_aux_loss_coef * aux_loss`` to its objective.

    Args:
      config: the architecture (:class:`LlmConfig`).
      dtype: parameter and computation dtype (norms, rotary tables and softmax run in float32).
      rngs: ``nn.Rngs`` for the random initialization (``from_pretrained`` skips it).

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> from cairn.llm import CausalLM, LlmConfig
    >>> cfg = LlmConfig("llama", vocab_size=32, hidden_size=16, intermediate_size=32,
    ...                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4)
    >>> model = CausalLM(cfg, rngs=nn.Rngs(0))
    >>> model(jnp.zeros((2, 5), jnp.int32)).shape
    (2, 5, 32)
    """

    def __init__(self, config: LlmConfig, *, dtype: Any = jnp.float32, rngs: nn.Rngs) -> None:
        dtype = jnp.dtype(dtype)  # one static value for jnp.float32, "float32", np.float32: equal structures
        self.config = config
        self.dtype = dtype
        self.embed = nn.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype,
                              embedding_init=_init(("vocab", "embed")), rngs=rngs)
        self.layers = nn.List([DecoderLayer(config, i, dtype=dtype, rngs=rngs) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, offset=config.norm_offset,
                            param_dtype=dtype, names=("embed",), rngs=rngs)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype,
            kernel_init=_init(("embed", "vocab")), rngs=rngs)

    def astype(self, dtype: Any) -> CausalLM:
        """A copy of this model whose parameters and computation are in ``dtype``.

        Every parameter is cast (each keeps its sharding); ``self`` is unchanged. A model
        holding quantized (``QArray``) weights is refused. :func:`cairn.llm.generate`
        uses it on CPU, where XLA has no bfloat16 matrix product (see its ``compute_dtype``).

        Args:
          dtype: a floating dtype, e.g. ``jnp.float32``.

        >>> import jax.numpy as jnp
        >>> from cairn import nn
        >>> from cairn.llm import CausalLM, LlmConfig
        >>> cfg = LlmConfig("llama", vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=4)
        >>> half = CausalLM(cfg, dtype=jnp.bfloat16, rngs=nn.Rngs(0))
        >>> full = half.astype(jnp.float32)
        >>> str(full.dtype), str(full.embed.embedding[...].dtype), str(half.embed.embedding[...].dtype)
        ('float32', 'float32', 'bfloat16')
        """
        target = jnp.dtype(dtype)
        if not jnp.issubdtype(target, jnp.floating):
            raise ValueError(f"CausalLM.astype: dtype must be a floating dtype, got {target}")
        quantized = self.quantized_paths()
        if quantized:
            raise ValueError(f"CausalLM.astype: quantized weights cannot be cast, e.g. {quantized[0]!r}; "
                             "cast the model before quantizing it")
        state = nn.state(self)
        assert isinstance(state, nn.State)  # one State: no filters given
        out = nn.merge(_graphdef(self.config, target), jax.tree_util.tree_map(lambda x: x.astype(target), state))
        assert isinstance(out, CausalLM)
        return out

    def quantized_paths(self) -> list[str]:
        """The paths of the parameters that hold a quantized ``QArray`` (none for a float model)."""
        state = nn.state(self)
        assert isinstance(state, nn.State)
        return ["/".join(map(str, p)) for p, v in state.flat_state().items() if isinstance(v.raw_value, QArray)]

    def init_cache(self, batch: int, max_length: int, dtype: Any = None) -> KVCache:
        """An empty :class:`KVCache` for ``batch`` rows of up to ``max_length`` tokens.

        Args:
          batch: rows.
          max_length: positions per row.
          dtype: the cache's dtype; None uses the model's.
        """
        c = self.config
        return KVCache.zeros(c.num_hidden_layers, batch, max_length, c.num_key_value_heads, c.head_dim,
                             self.dtype if dtype is None else dtype)

    def _rope(self, q_pos: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
        """The ``(cos, sin)`` tables of every layer, computed once per distinct rope setting."""
        c, tables, out = self.config, {}, []
        for i in range(c.num_hidden_layers):
            params = c.rope_parameters(i)
            key = tuple(sorted(params.items()))
            if key not in tables:
                tables[key] = rope_tables(params, c.head_dim, c.max_position_embeddings, q_pos)
            out.append(tables[key])
        return out

    def _positions(self, b: int, t: int, positions: Any, cache: KVCache | None, lengths: Any,
                   segment_ids: Any) -> jax.Array:
        """The query positions ``[B, T]`` of a call, after checking the arguments go together."""
        if segment_ids is not None and tuple(jnp.shape(segment_ids)) != (b, t):
            raise ValueError(f"CausalLM: segment_ids must be [batch, length] = {(b, t)}, got shape {tuple(jnp.shape(segment_ids))}")
        if cache is None:
            if lengths is not None:
                raise ValueError("CausalLM: lengths is only meaningful with a cache (right padding needs no mask without one)")
            return jnp.broadcast_to(jnp.arange(t), (b, t)) if positions is None else jnp.asarray(positions)
        if positions is not None:
            raise ValueError("CausalLM: with a cache, positions are the cache's lengths; do not pass positions")
        if segment_ids is not None:
            raise ValueError("CausalLM: segment_ids (packed rows) are for a full pass; a cache holds one sequence per row")
        _check_room(cache, t if lengths is None else lengths)
        return cache.lengths[:, None] + jnp.arange(t)[None, :]

    def _trunk(self, input_ids: jax.Array, positions: Any, cache: KVCache | None, lengths: Any,
               segment_ids: Any, start: int = 0) -> tuple[jax.Array, list, list, list]:
        """The final-normed hidden states (of the tokens from ``start``: the last layer
        computes only their queries and MLP) and every layer's keys, values and router logits."""
        b, t = input_ids.shape
        start = _check_start(start, t, cache)
        q_pos = self._positions(b, t, positions, cache, lengths, segment_ids)
        if hasattr(self.embed, "embedding_awq_scale"):
            raise ValueError("CausalLM: the embedding holds an AWQ input scale (embedding_awq_scale), which its "
                             "lookup and tied output product do not apply; leave the embedding out of the AwqRule")
        x = self.embed(input_ids)
        if self.config.embed_scale:
            x = x * jnp.asarray(math.sqrt(self.config.hidden_size), x.dtype)
        ropes = self._rope(q_pos)
        seg = None if segment_ids is None else jnp.asarray(segment_ids)
        keys, values, routers = [], [], []
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, (k, v), router = layer(x, ropes[i], q_pos, None if cache is None else (cache.keys[i], cache.values[i]), seg,
                                      start if i == last else 0)
            keys.append(k)
            values.append(v)
            routers += [] if router is None else [router]
        return self.norm(x), keys, values, routers

    def output_projection(self) -> jax.Array:
        """The ``[hidden, vocab]`` matrix the final hidden states are multiplied by: the tied
        embedding transposed, or ``lm_head``'s kernel (for fused linear + loss kernels)."""
        if self.lm_head is not None:
            scaled = scaled_kernel(self.lm_head, 1)
            if scaled is not None:
                return scaled
        w = self.embed.embedding[...] if self.lm_head is None else self.lm_head.kernel[...]
        w = w.dequantize() if isinstance(w, QArray) else w
        return w.T if self.lm_head is None else w

    def hidden_states(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
                      segment_ids: jax.Array | None = None, logits_start: int = 0) -> jax.Array:
        """The final-normed hidden states ``[B, T - logits_start, hidden]`` of a full pass (no
        cache): what :meth:`output_projection` turns into the logits (before
        ``final_logit_softcapping``). ``positions``, ``segment_ids`` and ``logits_start`` as in
        ``__call__``.

        Args:
          input_ids: ``[B, T]`` int token ids.
          positions: ``[B, T]`` int positions; None uses ``0 .. T-1`` on every row.
          segment_ids: ``[B, T]`` int ids of packed sequences (0: padding), which do not attend to
            each other; None for one sequence per row.
          logits_start: the first position whose hidden state is returned (the earlier ones
            are attended to, but the last layer computes no query or MLP for them).
        """
        return self._trunk(input_ids, positions, None, None, segment_ids, logits_start)[0]

    def __call__(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
                 cache: KVCache | None = None, lengths: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, return_aux_loss: bool = False,
                 logits_start: int = 0) -> Any:
        b, t = input_ids.shape
        if logits_start and return_aux_loss:
            raise ValueError("CausalLM: return_aux_loss needs every position's router logits; "
                             "it cannot be combined with logits_start > 0")
        x, keys, values, routers = self._trunk(input_ids, positions, cache, lengths, segment_ids, logits_start)
        logits = (self.embed.attend(x) if self.lm_head is None else project(self.lm_head, x)).astype(jnp.float32)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = cap * jnp.tanh(logits / cap)
        added = jnp.full((b,), t, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        out: list[Any] = [logits]
        if cache is not None:
            out.append(KVCache(tuple(keys), tuple(values), cache.lengths + added))
        if return_aux_loss:
            real = (jnp.arange(t)[None, :] < added[:, None]).reshape(-1)
            if segment_ids is not None:
                real = real & (jnp.asarray(segment_ids).reshape(-1) > 0)
            out.append(load_balancing_loss(routers, self.config.num_experts_per_tok, real))
        return out[0] if len(out) == 1 else tuple(out)
