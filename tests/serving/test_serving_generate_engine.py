"""The generation engine on the tiny test LM (gen_testlib, a cairn.llm CausalLM): greedy tokens
against a greedy loop over the model's full (uncached) forward pass, continuous batching equal to one-at-a-time generation under concurrent
load with cancellations, the static scheduler, bad input, backpressure, stop/EOS, model
errors, and export_generator -> load round trips (float, int8 and packed int4 weights)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import gen_testlib as g
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from serving_testlib import hermetic_prelude

from cairn.core_array import ArraySpec, dumps_checksummed_json, read_checksummed_json
from cairn.serving import (
    GenerationConfig,
    GenerationEngine,
    GenerationEvent,
    GenerativeModel,
    LoadedGenerator,
    LoadedModel,
    ModelFormatError,
    PythonGenerator,
    QueueFull,
    SamplingParams,
    Unavailable,
    detokenize,
    export,
    export_generator,
    load,
    load_generator,
    tokenize,
)
from cairn.serving._hashing import MANIFEST

# one worker compiles the engine's shapes once for the whole module (the fixtures are module-scoped)
pytestmark = pytest.mark.xdist_group("serving_generate")

SEED, SCALE = 1, 3.0  # weights whose greedy continuations vary
CONFIG = GenerationConfig(num_slots=6, prefill_batch=2, max_queue=256)
# the paged layout: blocks of 4 tokens, prompts prefilled 16 tokens per step (a long prompt over several)
PAGED = {"kv_layout": "paged", "prefill_chunk": 16}
LAYOUTS = ("contiguous", "paged")


def _config(layout="contiguous", **kw):
    """CONFIG's shapes (or ``kw``'s) in ``layout``."""
    base = {"num_slots": 6, "prefill_batch": 2, "max_queue": 256, **kw}
    return GenerationConfig(**base, **(PAGED if layout == "paged" else {}))


def _generator(params=None, **kw):
    kw.setdefault("eos_token_ids", ())
    return PythonGenerator(g.prefill, g.decode, g.init_params(SEED, SCALE) if params is None else params,
                           cache_specs=g.cache_specs(), vocab_size=g.VOCAB_SIZE, max_length=g.MAX_LENGTH,
                           vocabulary=g.VOCAB, bos_token_id=g.BOS_ID, name="tiny", paged=g.paged,
                           block_size=g.BLOCK_SIZE, **kw)


@pytest.fixture(scope="module")
def model():
    return _generator()


@pytest.fixture(scope="module", params=LAYOUTS)
def engine(model, request):
    with GenerationEngine(model, _config(request.param)) as eng:
        yield eng


def _layout(engine):
    return engine.config.kv_layout


def _workload(n, seed=0):
    """Mixed prompt and output lengths; every third request samples (seeded)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = [int(t) for t in rng.integers(3, g.VOCAB_SIZE, int(rng.integers(1, 24)))]
        k = int(rng.integers(1, 20))
        if i % 3 == 0:
            params = SamplingParams(k, temperature=0.9, top_k=int(rng.integers(0, 10)), top_p=float(rng.choice([1.0, 0.8])), seed=i)
        else:
            params = SamplingParams(k)
        out.append((prompt, params))
    return out


def _check_greedy(params, prompt, tokens):
    """``tokens`` is the full-forward reference's greedy continuation, except that the cached
    path may pick the runner-up where the reference's top two are within 1e-3."""
    seq = list(prompt)
    for t in tokens:
        logits = g.reference_logits(params, seq)[-1]
        best = int(np.argmax(logits))
        if t != best:
            assert logits[best] - logits[t] < 1e-3, (prompt, tokens, seq)
            return
        seq.append(t)


def test_greedy_equals_the_full_forward_reference(engine, model):
    params = g.init_params(SEED, SCALE)
    assert isinstance(model, GenerativeModel)
    for prompt in ([5], [3, 4, 5, 6, 7], list(range(3, 30)), [39] * 40):
        res = engine.generate(prompt, SamplingParams(max_new_tokens=min(12, g.MAX_LENGTH - len(prompt))))
        assert res.finish_reason == "length" and res.prompt_len == len(prompt)
        assert len(res.token_ids) == min(12, g.MAX_LENGTH - len(prompt))
        _check_greedy(params, prompt, res.token_ids)
        assert res.text == "".join(g.VOCAB[t] or "" for t in res.token_ids)
        assert 0 <= res.time_to_first_token <= res.latency


def test_prompt_filling_the_cache(engine):
    prompt = [7] * (g.MAX_LENGTH - 1)
    res = engine.generate(prompt, SamplingParams(max_new_tokens=1))
    assert len(res.token_ids) == 1 and res.finish_reason == "length"


def _run_concurrently(engine, work, cancel_at=None, threads=6):
    """Submit ``work`` from several threads at once; request i is cancelled after its
    ``cancel_at[i]``-th token (from the event callback). Returns the results in order."""
    cancel_at = cancel_at or {}
    results = [None] * len(work)
    barrier = threading.Barrier(threads)

    def worker(w):
        barrier.wait()
        reqs = []
        for i in range(w, len(work), threads):
            holder = {}

            def on_event(ev, i=i, holder=holder):
                if i in cancel_at and ev.index == cancel_at[i] and not ev.finished:
                    holder["req"].cancel()

            holder["req"] = engine.submit(*work[i], on_event=on_event)
            reqs.append((i, holder["req"]))
        for i, r in reqs:
            results[i] = r.result(timeout=120)

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return results


def test_continuous_batching_equals_sequential(engine):
    work = _workload(30, seed=1)
    cancel_at = {i: 2 for i in range(0, 30, 7) if work[i][1].max_new_tokens > 5}
    steps = engine.stats()["steps"]
    together = _run_concurrently(engine, work, cancel_at)
    # they really ran together: far fewer decode steps than tokens
    assert engine.stats()["steps"] - steps < sum(len(r.token_ids) for r in together) / 2
    alone = [engine.generate(*w) for w in work]  # one request at a time
    for i, (a, b) in enumerate(zip(together, alone, strict=True)):
        if i in cancel_at:
            assert a.finish_reason == "cancelled"
            assert 3 <= len(a.token_ids) < len(b.token_ids) and a.token_ids == b.token_ids[: len(a.token_ids)]
        else:
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), i
    stats = engine.stats()
    assert stats["active_slots"] == 0 and stats["queue"] == 0 and stats["cancelled"] >= len(cancel_at)


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(3))
def test_continuous_batching_equals_sequential_repeated(engine, round_):
    work = _workload(80, seed=100 + round_)
    together = _run_concurrently(engine, work, threads=8)
    assert [r.token_ids for r in together] == [engine.generate(*w).token_ids for w in work]


def test_static_scheduler_gives_the_same_tokens(engine, model):
    work = _workload(14, seed=2)
    with GenerationEngine(model, _config(_layout(engine), scheduler="static")) as static:
        got = _run_concurrently(static, work, threads=3)
        stats = static.stats()
        assert stats["scheduler"] == "static" and stats["requests"] == stats["finished"] == len(work)
        assert stats["tokens"] == sum(len(r.token_ids) for r in got)
        assert stats["prompt_tokens"] == sum(len(p) for p, _ in work) and stats["active_slots"] == 0
    assert [r.token_ids for r in got] == [engine.generate(*w).token_ids for w in work]


def test_events_stream_every_token_then_the_end(engine):
    events: list[GenerationEvent] = []
    res = engine.submit([3, 4], SamplingParams(5, temperature=1.0, seed=3), on_event=events.append).result(30)
    assert [e.token_id for e in events[:-1]] == res.token_ids and [e.index for e in events] == list(range(6))
    assert events[-1].finished and events[-1].finish_reason == "length" and events[-1].token_id is None
    assert "".join(e.text for e in events[:-1]) == res.text


def test_result_returns_after_the_final_event_was_delivered(engine):
    # result() used to wake its waiter before the final event was emitted: a caller could
    # find the events without their end (test_events_stream_every_token_then_the_end, now
    # and then under load). Holding the engine thread inside the final callback shows it.
    entered, release, events = threading.Event(), threading.Event(), []

    def on_event(ev):
        if ev.finished:
            entered.set()
            release.wait(30)
        events.append(ev)

    req = engine.submit([3, 4], SamplingParams(3), on_event=on_event)
    assert entered.wait(30)
    with pytest.raises(TimeoutError):  # the final event is still being delivered
        req.result(0.2)
    release.set()
    res = req.result(30)
    assert events[-1].finished and events[-1].finish_reason == res.finish_reason == "length"
    assert [e.token_id for e in events[:-1]] == res.token_ids


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], SamplingParams(), "prompt is empty"),
        ([3, 40], SamplingParams(), r"prompt token 40 at index 1 is outside the vocabulary \(0..39\)"),
        ([3, -1], SamplingParams(), "prompt token -1 at index 1"),
        ([[3, 4]], SamplingParams(), "flat list of integer"),
        ([1.5], SamplingParams(), "flat list of integer"),
        ([3] * g.MAX_LENGTH, SamplingParams(1), "does not fit the KV cache"),
        ([3] * 60, SamplingParams(5), r"max_new_tokens 5 exceeds the model's max_length 64; ask for at most 4"),
        ([3], SamplingParams(stop_token_ids=(45,)), r"stop_token_ids \[45\]"),
        ([3], {"max_tokens": 3}, "params must be SamplingParams"),
    ],
)
def test_bad_input_is_refused_and_the_engine_runs_on(engine, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        engine.submit(prompt, params)
    assert engine.generate([3, 4], SamplingParams(2)).finish_reason == "length"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_limits_queue_full_and_stop(model, layout):
    cfg = _config(layout, max_queue=2, max_new_tokens_limit=8)  # CONFIG's shapes
    engine = GenerationEngine(model, cfg)
    with pytest.raises(Unavailable):
        engine.submit([3], SamplingParams(2))
    engine.start()
    with pytest.raises(ValueError, match="max_new_tokens 9 exceeds this model's limit 8"):
        engine.submit([3], SamplingParams(9))
    entered, release = threading.Event(), threading.Event()

    def block(ev):  # holds the engine thread (a real callback must not block)
        entered.set()
        release.wait(30)

    first = engine.submit([3], SamplingParams(3), on_event=block)
    assert entered.wait(30)  # the engine thread is held inside a step: it moves nothing into the slots
    # max_queue counts requests waiting for a slot: the 5 free slots take 5 of these at the
    # next step whenever it comes, so a burst of 5 + 2 is accepted and only the next refused
    # (counting the whole queue refused a burst the slots could hold whenever it arrived
    # before the engine thread's next step: a 503 under load that never happened alone)
    queued = [engine.submit([4], SamplingParams(2)) for _ in range(5 + 2)]
    with pytest.raises(QueueFull, match=r"2 generation requests waiting for a slot \(max_queue 2\)") as e:
        engine.submit([5], SamplingParams(2))
    assert e.value.retry_after >= 1
    release.set()
    assert [r.result(30).finish_reason for r in (first, *queued)] == ["length"] * 8
    engine.stop()
    engine.stop()  # twice is harmless
    with pytest.raises(Unavailable, match="stopped"):
        engine.submit([3], SamplingParams(2))
    with pytest.raises(RuntimeError, match="the engine is stopped"):
        engine.start()


def test_the_static_scheduler_counts_every_queued_request_while_a_batch_runs(model):
    # it admits only into an empty engine: while a batch runs, free slots take nobody
    cfg = GenerationConfig(num_slots=6, prefill_batch=2, max_queue=2, scheduler="static")  # CONFIG's shapes
    with GenerationEngine(model, cfg) as engine:
        entered, release = threading.Event(), threading.Event()

        def block(ev):
            entered.set()
            release.wait(30)

        first = engine.submit([3], SamplingParams(3), on_event=block)
        assert entered.wait(30)
        queued = [engine.submit([4], SamplingParams(2)) for _ in range(2)]
        with pytest.raises(QueueFull, match=r"2 generation requests waiting for a slot \(max_queue 2\)"):
            engine.submit([5], SamplingParams(2))
        release.set()
        assert [r.result(30).finish_reason for r in (first, *queued)] == ["length"] * 3


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stop_without_drain_cancels_what_is_left(model, layout):
    engine = GenerationEngine(model, _config(layout)).start()
    entered, release = threading.Event(), threading.Event()

    def block(ev):
        entered.set()
        release.wait(30)

    first = engine.submit([3], SamplingParams(30), on_event=block)
    assert entered.wait(30)
    later = engine.submit([4], SamplingParams(30))  # queued behind the blocked step
    stopper = threading.Thread(target=engine.stop, kwargs={"drain": False})
    stopper.start()
    while engine.stats()["state"] == "running":
        threading.Event().wait(0.01)
    release.set()
    stopper.join(30)
    assert first.result(30).finish_reason == "cancelled" and len(first.result().token_ids) < 30
    assert later.result(30).finish_reason == "cancelled" and later.result().token_ids == []
    assert engine.stats()["state"] == "stopped"


def _with_eos(model, eos):
    """The same jitted model with other EOS ids (the engine reads them from the model)."""
    other = copy.copy(model)
    other.eos_token_ids = tuple(eos)
    return other


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_eos_and_stop_tokens(model):
    model = _with_eos(model, (g.EOS_ID,))
    params = g.init_params(SEED, SCALE)
    with GenerationEngine(model, CONFIG) as engine:
        prompt = [25, 11, 25]
        free = engine.generate(prompt, SamplingParams(20, ignore_eos=True)).token_ids
        assert len(free) == 20
        _check_greedy(params, prompt, free)
        stop = free[3]
        res = engine.generate(prompt, SamplingParams(20, stop_token_ids=(stop,)))
        assert res.finish_reason == "stop" and res.token_ids == free[: free.index(stop) + 1]
        # the model's EOS ends a request unless ignore_eos
        eos_model = _with_eos(model, (stop,))
        with GenerationEngine(eos_model, CONFIG) as eos_engine:
            assert eos_engine.generate(prompt, SamplingParams(20)).token_ids == res.token_ids
            assert eos_engine.generate(prompt, SamplingParams(20, ignore_eos=True)).token_ids == free


class _Flaky:
    """A GenerativeModel whose prefill raises for prompts holding token 39, and whose
    decode raises while ``fail_decode`` is set."""

    def __init__(self, inner):
        self.inner = inner
        self.fail_decode = threading.Event()
        for k in ("name", "vocab_size", "max_length", "eos_token_ids", "vocabulary", "cache_specs",  # the protocol's
                  "has_paged", "block_size"):
            setattr(self, k, getattr(inner, k))

    def init_pool(self, n):
        return self.inner.init_pool(n)

    def paged_step(self, tokens, positions, lengths, tables, pool):
        t = np.asarray(tokens)
        if t.shape[1] > 1 and (t == 39).any():  # a prefill chunk (a decode step is one token per row)
            raise RuntimeError("bad token in prefill")
        if t.shape[1] == 1 and self.fail_decode.is_set():
            raise RuntimeError("decode broke")
        return self.inner.paged_step(tokens, positions, lengths, tables, pool)

    def init_cache(self, n):
        return self.inner.init_cache(n)

    def prefill(self, tokens, lengths):
        if (np.asarray(tokens) == 39).any():
            raise RuntimeError("bad token in prefill")
        return self.inner.prefill(tokens, lengths)

    def decode(self, tokens, positions, cache):
        if self.fail_decode.is_set():
            raise RuntimeError("decode broke")
        return self.inner.decode(tokens, positions, cache)


def test_model_error_fails_only_its_requests(model, engine):
    with GenerationEngine(_Flaky(model), _config(_layout(engine))) as flaky:
        good = flaky.submit([3, 4, 5] * 6, SamplingParams(15))  # another prompt bucket: its own prefill call
        bad = flaky.submit([39, 4], SamplingParams(5))
        res = bad.result(30)
        assert res.finish_reason == "error" and "bad token in prefill" in res.error
        assert good.result(30).token_ids == engine.generate([3, 4, 5] * 6, SamplingParams(15)).token_ids
        assert flaky.stats()["errors"] == 1
        assert flaky.generate([5, 6], SamplingParams(3)).finish_reason == "length"


def test_decode_error_fails_the_running_requests_and_the_engine_recovers(model, engine):
    flaky_model = _Flaky(model)
    with GenerationEngine(flaky_model, _config(_layout(engine))) as flaky:
        entered, release = threading.Event(), threading.Event()

        def block(ev):
            if ev.index == 1:
                entered.set()
                release.wait(30)

        running = flaky.submit([3, 4], SamplingParams(20), on_event=block)
        assert entered.wait(30)
        flaky_model.fail_decode.set()  # the next decode step raises
        release.set()
        res = running.result(30)
        assert res.finish_reason == "error" and "decode broke" in res.error and len(res.token_ids) == 2
        flaky_model.fail_decode.clear()
        assert flaky.generate([3, 4, 5], SamplingParams(15)).token_ids == engine.generate([3, 4, 5], SamplingParams(15)).token_ids
        assert flaky.stats()["errors"] == 1


class _Recording(_Flaky):
    """Records the order of device calls (``decode`` when dispatched) in ``log``."""

    def __init__(self, inner, log):
        super().__init__(inner)
        self.log = log

    def decode(self, tokens, positions, cache):
        self.log.append("decode")
        return super().decode(tokens, positions, cache)

    def paged_step(self, tokens, positions, lengths, tables, pool):
        if np.asarray(tokens).shape[1] == 1:  # a decode step
            self.log.append("decode")
        return super().paged_step(tokens, positions, lengths, tables, pool)


def test_a_steps_events_are_streamed_while_the_next_step_runs(model, engine):
    """Token i's event (i >= 1) is delivered after step i + 1 is dispatched (its host work
    overlaps the device), in either KV layout; a request ending by its length leaves at
    sampling, so no step runs after its last token; the tokens are those of the plain engine."""
    order: list = []
    with GenerationEngine(_Recording(model, order), _config(_layout(engine))) as eng:
        order.clear()  # the warm-up's compile
        res = eng.submit([3, 4, 5], SamplingParams(5), on_event=lambda ev: order.append(ev.index)).result(30)
        time.sleep(0.2)  # the engine idles: no step follows the last token
    assert res.token_ids == engine.generate([3, 4, 5], SamplingParams(5)).token_ids
    assert order == [0, "decode", "decode", 1, "decode", 2, "decode", 3, 4, 5]  # 5: the final event


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_stop_string_found_at_the_next_step_keeps_the_tokens(model, layout):
    """A stop string is seen while recording a step (after the next was dispatched): that
    extra step's row is dropped, the result ends at the stop as in the plain engine."""
    gen = _generator()
    prompt = [3, 4, 5]
    full = GenerationEngine(gen, _config(layout)).start(precompile=False)
    try:
        text = full.generate(prompt, SamplingParams(12)).text
    finally:
        full.stop()
    stop = text[3:5]
    with GenerationEngine(gen, _config(layout)) as eng:
        res = eng.generate(prompt, SamplingParams(12, stop=(stop,)))
    assert res.finish_reason == "stop" and res.text == text[: text.index(stop)]
    assert eng.stats()["active_slots"] == 0


def test_stop_from_the_event_callback(model):
    engine = GenerationEngine(model, CONFIG).start()
    stopped = threading.Event()

    def on_event(ev):
        if ev.index == 1 and not stopped.is_set():
            stopped.set()
            engine.stop(drain=False)

    res = engine.submit([3], SamplingParams(10), on_event=on_event).result(30)
    assert res.finish_reason == "cancelled" and len(res.token_ids) == 2


def test_config_validation():
    with pytest.raises(ValueError, match="num_slots must be a positive integer"):
        GenerationConfig(num_slots=0)
    with pytest.raises(ValueError, match="prefill_batch 8 exceeds num_slots 4"):
        GenerationConfig(num_slots=4, prefill_batch=8)
    with pytest.raises(ValueError, match="scheduler must be one of"):
        GenerationConfig(scheduler="greedy")
    with pytest.raises(ValueError, match="unknown generation config key 'slots'"):
        GenerationConfig.from_json({"slots": 3})
    cfg = GenerationConfig.from_json({"num_slots": 3, "prefill_batch": 2, "max_new_tokens_limit": 9})
    assert GenerationConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="needs a GenerativeModel"):
        GenerationEngine(object())


def test_tokenize_detokenize(model):
    ids = model.tokenize("the abc 42")
    assert ids[0] == g.BOS_ID and model.detokenize(ids) == "the abc 42"
    assert ids[1] == g.VOCAB.index("the") and ids[2] == g.VOCAB.index(" ")  # longest match
    with pytest.raises(ValueError, match=r"character 'X' at offset 4"):
        model.tokenize("abc X")


def test_bad_generator_settings_are_named():
    params = g.init_params(0)
    with pytest.raises(ValueError, match=r"cache\['k0'\] is float32 \(2, 64, 2, 8\), cache_specs says float32 \(2, 32, 2, 8\)"):
        PythonGenerator(g.prefill, g.decode, params, cache_specs=g.cache_specs(32), vocab_size=40, max_length=32)
    with pytest.raises(ValueError, match="logits must be float32"):
        PythonGenerator(g.prefill, g.decode, params, cache_specs=g.cache_specs(), vocab_size=41, max_length=64)
    with pytest.raises(ValueError, match="cache entries"):
        PythonGenerator(g.prefill, g.decode, params, cache_specs={"k0": ArraySpec((64, 2, 8), "float32")},
                        vocab_size=40, max_length=64)
    with pytest.raises(ValueError, match="eos_token_ids: 40 is not a token id"):
        PythonGenerator(g.prefill, g.decode, params, cache_specs=g.cache_specs(), vocab_size=40, max_length=64,
                        eos_token_ids=[40])
    with pytest.raises(ValueError, match="vocabulary must hold vocab_size=40"):
        PythonGenerator(g.prefill, g.decode, params, cache_specs=g.cache_specs(), vocab_size=40, max_length=64,
                        vocabulary=["a"])


def _quantized(kind):
    params = g.init_params(SEED, SCALE)
    return params if kind == "float" else g.quantized_params(params, kind)


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.parametrize("kind", ["float", "int8", "int4"])
def test_export_load_round_trip(tmp_path, kind):
    params = _quantized(kind)
    path = export_generator(g.prefill, g.decode, params, tmp_path / "lm" / "1", cache_specs=g.cache_specs(),
                            vocab_size=g.VOCAB_SIZE, max_length=g.MAX_LENGTH, eos_token_ids=[g.EOS_ID],
                            vocabulary=g.VOCAB, bos_token_id=g.BOS_ID, max_batch_size=8)
    loaded = load(path)
    assert isinstance(loaded, LoadedGenerator) and isinstance(loaded, GenerativeModel)
    assert (loaded.name, loaded.vocab_size, loaded.max_length, loaded.eos_token_ids) == ("lm", 40, 64, (g.EOS_ID,))
    assert loaded.vocabulary == tuple(g.VOCAB) and loaded.bos_token_id == g.BOS_ID
    assert set(loaded.signatures) == {"prefill", "decode"} and loaded.manifest["generation"]["cache"].keys() == {"k0", "v0", "k1", "v1"}
    if kind == "int4":  # packed: two values a byte on disk and on the device
        assert loaded.weights["layers/0/mlp/gate/kernel/qvalue"].nbytes == g.D_MODEL * g.D_FF // 2
    # prompts of one bucket (5..8 tokens), so the lazily compiled engines compile few shapes
    work = [(p[:8] + [3] * (5 - len(p[:8])), s) for p, s in _workload(8, seed=5)]
    python = _generator(params, eos_token_ids=(g.EOS_ID,))
    a, b = GenerationEngine(python, CONFIG).start(precompile=False), GenerationEngine(loaded, CONFIG).start(precompile=False)
    try:
        want = [a.generate(*w).token_ids for w in work]
        assert [r.token_ids for r in _run_concurrently(b, work, threads=2)] == want
    finally:
        a.stop(drain=False)
        b.stop(drain=False)
    with pytest.raises(ValueError, match="num_slots 16 exceeds the model's max_batch_size 8"):
        GenerationEngine(loaded, GenerationConfig(num_slots=16))


def test_load_generator_refuses_a_plain_model(tmp_path):
    path = export(lambda p, i: {"y": i["x"] * p["k"]}, {"k": np.float32(2)}, {"x": ArraySpec(("b", 2), "float32")},
                  tmp_path / "plain")
    assert type(load(path)) is LoadedModel
    with pytest.raises(ModelFormatError, match="not a generative model"):
        load_generator(path)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([v for v in g.VOCAB if v]), max_size=12))
def test_tokenize_round_trips(pieces):
    text = "".join(pieces)
    ids = tokenize(text, g.VOCAB)
    assert detokenize(ids, g.VOCAB) == text and all(g.VOCAB[i] for i in ids)
    assert len(ids) <= len(pieces)  # longest match never uses more tokens than the pieces


HERMETIC = hermetic_prelude(("cairn.nn", "cairn.quant", "cairn.kernels", "gen_testlib")) + textwrap.dedent("""
    from cairn import serving

    model = serving.load(sys.argv[1])
    work = json.loads(sys.argv[2])
    config = serving.GenerationConfig(num_slots=6, prefill_batch=2)
    with serving.GenerationEngine(model, config).start(precompile=False) as engine:
        reqs = [engine.submit(p, serving.SamplingParams(**kw)) for p, kw in work]
        out = [r.result(120).token_ids for r in reqs]
    mods = sorted(k for k in sys.modules if k.startswith("cairn.") and sys.modules[k] is not None)
    print(json.dumps({"type": type(model).__name__, "tokens": out, "modules": mods}))
""")


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_hermetic_process_generates_the_same_tokens(model, engine, tmp_path):
    """A fresh process that cannot import the model's code loads the exported generator and
    produces, with its own engine, the tokens the in-process model produces."""
    path = export_generator(g.prefill, g.decode, g.init_params(SEED, SCALE), tmp_path / "lm" / "1",
                            cache_specs=g.cache_specs(), vocab_size=g.VOCAB_SIZE, max_length=g.MAX_LENGTH,
                            vocabulary=g.VOCAB, max_batch_size=8)
    work = [([3, 4, 5, 6, 7], {"max_new_tokens": 9}), ([8, 9, 10, 11, 12, 13], {"max_new_tokens": 7, "temperature": 0.9, "seed": 4}),
            ([20, 21, 22, 23, 24, 25, 26, 27], {"max_new_tokens": 12, "temperature": 1.2, "top_k": 5, "seed": 9})]
    script = tmp_path / "hermetic_gen.py"
    script.write_text(HERMETIC)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, str(script), path, json.dumps(work)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["type"] == "LoadedGenerator"
    assert {m.split(".")[1] for m in got["modules"]} <= {"core_array", "serving"}
    assert got["tokens"] == [engine.generate(p, SamplingParams(**kw)).token_ids for p, kw in work]


@pytest.mark.parametrize(("delay", "lo", "hi"), [(0, 0, 1), (3, 3, 4)])
def test_a_busy_engine_holds_a_lone_request_to_fill_a_prefill_group(model, delay, lo, hi):
    cfg = GenerationConfig(num_slots=6, prefill_batch=2, admission_delay_steps=delay)  # CONFIG's shapes
    with GenerationEngine(model, cfg) as engine:
        started = threading.Event()
        busy = [engine.submit([3 + i], SamplingParams(40), on_event=lambda ev: started.set()) for i in range(4)]
        assert started.wait(30)  # 4 of 6 slots busy: more than half
        seen = {}

        def first(ev):
            seen.setdefault("steps", engine.stats()["steps"])

        before = engine.stats()["steps"]
        lone = engine.submit([5, 6], SamplingParams(3), on_event=first)
        assert lone.result(30).finish_reason == "length"
        # prefilled after `delay` held steps (+1 for the step already running when it came)
        assert lo <= seen["steps"] - before <= hi + 1
        for r in busy:
            r.cancel()


def test_a_full_prefill_group_is_not_held_behind_an_older_partial_one(model):
    """A busy engine holds a lone request of one prompt bucket (its group is partial) for
    ``admission_delay_steps``, but prefills a full group of another bucket that came after it
    at once; every request still gets its tokens alone."""
    cfg = GenerationConfig(num_slots=6, prefill_batch=2, admission_delay_steps=12)  # CONFIG's shapes
    with GenerationEngine(model, cfg) as engine:
        started = threading.Event()
        busy = [engine.submit([3 + i], SamplingParams(60), on_event=lambda ev: started.set()) for i in range(4)]
        assert started.wait(30)  # 4 of 6 slots busy: more than half
        first: dict[str, int] = {}

        def mark(name):
            return lambda ev: first.setdefault(name, engine.stats()["steps"])

        with engine._cond:  # queued together, before the engine's next pick
            before = engine.stats()["steps"]
            lone = engine.submit([5, 6], SamplingParams(3), on_event=mark("lone"))  # bucket 16, alone
            pair = [engine.submit([7, 8, 9, 10, 11] * 4, SamplingParams(3), on_event=mark(f"pair{i}"))
                    for i in range(2)]  # bucket 32
        results = [r.result(60) for r in (lone, *pair)]
        assert first["pair0"] - before <= 2 and first["pair1"] - before <= 2  # the full group went first
        assert first["lone"] - before >= 12  # held its delay (its partial group)
        for r in busy:
            r.cancel()
    with GenerationEngine(model, CONFIG) as alone:
        for r, prompt in zip(results, ([5, 6], [7, 8, 9, 10, 11] * 4, [7, 8, 9, 10, 11] * 4)):
            assert r.token_ids == alone.generate(prompt, SamplingParams(3)).token_ids


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d["generation"].pop("cache"), "'generation' section is malformed"),
        (lambda d: d["generation"].update(vocab_size="many"), "'generation' section is malformed"),
        (lambda d: d["generation"].update(eos_token_ids=[99]), r"eos_token_ids: 99 is not a token id"),
        (lambda d: d["generation"].update(vocabulary=["a"]), "vocabulary must hold vocab_size=40"),
        (lambda d: d["signatures"].pop("decode"), r"a generator needs signatures \['decode'\]"),
    ],
)
def test_a_malformed_generation_manifest_is_named(tmp_path, edit, match):
    path = export_generator(g.prefill, g.decode, g.init_params(0), tmp_path / "lm", cache_specs=g.cache_specs(),
                            vocab_size=g.VOCAB_SIZE, max_length=g.MAX_LENGTH, max_batch_size=8)
    doc = read_checksummed_json(os.path.join(path, MANIFEST))
    edit(doc)
    with open(os.path.join(path, MANIFEST), "wb") as f:
        f.write(dumps_checksummed_json(doc))
    with pytest.raises(ModelFormatError, match=match):
        load(path)


# --- events reach an event loop once per step ---


def test_an_event_batch_runs_each_deferred_wake_up_once_at_its_end(caplog):
    from cairn.serving._generate import after_event_batch, event_batch

    calls = []
    wake_a, wake_b = (lambda: calls.append("a")), (lambda: calls.append("b"))
    after_event_batch(wake_a)
    assert calls == ["a"]  # outside a batch: at once
    with event_batch():
        for _ in range(3):
            after_event_batch(wake_a)
            after_event_batch(wake_b)
        with event_batch():  # nested: still the outer batch
            after_event_batch(wake_a)
        assert calls == ["a"]
    assert calls == ["a", "a", "b"]

    def broken():
        raise RuntimeError("listener gone")

    with event_batch():
        after_event_batch(broken)
        after_event_batch(wake_b)
    assert calls[-1] == "b" and "listener gone" in caplog.text  # logged, the rest still run


def test_the_pump_delivers_a_batch_of_events_after_the_batch_in_one_wake_up():
    import asyncio

    from cairn.serving._generate import event_batch
    from cairn.serving._genhttp import _EventPump

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        pump, wakes, got = _EventPump(loop), [], []
        original = pump._wake
        pump._wake = lambda: (wakes.append(1), original())
        with event_batch():
            for i in range(5):
                pump.put(got.append, i)
                time.sleep(0.02)  # the loop is idle: a wake-up now would deliver at once
            assert got == [] and wakes == []
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), loop).result(10)
        assert got == [0, 1, 2, 3, 4] and wakes == [1]
        pump.put(got.append, 5)  # outside a batch: woken at once
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), loop).result(10)
        assert got[-1] == 5 and len(wakes) == 2
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_wake_up_of_a_finished_row_waits_for_the_next_device_call(layout):
    """A row that ends at a step is recorded (its slot freed, its final event emitted) at
    once, but its listener's wake-up (a listener's loop, woken, takes the GIL) runs after
    the next device call is dispatched, while the device computes; the events in order."""
    from cairn.serving._generate import after_event_batch

    model, log = _generator(), []
    for name in ("prefill", "decode", "paged_step"):
        real = getattr(model, name)
        setattr(model, name, lambda *a, real=real: (log.append(("device",)), real(*a))[1])

    def listener(tag):
        def on_event(ev):
            log.append(("emit", tag, ev.finished))
            after_event_batch(lambda: log.append(("wake", tag, ev.finished)))
        return on_event

    with GenerationEngine(model, _config(layout)) as eng:
        short = eng.submit([5, 6, 7], SamplingParams(3, ignore_eos=True), on_event=listener("short"))
        long = eng.submit([8, 9], SamplingParams(12, ignore_eos=True), on_event=listener("long"))
        assert len(short.result(60).token_ids) == 3 and len(long.result(60).token_ids) == 12
    end = log.index(("emit", "short", True))
    assert ("device",) in log[end : log.index(("wake", "short", True))]  # held past the next step's dispatch
    for tag, n in (("short", 3), ("long", 12)):
        assert [e[2] for e in log if e[:2] == ("emit", tag)] == [False] * n + [True]
        assert [e[2] for e in log if e[:2] == ("wake", tag)] == [False] * n + [True]  # every event's wake-up ran


def test_held_wake_ups_run_at_the_end_of_a_step_that_called_no_device():
    """A step that dispatches nothing (here one decode skipped on purpose) still delivers
    what it holds: the held wake-ups and pending rows run at its end, not a step later."""
    from cairn.serving._generate import after_event_batch

    model, log = _generator(), []
    real_decode = model.decode
    model.decode = lambda *a: (log.append(("device",)), real_decode(*a))[1]
    eng = GenerationEngine(model, _config())
    real_step, state = eng._decode, {"skipped": False}

    def decode_step():  # the first decode call after the short request's end was sampled: skipped
        if short.done and not state["skipped"]:
            state["skipped"] = True
            log.append(("skip",))
            return
        real_step()

    eng._decode = decode_step

    def on_event(ev):
        after_event_batch(lambda: log.append(("wake", ev.finished)))

    with eng:
        short = eng.submit([5, 6, 7], SamplingParams(3, ignore_eos=True), on_event=on_event)
        long = eng.submit([8, 9], SamplingParams(12, ignore_eos=True))
        short.result(60), long.result(60)
    skip = log.index(("skip",))
    assert ("wake", True) in log[skip : log.index(("device",), skip)]


def test_a_step_of_streamed_rows_wakes_the_event_loop_once(model):
    """16 streamed requests decode together: the loop is woken about once per engine batch
    of events (a prefill's or a decode step's), not once per event; every event arrives in order."""
    import asyncio

    from cairn.serving._genhttp import _EventPump

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    wakes = []
    pump = _EventPump(loop)
    original = pump._wake
    pump._wake = lambda: (wakes.append(1), original())
    seen: dict[int, list[int]] = {}
    try:
        with GenerationEngine(model, GenerationConfig(num_slots=16, prefill_batch=16)) as eng:
            reqs = []
            for i in range(16):
                box = seen.setdefault(i, [])
                def on_event(ev, box=box):
                    pump.put(lambda e: box.append(e.index), ev)
                    time.sleep(0.001)  # time for the loop to drain, were it woken per event

                reqs.append(eng.submit([3 + i, 4, 5], SamplingParams(12, ignore_eos=True), on_event=on_event))
            results = [r.result(60) for r in reqs]
            steps = eng.stats()["steps"] + eng.stats()["prefills"]
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), loop).result(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    events = sum(len(r.token_ids) + 1 for r in results)
    assert all(seen[i] == list(range(12)) + [12] for i in range(16))  # tokens 0..11, then the final event
    assert len(wakes) <= 3 * steps < events / 2, (len(wakes), steps, events)


class _PrefillShapes:
    """The model, recording the prompt length of every prefill call."""

    def __init__(self, inner):
        self.inner, self.lengths = inner, []
        for k in ("name", "vocab_size", "max_length", "eos_token_ids", "vocabulary", "cache_specs"):
            setattr(self, k, getattr(inner, k))

    def init_cache(self, n):
        return self.inner.init_cache(n)

    def prefill(self, tokens, lengths):
        self.lengths.append(np.asarray(tokens).shape[1])
        return self.inner.prefill(tokens, lengths)

    def decode(self, tokens, positions, cache):
        return self.inner.decode(tokens, positions, cache)


def test_a_prompt_is_padded_to_at_most_one_and_a_half_times_its_length(model, engine):
    """Prompt buckets 16, 32, 48, 64 (max_length 64), not powers of two: a 33-token prompt
    prefills at 48, not 64; the tokens are those of the same prompt alone."""
    rec = _PrefillShapes(model)
    with GenerationEngine(rec, _config()) as eng:
        assert eng.buckets() == (16, 32, 48, 64)
        rec.lengths.clear()  # the warm-up compiled each bucket once
        for n, bucket in ((3, 16), (17, 32), (33, 48), (49, 64)):
            prompt = [3 + (i % 30) for i in range(n)]
            got = eng.generate(prompt, SamplingParams(4, temperature=0.7, seed=n))
            assert rec.lengths[-1] == bucket, (n, rec.lengths)
            assert got.token_ids == engine.generate(prompt, SamplingParams(4, temperature=0.7, seed=n)).token_ids


def test_a_decode_steps_sampling_runs_while_the_next_prefill_computes(model):
    """Contiguous layout: with a prompt waiting and a slot free, the engine dispatches the
    prefill before sampling the last decode step's rows (host work under the device's), and
    every request still gets its tokens alone."""
    import cairn.serving._generate as genmod

    log, refs = [], {}
    inner = _generator()
    real_prefill, real_decode = inner.prefill, inner.decode
    inner.prefill = lambda *a: (log.append("prefill"), real_prefill(*a))[1]

    def decode(*a):
        log.append("decode")
        out = real_decode(*a)
        if log.count("decode") == 3:  # inside a decode step: the second prompt arrives
            refs["second"] = refs["eng"].submit([6, 7], SamplingParams(5, temperature=0.9, seed=2))
        return out

    inner.decode = decode
    real_sample = genmod.sample_rows
    with GenerationEngine(inner, _config(admission_delay_steps=0)) as eng:
        try:
            genmod.sample_rows = lambda rows, params, seeds, index: (  # each row's token index
                log.append(f"sample{list(index)}"), real_sample(rows, params, seeds, index))[1]
            log.clear()  # the warm-up's calls
            refs["eng"] = eng
            first = eng.submit([3, 4, 5], SamplingParams(30, temperature=0.9, seed=1))
            results = [first.result(60)]
            results.append(refs["second"].result(60))
        finally:
            genmod.sample_rows = real_sample
    i = log.index("prefill", log.index("decode"))  # the second request's prefill, after a decode step
    assert log[i - 1] == "decode" and log[i + 1] == "sample[3]", " ".join(log)  # the first's row, under the prefill
    assert log[i + 2] == "sample[0]"  # then the second request's first token
    for r, (prompt, p) in zip(results, (([3, 4, 5], SamplingParams(30, temperature=0.9, seed=1)),
                                        ([6, 7], SamplingParams(5, temperature=0.9, seed=2)))):
        assert r.token_ids == model_alone(model, prompt, p)


def model_alone(model, prompt, params):
    with GenerationEngine(model, _config()) as alone:
        return alone.generate(prompt, params).token_ids


def test_a_row_cancelled_before_its_deferred_sampling_leaves_its_slot_to_the_next_request(model):
    """The decode step's row of a request cancelled before that step's (deferred) sampling is
    dropped (not recorded, and its end does not free the slot again); the request that takes
    its slot in the same iteration gets its own tokens."""
    eng_ref = {}
    inner = _generator()
    real_decode, calls = inner.decode, {"n": 0, "b": None}

    def decode(*a):
        out = real_decode(*a)
        calls["n"] += 1
        if calls["n"] == 4:  # while the engine is inside a decode step: cancel A, queue B
            eng_ref["a"].cancel()
            calls["b"] = eng_ref["eng"].submit([9, 8, 7], SamplingParams(6, temperature=0.8, seed=5))
        return out

    inner.decode = decode
    with GenerationEngine(inner, _config(num_slots=2, prefill_batch=1)) as eng:
        eng_ref["eng"] = eng
        # its 4th and last token comes from the 4th decode call (the warm-up's was the 1st): ending
        # there, its row would free a slot that the next request holds by then
        eng_ref["a"] = eng.submit([3, 4], SamplingParams(4, temperature=0.8, seed=4))
        a = eng_ref["a"].result(60)
        while calls["b"] is None:
            threading.Event().wait(0.001)
        b = calls["b"].result(60)
        assert eng.stats()["active_slots"] == 0
    assert a.finish_reason == "cancelled" and len(a.token_ids) == 3
    assert b.finish_reason == "length"
    assert b.token_ids == model_alone(model, [9, 8, 7], SamplingParams(6, temperature=0.8, seed=5))
