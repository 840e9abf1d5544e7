"""Generation over HTTP: /generate and /generate_stream (SSE) against the in-process
engine, many concurrent clients with mixed lengths equal to sequential results token for
token, clients leaving mid-stream (the slot is freed), bad requests answered 4xx with a
reason while a long generation runs on unharmed, 503 + Retry-After when the queue is full,
/infer beside a generator, metrics and statistics, and cairn-serve over a repository
holding an exported generator."""

import concurrent.futures
import contextlib
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import types

import gen_testlib as lm
import numpy as np
import pytest
import tritonclient.http as th
from hypothesis import given, settings
from hypothesis import strategies as st
from serving_testlib import RawClient, affine_model

from cairn.serving._batcher import BatchingConfig
from cairn.serving._generate import GenerationConfig, GenerationEngine
from cairn.serving._genexport import PythonGenerator, detokenize, tokenize
from cairn.serving._genhttp import parse_generate
from cairn.serving._offload import OFFLOAD_BYTES
from cairn.serving._repository import parse_config
from cairn.serving._sampling import SamplingParams

pytestmark = pytest.mark.xdist_group("serving_generate_http")

PARAMS = lm.init_params(seed=3, scale=2.0)


def _generator() -> PythonGenerator:
    return PythonGenerator(
        lm.prefill,
        lm.decode,
        PARAMS,
        cache_specs=lm.cache_specs(),
        vocab_size=lm.VOCAB_SIZE,
        max_length=lm.MAX_LENGTH,
        eos_token_ids=(lm.EOS_ID,),
        vocabulary=lm.VOCAB,
        bos_token_id=lm.BOS_ID,
        name="tiny",
    )


class _View:
    """Another name for a generator's compiled functions (no second compile): optionally
    without vocabulary, optionally with decode steps that take ``delay`` seconds (so a
    request holds its slot long enough to fill the queue behind it)."""

    def __init__(self, inner, name: str, delay: float = 0.0, text: bool = True) -> None:
        self.inner, self.delay, self.name = inner, delay, name
        for attr in ("vocab_size", "max_length", "eos_token_ids", "bos_token_id", "vocabulary", "cache_specs"):
            setattr(self, attr, getattr(inner, attr) if text or attr not in ("vocabulary", "bos_token_id") else None)

    def init_cache(self, num_slots):
        return self.inner.init_cache(num_slots)

    def prefill(self, tokens, lengths):
        return self.inner.prefill(tokens, lengths)

    fail = False  # set: decode raises (the model failing mid-generation)

    def decode(self, tokens, positions, cache):
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("decode exploded")
        return self.inner.decode(tokens, positions, cache)


GEN_CONFIG = GenerationConfig(num_slots=4, prefill_batch=2, max_queue=64)


@pytest.fixture(scope="module")
def generator():
    return _generator()


@pytest.fixture(scope="module")
def models(generator):
    """What the module's server serves; ``models["tiny"].delay`` slows its decode steps."""
    return {"tiny": _View(generator, "tiny"), "ids": _View(generator, "ids", text=False), "affine": affine_model()}


@pytest.fixture(scope="module")
def engine(generator):
    """The in-process engine the server's answers are compared with (same model, same shapes)."""
    with GenerationEngine(generator, GEN_CONFIG) as e:
        yield e


@contextlib.contextmanager
def _slow(view: _View, delay: float = 0.02):
    """Decode steps of ``view`` take ``delay`` s within the block: a 60-token request runs >= 60 delays."""
    view.delay = delay
    try:
        yield
    finally:
        view.delay = 0.0


@pytest.fixture(scope="module")
def server(models):
    from cairn.serving._server import Server

    s = Server(models, generation=GEN_CONFIG).start()
    yield s
    s.stop(drain=False)


def _post(server, path: str, body, timeout: float = 60.0):
    client = RawClient(server, timeout=timeout)
    try:
        status, headers, data = client.request("POST", path, json.dumps(body) if not isinstance(body, bytes) else body)
    finally:
        client.close()
    return status, headers, json.loads(data) if data else None


def _stream(server, model: str, body, timeout: float = 60.0):
    """POST /generate_stream; returns (status, headers, [event dicts])."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        conn.request("POST", f"/v2/models/{model}/generate_stream", json.dumps(body))
        resp = conn.getresponse()
        raw = resp.read().decode()
        headers = {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()
    if resp.status != 200:
        return resp.status, headers, [json.loads(raw)]
    assert raw.endswith("\n\n")
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        events.append(json.loads(block[len("data: ") :]))
    return resp.status, headers, events


def _engine_tokens(engine, prompt, **params) -> list[int]:
    return engine.generate(prompt, SamplingParams(**params)).token_ids


# --- one request ---


def test_generate_matches_the_engine(server, engine):
    prompt = [lm.BOS_ID, 5, 9, 12, 7]
    status, headers, out = _post(server, "/v2/models/tiny/generate", {"input_ids": prompt, "parameters": {"max_tokens": 12, "ignore_eos": True}})
    assert status == 200, out
    want = _engine_tokens(engine, prompt, max_new_tokens=12, ignore_eos=True)
    assert out["output_ids"] == want and len(want) == 12
    assert out["model_name"] == "tiny" and out["model_version"] == "1" and out["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 12}
    assert out["text_output"] == detokenize(want, lm.VOCAB)
    assert "x-request-id" in headers


def test_text_input_is_tokenized_with_bos(server, engine):
    status, _, out = _post(server, "/v2/models/tiny/versions/1/generate", {"text_input": "hi abc 42", "parameters": {"max_new_tokens": 6}})
    assert status == 200, out
    prompt = tokenize("hi abc 42", lm.VOCAB, lm.BOS_ID)  # BOS first, then longest matches
    assert prompt[0] == lm.BOS_ID and detokenize(prompt, lm.VOCAB) == "hi abc 42"
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert out["output_ids"] == _engine_tokens(engine, prompt, max_new_tokens=6)


def test_stream_events_equal_the_plain_answer(server):
    body = {"input_ids": [lm.BOS_ID, 3, 4, 5], "parameters": {"max_tokens": 10, "temperature": 0.9, "top_k": 8, "seed": 11, "ignore_eos": True}}
    status, headers, events = _stream(server, "tiny", body)
    assert status == 200 and headers["content-type"] == "text/event-stream" and headers["transfer-encoding"] == "chunked"
    *tokens, final = events
    assert [e["index"] for e in tokens] == list(range(10))
    assert all(len(e["output_ids"]) == 1 and e["model_name"] == "tiny" for e in tokens)
    assert final["finish_reason"] == "length" and final["usage"] == {"prompt_tokens": 4, "completion_tokens": 10}
    _, _, plain = _post(server, "/v2/models/tiny/generate", body)
    assert [e["output_ids"][0] for e in tokens] == plain["output_ids"]
    assert "".join(e["text_output"] for e in tokens) == plain["text_output"]


def test_stream_stops_at_a_stop_token_and_keeps_the_connection(server, engine):
    prompt = [lm.BOS_ID, 20, 21]
    free = _engine_tokens(engine, prompt, max_new_tokens=8, ignore_eos=True)
    stop = free[3]
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        for _ in range(2):  # twice on one keep-alive connection
            conn.request("POST", "/v2/models/tiny/generate_stream", json.dumps({"input_ids": prompt, "parameters": {"max_tokens": 8, "stop_token_ids": [stop], "ignore_eos": True}}))
            resp = conn.getresponse()
            events = [json.loads(b[6:]) for b in resp.read().decode().split("\n\n")[:-1]]
            assert resp.getheader("Connection") == "keep-alive"
            assert [e["output_ids"][0] for e in events[:-1]] == free[: free.index(stop) + 1]
            assert events[-1]["finish_reason"] == "stop"
    finally:
        conn.close()


def test_triton_style_top_level_parameters(server, engine):
    prompt = [lm.BOS_ID, 14, 15]
    body = {"input_ids": prompt, "max_tokens": 7, "ignore_eos": True, "stream": False, "parameters": {"temperature": 0.5, "seed": 3}}
    status, _, out = _post(server, "/v2/models/tiny/generate", body)
    assert status == 200, out
    assert out["output_ids"] == _engine_tokens(engine, prompt, max_new_tokens=7, ignore_eos=True, temperature=0.5, seed=3)
    status, _, events = _stream(server, "tiny", {**body, "stream": True})
    assert status == 200 and [e["output_ids"][0] for e in events[:-1]] == out["output_ids"]


def test_ids_only_model(server):
    status, _, out = _post(server, "/v2/models/ids/generate", {"input_ids": [1, 2, 3], "parameters": {"max_tokens": 3, "ignore_eos": True}})
    assert status == 200 and "text_output" not in out and len(out["output_ids"]) == 3
    status, _, events = _stream(server, "ids", {"input_ids": [1, 2, 3], "parameters": {"max_tokens": 2, "ignore_eos": True}})
    assert status == 200 and all("text_output" not in e for e in events) and len(events) == 3


# --- any body: a prompt and parameters, or a ValueError ---

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_keys = st.sampled_from(["text_input", "input_ids", "parameters", "stream", "max_tokens", "max_new_tokens", "temperature",
                         "top_k", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos", "other"])  # fmt: skip
_bodies = st.dictionaries(_keys, _json_values | st.lists(st.integers(-2, 45), max_size=6) | st.dictionaries(_keys, _json_values, max_size=4), max_size=5)


@settings(max_examples=300, deadline=None)
@given(body=_bodies | _json_values)
def test_parse_generate_answers_a_prompt_or_a_value_error(body):
    model = types.SimpleNamespace(name="m", vocabulary=tuple(lm.VOCAB), bos_token_id=lm.BOS_ID)
    try:
        prompt, params = parse_generate(json.dumps(body).encode(), model)
    except ValueError as e:
        assert str(e)
        return
    assert isinstance(body, dict) and ("text_input" in body) != ("input_ids" in body)
    assert all(isinstance(t, int) for t in prompt) and isinstance(params, SamplingParams)


# --- many clients ---


def _mixed_requests(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = [lm.BOS_ID, *rng.integers(3, lm.VOCAB_SIZE, size=int(rng.integers(1, 20))).tolist()]
        params = {"max_tokens": int(rng.integers(1, 24)), "ignore_eos": bool(i % 3)}
        if i % 2:
            params.update(temperature=0.8, top_p=0.9, seed=int(rng.integers(0, 1000)))
        out.append({"input_ids": prompt, "parameters": params})
    return out


def _tokens(server, body, stream: bool) -> list[int]:
    if stream:
        status, _, events = _stream(server, "tiny", body)
        assert status == 200 and "finish_reason" in events[-1]
        return [e["output_ids"][0] for e in events[:-1]]
    status, _, out = _post(server, "/v2/models/tiny/generate", body)
    assert status == 200, out
    return out["output_ids"]


def test_concurrent_clients_equal_sequential(server, engine):
    bodies = _mixed_requests(16)
    want = [_engine_tokens(engine, b["input_ids"], **{("max_new_tokens" if k == "max_tokens" else k): v for k, v in b["parameters"].items()}) for b in bodies]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda ib: _tokens(server, ib[1], stream=ib[0] % 2 == 0), enumerate(bodies)))
    assert got == want


def _leave_after(server, body, events: int) -> None:
    """Stream ``body`` and disconnect once ``events`` token events have arrived."""
    with _open_stream(server, "tiny", body) as s:
        data = b""
        while data.count(b"data: ") < events:
            data += s.recv(65536)


def test_many_clients_with_cancellations_equal_sequential(server, engine, models):
    bodies = _mixed_requests(48, seed=7)
    leaving = {i for i in range(len(bodies)) if i % 4 == 3}
    for i in leaving:
        bodies[i]["parameters"].update(max_tokens=60 - len(bodies[i]["input_ids"]), ignore_eos=True)
    want = {i: _engine_tokens(engine, b["input_ids"], **{("max_new_tokens" if k == "max_tokens" else k): v for k, v in b["parameters"].items()})
            for i, b in enumerate(bodies) if i not in leaving}  # fmt: skip
    cancelled = _stats(server)["generation_stats"]["finish_reasons"].get("cancelled", 0)
    with _slow(models["tiny"], 0.005), concurrent.futures.ThreadPoolExecutor(16) as pool:  # the leavers are surely still running
        futs = {i: pool.submit(_leave_after, server, b, 2) if i in leaving else pool.submit(_tokens, server, b, i % 2 == 0) for i, b in enumerate(bodies)}
        got = {i: f.result() for i, f in futs.items() if i not in leaving}
    assert got == want
    _wait(lambda: _stats(server)["generation_stats"]["finish_reasons"].get("cancelled", 0) == cancelled + len(leaving))
    _wait(lambda: _stats(server)["generation_stats"]["engine"].get("active_slots", 0) == 0)


# --- clients leaving ---


def _stats(server, model: str = "tiny") -> dict:
    status, _, out = RawClient(server).request("GET", f"/v2/models/{model}/stats")
    assert status == 200
    return json.loads(out)["model_stats"][0]


def _wait(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def _open_stream(server, model: str, body) -> socket.socket:
    payload = json.dumps(body).encode()
    s = socket.create_connection((server.host, server.port), timeout=60)
    s.sendall(f"POST /v2/models/{model}/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    data = b""
    while b"data: " not in data:  # the first token has arrived
        data += s.recv(65536)
    return s


def test_client_disconnect_cancels_and_frees_the_slot(server, engine, models):
    with _slow(models["tiny"]):
        cancelled = _stats(server)["generation_stats"]["finish_reasons"].get("cancelled", 0)
        long = {"input_ids": [lm.BOS_ID, 4], "parameters": {"max_tokens": 60, "ignore_eos": True}}
        socks = [_open_stream(server, "tiny", long) for _ in range(3)]
        other = [lm.BOS_ID, 30, 31, 32]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(_tokens, server, {"input_ids": other, "parameters": {"max_tokens": 20, "ignore_eos": True}}, True)
            for s in socks:
                s.close()
            assert fut.result() == _engine_tokens(engine, other, max_new_tokens=20, ignore_eos=True)
        _wait(lambda: _stats(server)["generation_stats"]["finish_reasons"].get("cancelled", 0) == cancelled + 3)
        _wait(lambda: _stats(server)["generation_stats"]["engine"].get("active_slots", 0) == 0)


def test_client_leaving_before_a_plain_answer_cancels(server, models):
    with _slow(models["tiny"]):
        cancelled = _stats(server)["generation_stats"]["finish_reasons"].get("cancelled", 0)
        payload = json.dumps({"input_ids": [lm.BOS_ID, 4], "parameters": {"max_tokens": 60, "ignore_eos": True}}).encode()
        with socket.create_connection((server.host, server.port), timeout=60) as s:
            s.sendall(b"POST /v2/models/tiny/generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (len(payload), payload))
            _wait(lambda: _stats(server)["generation_stats"]["engine"].get("active_slots", 0) == 1)
        _wait(lambda: _stats(server)["generation_stats"]["finish_reasons"].get("cancelled", 0) == cancelled + 1)
        _wait(lambda: _stats(server)["generation_stats"]["engine"].get("active_slots", 0) == 0)


def test_unload_drains_running_generations(generator, engine):
    from cairn.serving._server import Server

    prompt = [lm.BOS_ID, 9, 10]
    view = _View(generator, "tiny")
    with Server({"tiny": view}, generation=GEN_CONFIG) as server:
        view.delay = 0.01
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(_tokens, server, {"input_ids": prompt, "parameters": {"max_tokens": 30, "ignore_eos": True}}, True)
            _wait(lambda: _stats(server)["generation_stats"]["engine"].get("active_slots", 0) == 1)
            server.unload_model("tiny")  # returns once the running request has finished
            assert fut.result(30) == _engine_tokens(engine, prompt, max_new_tokens=30, ignore_eos=True)
        status, _, out = _post(server, "/v2/models/tiny/generate", {"input_ids": prompt})
        assert status == 404 and "not loaded" in out["error"]


# --- bad requests beside a running generation ---

_BAD = [
    ({"input_ids": list(range(3, 40)) * 2}, "cache"),  # 74 tokens: longer than the cache (64)
    ({"input_ids": [1, 2], "parameters": {"max_tokens": 63}}, "max"),  # prompt + max tokens > max_length
    ({"input_ids": [1, 2], "parameters": {"beam_width": 2}}, "beam_width"),
    ({"input_ids": [1, 2], "parameters": {"max_tokens": 0}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "parameters": {"max_tokens": -3}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "parameters": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1, 2], "parameters": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1, 2], "parameters": {"stop": ["zz"]}}, "stop"),
    ({"input_ids": [1, 2], "parameters": [1]}, "parameters"),
    ({"input_ids": []}, "prompt"),
    ({"input_ids": [1, 99]}, "99"),
    ({"input_ids": "abc"}, "input_ids"),
    ({"input_ids": [1, 2.5]}, "input_ids"),
    ({"text_input": "abc", "input_ids": [1]}, "exactly one"),
    ({"parameters": {}}, "exactly one"),
    ({"text_input": "ab\u00e9"}, "'\u00e9'"),
    ({"text_input": 5}, "text_input"),
    ({"input_ids": [1, 2], "prompt": "x"}, "prompt"),
    ({"input_ids": [1, 2], "max_tokens": 2, "parameters": {"max_tokens": 3}}, "both"),
    ({"input_ids": [1, 2], "stream": "yes"}, "stream"),
    (b"{not json", "JSON"),
    (b"[1, 2]", "JSON object"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"input_ids": [1, 2], "parameters": {"stop": ' + b"[" * 50_000 + b"]" * 50_000 + b"}}", "nested too deeply"),
    (b'{"input_ids": [1, 2], "parameters": {"temperature": NaN}}', "temperature must be a finite number, got NaN"),
    (b'{"input_ids": [1, 2], "temperature": 1e400}', "temperature must be a finite number"),
    (b'{"input_ids": [1, NaN]}', "input_ids"),
]


@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_are_4xx_and_the_running_batch_is_unaffected(server, engine, stream):
    prompt = [lm.BOS_ID, 6, 7, 8]
    running = {"input_ids": prompt, "parameters": {"max_tokens": 50, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_tokens, server, running, True)
        path = f"/v2/models/tiny/{'generate_stream' if stream else 'generate'}"
        answers = [(body, needle, *_post(server, path, body)) for body, needle in _BAD]
        wrong = [(body, out) for body, needle, status, _, out in answers if status != 400 or needle.lower() not in out["error"].lower()]
        assert not wrong
        status, _, out = _post(server, "/v2/models/ids/generate", {"text_input": "abc"})
        assert status == 400 and "vocabulary" in out["error"] and "input_ids" in out["error"]
        status, _, out = _post(server, "/v2/models/nope/generate", {"input_ids": [1]})
        assert status == 404 and "nope" in out["error"]
        status, _, out = _post(server, "/v2/models/tiny/versions/7/generate", {"input_ids": [1]})
        assert status == 404
        status, _, out = _post(server, "/v2/models/affine/generate", {"input_ids": [1]})
        assert status == 400 and "infer" in out["error"]
        x = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0, 0, 0, 0]}]}
        status, _, out = _post(server, "/v2/models/tiny/infer", x)
        assert status == 400 and "/generate" in out["error"]
        status, _, _ = RawClient(server).request("GET", "/v2/models/tiny/generate")
        assert status == 405
        assert fut.result() == _engine_tokens(engine, prompt, max_new_tokens=50, ignore_eos=True)


@pytest.mark.parametrize("stream", [False, True])
def test_a_big_generate_body_is_parsed_in_a_worker_process(server, engine, stream):
    # over OFFLOAD_BYTES (whitespace is JSON too): parsed off the loop, answered like a small one
    prompt = [lm.BOS_ID, 5, 9, 12]
    pad = b" " * (OFFLOAD_BYTES + 1)
    good = b'{"input_ids": %s, %s"parameters": {"max_tokens": 7, "ignore_eos": true}}' % (json.dumps(prompt).encode(), pad)
    bad = b'{"input_ids": [1, 2], %s"parameters": {"temperature": NaN}}' % pad
    path = f"/v2/models/tiny/{'generate_stream' if stream else 'generate'}"
    client = RawClient(server)
    status, _, data = client.request("POST", path, good)
    assert status == 200
    if stream:
        events = [json.loads(b[len("data: ") :]) for b in data.decode().split("\n\n")[:-1]]
        tokens = [t for e in events[:-1] for t in e["output_ids"]]
        assert events[-1]["finish_reason"] == "length"
    else:
        tokens = json.loads(data)["output_ids"]
    assert tokens == _engine_tokens(engine, prompt, max_new_tokens=7, ignore_eos=True)
    status, _, data = client.request("POST", path, bad)
    assert status == 400 and "temperature must be a finite number" in json.loads(data)["error"]
    assert client.request("GET", "/v2/health/live")[0] == 200  # the same kept-alive connection
    client.close()


# --- backpressure ---


def test_queue_full_is_503_with_retry_after(models):
    from cairn.serving._server import Server

    gen = _View(models["tiny"], "tiny")  # the fixture's shapes: compiled already
    config = GenerationConfig(num_slots=GEN_CONFIG.num_slots, prefill_batch=GEN_CONFIG.prefill_batch, max_queue=1)
    with Server({"tiny": gen}, generation=config) as server:
        gen.delay = 0.05  # from now on a 60-token request holds its slot for 3 s or more
        long = {"input_ids": [lm.BOS_ID, 4], "parameters": {"max_tokens": 60, "ignore_eos": True}}
        holders = [_open_stream(server, "tiny", long) for _ in range(config.num_slots)]  # every slot taken
        _wait(lambda: _stats(server)["generation_stats"]["engine"].get("active_slots", 0) == config.num_slots)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            queued = pool.submit(_post, server, "/v2/models/tiny/generate", {"input_ids": [1, 5], "parameters": {"max_tokens": 2}})
            _wait(lambda: _stats(server)["generation_stats"]["engine"].get("queue", 0) == 1)
            status, headers, out = _post(server, "/v2/models/tiny/generate", {"input_ids": [1, 6]})
            assert status == 503 and int(headers["retry-after"]) >= 1 and "overloaded" in out["error"]
            status, headers, out = _stream(server, "tiny", {"input_ids": [1, 6]})
            assert status == 503 and "retry-after" in headers
            for s in holders:
                s.close()  # frees the slots: the queued request runs
            status, _, out = queued.result()
            assert status == 200 and len(out["output_ids"]) <= 2
        metrics = RawClient(server).request("GET", "/metrics")[2].decode()
        assert re.search(r'cairn_generation_request_failure_total\{model="tiny",version="1",reason="queue_full"\} 2', metrics)


# --- beside /infer, metadata, statistics and metrics ---


def test_infer_beside_a_generator_metadata_stats_and_metrics(server):
    client = th.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        inp = th.InferInput("x", [2, 4], "FP32")
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer("affine", [inp]).as_numpy("y"), x * 2 + 1)
        meta = client.get_model_metadata("tiny")
        assert {i["name"] for i in meta["inputs"]} == {"text_input", "input_ids"}
        assert meta["generation"] == {"vocab_size": 40, "max_length": 64, "eos_token_ids": [2], "has_vocabulary": True}
        cfg = client.get_model_config("tiny")
        assert cfg["generation"]["num_slots"] == 4 and cfg["generation"]["prefill_batch"] == 2 and cfg["model_transaction_policy"]["decoupled"]
        assert client.is_model_ready("tiny")
        assert "generate" in client.get_server_metadata()["extensions"]
        steps = client.get_inference_statistics("tiny")["model_stats"][0]["execution_count"]
        _post(server, "/v2/models/tiny/generate", {"input_ids": [1, 3], "parameters": {"max_tokens": 3, "ignore_eos": True}})
        stats = {s["name"]: s for s in client.get_inference_statistics()["model_stats"]}
        gen = stats["tiny"]
        assert gen["inference_count"] >= 1 and gen["generation_stats"]["output_tokens"] >= 3
        # 3 tokens: the first from the prefill, two from decode steps. (`>= 3` held only when
        # earlier tests had run steps on the module's server: it failed when run alone.)
        assert gen["inference_stats"]["time_to_first_token"]["count"] >= 1 and gen["execution_count"] >= steps + 2
        assert stats["affine"]["inference_count"] >= 2
    finally:
        client.close()
    text = RawClient(server).request("GET", "/metrics")[2].decode()
    labels = '{model="tiny",version="1"}'
    for name in ("cairn_generation_output_tokens_total", "cairn_generation_prompt_tokens_total", "cairn_generation_queue_size",
                 "cairn_generation_active_slots", "cairn_generation_time_to_first_token_seconds_count"):  # fmt: skip
        assert f"{name}{labels}" in text, name
    assert re.search(r'cairn_generation_requests_total\{model="tiny",version="1",finish_reason="length"\} \d+', text)


# --- the model failing ---


def test_model_failure_is_500_or_an_error_event_and_the_engine_goes_on(generator, engine):
    from cairn.serving._server import Server

    view = _View(generator, "tiny")
    body = {"input_ids": [lm.BOS_ID, 12], "parameters": {"max_tokens": 5, "ignore_eos": True}}
    with Server({"tiny": view}, generation=GEN_CONFIG) as server:
        view.fail = True
        status, _, out = _post(server, "/v2/models/tiny/generate", body)
        assert status == 500 and "decode exploded" in out["error"]
        status, _, events = _stream(server, "tiny", body)
        assert status == 200 and events[-1]["finish_reason"] == "error" and "decode exploded" in events[-1]["error"]
        view.fail = False
        assert _tokens(server, body, stream=True) == _engine_tokens(engine, body["input_ids"], max_new_tokens=5, ignore_eos=True)
        assert _stats(server)["generation_stats"]["finish_reasons"]["error"] == 2


# --- configuration ---


def test_repository_generation_config(tmp_path, generator):
    from cairn.serving._repository import ModelRepository
    from cairn.serving._server import Server

    for name, cfg in (("good", {"generation": {"num_slots": 2, "max_queue": 7}}), ("bad", {"generation": {"num_slotz": 2}})):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    repo = ModelRepository(tmp_path, loader=lambda path: _View(generator, path.parent.name), generation=GenerationConfig(prefill_batch=2))
    with Server(repo) as server:
        cfg = json.loads(RawClient(server).request("GET", "/v2/models/good/config")[2])["generation"]
        assert (cfg["num_slots"], cfg["prefill_batch"], cfg["max_queue"], cfg["max_length"]) == (2, 2, 7, lm.MAX_LENGTH)
        status, _, out = _post(server, "/v2/models/good/generate", {"text_input": "ab", "parameters": {"max_tokens": 2}})
        assert status == 200 and len(out["output_ids"]) <= 2
        index = {r["name"]: r for r in json.loads(RawClient(server).request("POST", "/v2/repository/index", "{}")[2])}
        assert index["bad"]["state"] == "UNAVAILABLE"
        assert "bad/config.json: generation: " in index["bad"]["reason"] and "num_slotz" in index["bad"]["reason"]




def test_config_json_generation_key():
    cfg = parse_config({"generation": {"num_slots": 8, "max_queue": 3}}, "m/config.json", BatchingConfig(), GenerationConfig(prefill_batch=2))
    assert (cfg.generation.num_slots, cfg.generation.prefill_batch, cfg.generation.max_queue) == (8, 2, 3)
    assert parse_config({}, "m/config.json", BatchingConfig(), GenerationConfig(num_slots=5)).generation.num_slots == 5
    with pytest.raises(ValueError, match=r"m/config\.json: generation: .*slots_typo"):
        parse_config({"generation": {"slots_typo": 1}}, "m/config.json", BatchingConfig())
    with pytest.raises(ValueError, match=r"m/config\.json: generation must be a JSON object"):
        parse_config({"generation": [1]}, "m/config.json", BatchingConfig())
    with pytest.raises(ValueError, match=r"m/config\.json: generation: .*num_slots"):
        parse_config({"generation": {"num_slots": 0}}, "m/config.json", BatchingConfig())


def test_cli_generation_flags(tmp_path, capsys):
    from cairn.serving._cli import main, parser

    text = parser().format_help()
    for flag in ("--num-slots", "--prefill-batch", "--max-queue", "--max-new-tokens-limit"):
        assert flag in text
    args = parser().parse_args(["--model-repository", "x", "--num-slots", "3", "--prefill-batch", "1", "--max-queue", "9"])
    assert (args.num_slots, args.prefill_batch, args.max_queue) == (3, 1, 9)
    assert main(["--model-repository", str(tmp_path), "--num-slots", "0"]) == 2
    assert "num_slots" in capsys.readouterr().err
    args = parser().parse_args(["--model-repository", "x", "--kv-layout", "paged", "--num-blocks", "64", "--prefill-chunk", "32",
                                "--no-prefix-caching"])
    assert (args.kv_layout, args.num_blocks, args.prefill_chunk, args.no_prefix_caching) == ("paged", 64, 32, True)
    assert main(["--model-repository", str(tmp_path), "--kv-layout", "paged", "--prefill-chunk", "0"]) == 2
    assert "prefill_chunk" in capsys.readouterr().err


# --- a repository with an exported generator, served by cairn-serve ---


@pytest.mark.slow
def test_cli_serves_an_exported_generator(tmp_path, engine):
    from cairn.core_array import ArraySpec
    from cairn.serving._export import export
    from cairn.serving._genexport import export_generator

    export_generator(lm.prefill, lm.decode, PARAMS, tmp_path / "lm" / "1", cache_specs=lm.cache_specs(), vocab_size=lm.VOCAB_SIZE,
                     max_length=lm.MAX_LENGTH, eos_token_ids=(lm.EOS_ID,), vocabulary=lm.VOCAB, bos_token_id=lm.BOS_ID)  # fmt: skip
    (tmp_path / "lm" / "config.json").write_text(json.dumps({"generation": {"num_slots": 3, "max_queue": 5}}))
    w = np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32)
    export(lambda p, x: {"y": x["x"] @ p["w"]}, {"w": w}, {"x": ArraySpec(("b", 4), "float32")}, tmp_path / "mlp" / "1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cairn.serving._cli", "--model-repository", str(tmp_path), "--port", "0", "--num-slots", "2", "--prefill-batch", "2"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    try:
        url = _wait_for_url(proc)
        host, port = url.split(":")
        server = type("S", (), {"host": host, "port": int(port)})()
        cfg = json.loads(RawClient(server).request("GET", "/v2/models/lm/config")[2])
        assert cfg["generation"]["num_slots"] == 3 and cfg["generation"]["prefill_batch"] == 2 and cfg["generation"]["max_queue"] == 5
        bodies = _mixed_requests(6, seed=5)
        want = [_engine_tokens(engine, b["input_ids"], **{("max_new_tokens" if k == "max_tokens" else k): v for k, v in b["parameters"].items()}) for b in bodies]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda ib: _tokens_from(server, "lm", ib[1], stream=ib[0] % 2 == 0), enumerate(bodies)))
        assert got == want
        status, _, out = _post(server, "/v2/models/lm/generate", {"text_input": "the", "parameters": {"max_tokens": 4}})
        assert status == 200 and out["usage"]["prompt_tokens"] == len(tokenize("the", lm.VOCAB, lm.BOS_ID))
        client = th.InferenceServerClient(url)  # the exported /infer model beside the generator
        inp = th.InferInput("x", [2, 4], "FP32")
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        inp.set_data_from_numpy(x)
        np.testing.assert_allclose(client.infer("mlp", [inp]).as_numpy("y"), x.astype(np.float64) @ w, rtol=1e-5)
        client.close()
    finally:
        proc.terminate()
        assert proc.wait(60) == 0


def _wait_for_url(proc) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        m = re.search(r"serving on http://([\d.]+:\d+)", line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
            return m.group(1)
    proc.kill()
    raise AssertionError("cairn-serve did not start")


def _tokens_from(server, model: str, body, stream: bool) -> list[int]:
    if stream:
        status, _, events = _stream(server, model, body)
        assert status == 200
        return [e["output_ids"][0] for e in events[:-1]]
    status, _, out = _post(server, f"/v2/models/{model}/generate", body)
    assert status == 200, out
    return out["output_ids"]
