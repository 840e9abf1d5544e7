"""The parts under the OpenAI routes, without a server: stop strings over streamed text
(hypothesis against a prefix-by-prefix reference), OpenAI's penalty formula, top
log-probabilities, token bytes of byte-level and byte-fallback tokenizers, field
checks and seeds of the parser, and the ``score`` signature through export and load."""

import pathlib

import gen_testlib as g
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_serving_openai import score

from cairn import serving
from cairn.serving import Tokenizer
from cairn.serving._generate import TextState, _VocabDecoder
from cairn.serving._openai import (
    OpenAIError,
    TokenTexts,
    choice_seed,
    error_body,
    parse_chat,
    parse_completion,
)
from cairn.serving._sampling import apply_penalties, top_logprobs

TOKENIZERS = pathlib.Path(__file__).parent / "fixtures" / "tokenizers"
HELLO = [{"role": "user", "content": "hi"}]


# --- stop strings ---


def _reference(pieces, stops):
    """Stop at the first piece after which the text holds a stop string; cut at its earliest match."""
    for k in range(len(pieces)):
        prefix = "".join(pieces[: k + 1])
        hits = [prefix.find(s) for s in stops if s in prefix]
        if hits:
            return prefix[: min(hits)], True
    return "".join(pieces), False


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text("abc", max_size=3), max_size=12), st.lists(st.text("abc", min_size=1, max_size=4), max_size=3))
def test_stop_strings_cut_the_text_at_the_first_match_and_never_send_it(pieces, stops):
    state = TextState(_VocabDecoder(pieces), stops)
    sent = []
    for i in range(len(pieces)):
        sent.append(state.add(state.decoder.step(i)))
        assert "".join(sent) == state.text[: state.sent]
        if state.stopped:
            break
    sent.append(state.finish())
    want, stopped = _reference(pieces, stops)
    assert "".join(sent) == state.text == want and state.stopped == stopped


def test_held_back_text_is_sent_once_no_stop_can_match():
    state = TextState(_VocabDecoder(["ab", "c", "d"]), ("cx",))
    assert state.add("ab") == "ab"
    assert state.add("c") == ""  # may begin "cx"
    assert state.add("d") == "cd"
    assert state.finish() == "" and state.text == "abcd" and not state.stopped


# --- penalties and log-probabilities ---


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=20), st.floats(-2, 2), st.floats(-2, 2), st.integers(0, 2**32 - 1))
def test_penalties_are_openai_formula(history, presence, frequency, seed):
    logits = np.random.default_rng(seed).normal(size=10).astype(np.float32)
    counts = {t: history.count(t) for t in set(history)}
    c = np.bincount(np.array(history, np.int64), minlength=10).astype(np.float64)
    want = logits.astype(np.float64) - frequency * c - presence * (c > 0)
    np.testing.assert_allclose(apply_penalties(logits, counts, presence, frequency), want, rtol=0, atol=1e-12)


def test_top_logprobs_rank_by_probability_then_lower_id():
    lp = np.log(np.array([0.1, 0.3, 0.3, 0.2, 0.1]))
    assert [i for i, _ in top_logprobs(lp, 4)] == [1, 2, 3, 0]
    assert top_logprobs(lp, 0) == [] and len(top_logprobs(lp, 9)) == 5


def test_token_bytes_of_partial_characters():
    tok = Tokenizer.from_pretrained(TOKENIZERS / "bpe_chatml")
    ids = tok.encode("🤖")
    texts = TokenTexts(tok)
    assert len(ids) > 1 and b"".join(bytes(texts(i)[1]) for i in ids) == "🤖".encode()
    spm = Tokenizer.from_pretrained(TOKENIZERS / "spm_gemmastyle")
    ids = spm.encode("🤖", add_special_tokens=False)
    texts = TokenTexts(spm)
    assert b"".join(bytes(texts(i)[1]) for i in ids).endswith("🤖".encode())


# --- the parser ---


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_pretrained(g.char_tokenizer(tmp_path_factory.mktemp("tok")))


def test_noop_values_of_unsupported_fields_and_ignored_fields_are_accepted(tokenizer):
    body = {"model": "m", "messages": HELLO, "tools": [], "logit_bias": {}, "response_format": {"type": "text"},
            "user": "u-1", "metadata": {"a": "b"}, "tool_choice": None, "max_completion_tokens": 3}
    req = parse_chat(body, tokenizer)
    assert req.max_tokens == 3 and req.prompts == [tokenizer.encode(tokenizer.apply_chat_template(HELLO), add_special_tokens=False)]
    with pytest.raises(OpenAIError, match="logit_bias is not supported") as e:
        parse_chat({**body, "logit_bias": {"5": 10}}, tokenizer)
    assert e.value.param == "logit_bias" and e.value.status == 400


def test_completion_fields(tokenizer):
    req = parse_completion({"model": "m", "prompt": [[3, 4], "ab"], "n": 2, "best_of": 2, "logprobs": 3, "echo": True,
                            "seed": -1, "top_k": -1, "stop": "x"}, tokenizer)
    assert req.prompts == [[3, 4], tokenizer.encode("ab")] and req.prompt_texts == ["ab", "ab"]
    assert req.params.seed == 2**64 - 1 and req.params.top_k == 0 and req.params.stop == ("x",) and req.logprobs == 3
    for body, param in [({"prompt": []}, "prompt"), ({"prompt": [[99]]}, "prompt"), ({"prompt": "a", "best_of": 3}, "best_of"),
                        ({"prompt": "a", "max_tokens": 0}, "max_tokens"), ({"prompt": "a", "logprobs": 21}, "logprobs"),
                        ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options")]:
        with pytest.raises(OpenAIError) as e:
            parse_completion({"model": "m", **body}, tokenizer)
        assert e.value.param == param and e.value.status == 400


def test_choice_seeds_and_error_bodies():
    seeds = [choice_seed(5, i) for i in range(4)]
    assert seeds[0] == 5 and len(set(seeds)) == 4 and all(0 <= s < 2**64 for s in seeds)
    assert choice_seed(None, 3) is None
    assert error_body(429, "full", code="rate_limit_exceeded") == {
        "error": {"message": "full", "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}}


# --- score: a third signature ---


def test_score_is_exported_and_loaded(tmp_path):
    params = g.init_params(1)
    path = serving.export_generator(g.prefill, g.decode, params, tmp_path / "m", cache_specs=g.cache_specs(),
                                    vocab_size=g.VOCAB_SIZE, max_length=g.MAX_LENGTH, max_batch_size=2, score=score)
    model = serving.load_generator(path)
    assert model.has_score and "score" in model.signatures
    tokens = np.array([[g.BOS_ID, 5, 9, 12, 0, 0, 0, 0], [g.BOS_ID, 7, 0, 0, 0, 0, 0, 0]], np.int32)
    got = model.score(tokens, np.array([4, 2], np.int32))
    assert got.shape == (2, 8) and got.dtype == np.float32
    for row, n in zip(range(2), (4, 2)):
        ref = g.reference_logits(params, tokens[row, :n])
        ref = ref - ref.max(-1, keepdims=True)
        ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
        want = [0.0] + [ref[i - 1, tokens[row, i]] for i in range(1, n)]
        np.testing.assert_allclose(got[row, :n], want, atol=2e-4)
        assert not got[row, n:].any()
    plain = serving.PythonGenerator(g.prefill, g.decode, params, cache_specs=g.cache_specs(), vocab_size=g.VOCAB_SIZE,
                                    max_length=g.MAX_LENGTH)
    assert not plain.has_score
    with pytest.raises(ValueError, match="has no score function"):
        plain.score(tokens, np.array([4, 2], np.int32))


def test_a_score_of_the_wrong_shape_is_refused(tmp_path):
    def bad(params, tokens, lengths):
        return tokens.astype(np.float32)[:, :1]

    with pytest.raises(ValueError, match=r"score must return float32 log-probabilities shaped like tokens \(2, 4\)"):
        serving.PythonGenerator(g.prefill, g.decode, g.init_params(0), cache_specs=g.cache_specs(),
                                vocab_size=g.VOCAB_SIZE, max_length=g.MAX_LENGTH, score=bad)


@pytest.mark.parametrize(("kw", "match"), [
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be a finite number"),
    ({"logprobs": 21}, r"logprobs must be in \[0, 21\)"),
    ({"logprobs": True}, "logprobs must be an integer"),
    ({"stop": "x"}, "stop must be a list of non-empty strings"),
    ({"stop": ["a", ""]}, "stop must be a list of non-empty strings"),
])
def test_new_sampling_fields_are_checked(kw, match):
    from cairn.serving import SamplingParams

    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_from_json_reads_stop_as_text_when_told():
    from cairn.serving import SamplingParams

    assert SamplingParams.from_json({"stop": "ab c"}, text_stops=True).stop == ("ab c",)
    assert SamplingParams.from_json({"stop": ["b"]}, ["a", "b"]).stop_token_ids == (1,)
    p = SamplingParams.from_json({"presence_penalty": 0.5, "logprobs": 2})
    assert p.penalized and p.logprobs == 2


# --- the engine: stop strings over a plain vocabulary, logprobs ---


def test_engine_stop_strings_and_logprobs_on_a_vocabulary_model():
    from cairn.serving import GenerationConfig, GenerationEngine, PythonGenerator, SamplingParams

    kw = dict(cache_specs=g.cache_specs(), vocab_size=g.VOCAB_SIZE, max_length=g.MAX_LENGTH)
    model = PythonGenerator(g.prefill, g.decode, g.init_params(3, 2.0), vocabulary=g.VOCAB, **kw)
    prompt = [g.BOS_ID, 22, 10, 7]
    engine = GenerationEngine(model, GenerationConfig(num_slots=2, prefill_batch=1)).start(precompile=False)
    try:
        free = engine.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
        stop = free.text[3:5]
        events = []
        r = engine.submit(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True, stop=(stop,)), events.append).result()
        assert r.finish_reason == "stop" and r.text == free.text[: free.text.find(stop)]
        assert "".join(e.text or "" for e in events) == r.text
        assert r.token_ids == free.token_ids[: len(r.token_ids)] and len(r.token_ids) < 12
        lp = engine.generate(prompt, SamplingParams(max_new_tokens=4, logprobs=2, ignore_eos=True))
        assert len(lp.logprobs) == 4
        for tok, (logprob, top) in zip(lp.token_ids, lp.logprobs):
            assert len(top) == 2 and top[0] == (tok, logprob) and top[1][1] <= logprob  # greedy: the most likely
        assert engine.stats()["active_slots"] == 0
        ids_only = PythonGenerator(g.prefill, g.decode, g.init_params(3, 2.0), **kw)
        with pytest.raises(ValueError, match="stop strings need a model with a tokenizer or a vocabulary"):
            GenerationEngine(ids_only)._validate(prompt, SamplingParams(stop=("x",)))
    finally:
        engine.stop(drain=False)
