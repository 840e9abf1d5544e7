"""``generate``: batched text generation with a KV cache, one compiled decode step for all rows.

The prompts are prefilled together, right-padded with their true lengths, into a
:class:`~cairn.llm.KVCache` of at least ``max_length`` slots per row. Then one jitted step, run in a
``lax.while_loop``, picks each row's next token (greedy, or sampled from
temperature / top-k / top-p), records it with its log-probabilities, and feeds it at the
row's own next position; a row that stops (a stop id, its length limit) is no longer fed
while the others go on. Stop strings need the text, so with ``stop_strings`` the loop
returns to the host every few steps to detokenize the new tokens and stop rows whose text
now holds one.

Randomness is explicit: row ``b`` draws its ``t``-th token with
``fold_in(row_key[b], t)``, where ``row_key[b]`` is ``fold_in(key(seed), b)`` for an int
``seed`` or ``key(seed[b])`` for one seed per row. Nothing else enters a row's draw, so a
row's tokens do not depend on the other rows of the batch, and a request with the same seed
gives the same tokens alone or in any batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cairn.llm._cache import KVCache
from cairn.llm._model import CausalLM
from cairn.llm._sampling import SamplingParams, choose

__all__ = ["GenerationResult", "generate"]

# with stop strings, the device loop returns to the host after this many steps to detokenize
STOP_CHECK_STEPS = 8
# compiled shapes are rounded up (prompt length and output buffer to PROMPT_BUCKET, cache
# slots to CACHE_BUCKET or the padded prompt plus output buffer, whichever is less: see
# _cache_slots), so calls with nearby lengths share one program; the rows' limits still come
# from the exact max_length
PROMPT_BUCKET = 16
CACHE_BUCKET = 64
_FINISH = {1: "stop", 2: "length"}
DECODE_LOOPS = ("while_loop", "python")


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """What :func:`generate` returns, one entry per prompt, in the prompts' order.

    Args:
      tokens: the generated token ids of each row (not the prompt). A row stopped by a stop
        id ends with that id; a row stopped by a stop string ends with the token that
        completed it.
      logprobs: per row, ``float32 [len(tokens[b])]``: ``log_softmax`` of the model's raw
        logits at each chosen token (before temperature, top-k and top-p), or None when
        ``return_logprobs=False``.
      processed_logprobs: per row, the log-probability of each token under the distribution
        it was drawn from (after temperature, top-k, top-p; 0 for greedy rows), or None
        unless ``return_processed_logprobs=True``.
      finish_reason: ``"stop"`` (a stop id or stop string) or ``"length"``
        (``max_new_tokens`` or ``max_length`` reached).
      text: with a tokenizer, each row's generated text: the text the tokens add to the
        prompt's, without a final stop id and cut before a stop string; else None.
      prompt_tokens: the token ids of each prompt (encoded, when prompts were strings).
    """

    tokens: list[list[int]]
    logprobs: list[np.ndarray] | None
    processed_logprobs: list[np.ndarray] | None
    finish_reason: list[str]
    text: list[str] | None
    prompt_tokens: list[list[int]]


class _Carry(NamedTuple):
    tokens: jax.Array  # [B, N] int32
    logprobs: jax.Array  # [B, N] float32
    processed: jax.Array  # [B, N] float32
    n_gen: jax.Array  # [B] int32: tokens generated so far
    done: jax.Array  # [B] bool
    finish: jax.Array  # [B] int32: 0 running, 1 stop, 2 length
    logits: jax.Array  # [B, V] float32: the next token's logits
    cache: KVCache


class _Static(NamedTuple):  # hashable: one compiled program per model structure and mode
    treedef: Any
    sampling: bool
    filtering: bool


class _Inputs(NamedTuple):
    keys: jax.Array  # [B] PRNG keys
    limits: jax.Array  # [B] int32: most tokens each row may generate
    params: SamplingParams
    stop_ids: jax.Array  # [K] int32 (-1 padding)


def _prefill(static: _Static, max_length: int, n_new: int, leaves: list, ids: jax.Array,
             lengths: jax.Array) -> _Carry:
    model = jax.tree_util.tree_unflatten(static.treedef, leaves)
    b = ids.shape[0]
    logits, cache = model(ids, cache=model.init_cache(b, max_length), lengths=lengths)
    zeros = jnp.zeros((b, n_new), jnp.float32)
    return _Carry(jnp.zeros((b, n_new), jnp.int32), zeros, zeros, jnp.zeros((b,), jnp.int32),
                  jnp.zeros((b,), bool), jnp.zeros((b,), jnp.int32), logits[jnp.arange(b), lengths - 1], cache)


def _step(static: _Static, leaves: list, carry: _Carry, inp: _Inputs) -> _Carry:
    """Choose and record one token for every running row, then feed it to the model."""
    model = jax.tree_util.tree_unflatten(static.treedef, leaves)
    b, n = carry.tokens.shape
    keys = jax.vmap(jax.random.fold_in)(inp.keys, carry.n_gen)
    tok, lp, plp = choose(carry.logits, keys, inp.params, sampling=static.sampling, filtering=static.filtering)
    active = ~carry.done
    rows, slot = jnp.arange(b), jnp.where(active, carry.n_gen, n)  # slot n: dropped
    n_gen = carry.n_gen + active.astype(jnp.int32)
    stopped = active & jnp.isin(tok, inp.stop_ids)
    at_limit = active & ~stopped & (n_gen >= inp.limits)
    done = carry.done | stopped | at_limit
    feed = active & ~done

    def forward(cache: KVCache) -> tuple[jax.Array, KVCache]:
        logits, cache = model(tok[:, None], cache=cache, lengths=feed.astype(jnp.int32))
        return jnp.where(feed[:, None], logits[:, 0], carry.logits), cache

    logits, cache = jax.lax.cond(jnp.any(feed), forward, lambda c: (carry.logits, c), carry.cache)
    return _Carry(
        carry.tokens.at[rows, slot].set(tok, mode="drop"),
        carry.logprobs.at[rows, slot].set(lp, mode="drop"),
        carry.processed.at[rows, slot].set(plp, mode="drop"),
        n_gen, done, jnp.where(stopped, 1, jnp.where(at_limit, 2, carry.finish)), logits, cache,
    )


def _loop(static: _Static, leaves: list, carry: _Carry, inp: _Inputs, steps: jax.Array) -> _Carry:
    """Up to ``steps`` decode steps on the device, ending early when every row is done."""
    def cond(state: tuple[jax.Array, _Carry]) -> jax.Array:
        return (state[0] < steps) & ~jnp.all(state[1].done)

    def body(state: tuple[jax.Array, _Carry]) -> tuple[jax.Array, _Carry]:
        return state[0] + 1, _step(static, leaves, state[1], inp)

    return jax.lax.while_loop(cond, body, (jnp.int32(0), carry))[1]


_prefill_jit = jax.jit(_prefill, static_argnums=(0, 1, 2))
_step_jit = jax.jit(_step, static_argnums=0, donate_argnums=2)
_loop_jit = jax.jit(_loop, static_argnums=0, donate_argnums=2)


class _RowText:
    """One row's detokenized text, grown token by token, and the first stop string in it."""

    def __init__(self, tokenizer: Any, prompt: list[int], stops: list[str], skip_special_tokens: bool) -> None:
        self.decoder = tokenizer.incremental_decoder(skip_special_tokens, prompt)
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.fed = 0  # tokens given to the decoder
        self.match: tuple[int, int] | None = None  # (token index, character index)
        self.closed = False

    def _find(self, start: int) -> int | None:
        hits = [i for i in (self.decoder.text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def feed(self, tokens: np.ndarray, upto: int) -> bool:
        """Detokenize ``tokens[fed:upto]``; True when a stop string appeared (then stop)."""
        while self.fed < upto and self.match is None:
            before = len(self.decoder.text)
            piece = self.decoder.step(int(tokens[self.fed]))
            self.fed += 1
            if piece and self.stops:
                at = self._find(max(0, before - self.longest + 1))
                if at is not None:
                    self.match = (self.fed - 1, at)
        return self.match is not None

    def finish(self) -> str:
        """The row's text: flushed, and cut before the first stop string."""
        if self.match is None and not self.closed:
            before = len(self.decoder.text)
            self.decoder.flush()
            at = self._find(max(0, before - self.longest + 1)) if self.stops else None
            if at is not None:
                self.match = (self.fed - 1, at)
        self.closed = True
        return self.decoder.text if self.match is None else self.decoder.text[:self.match[1]]


def _text_upto(carry_h: dict[str, np.ndarray], b: int, stop_ids: set[int]) -> int:
    """How many of row ``b``'s tokens carry text: all but a final stop id."""
    n = int(carry_h["n_gen"][b])
    if n and carry_h["finish"][b] == 1 and int(carry_h["tokens"][b, n - 1]) in stop_ids:
        n -= 1
    return n


def _check_stop_strings(carry: _Carry, texts: list[_RowText], stop_ids: set[int]) -> _Carry:
    """Detokenize the new tokens of every row; rows whose text now holds a stop string stop."""
    host = {k: np.asarray(getattr(carry, k)) for k in ("tokens", "n_gen", "finish")}
    hit = np.zeros(len(texts), bool)
    for b, row in enumerate(texts):
        if row.match is None:
            hit[b] = row.feed(host["tokens"][b], _text_upto(host, b, stop_ids))
    if not hit.any():
        return carry
    mask = jnp.asarray(hit)
    return carry._replace(done=carry.done | mask, finish=jnp.where(mask, 1, carry.finish))


def _decode(static: _Static, leaves: list, carry: _Carry, inp: _Inputs, n_new: int, loop: str,
            texts: list[_RowText] | None, stop_ids: set[int]) -> _Carry:
    """Run the decode steps until every row is done (at most ``n_new``)."""
    checking = texts if texts is not None and texts[0].stops else None
    chunk = STOP_CHECK_STEPS if checking is not None else n_new
    steps = 0
    while steps < n_new:
        todo = min(chunk, n_new - steps)
        if loop == "while_loop":
            carry = _loop_jit(static, leaves, carry, inp, jnp.int32(todo))
        else:
            for _ in range(todo):
                carry = _step_jit(static, leaves, carry, inp)
                if bool(jnp.all(carry.done)):
                    break
        steps += todo
        if checking is not None:
            carry = _check_stop_strings(carry, checking, stop_ids)
        if bool(jnp.all(carry.done)):
            break
    return carry


def _result(carry: _Carry, prompts: list[list[int]], texts: list[_RowText] | None, stop_ids: set[int],
            return_logprobs: bool, return_processed: bool) -> GenerationResult:
    host = {k: np.asarray(v) for k, v in carry._asdict().items() if k not in ("cache", "logits")}
    tokens, logprobs, processed, reasons, out_text = [], [], [], [], []
    for b in range(len(prompts)):
        n = int(host["n_gen"][b])
        if host["finish"][b] not in _FINISH:
            raise AssertionError(f"generate: row {b} did not finish")  # the loop runs every row to its limit
        reason = _FINISH[int(host["finish"][b])]
        if texts is not None:
            row = texts[b]
            row.feed(host["tokens"][b], _text_upto(host, b, stop_ids))
            out_text.append(row.finish())
            if row.match is not None:
                n, reason = min(n, row.match[0] + 1), "stop"
        tokens.append(host["tokens"][b, :n].tolist())
        logprobs.append(host["logprobs"][b, :n].copy())
        processed.append(host["processed"][b, :n].copy())
        reasons.append(reason)
    return GenerationResult(tokens, logprobs if return_logprobs else None, processed if return_processed else None,
                            reasons, out_text if texts is not None else None, prompts)


def _inputs(b: int, temperature: float, top_k: int | None, top_p: float | None, seed: Any, room: np.ndarray,
            stop_ids: list[int]) -> _Inputs:
    """The decode loop's per-row inputs: keys, limits, sampling settings and stop ids."""
    params = SamplingParams(jnp.full((b,), temperature, jnp.float32), jnp.full((b,), top_k or 0, jnp.int32),
                            jnp.full((b,), 1.0 if top_p is None else top_p, jnp.float32))
    return _Inputs(_row_keys(seed, b), jnp.asarray(room), params, jnp.asarray(stop_ids or [-1], jnp.int32))


def _on_cpu(model: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(model)
    return bool(leaves) and all(isinstance(x, jax.Array) and all(d.platform == "cpu" for d in x.devices())
                                for x in leaves)


def _compute_model(model: Any, compute_dtype: Any) -> Any:
    """The model the prefill and decode steps run: ``model`` itself, or its copy in
    ``compute_dtype`` (``None``: float32 for a 16-bit float ``CausalLM`` on CPU).

    XLA:CPU has no bfloat16 / float16 matrix product: every jitted call would convert
    each weight to a float32 temporary (the whole model in float32, allocated and filled
    on every decode step). Converting once per call does that work once, with the same
    peak memory.
    """
    if compute_dtype is None:
        auto = (isinstance(model, CausalLM) and jnp.dtype(model.dtype) in (jnp.bfloat16, jnp.float16)
                and _on_cpu(model) and not model.quantized_paths())
        return model.astype(jnp.float32) if auto else model
    if not isinstance(model, CausalLM):
        raise TypeError(f"generate: compute_dtype needs a cairn.llm.CausalLM, got a {type(model).__name__}; "
                        "leave compute_dtype=None to run the model as it is")
    return model if jnp.dtype(compute_dtype) == jnp.dtype(model.dtype) else model.astype(compute_dtype)


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _prompt_ids(prompts: Any, tokenizer: Any, vocab: int) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
        raise TypeError("generate: prompts must be a list of prompts (each a list of token ids, or a string "
                        f"with tokenizer=), got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("generate: prompts is empty; pass at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if _is_int(p):
            raise TypeError("generate: prompts must be a list of prompts, got a flat list of ints; "
                            "wrap a single prompt in a list: generate(model, [ids], ...)")
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"generate: prompt {i} is a string; pass tokenizer= to encode it, or pass token ids")
            p = tokenizer.encode(p)
        arr = np.asarray(p)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"generate: prompt {i} must be a 1-d sequence of int token ids, got shape {arr.shape} "
                            f"dtype {arr.dtype}")
        if arr.size == 0:
            raise ValueError(f"generate: prompt {i} is empty; every prompt needs at least one token")
        bad = arr[(arr < 0) | (arr >= vocab)]
        if bad.size:
            raise ValueError(f"generate: prompt {i} has token id {int(bad[0])} outside the model's vocabulary [0, {vocab})")
        out.append([int(t) for t in arr])
    return out


def _check_settings(max_new_tokens: Any, temperature: Any, top_k: Any, top_p: Any, decode_loop: str) -> None:
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating, np.integer)) \
            or not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"generate: temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise ValueError(f"generate: top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float, np.floating))
                              or not 0.0 < top_p <= 1.0):
        raise ValueError(f"generate: top_p must be None or a number in (0, 1], got {top_p!r}")
    if temperature == 0 and (top_k is not None or top_p is not None):
        raise ValueError("generate: top_k and top_p filter a sampled distribution; with temperature=0 (greedy) "
                         "they would have no effect: set temperature > 0 or leave them None")
    if decode_loop not in DECODE_LOOPS:
        raise ValueError(f"generate: decode_loop must be one of {DECODE_LOOPS}, got {decode_loop!r}")


def _stop_settings(stop_token_ids: Any, stop_strings: Any, tokenizer: Any, vocab: int) -> tuple[list[int], list[str]]:
    if stop_token_ids is None:
        ids = list(tokenizer.eos_token_ids) if tokenizer is not None else []
    else:
        ids = [stop_token_ids] if _is_int(stop_token_ids) else list(stop_token_ids)
        bad = [i for i in ids if not _is_int(i) or not 0 <= i < vocab]
        if bad:
            raise ValueError(f"generate: stop_token_ids must be ids in the model's vocabulary [0, {vocab}), got {bad[0]!r}")
    stops = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings or [])
    if stops and tokenizer is None:
        raise ValueError("generate: stop_strings are matched on the decoded text; pass tokenizer=")
    if any(not isinstance(s, str) or not s for s in stops):
        raise ValueError(f"generate: stop_strings must be non-empty strings, got {stops!r}")
    return [int(i) for i in ids], stops


def _row_keys(seed: Any, batch: int) -> jax.Array:
    if _is_int(seed):
        if not -2**63 <= seed < 2**63:
            raise ValueError(f"generate: an int seed must fit in 64 bits, got {seed!r}")
        base = jax.random.key(int(seed))
        return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(batch, dtype=jnp.uint32))
    seeds = list(seed) if isinstance(seed, (Sequence, np.ndarray)) else None
    if seeds is None or len(seeds) != batch or not all(_is_int(s) and 0 <= s < 2**32 for s in seeds):
        raise ValueError(f"generate: seed must be an int or one int in [0, 2**32) per prompt ({batch}), got {seed!r}")
    return jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))


def _right_padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """``ids [B, T]`` (``T``: the longest prompt rounded up to ``PROMPT_BUCKET``) and ``lengths [B]``."""
    ids = np.zeros((len(rows), _round_up(max(len(p) for p in rows), PROMPT_BUCKET)), np.int32)
    for i, p in enumerate(rows):
        ids[i, :len(p)] = p
    return ids, np.array([len(p) for p in rows], np.int32)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _cache_slots(max_length: int, width: int, n_out: int) -> int:
    """The cache's slots per row: ``max_length`` rounded up to ``CACHE_BUCKET``, but no more than
    the padded prompt width plus the output buffer (every row's prompt and tokens fit there).

    Each decode step attends to every slot, so slots past the longest row are bytes read for
    nothing (a prompt of 65 and 64 new tokens: 144 slots instead of 192); both bounds depend
    only on what already keys the compiled programs (prompt bucket, output buffer, max_length).
    """
    return min(_round_up(max_length, CACHE_BUCKET), width + n_out)


def _limits(prompts: list[list[int]], max_new_tokens: int, max_length: Any) -> tuple[int, np.ndarray]:
    longest = max(len(p) for p in prompts)
    if max_length is None:
        max_length = longest + max_new_tokens
    if not _is_int(max_length) or max_length < 1:
        raise ValueError(f"generate: max_length must be a positive int (prompt plus generated tokens), got {max_length!r}")
    for i, p in enumerate(prompts):
        if len(p) >= max_length:
            raise ValueError(f"generate: prompt {i} has {len(p)} tokens, so max_length={max_length} (prompt plus "
                             "generated tokens) leaves no room to generate; shorten it or raise max_length")
    room = np.array([min(max_new_tokens, max_length - len(p)) for p in prompts], np.int32)
    return int(max_length), room


def generate(model: Any, prompts: Sequence[Sequence[int]] | Sequence[str], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | Sequence[int] = 0, stop_token_ids: int | Sequence[int] | None = None,
             stop_strings: str | Sequence[str] | None = None, tokenizer: Any = None,
             return_logprobs: bool = True, return_processed_logprobs: bool = False,
             max_length: int | None = None, skip_special_tokens: bool = True,
             decode_loop: str = "while_loop", compute_dtype: Any = None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after each prompt, all rows in one batch.

    Each row stops on its own: at a stop id (kept as its last token), at a stop string in
    its text (with a tokenizer), or after ``max_new_tokens`` tokens or when prompt plus
    generation reaches ``max_length``. Token ``t`` of a row is
    ``argmax(logits)`` when ``temperature == 0``, else drawn from
    ``softmax(filter(logits / temperature))`` (top-k, then top-p; see ``filter_logits``)
    with the key ``fold_in(row_key, t)`` (see the module docstring), so results are
    reproducible and a row's tokens do not depend on the rest of the batch.

    Args:
      model: a :class:`~cairn.llm.CausalLM` (or any pytree model with its ``config``,
        ``init_cache`` and ``model(ids, cache=, lengths=)`` call, e.g. one wrapped by
        ``cairn.quant.quantize_model`` for LoRA).
      prompts: a list of prompts, each a non-empty list of token ids, or a string when
        ``tokenizer`` is given (encoded with its special tokens, e.g. BOS).
      max_new_tokens: the most tokens generated per row (>= 1).
      temperature: 0 for greedy decoding, else the softmax temperature.
      top_k: keep the ``top_k`` most likely tokens; sampling only.
      top_p: then keep the smallest set of most likely tokens of probability ``>= top_p``.
      seed: an int (row ``b`` uses ``fold_in(key(seed), b)``) or one int per prompt
        (row ``b`` uses ``key(seed[b])``: the same request gives the same tokens in any batch).
      stop_token_ids: ids that end a row; default the tokenizer's ``eos_token_ids`` (none
        without a tokenizer).
      stop_strings: strings that end a row when its decoded text contains one, also when
        it spans several tokens; the row's text is cut before it. Needs ``tokenizer``.
      tokenizer: a :class:`~cairn.llm.Tokenizer` to encode string prompts and decode text.
      return_logprobs: return ``log_softmax`` of the raw logits at each chosen token.
      return_processed_logprobs: also return each token's log-probability under the
        distribution it was drawn from (temperature, top-k, top-p applied; 0 when greedy).
      max_length: cache slots per row, the most tokens of prompt plus generation; default
        the longest prompt plus ``max_new_tokens``.
      skip_special_tokens: drop special tokens from ``text``.
      decode_loop: ``"while_loop"`` (the default: the steps run in a ``lax.while_loop`` on
        the device) or ``"python"`` (a Python loop over the same jitted step, checking on
        the host after each step whether every row is done).
      compute_dtype: the steps' dtype, from a copy of the weights made per call (:meth:`CausalLM.astype`); ``None``:
        the model's, but float32 for a 16-bit ``CausalLM`` on CPU (XLA:CPU has no 16-bit matmul; docs/llm.md).

    Returns:
      A :class:`GenerationResult`.

    Raises:
      ValueError / TypeError: an empty prompt list or prompt, an id outside the vocabulary,
        a prompt that leaves no room under ``max_length``, a setting out of range
        (``top_p`` outside ``(0, 1]``, ``temperature < 0``, ``top_k < 1``, top-k/top-p
        with greedy decoding), string prompts or stop strings without a tokenizer.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> from cairn.llm import CausalLM, LlmConfig, generate
    >>> cfg = LlmConfig("llama", vocab_size=32, hidden_size=16, intermediate_size=32,
    ...                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4)
    >>> model = CausalLM(cfg, rngs=nn.Rngs(0))
    >>> out = generate(model, [[1, 2, 3], [4]], max_new_tokens=5, temperature=0.8, top_p=0.9, seed=[7, 8])
    >>> [len(t) for t in out.tokens], out.finish_reason
    ([5, 5], ['length', 'length'])
    """
    vocab = int(model.config.vocab_size)
    _check_settings(max_new_tokens, temperature, top_k, top_p, decode_loop)
    rows = _prompt_ids(prompts, tokenizer, vocab)
    ids_list, stops = _stop_settings(stop_token_ids, stop_strings, tokenizer, vocab)
    max_length, room = _limits(rows, max_new_tokens, max_length)
    model = _compute_model(model, compute_dtype)
    (ids, lengths), n_out = _right_padded(rows), _round_up(max_new_tokens, PROMPT_BUCKET)
    leaves, treedef = jax.tree_util.tree_flatten(model)
    static = _Static(treedef, temperature > 0, top_k is not None or top_p is not None)
    inp = _inputs(len(rows), temperature, top_k, top_p, seed, room, ids_list)
    carry = _prefill_jit(static, _cache_slots(max_length, ids.shape[1], n_out), n_out, leaves, jnp.asarray(ids),
                         jnp.asarray(lengths))
    texts = None if tokenizer is None else [_RowText(tokenizer, p, stops, skip_special_tokens) for p in rows]
    carry = _decode(static, leaves, carry, inp, max_new_tokens, decode_loop, texts, set(ids_list))
    return _result(carry, rows, texts, set(ids_list), return_logprobs, return_processed_logprobs)
