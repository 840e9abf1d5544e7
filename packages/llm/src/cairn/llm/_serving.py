"""A :class:`~cairn.llm.CausalLM` as a cairn.serving generative model: pure functions, export.

cairn.serving runs a generative model as two pure functions over its weights and a flat
KV cache batched along axis 0 (``docs/serving.md``, Generation). :func:`serving_functions`
builds them from the model itself, not from a second copy of the decoder:

- ``prefill(params, tokens (b, p), lengths (b,))`` runs the model's full causal pass over
  the ``p`` prompt positions (a fresh prompt attends over its own keys only, not over
  ``max_length`` cache slots; right padding follows the real tokens, so it changes none of
  them) and returns the logits at ``lengths - 1`` (the head runs on those tokens only) and
  the cache as ``{"k0": keys of layer 0, "v0": ..., ...}``, each ``(b, max_length,
  num_key_value_heads, head_dim)`` (the prompt's at slots ``0 .. p - 1``, zeros after);
- ``decode(params, tokens (b,), positions (b,), cache)`` rebuilds the
  :class:`~cairn.llm.KVCache` with ``lengths = positions`` (row ``b`` holds ``positions[b]``
  tokens) and runs ``model(tokens[:, None], cache=...)``: the token is written at its row's
  own position and attends to the slots before it, exactly the per-row decode of
  :func:`cairn.llm.generate`;
- ``paged(params, tokens (b, t), positions (b,), lengths (b,), block_tables (b, w), pool)``
  runs a chunk of ``lengths[b]`` tokens per row (right-padded to ``t``) starting at
  position ``positions[b]`` over a *paged* KV pool ``{"k0": (num_blocks, block_size,
  kv_heads, head_dim), ...}``: every layer writes the chunk's keys and values into the
  row's blocks (``cairn.kernels.paged_kv_write``) and attends over its block table
  (``cairn.kernels.paged_attention``; the last layer queries, and runs its MLP, at each
  row's last chunk token only); returns the logits after each row's last token and
  the pool. ``t = 1`` is a decode step, ``t > 1`` a prefill chunk (after a cached prefix
  or an earlier chunk); a row with ``lengths = 0`` writes nothing;
- ``score(params, tokens (b, p), lengths (b,))`` is the full forward pass's
  ``log_softmax`` at each prompt token given the ones before it (0 at position 0 and past
  ``lengths``), for prompt log-probabilities.

``params`` are the model's variables as nested plain dicts (``layers/0/attn/q/kernel``); a
weight replaced by a :class:`~cairn.core_array.QArray` (``cairn.quant.quantize_params``)
stays one, so :func:`export_for_serving` writes it quantized and the exported program
dequantizes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import cairn.kernels as ck
from cairn import nn, serving
from cairn.core_array import ArraySpec
from cairn.llm._cache import KVCache
from cairn.llm._model import CausalLM, attention_mask
from cairn.llm._projection import project
from cairn.llm._rope import apply_rope

__all__ = ["ServingFunctions", "as_generator", "export_for_serving", "serving_functions"]

MAX_BATCH_SIZE = 256  # cairn.serving.export_generator's default


@dataclasses.dataclass(frozen=True)
class ServingFunctions:
    """What :func:`serving_functions` returns.

    Args:
      prefill: ``prefill(params, tokens (b, p), lengths (b,)) -> (logits, cache)`` (module
        docstring), jit- and export-ready.
      decode: ``decode(params, tokens (b,), positions (b,), cache) -> (logits, cache)``.
      score: ``score(params, tokens (b, p), lengths (b,)) -> logprobs (b, p)``.
      paged: ``paged(params, tokens (b, t), positions (b,), lengths (b,), block_tables, pool) -> (logits, pool)``
        (module docstring), or None when not asked for.
      forward: ``forward(params, tokens (b, t)) -> logits (b, t, vocab)``, the model's full
        causal pass over ``params`` (for calibrating ``cairn.quant`` on the same weights).
      params: the model's weights, nested plain dicts keyed by the model's path parts.
      cache_specs: per-row ``{"k0": ArraySpec((max_length, kv_heads, head_dim), dtype), ...}``.
      vocab_size: the logits' width.
      max_length: the cache's positions per row.
    """

    prefill: Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
    decode: Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
    score: Callable[..., jax.Array]
    forward: Callable[..., jax.Array]
    params: Any
    cache_specs: dict[str, ArraySpec]
    vocab_size: int
    max_length: int
    paged: Callable[..., tuple[jax.Array, dict[str, jax.Array]]] | None = None


def _check_model(model: Any, what: str) -> CausalLM:
    if isinstance(model, CausalLM):
        return model
    inner = getattr(model, "model", None)
    if isinstance(inner, CausalLM):  # a cairn.quant QuantizedModel (apply_lora returns one)
        raise TypeError(
            f"{what}: got a {type(model).__name__} wrapping a CausalLM; export the CausalLM itself: fold LoRA "
            "adapters in with cairn.llm.merge_lora, and quantize weights into it with "
            "nn.update(model, nn.state(quant.quantize_params(model, provider, fn, *args))) (QArray weights stay quantized)"
        )
    raise TypeError(f"{what}: model must be a cairn.llm.CausalLM, got {type(model).__name__}")


def _check_max_length(model: CausalLM, max_length: Any, what: str) -> int:
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"{what}: max_length (cache positions per row: prompt plus generated tokens) must be an "
                         f"int >= 2, got {max_length!r}")
    limit = model.config.max_position_embeddings
    if max_length > limit:
        raise ValueError(f"{what}: max_length={max_length} exceeds the model's max_position_embeddings={limit} "
                         "(LlmConfig); the model was not built for positions past it")
    return int(max_length)


def _rebuilder(model: CausalLM) -> tuple[Callable[[Any], CausalLM], Any]:
    """``(rebuild(params) -> CausalLM, params)``: params as nested plain dicts, rebuilt into a
    model of the same structure inside a trace (fresh variables: nothing outside is changed)."""
    graphdef, state = nn.split(model)
    paths, kinds = list(state._flat), [type(v) for v in state._flat.values()]

    def rebuild(params: Any) -> CausalLM:
        tree: dict = {}
        for path, kind in zip(paths, kinds):
            node, into = params, tree
            for key in path:
                node = node[key] if key in node else node[str(key)]
            for key in path[:-1]:
                into = into.setdefault(key, {})
            into[path[-1]] = kind(node)
        rebuilt: CausalLM = nn.merge(graphdef, nn.State(tree))
        return rebuilt

    return rebuild, state.to_pure_dict()


def _kernels_for(tokens: jax.Array) -> contextlib.AbstractContextManager:
    """cairn.kernels' XLA implementations while shapes are symbolic (a ``jax.export`` with a
    symbolic batch): its autotuned choice is keyed by concrete shapes, which an exported
    program, run at any batch, does not have. Concrete shapes (``jit``, in process) keep
    the usual choice."""
    if all(isinstance(d, int) for d in tokens.shape):
        return contextlib.nullcontext()
    return ck.override("xla")


def serving_functions(model: CausalLM, max_length: int) -> ServingFunctions:
    """cairn.serving's ``prefill`` / ``decode`` (and ``score``) over ``model``'s own modules.

    Args:
      model: a :class:`~cairn.llm.CausalLM` (its weights may be ``QArray`` leaves).
      max_length: cache positions per row (prompt plus generated tokens), at most the
        config's ``max_position_embeddings``.

    Returns:
      A :class:`ServingFunctions`; ``prefill(params, tokens, lengths)`` etc. with its ``params``.

    Raises:
      TypeError: ``model`` is not a ``CausalLM``. ValueError: ``max_length`` out of range.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> from cairn.llm import CausalLM, LlmConfig, serving_functions
    >>> cfg = LlmConfig("llama", vocab_size=32, hidden_size=16, intermediate_size=32,
    ...                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4)
    >>> fns = serving_functions(CausalLM(cfg, rngs=nn.Rngs(0)), max_length=16)
    >>> logits, cache = fns.prefill(fns.params, jnp.ones((2, 3), jnp.int32), jnp.array([3, 1]))
    >>> logits.shape, sorted(cache), cache["k0"].shape
    ((2, 32), ['k0', 'k1', 'v0', 'v1'], (2, 16, 2, 4))
    """
    model = _check_model(model, "serving_functions")
    max_length = _check_max_length(model, max_length, "serving_functions")
    rebuild, params = _rebuilder(model)
    cfg, n = model.config, model.config.num_hidden_layers
    dtype = jnp.dtype(model.dtype)
    specs = {f"{kv}{i}": ArraySpec((max_length, cfg.num_key_value_heads, cfg.head_dim), dtype.name)
             for i in range(n) for kv in "kv"}

    def flat(cache: KVCache) -> dict[str, jax.Array]:
        out = {}
        for i in range(n):
            out[f"k{i}"], out[f"v{i}"] = cache.keys[i], cache.values[i]
        return out

    def prefill(params: Any, tokens: jax.Array, lengths: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        # a fresh prompt: the full causal pass over its own p positions (right padding only
        # follows the real tokens, so it changes none of them), not a cached pass whose
        # queries attend over all max_length slots; the head runs on each row's last token
        m = rebuild(params)
        tokens, lengths = jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32)
        b = tokens.shape[0]
        with _kernels_for(tokens):
            x, keys, values = _prefill_trunk(m, tokens, jnp.maximum(lengths, 1) - 1)
            logits = _head(m, m.norm(x))[:, 0]
        empty = m.init_cache(b, max_length)  # the prompt's keys and values go at slots 0 .. p - 1
        cache = KVCache(tuple(_at_start(c, k) for c, k in zip(empty.keys, keys)),
                        tuple(_at_start(c, v) for c, v in zip(empty.values, values)), lengths)
        return logits, flat(cache)

    def decode(params: Any, tokens: jax.Array, positions: jax.Array,
               cache: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        m = rebuild(params)
        kv = KVCache(tuple(cache[f"k{i}"] for i in range(n)), tuple(cache[f"v{i}"] for i in range(n)),
                     jnp.asarray(positions, jnp.int32))
        with _kernels_for(tokens):
            logits, kv = m(jnp.asarray(tokens, jnp.int32)[:, None], cache=kv)
        return logits[:, 0], flat(kv)

    def score(params: Any, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
        tokens, lengths = jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32)
        with _kernels_for(tokens):
            logp = jax.nn.log_softmax(rebuild(params)(tokens), axis=-1)
        # no slicing by a symbolic length (the exported batch and prompt sizes are symbolic):
        # position t scores the token after it, then the scores move one step right
        ahead = jnp.take_along_axis(logp, jnp.roll(tokens, -1, axis=1)[..., None], axis=-1)[..., 0]
        t = jnp.arange(tokens.shape[1])[None, :]
        out = jnp.where(t == 0, 0.0, jnp.roll(ahead, 1, axis=1))
        return jnp.where(t < lengths[:, None], out, 0.0).astype(jnp.float32)

    def forward(params: Any, tokens: jax.Array) -> jax.Array:
        tokens = jnp.asarray(tokens, jnp.int32)
        with _kernels_for(tokens):
            return rebuild(params)(tokens)

    return ServingFunctions(prefill, decode, score, forward, params, specs, int(cfg.vocab_size), max_length,
                            _paged_fn(rebuild, n))


def _at_start(cache_kv: jax.Array, new: jax.Array) -> jax.Array:
    """``new [B, p, ...]`` written at slots ``0 .. p - 1`` of ``cache_kv [B, max_length, ...]``."""
    return jax.lax.dynamic_update_slice(cache_kv, new.astype(cache_kv.dtype), (0,) * cache_kv.ndim)


def _embed(m: CausalLM, tokens: jax.Array) -> jax.Array:
    """The model's scaled input embedding of ``tokens``, as ``CausalLM.__call__`` computes it."""
    if hasattr(m.embed, "embedding_awq_scale"):
        raise ValueError("CausalLM: the embedding holds an AWQ input scale (embedding_awq_scale), which its "
                         "lookup and tied output product do not apply; leave the embedding out of the AwqRule")
    x = m.embed(tokens)
    return x * jnp.asarray(m.config.hidden_size ** 0.5, x.dtype) if m.config.embed_scale else x


def _layer_tail(layer: Any, x: jax.Array, h: jax.Array) -> jax.Array:
    """A decoder layer's output from its input ``x`` and its attention output ``h``: the
    residual, the MLP (or MoE) block and the sandwich norms, as ``DecoderLayer.__call__``."""
    if layer.post_attn_norm is not None:
        h = layer.post_attn_norm(h)
    x = x + h
    y = layer.mlp(layer.mlp_norm(x))
    h = y[0] if isinstance(y, tuple) else y
    if layer.post_mlp_norm is not None:
        h = layer.post_mlp_norm(h)
    return x + h


def _prefill_trunk(m: CausalLM, tokens: jax.Array, last: jax.Array) -> tuple[jax.Array, list, list]:
    """The full causal pass of prompts ``tokens [B, T]`` (positions ``0 .. T-1``) for a
    prefill: every layer's keys and values at all ``T`` positions, and the last layer's
    output (not yet final-normed) at row ``b``'s token ``last[b]`` only, ``[B, 1, hidden]``.

    The layers below the last run as in a full pass. The last one projects keys and values
    for every position but its query, attention output and MLP for the one token whose
    logits are wanted: the other positions' outputs feed nothing (a prompt's logits are
    taken at its last token; rows never mix, a MoE block routes each token alone).
    """
    b, t = tokens.shape
    q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
    x = _embed(m, tokens)
    ropes = m._rope(q_pos)
    keys, values = [], []
    *below, top = list(m.layers)
    for i, layer in enumerate(below):
        x, (k, v), _ = layer(x, ropes[i], q_pos, None)
        keys.append(k)
        values.append(v)
    attn, rows = top.attn, jnp.arange(b)
    h = top.input_norm(x)
    q, k, v = project(attn.q, h[rows, last][:, None]), project(attn.k, h), project(attn.v, h)
    if attn.q_norm is not None and attn.k_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = ropes[-1]
    q, k = apply_rope(q, cos[rows, last][:, None], sin[rows, last][:, None]), apply_rope(k, cos, sin)
    mask = attention_mask(last[:, None], q_pos, attn.window)
    out = ck.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask=mask, scale=attn.scale,
                                   logits_soft_cap=attn.soft_cap)
    keys.append(k)
    values.append(v)
    return _layer_tail(top, x[rows, last][:, None], attn._out(out)), keys, values


def _head(m: CausalLM, x: jax.Array) -> jax.Array:
    """The float32 logits of final-normed hidden states ``x [B, T, hidden]``, as ``CausalLM.__call__``
    computes them (tied embedding or ``lm_head``, then ``final_logit_softcapping``)."""
    logits = (m.embed.attend(x) if m.lm_head is None else project(m.lm_head, x)).astype(jnp.float32)
    cap = m.config.final_logit_softcapping
    return cap * jnp.tanh(logits / cap) if cap else logits


def _paged_attention(attn: Any, x: jax.Array, rope: Any, pages: tuple[jax.Array, jax.Array], tables: jax.Array,
                     kv_len: jax.Array, write_pos: jax.Array, last: jax.Array | None = None) -> tuple[jax.Array, tuple]:
    """``attn`` (a :class:`cairn.llm` attention layer) over a paged cache: the chunk's keys and
    values go into ``pages`` at ``write_pos`` (-1: padding, skipped), then its queries attend
    over the row's blocks (query ``j`` of row ``b`` at position ``kv_len[b] - t + j``). With
    ``last [B]``, only chunk token ``last[b]`` of each row queries (output ``[B, 1, hidden]``;
    every token is still a key and value)."""
    xq, q_rope, q_len = x, rope, kv_len
    if last is not None:
        rows, t = jnp.arange(x.shape[0]), x.shape[1]
        xq, q_rope = x[rows, last][:, None], (rope[0][rows, last][:, None], rope[1][rows, last][:, None])
        q_len = kv_len - t + last + 1  # its position plus one
    q, k, v = project(attn.q, xq), project(attn.k, x), project(attn.v, x)
    if attn.q_norm is not None and attn.k_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, *q_rope), apply_rope(k, *rope)
    kp, vp = ck.paged_kv_write(pages[0], pages[1], k.astype(pages[0].dtype), v.astype(pages[1].dtype), tables, write_pos)
    ka, va = (kp, vp) if kp.dtype == q.dtype else (kp.astype(q.dtype), vp.astype(q.dtype))
    window = None if attn.window is None else attn.window - 1  # the model's window w sees q - w < kv <= q
    out = ck.paged_attention(q, ka, va, tables, q_len, scale=attn.scale, logits_soft_cap=attn.soft_cap,
                             local_window_size=window)
    return attn._out(out), (kp, vp)


def _paged_fn(rebuild: Callable[[Any], CausalLM], n: int) -> Callable:
    """The ``paged`` serving function (module docstring) of a model of ``n`` layers."""

    def paged(params: Any, tokens: jax.Array, positions: jax.Array, lengths: jax.Array, block_tables: jax.Array,
              pool: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        m = rebuild(params)
        tokens = jnp.asarray(tokens, jnp.int32)
        positions, lengths = jnp.asarray(positions, jnp.int32), jnp.asarray(lengths, jnp.int32)
        tables = jnp.asarray(block_tables, jnp.int32)
        b, t = tokens.shape
        q_pos = positions[:, None] + jnp.arange(t)[None, :]
        write_pos = jnp.where(jnp.arange(t)[None, :] < lengths[:, None], q_pos, -1)
        kv_len = positions + t  # the padded chunk's queries are the row's last t positions
        last = jnp.maximum(lengths, 1) - 1  # the token whose logits are returned
        out = {}
        with _kernels_for(tokens):
            x = _embed(m, tokens)
            ropes = m._rope(q_pos)
            for i, layer in enumerate(m.layers):
                # the last layer queries (and runs its MLP) at each row's last token only
                top = last if i == n - 1 else None
                h, (out[f"k{i}"], out[f"v{i}"]) = _paged_attention(
                    layer.attn, layer.input_norm(x), ropes[i], (pool[f"k{i}"], pool[f"v{i}"]), tables, kv_len,
                    write_pos, top)
                x = _layer_tail(layer, x if top is None else x[jnp.arange(b), top][:, None], h)
            logits = _head(m, m.norm(x))  # [b, 1, hidden]: each row's last token
        return logits[:, 0], {f"{kv}{i}": out[f"{kv}{i}"] for i in range(n) for kv in "kv"}

    return paged


def _eos_ids(model: CausalLM, tokenizer: Any, eos_token_ids: Sequence[int] | None) -> tuple[int, ...]:
    """The ids given; else the tokenizer's; else ``eos_token_id`` of the config.json the model came from."""
    if eos_token_ids is not None:
        return tuple(int(t) for t in eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_ids:
        return tuple(tokenizer.eos_token_ids)
    hf = json.loads(model.config.hf) if model.config.hf else {}
    eos = hf.get("eos_token_id")
    return () if eos is None else tuple(int(t) for t in (eos if isinstance(eos, list) else [eos]))


def _tokenizer(tokenizer: Any, model: CausalLM, what: str) -> serving.Tokenizer | None:
    if tokenizer is None:
        return None
    if isinstance(tokenizer, str | os.PathLike):
        tokenizer = serving.Tokenizer.from_pretrained(tokenizer)
    if not isinstance(tokenizer, serving.Tokenizer):
        raise TypeError(f"{what}: tokenizer must be a cairn.llm.Tokenizer, a tokenizer folder or None, "
                        f"got {type(tokenizer).__name__}")
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(f"{what}: the tokenizer has {len(tokenizer)} ids but the model's vocab_size is "
                         f"{model.config.vocab_size}: it is not this model's tokenizer")
    return tokenizer


def export_for_serving(model: CausalLM, tokenizer: Any, repository: str | os.PathLike, name: str, *,
                       max_length: int, version: int = 1, max_batch_size: int = MAX_BATCH_SIZE,
                       eos_token_ids: Sequence[int] | None = None, platforms: Sequence[str] | None = None,
                       block_size: int | None = None, overwrite: bool = False) -> str:
    """Export ``model`` as a cairn.serving generator into ``<repository>/<name>/<version>``.

    The prefill, decode and score (prompt log-probabilities, for ``echo`` with ``logprobs``)
    of :func:`serving_functions` become StableHLO programs with the
    weights as arguments (``QArray`` weights written quantized, int4 as packed or not as
    they are), the tokenizer's files (chat template included) go into the model directory's
    ``tokenizer/`` folder under the manifest's hashes, and ``cairn-serve
    --model-repository <repository>`` serves it over both protocols without importing
    cairn.llm or any model code. An engine slot holds ``max_length`` positions; with
    ``block_size``, the ``paged`` program is exported too and the engine may run the paged
    KV layout instead (``GenerationConfig(kv_layout="paged")``: blocks of ``block_size``
    tokens claimed as tokens arrive, prefix caching, chunked prefill).

    Args:
      model: a :class:`~cairn.llm.CausalLM`.
      tokenizer: its :class:`~cairn.llm.Tokenizer` (or a tokenizer folder), or None (the
        server then takes and returns token ids only).
      repository: the model repository's folder.
      name: the model's name in it (its folder under ``repository``).
      max_length: cache positions per row, at most ``max_position_embeddings``.
      version: the version folder (an int >= 1).
      max_batch_size: the most rows (engine slots) either program takes.
      eos_token_ids: default the tokenizer's, else the ``eos_token_id`` of the model's
        ``config.json``.
      platforms: as :func:`cairn.serving.export` (default the current backend).
      block_size: tokens per KV block of the paged layout; ``None`` exports the contiguous
        layout only.
      overwrite: replace an existing version folder.

    Returns:
      The absolute path of the model directory.

    Raises:
      TypeError: not a ``CausalLM`` (a LoRA-wrapped model: merge it first) or a bad tokenizer.
      ValueError: ``max_length`` beyond the model's positions, a tokenizer with more ids than
        the vocabulary, a bad ``name`` or ``version``. FileExistsError: the version exists.
    """
    what = "export_for_serving"
    model = _check_model(model, what)
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise ValueError(f"{what}: name must be a model name (a folder name without '/'), got {name!r}")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"{what}: version must be an int >= 1, got {version!r}")
    tok = _tokenizer(tokenizer, model, what)
    fns = serving_functions(model, max_length)
    path = os.path.join(os.fspath(repository), name, str(version))
    return serving.export_generator(
        fns.prefill, fns.decode, fns.params, path, cache_specs=fns.cache_specs, vocab_size=fns.vocab_size,
        max_length=fns.max_length, eos_token_ids=_eos_ids(model, tok, eos_token_ids), platforms=platforms,
        max_batch_size=max_batch_size, tokenizer=tok, score=fns.score, overwrite=overwrite,
        **_paged_kw(fns, block_size, what))


def _paged_kw(fns: ServingFunctions, block_size: Any, what: str) -> dict[str, Any]:
    """``paged=`` and ``block_size=`` for cairn.serving (nothing when ``block_size`` is None)."""
    if block_size is None:
        return {}
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= fns.max_length:
        raise ValueError(f"{what}: block_size (tokens per paged KV block) must be an int in 1..max_length="
                         f"{fns.max_length}, got {block_size!r}")
    return {"paged": fns.paged, "block_size": block_size}


def as_generator(model: CausalLM, tokenizer: Any = None, *, max_length: int, name: str = "generator",
                 eos_token_ids: Sequence[int] | None = None, block_size: int | None = None) -> serving.PythonGenerator:
    """``model`` as an in-process :class:`cairn.serving.PythonGenerator` (what
    :func:`export_for_serving` writes, without the export): run it with
    ``cairn.serving.GenerationEngine``.

    Args:
      model: as :func:`export_for_serving`.
      tokenizer: as :func:`export_for_serving`.
      max_length: as :func:`export_for_serving`.
      eos_token_ids: as :func:`export_for_serving`.
      block_size: as :func:`export_for_serving`.
      name: the generator's name.

    Raises:
      As :func:`export_for_serving`.
    """
    model = _check_model(model, "as_generator")
    tok = _tokenizer(tokenizer, model, "as_generator")
    fns = serving_functions(model, max_length)
    return serving.PythonGenerator(fns.prefill, fns.decode, fns.params, cache_specs=fns.cache_specs,
                                   vocab_size=fns.vocab_size, max_length=fns.max_length,
                                   eos_token_ids=_eos_ids(model, tok, eos_token_ids), tokenizer=tok, name=name,
                                   score=fns.score, **_paged_kw(fns, block_size, "as_generator"))
