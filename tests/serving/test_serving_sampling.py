"""SamplingParams validation and the host sampler: the filtered distribution against an
independent float64 reference, draws that depend only on (seed, token index), and the
batched sampler: every row drawn exactly as the reference draws it, whatever else is in
the batch."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.serving import SamplingParams, _sampling
from cairn.serving._sampling import filtered_probs, sample_rows, sample_token, uniform


def _reference(logits, temperature, top_k, top_p):
    """Token by token in plain Python floats: sort (most likely first, lower id on ties),
    keep top_k, keep while the mass before a token is below top_p, renormalise."""
    z = [float(v) / temperature for v in logits]
    m = max(z)
    w = [math.exp(v - m) for v in z]
    order = sorted(range(len(z)), key=lambda i: (-z[i], i))
    keep = order[:top_k] if top_k else order
    mass = sum(w[i] for i in keep)
    kept, before = [], 0.0
    for i in keep:
        if before >= top_p and top_p < 1.0:
            break
        kept.append(i)
        before += w[i] / mass
    s = sum(w[i] for i in kept)
    out = np.zeros(len(z))
    for i in kept:
        out[i] = w[i] / s
    return out


logit_lists = st.lists(st.sampled_from([-3.0, -1.0, 0.0, 0.5, 1.0, 2.5]) | st.floats(-8, 8), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(logit_lists, st.floats(0.05, 4.0), st.integers(0, 14), st.floats(0.01, 1.0))
def test_filtered_probs_match_reference(logits, temperature, top_k, top_p):
    got = filtered_probs(np.array(logits, np.float32), temperature, top_k, top_p)
    want = _reference(np.array(logits, np.float32), temperature, top_k, top_p)
    np.testing.assert_allclose(got, want, atol=1e-12)
    assert got.sum() == pytest.approx(1.0)


def test_draws_follow_the_filtered_distribution():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    p = filtered_probs(logits, 0.8, 4, 0.9)
    n = 20000
    counts = np.bincount([sample_token(logits, params, seed, 3) for seed in range(n)], minlength=6)
    assert counts[p == 0].sum() == 0  # never outside the nucleus
    # each kept token's frequency within 5 standard deviations of its probability
    sd = np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(counts / n - p) <= 5 * sd + 1e-12)


def test_draws_depend_only_on_seed_and_index():
    logits = np.linspace(-1, 1, 30).astype(np.float32)
    params = SamplingParams(temperature=1.0)
    a = [sample_token(logits, params, 7, i) for i in range(50)]
    assert a == [sample_token(logits, params, 7, i) for i in range(50)]
    assert a != [sample_token(logits, params, 8, i) for i in range(50)]
    assert [sample_token(logits, params, 7, i) for i in (9, 3)] == [a[9], a[3]]  # order of calls is irrelevant


def test_greedy_is_argmax_first_max():
    assert sample_token(np.array([1.0, 3.0, 3.0, 0.0]), SamplingParams(), 0, 0) == 1
    # top_k=1 sampling is greedy too
    assert sample_token(np.array([1.0, 3.0, 2.0]), SamplingParams(temperature=2.0, top_k=1), 5, 0) == 1


bad_values = [
    ("max_new_tokens", 0), ("max_new_tokens", -3), ("max_new_tokens", 2.5), ("max_new_tokens", True),
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"),
    ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("seed", -1), ("seed", 2**64),
    ("stop_token_ids", "ab"), ("stop_token_ids", (1, -2)), ("ignore_eos", 1),
]


@pytest.mark.parametrize(("field", "value"), bad_values)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field.rstrip("s") if field == "stop_token_ids" else field):
        SamplingParams(**{field: value})


@settings(max_examples=100, deadline=None)
@given(st.integers(-5, 50), st.floats(-1, 3, allow_nan=False), st.integers(-2, 50), st.floats(-0.5, 1.5, allow_nan=False))
def test_params_valid_iff_in_range(n, t, k, p):
    ok = n >= 1 and t >= 0 and k >= 0 and 0 < p <= 1
    if ok:
        sp = SamplingParams(max_new_tokens=n, temperature=t, top_k=k, top_p=p)
        assert (sp.max_new_tokens, sp.top_k) == (n, k) and sp.greedy == (t == 0)
    else:
        with pytest.raises(ValueError, match="SamplingParams"):
            SamplingParams(max_new_tokens=n, temperature=t, top_k=k, top_p=p)


def test_from_json_names():
    obj = {"max_tokens": 5, "temperature": 0.5, "top_k": 3, "top_p": 0.9, "seed": 11, "stop_token_ids": [4],
           "stop": ["b", "cd"], "ignore_eos": True}
    sp = SamplingParams.from_json(obj, vocabulary=[None, "a", "b", "cd", "e"])
    assert sp == SamplingParams(5, 0.5, 3, 0.9, 11, (4, 2, 3), True)
    assert SamplingParams.from_json({"max_new_tokens": 2, "seed": None}).seed is None
    with pytest.raises(ValueError, match=r"unknown sampling parameter 'n'; known: .*max_tokens"):
        SamplingParams.from_json({"n": 2})
    with pytest.raises(ValueError, match="not both"):
        SamplingParams.from_json({"max_tokens": 2, "max_new_tokens": 3})
    with pytest.raises(ValueError, match="needs a model with a vocabulary"):
        SamplingParams.from_json({"stop": "x"})
    with pytest.raises(ValueError, match="'zz' is not the text of one token"):
        SamplingParams.from_json({"stop": ["zz"]}, vocabulary=["a"])
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got -1"):
        SamplingParams.from_json({"max_tokens": -1})
    with pytest.raises(ValueError, match="JSON object"):
        SamplingParams.from_json([1])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**40)), min_size=1, max_size=40))
def test_uniforms_are_the_scalar_draws(pairs):
    """The array form (wrapping uint64 arithmetic) equals the Python-integer SplitMix64."""
    seeds, indices = zip(*pairs)
    got = _sampling.uniforms(np.array(seeds, np.uint64), np.array(indices, np.uint64))
    assert got.tolist() == [uniform(s, i) for s, i in pairs]


def test_uniform_is_uniform_and_uncorrelated():
    u = np.array([[uniform(seed, i) for i in range(100)] for seed in range(200)])
    assert ((u >= 0) & (u < 1)).all() and len(np.unique(u)) == u.size
    counts = np.bincount((u * 20).astype(int).ravel(), minlength=20)
    chi2 = ((counts - u.size / 20) ** 2 / (u.size / 20)).sum()
    assert chi2 < 45  # 19 degrees of freedom: p < 0.001 above ~43.8
    # neighbouring indices and neighbouring seeds are uncorrelated
    assert abs(np.corrcoef(u[:, :-1].ravel(), u[:, 1:].ravel())[0, 1]) < 0.03
    assert abs(np.corrcoef(u[:-1].ravel(), u[1:].ravel())[0, 1]) < 0.03


# --- the batched sampler ---


def _reference_draw(logits, temperature, top_k, top_p, u):
    """The inverse-CDF draw from ``_reference`` at ``u`` (tokens in id order), and whether
    it is ambiguous: the top-p cut or ``u`` lies within 1e-9 of a boundary, where the
    order of float additions may decide (ties of probability are not ambiguous)."""
    z = [float(v) / temperature for v in logits]
    w = [math.exp(v - max(z)) for v in z]
    order = sorted(range(len(z)), key=lambda i: (-z[i], i))[: top_k or None]
    mass, before = sum(w[i] for i in order), 0.0
    ambiguous = False
    for i in order:
        ambiguous |= top_p < 1.0 and abs(before - top_p) < 1e-9
        before += w[i] / mass
    p = _reference(logits, temperature, top_k, top_p)
    c = np.cumsum(p)
    tok = int(np.searchsorted(c, u * c[-1], side="right"))
    ambiguous |= bool(np.any(np.abs(c[p > 0] - u * c[-1]) < 1e-9))
    return tok, ambiguous


def _check_rows(logits, params, seeds, indices):
    """sample_rows on the batch, each row alone, and the reference agree."""
    got = sample_rows(logits, params, seeds, indices)
    assert got.shape == (len(params),) and got.dtype == np.int64
    skipped = 0
    for i, sp in enumerate(params):
        assert got[i] == sample_token(logits[i], sp, seeds[i], indices[i])  # the same alone
        if sp.greedy:
            assert got[i] == int(np.argmax(logits[i]))
            continue
        want, ambiguous = _reference_draw(logits[i], sp.temperature, sp.top_k, sp.top_p, uniform(seeds[i], indices[i]))
        skipped += ambiguous
        assert ambiguous or got[i] == want, (i, sp, got[i], want)
    return got, skipped


row_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 1.0]) | st.floats(0.05, 4.0),
    top_k=st.sampled_from([0, 1, 2, 5, 31, 32, 33, 40, 70]) | st.integers(0, 90),
    top_p=st.sampled_from([1.0, 0.3, 0.5, 0.9, 0.99]) | st.floats(0.01, 1.0),
)


@settings(max_examples=120, deadline=None)
@given(st.data(), st.integers(1, 80), st.integers(1, 7))
def test_sample_rows_exact_and_independent_of_the_other_rows(data, vocab, n):
    value = st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.5]) | st.floats(-12, 12, width=32)  # ties are common
    logits = np.array(data.draw(st.lists(st.lists(value, min_size=vocab, max_size=vocab), min_size=n, max_size=n)),
                      np.float32)
    params = data.draw(st.lists(row_params, min_size=n, max_size=n))
    seeds = data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n))
    indices = data.draw(st.lists(st.integers(0, 10_000), min_size=n, max_size=n))
    got, _ = _check_rows(logits, params, seeds, indices)
    sub = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1)))  # any subset, any order
    sub = data.draw(st.permutations(sub))
    part = sample_rows(logits[sub], [params[i] for i in sub], [seeds[i] for i in sub], [indices[i] for i in sub])
    assert part.tolist() == got[sub].tolist()


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
def test_sample_rows_every_path_matches_the_reference(monkeypatch):
    """A large vocabulary so candidates are a real subset: top-p inside the top 32, top-k
    above 32 (k + 1 candidates) and above 256, a flat row whose nucleus is larger than
    32, a tie at the 32nd candidate inside the nucleus, plain temperature, greedy. The
    rows that cannot be decided from the candidates really take the whole-vocabulary path."""
    rng = np.random.default_rng(0)
    vocab = 600
    sharp = (rng.normal(size=vocab) * 6).astype(np.float32)
    flat = (rng.normal(size=vocab) * 0.1).astype(np.float32)
    tied = np.full(vocab, -20.0, np.float32)
    tied[rng.choice(vocab, 20, replace=False)] = 3.0
    tied[rng.choice(np.flatnonzero(tied < 0), 40, replace=False)] = 2.0  # ranks 20..59 tie, the 32nd among them
    rows = [
        (sharp, SamplingParams(temperature=0.8, top_p=0.9)),
        (sharp, SamplingParams(temperature=3.0, top_k=40, top_p=0.95)),
        (flat, SamplingParams(temperature=1.0, top_k=300)),
        (flat, SamplingParams(temperature=1.0, top_p=0.5)),
        (tied, SamplingParams(temperature=1.0, top_p=0.99)),
        (tied, SamplingParams(temperature=1.0, top_k=25)),
        (sharp, SamplingParams(temperature=1.3)),
        (flat, SamplingParams()),
    ]
    widths = []
    real = _sampling._filtered_draw
    monkeypatch.setattr(_sampling, "_CHUNK", 1 << 20)  # one call (chunks: the next test)
    monkeypatch.setattr(_sampling, "_filtered_draw", lambda *a: (widths.append((len(a[0]), a[-1])), real(*a))[1])
    draws = 60
    logits = np.stack([r for r, _ in rows] * draws)
    params = [p for _, p in rows] * draws
    seeds = [int(s) for s in rng.integers(0, 2**63, len(params))]
    got, skipped = _check_rows(logits, params, seeds, list(range(len(params))))
    assert skipped <= 2
    # 41 candidates for top-k 40; top-k 300, the flat nucleus and both tied rows needed the whole row;
    # the flat nucleus (its 41 most likely tokens hold less than top_p) skipped the candidates
    assert widths[0] == (5 * draws, 41) and widths[1] == (4 * draws, vocab)
    assert len(set(got[4::8].tolist())) > 20  # the tied row really draws from its 59-token nucleus


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(2, 70), st.integers(1, 6))
def test_the_cut_from_sorted_values_is_the_stable_rankings(data, vocab, n):
    """The top-k / top-p kept set found from sorted values alone (the fast path) equals the
    one from a stable ranking of each row (ties at the cut: lower ids), or is declined."""
    value = st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.5]) | st.floats(-12, 12, width=32)  # ties are common
    z = np.array(data.draw(st.lists(st.lists(value, min_size=vocab, max_size=vocab), min_size=n, max_size=n)), np.float64)
    z /= data.draw(st.floats(0.05, 4.0))
    e = np.exp(z - z.max(axis=1, keepdims=True))
    total = e.sum(axis=1)
    pc = e / total[:, None]
    top_k = np.array(data.draw(st.lists(st.integers(0, vocab), min_size=n, max_size=n)), np.int64)
    top_p = np.array(data.draw(st.lists(st.sampled_from([1.0, 0.5, 0.95]) | st.floats(0.01, 1.0), min_size=n, max_size=n)))
    m = data.draw(st.integers(1, vocab))
    cand = np.sort(np.argpartition(z, vocab - m, axis=1)[:, vocab - m :], axis=1)
    zc, pm = np.take_along_axis(z, cand, 1), np.take_along_axis(e, cand, 1) / total[:, None]
    for args in ((z, pc, total, top_k, top_p, vocab, vocab), (zc, pm, total, top_k, top_p, m, vocab)):
        fast, ok_fast = _sampling._kept_sorted(*args)
        slow, ok_slow = _sampling._kept_ranked(*args[:2], *args[3:])
        if fast is not None:
            assert fast.tolist() == slow.tolist() and ok_fast.tolist() == ok_slow.tolist()


def test_a_batch_of_flat_top_p_rows_skips_the_candidates(monkeypatch):
    """Serving's usual batch: every row top-p over a flat distribution (a random-weight
    model's logits). No row can be decided from 32 candidates (their mass is at most
    32 / total), so the batch goes straight to the whole-row path, in one call without
    copies, and every row is still the reference's draw and its own alone."""
    rng = np.random.default_rng(11)
    logits = (rng.normal(size=(24, 512)) * 0.3).astype(np.float32)
    logits[5, 7] = logits[5, 9]  # a tie in the nucleus: the lower id first
    params = [SamplingParams(temperature=0.8, top_p=float(p)) for p in rng.choice([0.5, 0.9, 0.95], 24)]
    widths = []
    real = _sampling._filtered_draw
    monkeypatch.setattr(_sampling, "_filtered_draw", lambda *a: (widths.append((len(a[0]), a[-1])), real(*a))[1])
    got, skipped = _check_rows(logits, params, list(range(24)), [3] * 24)
    assert skipped == 0 and widths[0] == (24, 512)
    assert len(set(got.tolist())) > 12


def test_the_fast_cut_takes_ordinary_rows():
    rng = np.random.default_rng(3)
    z = rng.normal(size=(8, 512)) / 0.8
    e = np.exp(z - z.max(axis=1, keepdims=True))
    total = e.sum(axis=1)
    keep, _ = _sampling._kept_sorted(z, e / total[:, None], total, np.zeros(8, np.int64), np.full(8, 0.95), 512, 512)
    assert keep is not None and 0.5 * 512 < keep.sum(axis=1).min() < 512


def test_sample_rows_bad_input_is_named():
    sp = SamplingParams(temperature=1.0)
    with pytest.raises(ValueError, match=r"\(n, vocab\) logits and n params.*got logits \(3,\)"):
        sample_rows(np.zeros(3), [sp], [0], [0])
    with pytest.raises(ValueError, match="2 params, 1 seeds"):
        sample_rows(np.zeros((2, 3)), [sp, sp], [0], [0, 1])
    assert sample_rows(np.zeros((0, 3)), [], [], []).shape == (0,)


def test_sample_rows_in_chunks_gives_the_same_tokens(monkeypatch):
    """Big vocabularies are sampled a few rows per call: the same tokens as one call."""
    rng = np.random.default_rng(1)
    logits = (rng.normal(size=(40, 300)) * rng.uniform(0.1, 8, (40, 1))).astype(np.float32)
    params = [SamplingParams(temperature=float(rng.uniform(0.2, 2)), top_k=int(rng.choice([0, 5, 50, 280])),
                             top_p=float(rng.choice([1.0, 0.5, 0.95]))) for _ in range(40)]
    seeds, indices = list(range(40)), [int(i) for i in rng.integers(0, 99, 40)]
    whole = sample_rows(logits, params, seeds, indices)
    monkeypatch.setattr(_sampling, "_CHUNK", 700)  # 2 rows per call
    assert sample_rows(logits, params, seeds, indices).tolist() == whole.tolist()
