"""OpenAI's API (/v1/models, /v1/completions, /v1/chat/completions) with the official
``openai`` client, against a server the tests start on 127.0.0.1: answers equal the
engine's tokens, streams join to the plain answers, ``n`` and ``seed``, stop strings
across token boundaries, log-probabilities against a float64 NumPy ``log_softmax`` of the
model, penalties against a NumPy reference of OpenAI's formula, usage, and errors as the
client's exception classes; raw HTTP for the SSE framing and the error bodies."""

import concurrent.futures
import http.client
import json
import socket
import time

import gen_testlib as g
import numpy as np
import openai
import pytest

from cairn.serving import PythonGenerator, Tokenizer
from cairn.serving._generate import GenerationConfig, GenerationEngine
from cairn.serving._sampling import SamplingParams
from cairn.serving._server import Server

pytestmark = pytest.mark.xdist_group("serving_openai")

PARAMS = g.init_params(seed=3, scale=2.0)
CONFIG = GenerationConfig(num_slots=4, prefill_batch=2, max_queue=2)
HELLO = [{"role": "user", "content": "hello there"}]
LOGPROB_ATOL = 2e-4  # float32 model vs the float64 reference, log-probabilities of order 1..20


def score(params, tokens, lengths):
    """Each token's log-probability given those before (0 at position 0): prefill at every length."""
    import jax
    import jax.numpy as jnp

    b, p = tokens.shape

    def at(i):  # token i given tokens[:i]: the prefill logits at position i - 1 (position 0 scores 0)
        logits, _ = g.prefill(params, tokens, jnp.full((b,), jnp.maximum(i, 1), jnp.int32))
        lp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), jnp.take(tokens, i, axis=1)[:, None], 1)[:, 0]
        return jnp.where(i > 0, lp, 0.0)

    lp = jax.vmap(at)(jnp.arange(p)).T
    return jnp.where(jnp.arange(p)[None] < lengths[:, None], lp, 0.0).astype(jnp.float32)


class _View:
    """The generator under another name (its compiled functions shared), optionally slow or without score."""

    def __init__(self, inner, name, scores=True):
        self.inner, self.name, self.delay = inner, name, 0.0
        for attr in ("vocab_size", "max_length", "eos_token_ids", "bos_token_id", "vocabulary", "cache_specs", "tokenizer"):
            setattr(self, attr, getattr(inner, attr))
        self.has_score = scores

    def init_cache(self, n):
        return self.inner.init_cache(n)

    def prefill(self, tokens, lengths):
        return self.inner.prefill(tokens, lengths)

    def decode(self, tokens, positions, cache):
        time.sleep(self.delay)
        return self.inner.decode(tokens, positions, cache)

    def score(self, tokens, lengths):
        return self.inner.score(tokens, lengths)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_pretrained(g.char_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def generator(tokenizer):
    return PythonGenerator(g.prefill, g.decode, PARAMS, cache_specs=g.cache_specs(), vocab_size=g.VOCAB_SIZE,
                           max_length=g.MAX_LENGTH, tokenizer=tokenizer, name="tiny", score=score)


@pytest.fixture(scope="module")
def views(generator):
    return {"tiny": _View(generator, "tiny"), "noscore": _View(generator, "noscore", scores=False)}


@pytest.fixture(scope="module")
def server(views):
    s = Server(views, generation=CONFIG).start()
    yield s
    s.stop(drain=False)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(generator):
    with GenerationEngine(generator, GenerationConfig(num_slots=4, prefill_batch=2)) as e:
        yield e


def _chat_ids(tokenizer, messages=HELLO):
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _stats(server, name="tiny"):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("GET", f"/v2/models/{name}/stats")
    out = json.loads(conn.getresponse().read())
    conn.close()
    return out["model_stats"][0]["generation_stats"]


def _wait(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.02)


# --- answers equal the engine's ---


def test_models_lists_the_generators_with_a_tokenizer(client):
    ids = [m.id for m in client.models.list()]
    assert ids == ["noscore", "tiny"]
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.owned_by == "cairn" and card.model_extra["max_model_len"] == g.MAX_LENGTH
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.code == "model_not_found"


def test_chat_applies_the_template_and_matches_the_engine(client, engine, tokenizer):
    out = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=9, temperature=0)
    ids = _chat_ids(tokenizer)
    want = engine.generate(ids, SamplingParams(max_new_tokens=9))
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and out.model == "tiny"
    (choice,) = out.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(want.token_ids, skip_special_tokens=True)
    assert choice.finish_reason == {"stop": "stop", "length": "length"}[want.finish_reason]
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(want.token_ids)
    assert out.usage.total_tokens == len(ids) + len(want.token_ids)
    # without a generation prompt the template renders the conversation alone
    bare = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, temperature=0,
                                          extra_body={"add_generation_prompt": False})
    assert bare.usage.prompt_tokens == len(tokenizer.encode(tokenizer.apply_chat_template(HELLO, add_generation_prompt=False),
                                                            add_special_tokens=False))


def test_completions_take_text_token_ids_and_several_prompts(client, engine, tokenizer):
    out = client.completions.create(model="tiny", prompt=["the cab", [g.BOS_ID, 5, 6]], max_tokens=5, temperature=0)
    assert out.object == "text_completion" and [c.index for c in out.choices] == [0, 1]
    for choice, ids in zip(out.choices, [tokenizer.encode("the cab"), [g.BOS_ID, 5, 6]]):
        want = engine.generate(ids, SamplingParams(max_new_tokens=5))
        assert choice.text == tokenizer.decode(want.token_ids, skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(tokenizer.encode("the cab")) + 3
    # default max_tokens: 16 (as OpenAI's completions)
    assert client.completions.create(model="tiny", prompt="ab", temperature=0, extra_body={"ignore_eos": True}).usage.completion_tokens == 16
    echo = client.completions.create(model="tiny", prompt="the", max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model="tiny", prompt="the", max_tokens=3, temperature=0)
    assert echo.choices[0].text == "the" + plain.choices[0].text


def test_streams_join_to_the_plain_answers(client):
    kw = dict(model="tiny", max_tokens=12, temperature=0.8, seed=4, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(messages=HELLO, **kw)
    chunks = list(client.chat.completions.create(messages=HELLO, stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    *body, last = chunks
    assert last.choices == [] and last.usage == plain.usage
    assert all(c.usage is None for c in body)
    assert "".join(c.choices[0].delta.content or "" for c in body) == plain.choices[0].message.content
    assert body[-1].choices[0].finish_reason == "length"
    text = client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=0)
    pieces = list(client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == text.choices[0].text
    assert pieces[-1].choices[0].finish_reason == text.choices[0].finish_reason
    assert all(p.usage is None for p in pieces)  # no include_usage: no usage chunk


def test_n_choices_and_seeds_are_reproducible(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "zz"}], max_tokens=16, temperature=1.5,
              extra_body={"ignore_eos": True})
    a = client.chat.completions.create(n=4, seed=123, **kw)
    b = client.chat.completions.create(n=4, seed=123, **kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1  # the choices draw from different seeds
    one = client.chat.completions.create(n=1, seed=123, **kw)
    assert one.choices[0].message.content == texts[0]  # choice 0 uses the seed itself
    assert a.usage.completion_tokens == 64 and a.usage.prompt_tokens == one.usage.prompt_tokens
    streamed = list(client.chat.completions.create(n=4, seed=123, stream=True, **kw))
    joined = ["".join(c.choices[0].delta.content or "" for c in streamed if c.choices[0].index == i) for i in range(4)]
    assert joined == texts


def test_stop_strings_match_across_token_boundaries(client, engine, tokenizer):
    ids = tokenizer.encode("the 12")
    free = engine.generate(ids, SamplingParams(max_new_tokens=20, ignore_eos=True))
    pieces = [tokenizer.decode([t], skip_special_tokens=True) for t in free.token_ids]
    text = "".join(pieces)
    # a stop string made of the last character of one token and the first of the next
    i = next(i for i in range(1, len(pieces) - 1) if pieces[i] and pieces[i + 1])
    at = len("".join(pieces[: i + 1])) - 1
    stop = text[at : at + 2]
    cut = text.find(stop)
    kw = dict(model="tiny", prompt="the 12", max_tokens=20, temperature=0, stop=[stop, "never-there"],
              extra_body={"ignore_eos": True})
    out = client.completions.create(**kw)
    assert out.choices[0].text == text[:cut] and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 20
    streamed = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == text[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=30, temperature=0)
    full = chat.choices[0].message.content
    if len(full) > 4:
        cut_chat = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=30, temperature=0, stop=full[2:4])
        assert cut_chat.choices[0].message.content == full[: full.find(full[2:4])]


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_chat_logprobs_equal_a_float64_log_softmax(client, tokenizer):
    out = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=3, extra_body={"ignore_eos": True})
    seq = _chat_ids(tokenizer)
    entries = out.choices[0].logprobs.content
    assert len(entries) == 8
    for e in entries:
        ref = _log_softmax(g.reference_logits(PARAMS, seq)[-1])
        tok = int(np.argmax(ref))  # greedy: the most likely token
        assert e.token == tokenizer.decode([tok]) and e.bytes == list(e.token.encode())
        np.testing.assert_allclose(e.logprob, ref[tok], atol=LOGPROB_ATOL)
        top = np.argsort(-ref, kind="stable")[:3]
        assert [t.token for t in e.top_logprobs] == [tokenizer.decode([int(i)]) for i in top]
        np.testing.assert_allclose([t.logprob for t in e.top_logprobs], ref[top], atol=LOGPROB_ATOL)
        seq = [*seq, tok]
    # without logprobs: none
    assert client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2).choices[0].logprobs is None


def test_completion_logprobs_and_echo_score_the_prompt(client, tokenizer):
    prompt = "the cab 12"
    ids = tokenizer.encode(prompt)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    ref = _log_softmax(g.reference_logits(PARAMS, ids))
    n = len(ids)
    assert lp.tokens[:n] == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:n], [ref[i - 1, ids[i]] for i in range(1, n)], atol=LOGPROB_ATOL)
    assert lp.text_offset[:n] == [len("".join(lp.tokens[:i])) for i in range(n)]
    assert lp.text_offset[n] == len(prompt) and "".join(lp.tokens) == out.choices[0].text
    seq = list(ids)
    for i in range(3):
        r = _log_softmax(g.reference_logits(PARAMS, seq)[-1])
        tok = int(np.argmax(r))
        np.testing.assert_allclose(lp.token_logprobs[n + i], r[tok], atol=LOGPROB_ATOL)
        assert list(lp.top_logprobs[n + i]) == [tokenizer.decode([int(t)]) for t in np.argsort(-r, kind="stable")[:2]]
        seq.append(tok)
    # max_tokens 0 with echo: only the prompt, scored
    only = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0
    np.testing.assert_allclose(only.choices[0].logprobs.token_logprobs[1:], lp.token_logprobs[1:n], atol=1e-6)


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_penalties_follow_openai_formula(client, tokenizer):
    presence, frequency = 1.5, 0.75
    out = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=14, temperature=0,
                                         presence_penalty=presence, frequency_penalty=frequency,
                                         extra_body={"ignore_eos": True})
    seq, counts, want = _chat_ids(tokenizer), np.zeros(g.VOCAB_SIZE), []
    for _ in range(14):
        mu = g.reference_logits(PARAMS, seq)[-1] - frequency * counts - presence * (counts > 0)
        tok = int(np.argmax(mu))
        want.append(tok)
        counts[tok] += 1
        seq.append(tok)
    assert out.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
    plain = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=14, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert plain.choices[0].message.content != out.choices[0].message.content  # the penalties changed the output


# --- errors, as the client's exception classes ---


@pytest.mark.parametrize(("kw", "param"), [
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 1000}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 500}, "max_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"stop": 5}, "stop"),
    ({"extra_body": {"bogus": 1}}, "bogus"),
    ({"extra_body": {"tools": [{"type": "function", "function": {"name": "f"}}]}}, "tools"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "xy" * 40}]}, "messages"),
])
def test_bad_chat_requests_are_400_naming_the_field(client, kw, param):
    body = {"model": "tiny", "messages": HELLO, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    assert e.value.status_code == 400 and e.value.param == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"]


def test_unknown_model_auth_and_missing_score(server, client, views):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=HELLO)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError, match="without a score function") as e:
        client.completions.create(model="noscore", prompt="ab", echo=True, logprobs=1, max_tokens=1)
    assert e.value.param == "echo"
    with Server({"tiny": views["tiny"]}, generation=CONFIG, token="s3cret") as locked:
        bad = openai.OpenAI(base_url=locked.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        good = openai.OpenAI(base_url=locked.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2).usage.completion_tokens == 2


def test_a_stopped_engine_answers_503_with_retry_after(views):
    with Server({"tiny": views["tiny"]}, generation=CONFIG) as other:
        other.app.live["tiny"][1].engine.stop(drain=False)  # as while a version is being retired
        client = openai.OpenAI(base_url=other.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        assert e.value.body["type"] == "server_error" and "not taking requests" in e.value.body["message"]


def _raw(server, method, path, body=None):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request(method, path, body=None if body is None else (body if isinstance(body, bytes) else json.dumps(body)))
    resp = conn.getresponse()
    out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    conn.close()
    return out


def test_error_bodies_have_openai_shape(server):
    for method, path, body, status in [
        ("POST", "/v1/chat/completions", b"{not json", 400),
        ("POST", "/v1/chat/completions", {"messages": HELLO}, 400),
        ("GET", "/v1/chat/completions", None, 405),
        ("POST", "/v1/embeddings", {"model": "tiny"}, 404),
        ("POST", "/v1/completions", {"model": "nope", "prompt": "a"}, 404),
    ]:
        got, headers, raw = _raw(server, method, path, body)
        err = json.loads(raw)["error"]
        assert got == status and headers["content-type"] == "application/json", raw
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["type"] == "invalid_request_error"


def test_a_big_body_is_parsed_off_the_event_loop(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "xy" * 600_000}], "max_tokens": 2}
    status, _, raw = _raw(server, "POST", "/v1/chat/completions", body)  # 1.2 MB: over the 1 MiB offload bound
    err = json.loads(raw)["error"]
    assert status == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert "1200" in err["message"] and str(g.MAX_LENGTH) in err["message"]


def test_sse_framing(server):
    status, headers, raw = _raw(server, "POST", "/v1/chat/completions", {
        "model": "tiny", "messages": HELLO, "max_tokens": 5, "stream": True, "logprobs": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True})
    assert status == 200 and headers["content-type"] == "text/event-stream"
    text = raw.decode()
    assert text.endswith("data: [DONE]\n\n")
    blocks = text.split("\n\n")[:-1]
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks)
    events = [json.loads(b[6:]) for b in blocks[:-1]]
    tokens = [e for e in events if e["choices"] and e["choices"][0]["logprobs"]]
    assert len(tokens) == 5 and all(len(e["choices"][0]["logprobs"]["content"]) == 1 for e in tokens)
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-2]["choices"][0]["delta"] == {}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


def test_queue_full_is_429_and_a_disconnect_frees_the_slot(server, client, views):
    view = views["tiny"]
    view.delay = 0.02
    socks = []
    try:
        before = _stats(server)["finish_reasons"].get("cancelled", 0)
        body = json.dumps({"model": "tiny", "messages": HELLO, "max_tokens": 30, "stream": True, "ignore_eos": True}).encode()
        for _ in range(6):  # 4 slots + the 2 waiting that max_queue allows
            s = socket.create_connection((server.host, server.port), timeout=30)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
            assert s.recv(12).startswith(b"HTTP/1.1 200")
            socks.append(s)
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2)
        assert e.value.status_code == 429 and int(e.value.response.headers["retry-after"]) >= 1
        for s in socks:
            s.close()
        _wait(lambda: _stats(server)["finish_reasons"].get("cancelled", 0) == before + 6)
        _wait(lambda: _stats(server)["engine"]["active_slots"] == 0 and _stats(server)["engine"]["queue"] == 0)
    finally:
        view.delay = 0.0
        for s in socks:
            s.close()


def test_concurrent_clients_get_their_own_tokens(client, engine, tokenizer):
    prompts = ["a", "the 1", "cab cab", "0.5", "zz", "x, y"]

    def one(p):
        return client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(one, prompts))
    for p, text in zip(prompts, got):
        want = engine.generate(tokenizer.encode(p), SamplingParams(max_new_tokens=10, ignore_eos=True))
        assert text == tokenizer.decode(want.token_ids, skip_special_tokens=True)


def test_generate_routes_use_the_tokenizer_and_metrics_count_openai(server, tokenizer, engine):
    ids = tokenizer.encode("the ab")
    status, _, raw = _raw(server, "POST", "/v2/models/tiny/generate",
                          {"text_input": "the ab", "parameters": {"max_tokens": 6, "ignore_eos": True}})
    out = json.loads(raw)
    want = engine.generate(ids, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert status == 200 and out["output_ids"] == want.token_ids
    assert out["text_output"] == tokenizer.decode(want.token_ids, skip_special_tokens=True)
    # this test's own OpenAI requests (the module's other tests may run in another xdist worker)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 2}
    assert _raw(server, "POST", "/v1/chat/completions", chat)[0] == 200
    assert _raw(server, "POST", "/v1/chat/completions", {**chat, "max_tokens": -1})[0] == 400
    _, _, metrics = _raw(server, "GET", "/metrics")
    line = next(x for x in metrics.decode().splitlines()
                if x.startswith('cairn_openai_requests_total{route="/v1/chat/completions",code="200"}'))
    assert float(line.split()[-1]) >= 1
    assert 'cairn_openai_requests_total{route="/v1/chat/completions",code="400"}' in metrics.decode()


# --- a byte-level tokenizer: characters split over tokens arrive whole ---


def _scripted(tok, text, max_length=64):
    """A model that, after any prompt, emits the ids of ``text`` then EOS: logits one-hot on a
    table indexed by the generated token's number (the prompt's length kept in the cache)."""
    import jax.numpy as jnp

    from cairn.core_array import ArraySpec

    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_ids[0]]
    table = np.full(max_length, ids[-1], np.int32)
    table[: len(ids)] = ids
    vocab = len(tok)

    def one_hot(i):
        return 20.0 * (jnp.arange(vocab)[None] == jnp.asarray(table)[jnp.clip(i, 0, max_length - 1)][:, None]).astype(jnp.float32)

    def prefill(params, tokens, lengths):
        start = jnp.zeros((tokens.shape[0], max_length, 1), jnp.float32).at[:, 0, 0].set(lengths.astype(jnp.float32))
        return one_hot(jnp.zeros_like(lengths)), {"c": start}

    def decode(params, tokens, positions, cache):
        return one_hot(positions + 1 - cache["c"][:, 0, 0].astype(jnp.int32)), cache

    return PythonGenerator(prefill, decode, {}, cache_specs={"c": ArraySpec((max_length, 1), "float32")},
                           vocab_size=vocab, max_length=max_length, tokenizer=tok, name="bytes"), ids


@pytest.mark.slow
def test_byte_level_text_streams_whole_characters_and_stops_inside_them():
    tok = Tokenizer.from_pretrained(g.__file__.replace("gen_testlib.py", "fixtures/tokenizers/bpe_chatml"))
    text = "a🤖b 🤖 ok"
    model, ids = _scripted(tok, text)
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)  # the robot is split over byte tokens
    with Server({"bytes": model}, generation=GenerationConfig(num_slots=2, prefill_batch=1)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        chunks = list(client.completions.create(model="bytes", prompt="hi", max_tokens=20, temperature=0, stream=True))
        pieces = [c.choices[0].text for c in chunks]
        assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
        assert chunks[-1].choices[0].finish_reason == "stop"  # the EOS
        stopped = client.completions.create(model="bytes", prompt="hi", max_tokens=20, temperature=0, stop=["🤖 o"])
        assert stopped.choices[0].text == "a🤖b " and stopped.choices[0].finish_reason == "stop"
        chat = client.chat.completions.create(model="bytes", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=len(ids) - 1, logprobs=True, temperature=0)
        assert chat.choices[0].message.content == text and chat.choices[0].finish_reason == "length"
        entries = chat.choices[0].logprobs.content
        assert b"".join(bytes(e.bytes) for e in entries) == text.encode()  # split characters' raw bytes
        assert all(e.logprob > -1e-3 for e in entries)
