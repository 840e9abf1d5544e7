"""cairn.llm.generate: batching never changes a row, log-probs are the model's, sampling is the
published top-k / top-p rule, rows stop on their own ids and strings, bad input is refused.

References are independent of the code under test: the model's full causal forward pass
(which test_llm_models.py checks against transformers) with a float64 NumPy log_softmax,
and NumPy formulas of temperature / top-k / top-p.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from llm_testlib import FIXTURES, forward, load

from cairn import llm
from cairn.llm import _sampling

# families with different attention: full (llama), sliding window 5 (mistral), q/k norms
# (qwen3), soft-capping and alternating windows of 4 (gemma2)
FAMILIES = ["llama", "mistral", "qwen3", "gemma2"]
# llama runs in the default suite, the other families (compiles of ~10-25 s each) in tests_slow
FAMILY_PARAMS = ["llama"] + [pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES[1:]]
PROMPTS = [[5, 17, 33, 8, 61, 2, 9], [40], [11, 12, 13, 70]]


def _log_softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _filter64(x: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """transformers' TopK then TopP warpers on one row (float64; -inf outside the kept set)."""
    x = np.asarray(x, np.float64).copy()
    if 0 < top_k < x.size:
        x[x < np.sort(x)[::-1][top_k - 1]] = -np.inf
    if top_p < 1.0:
        order = np.argsort(-x, kind="stable")
        p = np.exp(_log_softmax64(x[order]))
        before = np.cumsum(p) - p
        remove = before >= top_p
        remove[0] = False
        x[order[remove]] = -np.inf
    return x


# --- batching ---

@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.parametrize("variant", FAMILY_PARAMS)
def test_greedy_batch_with_ragged_prompts_equals_one_prompt_at_a_time(variant):
    model = load(variant)
    batch = llm.generate(model, PROMPTS, 9)
    for b, prompt in enumerate(PROMPTS):
        alone = llm.generate(model, [prompt], 9)
        assert batch.tokens[b] == alone.tokens[0]
        np.testing.assert_allclose(batch.logprobs[b], alone.logprobs[0], rtol=1e-5, atol=1e-5)
    assert batch.finish_reason == ["length"] * 3


@pytest.mark.parametrize("variant, loop", [
    ("llama", "while_loop"),
    pytest.param("gemma2", "while_loop", marks=pytest.mark.slow),
    pytest.param("llama", "python", marks=pytest.mark.slow),
    pytest.param("gemma2", "python", marks=pytest.mark.slow),
])
@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_sampled_batch_equals_one_prompt_at_a_time_with_the_same_seed(variant, loop):
    model = load(variant)
    seeds = [11, 12, 13]
    kw = dict(temperature=1.3, top_k=40, top_p=0.9, decode_loop=loop)
    batch = llm.generate(model, PROMPTS, 12, seed=seeds, **kw)
    for b, prompt in enumerate(PROMPTS):
        assert batch.tokens[b] == llm.generate(model, [prompt], 12, seed=[seeds[b]], **kw).tokens[0]
    # a row's draw depends on its own seed only: reordering the batch reorders the rows
    flipped = llm.generate(model, PROMPTS[::-1], 12, seed=seeds[::-1], **kw)
    assert flipped.tokens == batch.tokens[::-1]
    # and the seed matters
    other = llm.generate(model, PROMPTS, 12, seed=[21, 22, 23], **kw)
    assert other.tokens != batch.tokens


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_an_int_seed_is_reproducible_and_gives_each_row_its_own_key():
    model = load("llama")
    same = [[5, 6, 7]] * 3
    a = llm.generate(model, same, 10, temperature=1.5, seed=3)
    b = llm.generate(model, same, 10, temperature=1.5, seed=3)
    assert a.tokens == b.tokens
    assert len({tuple(t) for t in a.tokens}) == 3  # three rows, three different draws


@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_python_loop_equals_while_loop():
    model = load("mistral")
    kw = dict(temperature=0.9, top_p=0.95, seed=[1, 2, 3], stop_token_ids=[7, 30])
    w = llm.generate(model, PROMPTS, 15, decode_loop="while_loop", **kw)
    p = llm.generate(model, PROMPTS, 15, decode_loop="python", **kw)
    assert w.tokens == p.tokens and w.finish_reason == p.finish_reason


# --- log-probabilities ---

@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.parametrize("variant", FAMILY_PARAMS)
def test_logprobs_equal_log_softmax_of_the_full_forward_pass(variant):
    model = load(variant)
    temperature, top_k, top_p = 1.2, 30, 0.85
    out = llm.generate(model, PROMPTS, 10, temperature=temperature, top_k=top_k, top_p=top_p,
                       seed=[4, 5, 6], return_processed_logprobs=True)
    for b, prompt in enumerate(PROMPTS):
        full = prompt + out.tokens[b]
        logits = np.asarray(forward(model, np.asarray([full], np.int32)))[0]
        at = np.arange(len(prompt) - 1, len(full) - 1)  # the logits that chose each new token
        want = _log_softmax64(logits[at])[np.arange(len(at)), out.tokens[b]]
        np.testing.assert_allclose(out.logprobs[b], want, rtol=0, atol=3e-5)
        proc = np.stack([_log_softmax64(_filter64(logits[i] / temperature, top_k, top_p)) for i in at])
        want_proc = proc[np.arange(len(at)), out.tokens[b]]
        assert np.all(np.isfinite(want_proc))  # every token drawn lies in its kept set
        np.testing.assert_allclose(out.processed_logprobs[b], want_proc, rtol=0, atol=3e-5)


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_greedy_picks_the_argmax_and_its_processed_logprob_is_zero():
    model = load("qwen3")
    out = llm.generate(model, PROMPTS[:1], 6, return_processed_logprobs=True)
    full = PROMPTS[0] + out.tokens[0]
    logits = np.asarray(forward(model, np.asarray([full], np.int32)))[0]
    assert out.tokens[0] == logits[len(PROMPTS[0]) - 1:-1].argmax(-1).tolist()
    assert np.all(out.processed_logprobs[0] == 0.0)
    assert llm.generate(model, PROMPTS[:1], 6, return_logprobs=False).logprobs is None


# --- top-k / top-p ---

def test_filter_logits_keeps_the_top_k_then_top_p_sets_of_the_numpy_reference():
    rng = np.random.default_rng(0)
    v = 50
    cases = [(0, 1.0), (1, 1.0), (5, 1.0), (v, 1.0), (v + 7, 0.5), (0, 0.3), (0, 0.9), (10, 0.6),
             (3, 0.999), (0, 1e-6), (20, 0.75), (7, 0.95)]
    logits = (rng.standard_normal((len(cases), v)) * 2.5).astype(np.float32)
    logits[3, 10:14] = logits[3, 9]  # ties
    got = np.asarray(_sampling.filter_logits(jnp.asarray(logits), jnp.array([c[0] for c in cases]),
                                              jnp.array([c[1] for c in cases], jnp.float32)))
    for row, (k, p) in enumerate(cases):
        want = _filter64(logits[row], k, p)
        np.testing.assert_array_equal(np.isfinite(got[row]), np.isfinite(want), err_msg=f"top_k={k} top_p={p}")
        kept = np.isfinite(want)
        np.testing.assert_array_equal(got[row][kept], logits[row][kept])


def test_sampled_frequencies_match_the_filtered_distribution():
    logits = np.log(np.array([0.3, 0.2, 0.15, 0.12, 0.08, 0.06, 0.05, 0.04], np.float64))
    temperature, top_k, top_p = 0.8, 6, 0.8
    want = np.exp(_log_softmax64(_filter64(logits / temperature, top_k, top_p)))
    n = 20000
    params = _sampling.SamplingParams(jnp.full((n,), temperature, jnp.float32), jnp.full((n,), top_k, jnp.int32),
                                      jnp.full((n,), top_p, jnp.float32))
    keys = jax.random.split(jax.random.key(0), n)
    tokens, _, processed = jax.jit(_sampling.choose, static_argnames=("sampling", "filtering"))(
        jnp.asarray(np.tile(logits, (n, 1)), jnp.float32), keys, params, sampling=True, filtering=True)
    counts = np.bincount(np.asarray(tokens), minlength=logits.size)
    kept = want > 0
    assert counts[~kept].sum() == 0
    expected = n * want[kept]
    chi2 = ((counts[kept] - expected) ** 2 / expected).sum()
    df = kept.sum() - 1
    z = 4.75  # one-sided p = 1e-6; Wilson-Hilferty quantile of the chi-square distribution
    bound = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
    assert chi2 < bound, (counts, expected)
    np.testing.assert_allclose(np.asarray(processed), np.log(want[np.asarray(tokens)]), atol=1e-5)


# --- stopping ---

@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
def test_rows_stop_on_their_own_stop_ids_and_the_others_go_on():
    model = load("llama")
    kw = dict(temperature=1.0, seed=[1, 2, 3])
    free = llm.generate(model, PROMPTS, 16, **kw)
    stop = free.tokens[0][4]  # row 0 meets it at step 4 (or earlier)
    out = llm.generate(model, PROMPTS, 16, stop_token_ids=[stop], **kw)
    for b in range(3):
        first = free.tokens[b].index(stop) if stop in free.tokens[b] else None
        if first is None:
            assert out.tokens[b] == free.tokens[b] and out.finish_reason[b] == "length"
        else:
            assert out.tokens[b] == free.tokens[b][:first + 1] and out.finish_reason[b] == "stop"
            np.testing.assert_array_equal(out.logprobs[b], free.logprobs[b][:first + 1])
    assert out.finish_reason[0] == "stop"


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_max_length_caps_prompt_plus_generation_per_row():
    model = load("llama")
    out = llm.generate(model, PROMPTS, 10, max_length=9)  # prompts of 7, 1 and 4 tokens
    assert [len(t) for t in out.tokens] == [2, 8, 5]
    assert out.finish_reason == ["length"] * 3
    assert out.tokens[1] == llm.generate(model, [PROMPTS[1]], 8).tokens[0]


def _char_tokenizer() -> llm.Tokenizer:
    """96 tokens (the fixtures' vocabulary): <eos>, single characters and some pairs."""
    pieces = ["<eos>", *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?-",
              "th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ti", "es", "or", "te", "of", "ed",
              "is", "it", "al", "ar", "st", "to", "nt", "ng", "se", "ha", "as"]
    assert len(pieces) == 96
    backend = tokenizers.Tokenizer(tokenizers.models.BPE({p: i for i, p in enumerate(pieces)}, []))
    backend.decoder = tokenizers.decoders.Fuse()
    backend.add_special_tokens([tokenizers.AddedToken("<eos>", special=True)])
    return llm.Tokenizer(backend, {"eos_token": "<eos>"})


def _expected_stop(pieces: list[str], stop: str) -> tuple[int, str] | None:
    """(tokens kept, text) when ``stop`` occurs in the concatenated pieces, by plain string search."""
    text = "".join(pieces)
    at = text.find(stop)
    if at < 0:
        return None
    ends = np.cumsum([len(p) for p in pieces])
    return int(np.searchsorted(ends, at + len(stop))) + 1, text[:at]


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
def test_stop_strings_match_across_token_boundaries():
    model, tok = load("gemma2"), _char_tokenizer()
    kw = dict(temperature=1.0, seed=[7, 8, 9], tokenizer=tok, stop_token_ids=[])
    free = llm.generate(model, PROMPTS, 30, **kw)
    pieces = [[tok.decode([t]) for t in row] for row in free.tokens]
    assert free.text == ["".join(p) for p in pieces]
    # a stop string made of the last character of token 20 and the first of token 21 of row 1
    stop = pieces[1][20][-1] + pieces[1][21][0]
    out = llm.generate(model, PROMPTS, 30, stop_strings=[stop, "@never@"], **kw)
    for b in range(3):
        want = _expected_stop(pieces[b], stop)
        if want is None:
            assert (out.tokens[b], out.text[b], out.finish_reason[b]) == (free.tokens[b], free.text[b], "length")
        else:
            assert out.tokens[b] == free.tokens[b][:want[0]]
            assert out.text[b] == want[1]
            assert out.finish_reason[b] == "stop"
    assert out.finish_reason[1] == "stop"


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
def test_eos_from_the_tokenizer_stops_and_leaves_the_text():
    model, tok = load("llama"), _char_tokenizer()
    free = llm.generate(model, PROMPTS, 20, temperature=1.0, seed=[1, 2, 3], tokenizer=tok, stop_token_ids=[])
    eos = free.tokens[2][5]
    tok2 = llm.Tokenizer(tok.backend_tokenizer, {"eos_token": tok.convert_ids_to_tokens(eos)})
    assert tok2.eos_token_ids == (eos,)
    out = llm.generate(model, PROMPTS, 20, temperature=1.0, seed=[1, 2, 3], tokenizer=tok2,
                       skip_special_tokens=False)
    first = free.tokens[2].index(eos)
    assert out.tokens[2] == free.tokens[2][:first + 1] and out.finish_reason[2] == "stop"
    assert out.text[2] == tok.decode(free.tokens[2][:first])  # the stop id adds no text


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
def test_string_prompts_are_encoded_with_the_tokenizer():
    model, tok = load("llama"), _char_tokenizer()
    out = llm.generate(model, ["hello there", "a"], 4, tokenizer=tok)
    assert out.prompt_tokens == [tok.encode("hello there"), tok.encode("a")]
    assert out.tokens == llm.generate(model, out.prompt_tokens, 4, stop_token_ids=tok.eos_token_ids).tokens


# --- bad input ---

@pytest.mark.parametrize("prompts, kwargs, error, match", [
    ([], {}, ValueError, "prompts is empty"),
    ([[1, 2], []], {}, ValueError, "prompt 1 is empty"),
    ([1, 2, 3], {}, TypeError, "flat list of ints"),
    ("hello", {}, TypeError, "list of prompts"),
    (["hello"], {}, ValueError, "pass tokenizer="),
    ([[1, 96]], {}, ValueError, r"token id 96 outside the model's vocabulary \[0, 96\)"),
    ([[1.5, 2.0]], {}, TypeError, "int token ids"),
    ([[1, 2, 3]], {"max_length": 3}, ValueError, "prompt 0 has 3 tokens, so max_length=3"),
    ([[1]], {"max_new_tokens": 0}, ValueError, "max_new_tokens must be a positive int"),
    ([[1]], {"temperature": -0.1}, ValueError, "temperature must be a finite number >= 0"),
    ([[1]], {"temperature": float("nan")}, ValueError, "temperature"),
    ([[1]], {"temperature": 1.0, "top_p": 0.0}, ValueError, r"top_p must be None or a number in \(0, 1\]"),
    ([[1]], {"temperature": 1.0, "top_p": 1.5}, ValueError, r"top_p must be None or a number in \(0, 1\]"),
    ([[1]], {"temperature": 1.0, "top_k": 0}, ValueError, "top_k must be None or an int >= 1"),
    ([[1]], {"top_k": 5}, ValueError, "with temperature=0"),
    ([[1]], {"stop_token_ids": [3, 200]}, ValueError, "stop_token_ids must be ids"),
    ([[1]], {"stop_strings": ["x"]}, ValueError, "stop_strings are matched on the decoded text"),
    ([[1], [2]], {"seed": [1]}, ValueError, "one int in"),
    ([[1]], {"seed": 2**70}, ValueError, "must fit in 64 bits"),
    ([[1]], {"seed": "7"}, ValueError, "seed must be an int"),
    ([[1]], {"decode_loop": "scan"}, ValueError, "decode_loop must be one of"),
])
def test_bad_input_is_refused_with_a_clear_error(prompts, kwargs, error, match):
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(error, match=match):
        llm.generate(load("llama"), prompts, kwargs.pop("max_new_tokens"), **kwargs)


# --- compute dtype: a 16-bit model on CPU decodes with a float32 copy of its weights ---

@pytest.mark.slow  # 10 s: CI's 10-minute budget; tests/llm/test_llm_models covers CausalLM.astype
def test_a_bfloat16_model_on_cpu_generates_with_a_float32_copy_and_is_left_bfloat16():
    half = llm.from_pretrained(FIXTURES / "llama", dtype=jnp.bfloat16)
    full = half.astype(jnp.float32)
    auto = llm.generate(half, PROMPTS, 8, stop_token_ids=[])
    want = llm.generate(full, PROMPTS, 8, stop_token_ids=[])
    assert auto.tokens == want.tokens
    for got, ref in zip(auto.logprobs, want.logprobs, strict=True):
        np.testing.assert_array_equal(got, ref)  # the same float32 program on the same float32 weights
    assert {str(x.dtype) for x in jax.tree_util.tree_leaves(half)} == {"bfloat16"}  # the caller's model is untouched
    kept = llm.generate(half, PROMPTS, 8, stop_token_ids=[], compute_dtype=jnp.bfloat16)
    for b, prompt in enumerate(PROMPTS):  # bfloat16 numerics: the logprobs of the bfloat16 forward pass
        full_ids = prompt + kept.tokens[b]
        logits = np.asarray(forward(half, np.asarray([full_ids], np.int32)))[0]
        at = np.arange(len(prompt) - 1, len(full_ids) - 1)
        np.testing.assert_allclose(kept.logprobs[b], _log_softmax64(logits[at])[np.arange(len(at)), kept.tokens[b]],
                                   rtol=0, atol=2e-2)


def test_compute_dtype_needs_a_causal_lm():
    class Wrapped:  # any pytree model generate accepts, but not a CausalLM
        def __init__(self, model):
            self.config, self.model = model.config, model

    with pytest.raises(TypeError, match="compute_dtype needs a cairn.llm.CausalLM"):
        llm.generate(Wrapped(load("llama")), PROMPTS, 2, compute_dtype=jnp.float32)
