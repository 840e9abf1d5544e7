"""The paged generation engine (GenerationConfig(kv_layout="paged")) on the tiny test LM:
prefix caching (hits counted, tokens unchanged, blocks being written never shared),
cancel frees blocks, many short requests in the memory where contiguous rows refuse,
preemption and resumption in a pool too small for all requests (tokens as alone), no
reservation of max_tokens, copy-on-write of a shared partial block for n samples,
chunked prefill between decode steps, per-token logprobs against a float64 log_softmax of
the full forward pass, export -> load of the paged program, and bad settings.
(The contiguous engine's tests run over both layouts in test_serving_generate_engine.py.)"""

from __future__ import annotations

import threading

import gen_testlib as g
import numpy as np
import pytest

from cairn.serving import (
    GenerationConfig,
    GenerationEngine,
    PagedGenerationEngine,
    PythonGenerator,
    SamplingParams,
    export_generator,
    load_generator,
)

pytestmark = pytest.mark.xdist_group("serving_paged_engine")

SEED, SCALE = 1, 3.0
BS = g.BLOCK_SIZE


def _generator(params=None, paged=True):
    kw = {"paged": g.paged, "block_size": BS} if paged else {}
    return PythonGenerator(g.prefill, g.decode, g.init_params(SEED, SCALE) if params is None else params,
                           cache_specs=g.cache_specs(), vocab_size=g.VOCAB_SIZE, max_length=g.MAX_LENGTH,
                           vocabulary=g.VOCAB, eos_token_ids=(), name="tiny", **kw)


def _paged(**kw):
    return GenerationConfig(**{"num_slots": 4, "prefill_batch": 2, "kv_layout": "paged", "prefill_chunk": 32, **kw})


@pytest.fixture(scope="module")
def model():
    return _generator()


def _prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, g.VOCAB_SIZE, n)]


SYSTEM = _prompt(21, 0)  # 5 full blocks of 4, then one token


def test_a_shared_prefix_is_prefilled_once_and_gives_the_same_tokens(model):
    work = [(SYSTEM + _prompt(3 + i, 10 + i), SamplingParams(8, temperature=0.8 if i % 2 else 0.0, seed=i))
            for i in range(5)]
    with GenerationEngine(model, _paged(enable_prefix_caching=False)) as cold:
        alone = [cold.generate(*w).token_ids for w in work]
        assert cold.stats()["prefix_cache_hit_tokens"] == 0
    with GenerationEngine(model, _paged()) as eng:
        first = eng.generate(*work[0])
        assert first.token_ids == alone[0] and eng.stats()["prefix_cache_hit_tokens"] == 0
        rest = [eng.submit(*w) for w in work[1:]]  # together, each sharing the first's 5 blocks
        assert [r.result(60).token_ids for r in rest] == alone[1:]
        stats = eng.stats()
    assert stats["prefix_cache_hit_tokens"] == 4 * 5 * BS
    assert stats["prefix_cache_query_tokens"] == sum(len(p) for p, _ in work)
    assert stats["prefix_cache_hit_rate"] == pytest.approx(80 / stats["prefix_cache_query_tokens"])
    assert stats["free_blocks"] == stats["num_blocks"] and stats["kv_cache_usage"] == 0.0


def test_a_prefix_still_being_prefilled_is_not_shared_until_written(model):
    # two requests with one long common prefix arrive together: the second must not read the
    # first's blocks before the first's chunks have written them (its tokens would be wrong)
    long = _prompt(40, 3)
    work = [(long + [5], SamplingParams(6)), (long + [6, 7], SamplingParams(6))]
    with GenerationEngine(model, _paged(enable_prefix_caching=False)) as cold:
        alone = [cold.generate(*w).token_ids for w in work]
    with GenerationEngine(model, _paged()) as eng:
        reqs = [eng.submit(*w) for w in work]
        assert [r.result(60).token_ids for r in reqs] == alone
        assert eng.stats()["prefix_cache_hit_tokens"] == 40


class _GatedChunks:
    """The model, with the engine thread held inside its ``n``-th prefill chunk (a paged
    call of more than one token per row) until ``release`` is set."""

    def __init__(self, inner, n):
        self.inner, self.n, self.calls = inner, n, 0
        self.entered, self.release = threading.Event(), threading.Event()
        for k in ("name", "vocab_size", "max_length", "eos_token_ids", "vocabulary", "cache_specs",
                  "has_paged", "block_size"):
            setattr(self, k, getattr(inner, k))

    def init_pool(self, n):
        return self.inner.init_pool(n)

    def init_cache(self, n):
        return self.inner.init_cache(n)

    def prefill(self, tokens, lengths):
        return self.inner.prefill(tokens, lengths)

    def decode(self, tokens, positions, cache):
        return self.inner.decode(tokens, positions, cache)

    def paged_step(self, tokens, positions, lengths, tables, pool):
        if np.asarray(tokens).shape[1] > 1:
            self.calls += 1
            if self.calls == self.n:
                self.entered.set()
                assert self.release.wait(30)
        return self.inner.paged_step(tokens, positions, lengths, tables, pool)


def test_cancel_frees_blocks_and_unwritten_blocks_are_not_cached(model):
    prompt = _prompt(60, 4)  # 8 chunks of 8: cancelled while it is still prefilling
    with GenerationEngine(model, _paged(enable_prefix_caching=False, prefill_chunk=8)) as cold:
        expected = cold.generate(prompt, SamplingParams(3)).token_ids
    gated = _GatedChunks(model, 1 + 3)  # the blocker's prompt, then the victim's third chunk
    with GenerationEngine(gated, _paged(num_slots=2, prefill_batch=1, prefill_chunk=8)) as eng:
        blocker = eng.submit([3, 4], SamplingParams(40))
        victim = eng.submit(prompt, SamplingParams(3))
        assert gated.entered.wait(30)  # the victim is part-way through its prompt, the engine held
        victim.cancel()
        gated.release.set()
        assert victim.result(30).finish_reason == "cancelled"
        blocker.cancel()
        assert blocker.result(30).finish_reason == "cancelled"
        stats = eng.stats()
        assert stats["active_slots"] == 0 and stats["free_blocks"] == stats["num_blocks"]
        # blocks it named but never wrote were forgotten: the same prompt now computes them itself
        again = eng.generate(prompt, SamplingParams(3))
        assert again.token_ids == expected


def test_many_short_requests_fit_where_contiguous_rows_refuse():
    # the memory of 2 contiguous rows of max_length 64 = 32 blocks of 4 tokens
    model = _generator()
    peak = {"contiguous": 0, "paged": 0}
    configs = {"contiguous": GenerationConfig(num_slots=2, prefill_batch=1),
               "paged": _paged(num_slots=8, num_blocks=2 * g.MAX_LENGTH // BS)}
    for layout, cfg in configs.items():
        with GenerationEngine(model, cfg).start(precompile=False) as eng:
            def watch(ev, eng=eng, layout=layout):
                peak[layout] = max(peak[layout], eng.stats()["active_slots"])

            work = [(_prompt(3, 20 + i), SamplingParams(5)) for i in range(8)]  # 7 tokens: 2 blocks each
            reqs = [eng.submit(*w, on_event=watch) for w in work]
            assert all(r.result(60).finish_reason == "length" for r in reqs)
    assert peak["contiguous"] == 2 and peak["paged"] == 8


def _small_pool(model, **kw):
    """An engine on a pool of 8 blocks of 4 tokens (32 tokens for 4 slots), compiled as it goes."""
    return GenerationEngine(model, _paged(num_slots=4, num_blocks=8, prefill_chunk=16, **kw)).start(precompile=False)


def _events(store):
    def on_event(ev):
        store.append(ev.index)
    return on_event


def test_a_pool_too_small_for_all_requests_preempts_and_resumes_them_with_their_tokens(model):
    # 4 requests of 3-6 prompt tokens + 20 new tokens: 6 blocks each at the end, 24 for all
    # four at once, in a pool of 8 (and two more ending at a stop string). They are admitted on what they hold now, grow block by
    # block, and the youngest running request is preempted when a block is missing; each
    # resumes (recomputing its keys and values) with the tokens it gets alone.
    work = [(_prompt(3 + i, 40 + i), SamplingParams(20, temperature=0.9 if i % 2 else 0.0, top_k=8, seed=i))
            for i in range(4)]
    with GenerationEngine(model, _paged()) as roomy:
        texts = [roomy.generate(*w).text for w in work]
        # two more end at a stop string late in their text (seen one step after sampling, maybe
        # while preempted)
        work += [(p, SamplingParams(20, temperature=0.9, top_k=8, seed=i, stop=(texts[i][-4:-2],)))
                 for i, (p, _) in enumerate(work[2:], start=2)]
        alone = [roomy.generate(*w) for w in work]
    with _small_pool(model) as eng:
        events = [[] for _ in work]
        reqs = [eng.submit(*w, on_event=_events(ev)) for w, ev in zip(work, events, strict=True)]
        got = [r.result(60) for r in reqs]
        stats = eng.stats()
    assert [r.token_ids for r in got] == [r.token_ids for r in alone]
    assert [(r.text, r.finish_reason) for r in got] == [(r.text, r.finish_reason) for r in alone]
    assert [r.finish_reason for r in got[4:]] == ["stop", "stop"]
    assert stats["preemptions"] >= 1 and stats["free_blocks"] == 8 and stats["active_slots"] == 0
    # replayed tokens are not generated again (a stop string seen a step late samples one discarded row)
    assert 0 <= stats["tokens"] - sum(len(r.token_ids) for r in got) <= 2
    for ev, r in zip(events, got, strict=True):  # every token streamed once, in order, across the preemption
        assert ev == list(range(len(r.token_ids) + 1))


def test_requests_far_below_their_max_tokens_run_together_without_reserving_it(model):
    # each asks for up to 27 new tokens (7 blocks of the pool's 8, the old reservation: one at a
    # time) but ends after a few at its stop token: all four run at once
    probe = [(_prompt(1, 50 + i), SamplingParams(27, temperature=1.0, seed=i)) for i in range(12)]
    with GenerationEngine(model, _paged()) as roomy:
        free = [roomy.generate(*w).token_ids for w in probe]
    # four requests, each stopping at a token k >= 2 that it has not generated before
    ends = {i: next((k for k in range(2, 12) if t[k] not in t[:k]), None) for i, t in enumerate(free)}
    picked = [i for i, k in ends.items() if k is not None][:4]
    work = [(probe[i][0], SamplingParams(27, temperature=1.0, seed=i, stop_token_ids=(free[i][ends[i]],))) for i in picked]
    with _small_pool(model) as eng:
        peak, submitted = [0], threading.Event()

        def watch(ev):
            submitted.wait(30)  # the first request's first token holds the engine until all are queued
            peak[0] = max(peak[0], eng.stats()["active_slots"])

        reqs = [eng.submit(*w, on_event=watch) for w in work]
        submitted.set()
        got = [r.result(60) for r in reqs]
    assert [r.token_ids for r in got] == [free[i][: ends[i] + 1] for i in picked]
    assert peak[0] == 4 and all(r.finish_reason == "stop" for r in got)


def test_n_samples_copy_the_shared_partial_block_on_their_first_write(model):
    # a prompt of 5 full blocks and 2 tokens: the later samples share its 5 blocks and the
    # first token of the partial one, each copies that block before writing its last token,
    # and every sample gets the tokens it gets without prefix caching
    prompt = SYSTEM + [7]  # 22 tokens
    work = [(prompt, SamplingParams(10, temperature=1.0, seed=i)) for i in range(4)]
    with GenerationEngine(model, _paged(enable_prefix_caching=False)) as cold:
        alone = [cold.generate(*w).token_ids for w in work]
    with GenerationEngine(model, _paged()) as eng:
        reqs = [eng.submit(*w) for w in work]
        got = [r.result(60).token_ids for r in reqs]
        stats = eng.stats()
    assert got == alone and len({tuple(t) for t in got}) > 1
    assert stats["prefix_cache_copies"] == 3 and stats["prefix_cache_hit_tokens"] == 3 * (len(prompt) - 1)
    assert stats["free_blocks"] == stats["num_blocks"]


def test_chunked_prefill_runs_between_decode_steps(model):
    with GenerationEngine(model, _paged(prefill_batch=1, prefill_chunk=4)) as eng:
        tokens_of_a, first_of_b = [], threading.Event()
        started = threading.Event()

        def on_a(ev):
            if not ev.finished:
                tokens_of_a.append(first_of_b.is_set())
            if ev.index == 1:
                started.set()

        a = eng.submit([3, 4], SamplingParams(40), on_event=on_a)
        assert started.wait(30)
        b = eng.submit(_prompt(60, 5), SamplingParams(2), on_event=lambda ev: first_of_b.set())
        count_before = len(tokens_of_a)
        b.result(60)
        a.result(60)
        # b's 15 prefill chunks ran one per step, each step decoding a as well
        during = tokens_of_a[count_before:].count(False)
        assert during >= 10, during


def test_a_suffix_after_a_cached_prefix_is_padded_to_its_own_bucket():
    """Chunks run at 16, 32, 48, 64 tokens (not powers of two only): after the 20-token
    prefix is cached, a 34-token suffix runs as one 48-token chunk, with the same tokens."""
    seen = []
    model = _generator()
    step = model.paged_step

    def recording(tokens, *rest):
        seen.append(np.shape(tokens))
        return step(tokens, *rest)

    model.paged_step = recording
    prefix, suffix = _prompt(20, 21), _prompt(34, 22)
    with GenerationEngine(model, _paged(prefill_batch=1, prefill_chunk=64)) as eng:
        assert eng.buckets() == (16, 32, 48, 64)
        eng.generate(prefix + [9], SamplingParams(1))
        seen.clear()
        hit = eng.generate(prefix + suffix, SamplingParams(4))
        assert seen[0] == (1, 48) and eng.stats()["prefix_cache_hit_tokens"] == 20
    with GenerationEngine(_generator(), _paged(enable_prefix_caching=False)) as cold:
        assert cold.generate(prefix + suffix, SamplingParams(4)).token_ids == hit.token_ids


def test_logprobs_equal_a_float64_log_softmax_of_the_full_forward_pass(model):
    params = g.init_params(SEED, SCALE)
    prompt = SYSTEM + [7, 8]
    with GenerationEngine(model, _paged()) as eng:
        eng.generate(SYSTEM + [9], SamplingParams(2))  # so the next prompt hits the cache
        res = eng.generate(prompt, SamplingParams(6, temperature=1.0, seed=3, logprobs=3))
        assert eng.stats()["prefix_cache_hit_tokens"] == 5 * BS
    seq = list(prompt)
    for tok, (lp, top) in zip(res.token_ids, res.logprobs, strict=True):
        logits = g.reference_logits(params, seq)[-1]
        ref = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        assert lp == pytest.approx(ref[tok], abs=2e-4)  # float32 model against float64
        assert [i for i, _ in top] == list(np.argsort(-ref)[:3])
        np.testing.assert_allclose([v for _, v in top], np.sort(ref)[::-1][:3], atol=2e-4)
        seq.append(tok)


@pytest.mark.slow  # exports and compiles a second model
def test_export_load_round_trip_of_the_paged_program(tmp_path, model):
    path = export_generator(g.prefill, g.decode, g.init_params(SEED, SCALE), tmp_path / "m", cache_specs=g.cache_specs(),
                            vocab_size=g.VOCAB_SIZE, max_length=g.MAX_LENGTH, vocabulary=g.VOCAB, paged=g.paged,
                            block_size=BS, max_batch_size=8)
    loaded = load_generator(path)
    assert loaded.has_paged and loaded.block_size == BS and "paged" in loaded.signatures
    work = [(SYSTEM + _prompt(4, 30 + i), SamplingParams(6)) for i in range(3)]
    with GenerationEngine(loaded, _paged()) as a, GenerationEngine(model, _paged()) as b:
        assert [a.generate(*w).token_ids for w in work] == [b.generate(*w).token_ids for w in work]


def test_bad_paged_settings_are_named(model):
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        GenerationConfig(kv_layout="blocks")
    with pytest.raises(ValueError, match="prefill_chunk must be a positive integer"):
        GenerationConfig(prefill_chunk=0)
    with pytest.raises(ValueError, match="num_blocks must be a positive integer"):
        GenerationConfig(num_blocks=0)
    with pytest.raises(ValueError, match="enable_prefix_caching must be true or false"):
        GenerationConfig(enable_prefix_caching="yes")
    with pytest.raises(ValueError, match="kv_layout 'paged' needs a model with a paged function"):
        GenerationEngine(_generator(paged=False), _paged())
    with pytest.raises(ValueError, match="paged and block_size go together"):
        PythonGenerator(g.prefill, g.decode, g.init_params(), cache_specs=g.cache_specs(), vocab_size=g.VOCAB_SIZE,
                        max_length=g.MAX_LENGTH, paged=g.paged)
    with pytest.raises(ValueError, match="has no paged KV layout"):
        _generator(paged=False).init_pool(4)
    from cairn.serving._genexport import GenerationInfo

    info = GenerationInfo(g.VOCAB_SIZE, g.MAX_LENGTH, g.cache_specs(), block_size=BS)
    assert GenerationInfo.from_json(info.to_json()).block_size == BS and info.to_json()["paged_signature"] == "paged"
    with pytest.raises(ValueError, match="block_size must be a positive integer or None, got 0"):
        GenerationInfo(g.VOCAB_SIZE, g.MAX_LENGTH, g.cache_specs(), block_size=0)
    assert isinstance(GenerationEngine(model, _paged()), PagedGenerationEngine)
    assert GenerationConfig.from_json(_paged().to_json()) == _paged()


def test_the_server_reports_prefix_cache_hits_and_kv_usage_in_metrics(model):
    import json
    import re

    from serving_testlib import RawClient

    from cairn.serving._server import Server

    with Server({"tiny": model}, generation=_paged()) as server:
        client = RawClient(server)
        for tail in ([5], [6, 7]):
            body = json.dumps({"input_ids": SYSTEM + tail, "parameters": {"max_tokens": 3}})
            assert client.request("POST", "/v2/models/tiny/generate", body)[0] == 200
        text = client.request("GET", "/metrics")[2].decode()
        client.close()
    labels = r'\{model="tiny",version="1"\}'
    assert re.search(rf"cairn_prefix_cache_query_tokens_total{labels} {2 * len(SYSTEM) + 3}\b", text), text
    assert re.search(rf"cairn_prefix_cache_hit_tokens_total{labels} {5 * BS}\b", text)
    assert re.search(rf"cairn_kv_cache_usage_ratio{labels} 0\b", text)
    assert re.search(rf"cairn_generation_preemptions_total{labels} 0\b", text)


def test_openai_client_over_the_paged_engine(tmp_path):
    # n choices share their prompt's blocks and get the tokens they get without prefix
    # caching; a stream closed early frees its blocks
    import json
    import time
    import urllib.request

    import openai

    from cairn.serving import Tokenizer
    from cairn.serving._server import Server

    tok = Tokenizer.from_pretrained(g.char_tokenizer(tmp_path))
    gen = PythonGenerator(g.prefill, g.decode, g.init_params(SEED, SCALE), cache_specs=g.cache_specs(),
                          vocab_size=g.VOCAB_SIZE, max_length=g.MAX_LENGTH, tokenizer=tok, name="tiny",
                          paged=g.paged, block_size=BS)
    messages = [{"role": "system", "content": "the abc, the abc."}, {"role": "user", "content": "hi"}]
    request = {"model": "tiny", "messages": messages, "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 0,
               "extra_body": {"ignore_eos": True}}
    answers, engines = [], []
    for caching in (False, True):
        with Server({"tiny": gen}, generation=_paged(enable_prefix_caching=caching)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            answers.append([c.message.content for c in client.chat.completions.create(**request).choices])
            stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, stream=True,
                                                    extra_body={"ignore_eos": True})
            next(iter(stream))
            stream.close()  # the server cancels the request
            end = time.monotonic() + 30
            while True:
                with urllib.request.urlopen(server.url + "/v2/models/tiny/stats") as r:
                    engine = json.loads(r.read())["model_stats"][0]["generation_stats"]["engine"]
                if engine["active_slots"] == 0 or time.monotonic() > end:
                    break
                time.sleep(0.05)
            engines.append(engine)
    assert answers[0] == answers[1] and len(answers[0]) == 3
    for engine in engines:
        assert engine["active_slots"] == 0 and engine["free_blocks"] == engine["num_blocks"]
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    shared = (len(ids) - 1) // BS * BS
    assert engines[0]["prefix_cache_hit_tokens"] == 0 and engines[1]["prefix_cache_hit_tokens"] >= 3 * shared
