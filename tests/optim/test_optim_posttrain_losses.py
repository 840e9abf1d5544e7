"""Post-training losses against float64 NumPy transcriptions of their published equations.

Covers ``token_logprobs``/``sequence_logprobs``, DPO (and cDPO), IPO, SimPO, ORPO, the
PPO/GRPO clipped policy objective with its four aggregations, the k1/k2/k3 KL
estimators and group-relative advantages. Each reference below is written from the
paper's equation, in the most direct NumPy form (textbook ``log(p / (1 - p))``,
``r - log r - 1``, loops over sequences and groups), not from our implementation.

Tolerances (stated once, used throughout):
- float64 (inside ``jax.enable_x64``): rtol 1e-10 for values; gradients against
  central finite differences (h = 1e-6) of the float64 NumPy formula: rtol 1e-6,
  atol 1e-8 (the FD truncation error is ~h^2 times the third derivative).
- float32: rtol 2e-5, atol 2e-5 against the float64 reference of the same inputs
  (sums of up to 16 log-probabilities of magnitude < 10).
- bfloat16 inputs: the reference takes the bfloat16-rounded inputs; results computed
  in float32 and rounded once to bfloat16 must agree to rtol 1e-2, atol 1e-2.
  ``token_logprobs``/``sequence_logprobs`` return float32 for bfloat16 logits and
  must then agree to the float32 tolerance.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import scipy.special as sp
from _cairn_testlib import central_diff
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.optim import losses

HSET = settings(max_examples=12, deadline=None)
F64 = dict(rtol=1e-10, atol=1e-12)
FD = dict(rtol=1e-6, atol=1e-8)
F32 = dict(rtol=2e-5, atol=2e-5)
BF16 = dict(rtol=1e-2, atol=1e-2)


def rng(seed=0):
    return np.random.default_rng(seed)


def bf16_round(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


@functools.cache
def J(fn, **config):
    """``fn`` with its configuration bound, under jit; cached, so a test that calls it again
    with the same shapes reuses the compiled program (eager dispatch compiles every
    primitive per shape, which dominates this file's time). The eager path, with its
    concrete-value checks, is covered by the bad-input tests."""
    return jax.jit(functools.partial(fn, **config))


def JG(fn, **config):
    """Gradient of ``sum(fn(x, *rest, **config).loss)`` (or of the array ``fn`` returns)
    with respect to its first argument, under jit."""
    def total(x, *rest, **more):
        out = fn(x, *rest, **config, **more)
        return jnp.sum(getattr(out, "loss", out))
    return _jit_grad(total)


def _jit_grad(f):
    return jax.jit(jax.grad(f))


# --- float64 references, from the papers' equations ---


def np_token_logprobs(x, y, m):
    logp = x - sp.logsumexp(x, axis=-1, keepdims=True)
    out = np.zeros(y.shape)
    for i in np.ndindex(y.shape):
        if m[i]:
            out[i] = logp[i][y[i]]
    return out


def np_sequence_logprobs(x, y, m, average):
    total = np_token_logprobs(x, y, m).sum(-1)
    return total / np.maximum(m.sum(-1), 1) if average else total


def np_dpo(c, r, rc, rr, beta=0.1, label_smoothing=0.0):
    z = beta * (c - rc) - beta * (r - rr)
    return -(1 - label_smoothing) * sp.log_expit(z) - label_smoothing * sp.log_expit(-z)


def np_ipo(c, r, rc, rr, beta=0.1):
    h = (c - rc) - (r - rr)
    return (h - 1 / (2 * beta)) ** 2


def np_simpo(c, r, beta=2.0, gamma=1.0, label_smoothing=0.0):
    z = beta * c - beta * r - gamma
    return -(1 - label_smoothing) * sp.log_expit(z) - label_smoothing * sp.log_expit(-z)


def np_orpo(c, r, beta=0.1, include_nll=True):
    pw, pl = np.exp(c), np.exp(r)
    log_odds_ratio = np.log((pw / (1 - pw)) / (pl / (1 - pl)))
    out = -beta * sp.log_expit(log_odds_ratio)
    return out - c if include_nll else out


def np_kl(lp, ref, estimator):
    ratio = np.exp(ref - lp)           # pi_ref / pi_theta
    if estimator == "k1":
        return -np.log(ratio)
    if estimator == "k2":
        return 0.5 * np.log(ratio) ** 2
    return ratio - np.log(ratio) - 1


def np_aggregate(per_token, m, aggregation):
    T = per_token.shape[-1]
    rows, masks = per_token.reshape(-1, T), m.reshape(-1, T)
    if aggregation == "token-mean":
        return per_token[m].sum() / max(m.sum(), 1)
    values = []
    for row, mr in zip(rows, masks):
        n = mr.sum()
        if n == 0:
            continue
        s = row[mr].sum()
        values.append({"seq-mean-token-mean": s / n, "seq-mean-token-sum": s,
                       "seq-mean-token-sum-norm": s / T}[aggregation])
    return float(np.mean(values)) if values else 0.0


def np_policy(lp, old, adv, m, eps_low=0.2, eps_high=None, ref=None, beta=0.0,
              estimator="k3", aggregation="seq-mean-token-mean"):
    """PPO/GRPO per-token objective and its aggregation (GRPO eq. 3, DAPO eq. 8)."""
    eps_high = eps_low if eps_high is None else eps_high
    a = adv[..., None] if adv.shape == lp.shape[:-1] else adv
    a = np.broadcast_to(a, lp.shape)
    ratio = np.exp(np.where(m, lp - old, 0.0))
    surrogate = -np.minimum(ratio * a, np.clip(ratio, 1 - eps_low, 1 + eps_high) * a)
    kl = np.zeros_like(lp) if ref is None else np.where(m, np_kl(lp, np.where(m, ref, lp), estimator), 0)
    per_token = np.where(m, surrogate + beta * kl, 0.0)
    low = (m & (ratio < 1 - eps_low) & (a < 0)).sum() / max(m.sum(), 1)
    high = (m & (ratio > 1 + eps_high) & (a > 0)).sum() / max(m.sum(), 1)
    return dict(loss=np_aggregate(per_token, m, aggregation), per_token_loss=per_token,
                policy_loss=np_aggregate(np.where(m, surrogate, 0), m, aggregation),
                kl=np_aggregate(kl, m, aggregation), clip_fraction_low=low,
                clip_fraction_high=high)


def np_group_advantages(r, G, normalize_std=True, eps=1e-4, ddof=1):
    out = np.zeros(r.shape)
    for idx in np.ndindex(r.shape[:-1]):
        for g in range(r.shape[-1] // G):
            block = r[idx][g * G:(g + 1) * G].astype(np.float64)
            a = block - block.mean()
            if normalize_std:
                a = a / (block.std(ddof=ddof) + eps)
            out[idx][g * G:(g + 1) * G] = a
    return out


# --- sequence log-probabilities ---


def _lm_batch(seed, batch, T, V, p_mask=0.7):
    g = rng(seed)
    x = g.normal(size=batch + (T, V)) * 3
    y = g.integers(0, V, size=batch + (T,))
    m = g.random(batch + (T,)) < p_mask
    return x, y, m


@jax.jit
def _all_logprobs(x, y, m):
    return (losses.token_logprobs(x, y, m), losses.sequence_logprobs(x, y, m),
            losses.sequence_logprobs(x, y, m, average=True))


@HSET
@given(batch=st.sampled_from([(), (3,), (2, 2)]), T=st.sampled_from([1, 5]),
       V=st.sampled_from([2, 7]), p=st.sampled_from([0.0, 0.5, 1.0]), seed=st.integers(0, 2**16))
def test_token_and_sequence_logprobs_match_numpy(batch, T, V, p, seed):
    x, y, m = _lm_batch(seed, batch, T, V, p)
    xs = jnp.asarray(x, jnp.float32)
    ref_x = np.asarray(xs, np.float64)
    tok, total, mean = _all_logprobs(xs, y, m)
    assert tok.dtype == jnp.float32 and tok.shape == batch + (T,)
    np.testing.assert_allclose(tok, np_token_logprobs(ref_x, y, m), **F32)
    for average, got in ((False, total), (True, mean)):
        assert got.shape == batch and got.dtype == jnp.float32
        np.testing.assert_allclose(got, np_sequence_logprobs(ref_x, y, m, average), **F32)


def test_sequence_logprobs_float64_values_and_grads():
    x, y, m = _lm_batch(1, (3,), 5, 4)
    m[2] = False                                       # one row with no completion token
    w = rng(2).normal(size=3)
    with jax.enable_x64(True):
        for average in (False, True):
            got = J(losses.sequence_logprobs, average=average)(x, y, m)
            np.testing.assert_allclose(got, np_sequence_logprobs(x, y, m, average), **F64)
            g = _jit_grad(lambda z, a=average: jnp.sum(w * losses.sequence_logprobs(z, y, m, average=a)))(x)
            fd = central_diff(lambda z, a=average: np.sum(w * np_sequence_logprobs(z, y, m, a)), x)
            np.testing.assert_allclose(g, fd, **FD)
            assert np.all(np.asarray(g)[2] == 0)      # the empty row: value 0, gradient 0
            assert float(got[2]) == 0.0


def test_sequence_logprobs_bfloat16_logits_give_float32():
    x, y, m = _lm_batch(3, (2,), 6, 5)
    xb = jnp.asarray(x, jnp.bfloat16)
    ref = np_sequence_logprobs(bf16_round(x), y, m, True)
    got = jax.jit(lambda a: losses.sequence_logprobs(a, y, m, average=True))(xb)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, ref, **F32)


def test_sequence_logprobs_are_aligned_and_a_causal_lm_shifts():
    """A 'model' whose output at t puts all mass on input t+1: shifted, the sequence has
    probability 1; passed aligned (unshifted), it has probability ~0."""
    ids = jnp.array([[3, 1, 4, 1, 5, 2]])
    next_ids = jnp.concatenate([ids[:, 1:], ids[:, :1]], axis=1)
    logits = 30.0 * jax.nn.one_hot(next_ids, 6)         # output t predicts ids[t + 1]
    mask = jnp.array([[0, 0, 1, 1, 1, 1]])              # completion: the last four tokens
    shifted = J(losses.sequence_logprobs)(logits[:, :-1], ids[:, 1:], mask[:, 1:])
    aligned = J(losses.sequence_logprobs)(logits, ids, mask)
    assert float(shifted[0]) > -1e-9
    assert float(aligned[0]) < -100


def test_sequence_logprobs_masked_padding_may_be_anything():
    x, y, m = _lm_batch(4, (2,), 4, 5)
    y = np.where(m, y, -100)                           # Hugging Face's ignore index
    got = losses.sequence_logprobs(jnp.asarray(x, jnp.float32), y, m)   # eager: checks run
    np.testing.assert_allclose(got, np_sequence_logprobs(x, np.where(m, y, 0), m, False), **F32)


def test_sequence_logprobs_jit_and_vmap_agree_with_eager():
    x, y, m = _lm_batch(5, (4,), 5, 6)
    x = jnp.asarray(x, jnp.float32)
    eager = losses.sequence_logprobs(x, y, m, average=True)
    jitted = jax.jit(lambda a, b, c: losses.sequence_logprobs(a, b, c, average=True))(x, y, m)
    mapped = jax.vmap(lambda a, b, c: losses.sequence_logprobs(a, b, c, average=True))(x, y, m)
    np.testing.assert_allclose(jitted, eager, rtol=1e-6)
    np.testing.assert_allclose(mapped, eager, rtol=1e-6)


def test_logprobs_bad_input():
    x, y, m = _lm_batch(6, (2,), 3, 4)
    with pytest.raises(TypeError, match="`logits` must have a floating dtype"):
        losses.sequence_logprobs(y, y, m)
    with pytest.raises(TypeError, match="`tokens` must have an integer dtype"):
        losses.sequence_logprobs(x, y.astype(float), m)
    with pytest.raises(ValueError, match=r"`tokens` must have logits' shape .* \(2, 3\), got \(2, 2\)"):
        losses.sequence_logprobs(x, y[:, :2], m)
    with pytest.raises(ValueError, match=r"`mask` must have the shape of `tokens`"):
        losses.token_logprobs(x, y, m[:, :2])
    with pytest.raises(ValueError, match="at least 2 axes"):
        losses.sequence_logprobs(x[0, 0], y[0, 0], None)
    bad = y.copy()
    bad[1, 2] = 4
    m[1, 2] = True
    with pytest.raises(ValueError, match=r"\[0, 4\) .* tokens\[1, 2\] = 4"):
        losses.sequence_logprobs(x, bad, m)


# --- preference losses ---

PREFERENCE = {
    "dpo": (losses.dpo_loss, np_dpo, 4, dict(beta=0.3, label_smoothing=0.0)),
    "cdpo": (losses.dpo_loss, np_dpo, 4, dict(beta=0.3, label_smoothing=0.2)),
    "ipo": (losses.ipo_loss, np_ipo, 4, dict(beta=0.4)),
    "simpo": (losses.simpo_loss, np_simpo, 2, dict(beta=2.5, gamma=1.2, label_smoothing=0.1)),
    "orpo": (losses.orpo_loss, np_orpo, 2, dict(beta=0.2)),
    "orpo_or_only": (losses.orpo_loss, np_orpo, 2, dict(beta=0.5, include_nll=False)),
}


def _preference_args(seed, shape, n, averaged):
    """Sequence log-probs: sums over ~20 tokens (DPO/IPO) or per-token means (SimPO/ORPO)."""
    g = rng(seed)
    if averaged:
        return [-np.exp(g.normal(size=shape) - 0.5) for _ in range(n)]
    return [g.normal(size=shape) * 3 - 20 for _ in range(n)]


def _rewards_ref(name, args, kw):
    if name in ("dpo", "cdpo", "ipo"):
        b = kw["beta"]
        return b * (args[0] - args[2]), b * (args[1] - args[3])
    return kw["beta"] * args[0], kw["beta"] * args[1]


@pytest.mark.parametrize("name", list(PREFERENCE))
def test_preference_loss_values_rewards_and_grads_float64(name):
    fn, ref, n, kw = PREFERENCE[name]
    args = _preference_args(7, (6,), n, averaged=n == 2)
    with jax.enable_x64(True):
        out = J(fn, **kw)(*args)
        np.testing.assert_allclose(out.loss, ref(*args, **kw), **F64)
        rw, rl = _rewards_ref(name, args, kw)
        np.testing.assert_allclose(out.chosen_rewards, rw, **F64)
        np.testing.assert_allclose(out.rejected_rewards, rl, **F64)
        np.testing.assert_allclose(out.margins, rw - rl, **F64)
        np.testing.assert_array_equal(out.accuracies, (rw > rl).astype(float))
        grads = _jit_grad(lambda a: jnp.sum(fn(*a, **kw).loss))(args)
        for i in range(n):
            def theirs(a, i=i):
                full = list(args)
                full[i] = a
                return np.sum(ref(*full, **kw))

            np.testing.assert_allclose(grads[i], central_diff(theirs, args[i]), **FD)


@pytest.mark.parametrize("name", list(PREFERENCE))
def test_preference_loss_float32_and_bfloat16(name):
    fn, ref, n, kw = PREFERENCE[name]
    args = _preference_args(8, (3, 4), n, averaged=n == 2)
    got = J(fn, **kw)(*(jnp.asarray(a, jnp.float32) for a in args))
    assert got.loss.dtype == jnp.float32 and got.loss.shape == (3, 4)
    np.testing.assert_allclose(got.loss, ref(*(np.float32(a).astype(np.float64) for a in args), **kw), **F32)
    rounded = [bf16_round(a) for a in args]
    got = J(fn, **kw)(*(jnp.asarray(a, jnp.bfloat16) for a in args))
    assert all(f.dtype == jnp.bfloat16 for f in got)
    np.testing.assert_allclose(np.asarray(got.loss, np.float64), ref(*rounded, **kw), **BF16)


@HSET
@given(name=st.sampled_from(list(PREFERENCE)), shape=st.sampled_from([(), (1,), (2, 3), (2, 1, 3)]),
       seed=st.integers(0, 2**16), beta=st.sampled_from([0.05, 1.0, 3.0]),
       smoothing=st.sampled_from([0.0, 0.25, 0.5]))
def test_preference_losses_any_shape_and_hyperparameters(name, shape, seed, beta, smoothing):
    fn, ref, n, kw = PREFERENCE[name]
    kw = dict(kw, beta=beta)
    if "label_smoothing" in kw:
        kw["label_smoothing"] = smoothing
    args = _preference_args(seed, shape, n, averaged=n == 2)
    with jax.enable_x64(True):
        out = J(fn, **kw)(*args)
        assert all(f.shape == shape for f in out)
        np.testing.assert_allclose(out.loss, ref(*args, **kw), rtol=1e-9, atol=1e-12)
        assert np.all(np.asarray(out.loss) >= 0)


def test_preference_losses_vmap_and_jit_match_batched_call():
    args = [jnp.asarray(a, jnp.float32) for a in _preference_args(9, (5,), 4, False)]
    batched = losses.dpo_loss(*args, beta=0.2)
    mapped = jax.jit(jax.vmap(functools.partial(losses.dpo_loss, beta=0.2)))(*args)
    jitted = J(losses.dpo_loss, beta=0.2)(*args)
    for a, b, c in zip(batched, mapped, jitted):
        np.testing.assert_allclose(a, b, rtol=1e-6)
        np.testing.assert_allclose(a, c, rtol=1e-6)


def test_preference_rewards_carry_no_gradient_and_aux_works():
    args = [jnp.asarray(a, jnp.float32) for a in _preference_args(10, (4,), 4, False)]

    def loss(c):
        out = losses.dpo_loss(c, *args[1:])
        return out.loss.mean(), out

    (value, aux), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(args[0])
    assert np.isfinite(float(value)) and np.all(np.isfinite(g)) and aux.margins.shape == (4,)
    g_rewards = _jit_grad(lambda c: losses.dpo_loss(c, *args[1:]).chosen_rewards.sum())(args[0])
    assert np.all(np.asarray(g_rewards) == 0)


def test_dpo_and_simpo_do_not_overflow_for_large_margins():
    big = jnp.array([1e4, -1e4], jnp.float32)
    zero = jnp.zeros(2, jnp.float32)
    out = J(losses.dpo_loss, beta=1.0, label_smoothing=0.1)(big, zero, zero, zero)
    np.testing.assert_allclose(out.loss, [0.1 * 1e4, 0.9 * 1e4], rtol=1e-6)
    g = JG(losses.dpo_loss, beta=1.0)(big, zero, zero, zero)
    np.testing.assert_allclose(g, [0.0, -1.0], atol=1e-6)
    out = J(losses.simpo_loss, beta=1e4, gamma=0.0)(big / 1e4, -big / 1e4)
    np.testing.assert_allclose(out.loss, [0.0, 2e4], rtol=1e-6, atol=1e-6)


def test_cdpo_half_smoothing_is_symmetric_in_the_preference():
    a = _preference_args(11, (5,), 4, False)
    one = J(losses.dpo_loss, label_smoothing=0.5)(*a).loss
    swapped = J(losses.dpo_loss, label_smoothing=0.5)(a[1], a[0], a[3], a[2]).loss
    np.testing.assert_allclose(one, swapped, rtol=1e-6)


def test_orpo_near_probability_one_and_zero_stays_finite():
    """log(1 - p) near p = 1 (log-prob -> 0-) and the odds of tiny p, against the
    asymptotes log odds ~ lp - log(-lp) (lp -> 0-) and ~ lp (lp -> -inf)."""
    chosen = np.array([-1e-12, -1e-6, -0.0, -3.0])
    rejected = np.array([-2.0, -60.0, -1.0, -1e-9])
    with jax.enable_x64(True):
        out = losses.orpo_loss(chosen, rejected, beta=1.0, include_nll=False)
        g = JG(losses.orpo_loss, beta=1.0)(chosen, rejected)
    assert np.all(np.isfinite(out.loss)) and np.all(np.isfinite(g))
    def log_odds(lp):
        if lp > -1e-5:   # 1 - e^x = -x (1 + x/2 + x^2/6 + O(x^3))
            return lp - np.log(-lp) - np.log1p(lp / 2 + lp * lp / 6)
        return np.log(np.exp(lp) / (1 - np.exp(lp)))

    ref = -sp.log_expit(log_odds(-1e-12) - log_odds(-2.0))
    np.testing.assert_allclose(out.loss[0], ref, rtol=1e-9)
    ref = -sp.log_expit(log_odds(-1e-6) - (-60.0))
    np.testing.assert_allclose(out.loss[1], ref, rtol=1e-9)
    # log-prob exactly 0: taken as the largest value below 0, a huge but finite odds
    assert float(out.loss[2]) < 1e-100
    # float32: the same points stay finite
    out32 = J(losses.orpo_loss)(chosen.astype(np.float32), rejected.astype(np.float32))
    assert np.all(np.isfinite(out32.loss))


@pytest.mark.parametrize("call,exc,msg", [
    (lambda a: losses.dpo_loss(*a, beta=0.0), ValueError, r"dpo_loss: `beta` must be a finite number in \(0"),
    (lambda a: losses.dpo_loss(*a, beta=float("nan")), ValueError, "`beta` must be a finite"),
    (lambda a: losses.dpo_loss(*a, label_smoothing=0.6), ValueError, r"`label_smoothing` .* \[0.0, 0.5\]"),
    (lambda a: losses.dpo_loss(*a, beta="0.1"), TypeError, "`beta` must be a real number"),
    (lambda a: losses.ipo_loss(*a, beta=-1.0), ValueError, "ipo_loss: `beta`"),
    (lambda a: losses.simpo_loss(a[0], a[1], gamma=float("inf")), ValueError, "`gamma`"),
    (lambda a: losses.dpo_loss(a[0], a[1][:2], a[2], a[3]), ValueError,
     r"one shape, got chosen_logps.shape=\(3,\), rejected_logps.shape=\(2,\)"),
    (lambda a: losses.dpo_loss(a[0], a[1], a[2].astype(int), a[3]), TypeError,
     "`ref_chosen_logps` must have a floating dtype"),
    (lambda a: losses.orpo_loss(-a[0], a[1]), ValueError, r"`chosen_logps` must be log-probabilities \(<= 0\)"),
    (lambda a: losses.orpo_loss(a[0], a[1], beta=0), ValueError, "orpo_loss: `beta`"),
])
def test_preference_losses_bad_input(call, exc, msg):
    args = [np.array([-1.0, -2.0, -3.0]) - i for i in range(4)]
    with pytest.raises(exc, match=msg):
        call(args)


# --- KL estimators ---


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_matches_schulman_estimators(estimator):
    g = rng(12)
    lp, ref = -np.exp(g.normal(size=(3, 7))), -np.exp(g.normal(size=(3, 7)))
    with jax.enable_x64(True):
        got = J(losses.kl_penalty, estimator=estimator)(lp, ref)
        np.testing.assert_allclose(got, np_kl(lp, ref, estimator), rtol=1e-9, atol=1e-12)
        grad = JG(losses.kl_penalty, estimator=estimator)(lp, ref)
        np.testing.assert_allclose(grad, central_diff(lambda a: np_kl(a, ref, estimator).sum(), lp), **FD)
    got32 = J(losses.kl_penalty, estimator=estimator)(lp.astype(np.float32), ref.astype(np.float32))
    assert got32.dtype == jnp.float32
    np.testing.assert_allclose(got32, np_kl(np.float32(lp), np.float32(ref), estimator), **F32)


def test_kl_estimators_are_unbiased_on_samples():
    """Sampling o ~ p and averaging: k1 and k3 are unbiased for KL(p || q), k3 >= 0 per sample."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    q = np.array([0.4, 0.4, 0.1, 0.1])
    true_kl = float(np.sum(p * np.log(p / q)))
    n = 200_000
    samples = rng(13).choice(4, size=n, p=p)
    lp, ref = np.log(p)[samples], np.log(q)[samples]
    for estimator in ("k1", "k3"):
        per = np.asarray(J(losses.kl_penalty, estimator=estimator)(
            lp.astype(np.float32), ref.astype(np.float32)), np.float64)
        stderr = per.std() / math.sqrt(n)
        assert abs(per.mean() - true_kl) < 5 * stderr, (estimator, per.mean(), true_kl)
    assert np.all(per >= 0)


def _k3_reference(d):
    """k3 = e^d - 1 - d in float64; by its series where float64 itself would cancel."""
    if abs(d) < 1e-3:
        return d * d / 2 + d**3 / 6 + d**4 / 24 + d**5 / 120
    return math.expm1(d) - d


@HSET
@given(d=st.one_of(st.floats(-30.0, 30.0), st.floats(-1e-3, 1e-3)))
def test_k3_is_nonnegative_and_keeps_relative_precision_near_zero(d):
    d = float(np.float32(d))
    got = float(J(losses.kl_penalty)(jnp.float32(0.0), jnp.float32(d)))
    assert got >= 0
    assert math.isclose(got, _k3_reference(d), rel_tol=1e-5, abs_tol=1e-37), (d, got)


def test_k3_near_zero_values():
    ds = np.array([1e-6, -1e-4, 0.05, -0.0999, 0.1, 0.3, -2.0], np.float32)
    got = np.asarray(J(losses.kl_penalty)(np.zeros_like(ds), ds), np.float64)
    want = np.array([_k3_reference(float(d)) for d in ds])
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_kl_penalty_bad_input():
    with pytest.raises(ValueError, match="`estimator` must be one of"):
        losses.kl_penalty(jnp.zeros(2), jnp.zeros(2), estimator="k4")
    with pytest.raises(ValueError, match="same shape"):
        losses.kl_penalty(jnp.zeros(2), jnp.zeros(3))
    with pytest.raises(TypeError, match="`ref_logprobs` must have a floating dtype"):
        losses.kl_penalty(jnp.zeros(2), jnp.zeros(2, int))


# --- the clipped policy objective ---

AGGREGATIONS = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _rollouts(seed, batch=(4,), T=6, away_from=(0.2, 0.28)):
    """Log-probs, old log-probs (log-ratios around the clip range, none within 1e-3 of a
    clip boundary, so finite differences do not straddle a kink), advantages, reference
    log-probs and a mask with ragged lengths and one empty row."""
    g = rng(seed)
    lp = -np.exp(g.normal(size=batch + (T,)))
    log_ratio = g.normal(size=lp.shape) * 0.25
    for b in (math.log(1 - away_from[0]), math.log(1 + away_from[1])):
        near = np.abs(log_ratio - b) < 1e-3
        log_ratio[near] += 3e-3
    old = lp - log_ratio
    ref = lp + g.normal(size=lp.shape) * 0.3
    adv = g.normal(size=batch)
    lengths = g.integers(1, T + 1, size=batch)
    m = np.arange(T) < lengths[..., None]
    m.reshape(-1, T)[0] = False
    return lp, old, adv, ref, m


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_clipped_policy_loss_matches_numpy_float64(aggregation, estimator):
    lp, old, adv, ref, m = _rollouts(14)
    kw = dict(clip_epsilon=0.2, clip_epsilon_high=0.28, beta=0.04, kl_estimator=estimator,
              aggregation=aggregation)
    want = np_policy(lp, old, adv, m, 0.2, 0.28, ref, 0.04, estimator, aggregation)
    with jax.enable_x64(True):
        out = J(losses.clipped_policy_loss, **kw)(lp, old, adv, m, ref_logprobs=ref)
        for field, value in want.items():
            np.testing.assert_allclose(getattr(out, field), value, err_msg=field, **F64)
        np.testing.assert_allclose(out.loss, out.policy_loss + 0.04 * out.kl, **F64)
        g = JG(losses.clipped_policy_loss, **kw)(lp, old, adv, m, ref_logprobs=ref)
        fd = central_diff(lambda a: np_policy(a, old, adv, m, 0.2, 0.28, ref, 0.04, estimator,
                                              aggregation)["loss"], lp)
        np.testing.assert_allclose(g, fd, **FD)
    assert 0 < want["clip_fraction_low"] + want["clip_fraction_high"] < 1  # both regimes hit


def test_clipped_policy_loss_float32_bfloat16_and_per_token_advantages():
    lp, old, adv, ref, m = _rollouts(15, batch=(2, 3), T=5)
    want = np_policy(lp, old, adv, m, 0.2, None, ref, 0.1, "k3", "token-mean")
    f = jax.jit(lambda *a: losses.clipped_policy_loss(*a[:4], ref_logprobs=a[4], beta=0.1,
                                                      aggregation="token-mean"))
    per_token_adv = np.broadcast_to(adv[..., None], lp.shape)
    for a in (adv, per_token_adv):
        out = f(*(jnp.asarray(x, jnp.float32) for x in (lp, old, a)), m, jnp.asarray(ref, jnp.float32))
        assert out.loss.dtype == jnp.float32 and out.per_token_loss.shape == lp.shape
        np.testing.assert_allclose(out.loss, want["loss"], **F32)
        np.testing.assert_allclose(out.per_token_loss, want["per_token_loss"], **F32)
    rounded = [bf16_round(x) for x in (lp, old, adv, ref)]
    want = np_policy(*rounded[:3], m, 0.2, None, rounded[3], 0.1, "k3", "token-mean")
    out = f(*(jnp.asarray(x, jnp.bfloat16) for x in (lp, old, adv)), m, jnp.asarray(ref, jnp.bfloat16))
    assert out.loss.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.float64(out.loss), want["loss"], **BF16)


@HSET
@given(batch=st.sampled_from([(1,), (3,), (2, 2)]), T=st.sampled_from([1, 5]),
       seed=st.integers(0, 2**16), aggregation=st.sampled_from(AGGREGATIONS),
       eps=st.sampled_from([0.0, 0.2]), eps_high=st.sampled_from([None, 0.28]))
@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
def test_clipped_policy_loss_any_shape_mask_and_epsilon(batch, T, seed, aggregation, eps, eps_high):
    lp, old, adv, _, m = _rollouts(seed, batch, T)
    m = m & (rng(seed + 1).random(m.shape) < 0.8)
    kw = dict(clip_epsilon=eps, clip_epsilon_high=eps_high, aggregation=aggregation)
    want = np_policy(lp, old, adv, m, eps, eps_high, None, 0.0, "k3", aggregation)
    with jax.enable_x64(True):
        out = J(losses.clipped_policy_loss, **kw)(lp, old, adv, m)
    np.testing.assert_allclose(out.loss, want["loss"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(out.clip_fraction_high, want["clip_fraction_high"], atol=1e-12)
    assert float(out.kl) == 0.0


def test_clipped_policy_loss_on_policy_gradient():
    """old_logprobs=None: every ratio is 1 and the gradient is the policy gradient
    -A_i / |o_i| / (number of non-empty sequences) on each masked token."""
    lp, _, adv, _, m = _rollouts(16)
    with jax.enable_x64(True):
        out = J(losses.clipped_policy_loss)(lp, None, adv, m)
        g = JG(losses.clipped_policy_loss)(lp, None, adv, m)
    n = m.sum(-1)
    want = np.where(m, -adv[:, None] / np.maximum(n, 1)[:, None] / (n > 0).sum(), 0.0)
    np.testing.assert_allclose(g, want, **F64)
    np.testing.assert_allclose(out.loss, np_policy(lp, lp, adv, m)["loss"], **F64)
    assert float(out.clip_fraction_low) == float(out.clip_fraction_high) == 0.0


def test_clipped_policy_loss_ignores_garbage_at_masked_tokens():
    lp, old, adv, ref, m = _rollouts(17)
    f = jax.jit(lambda a, o, r: losses.clipped_policy_loss(a, o, adv, m, ref_logprobs=r, beta=0.1).loss)
    clean = f(lp, old, ref)
    dirty = [np.where(m, x, fill) for x, fill in ((lp, -np.inf), (old, np.nan), (ref, np.inf))]
    np.testing.assert_allclose(f(*dirty), clean, rtol=1e-6)
    g = jax.jit(jax.grad(lambda a: losses.clipped_policy_loss(a, dirty[1], adv, m, ref_logprobs=dirty[2],
                                                              beta=0.1).loss))(dirty[0])
    assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[~m] == 0)


def test_clipped_policy_loss_all_masked_is_zero_with_zero_gradient():
    lp, old, adv, ref, m = _rollouts(18)
    none = np.zeros_like(m)
    for aggregation in AGGREGATIONS:
        out = J(losses.clipped_policy_loss, beta=0.1, aggregation=aggregation)(
            lp, old, adv, none, ref_logprobs=ref)
        assert all(float(jnp.sum(jnp.abs(x))) == 0.0 for x in out), aggregation
        g = JG(losses.clipped_policy_loss, beta=0.1, aggregation=aggregation)(
            lp, old, adv, none, ref_logprobs=ref)
        assert np.all(np.asarray(g) == 0)


def test_clipped_policy_loss_vmaps_over_groups():
    lp, old, adv, _, m = _rollouts(19, batch=(3, 4), T=5)
    f = lambda a, o, d, k: losses.clipped_policy_loss(a, o, d, k, aggregation="token-mean").loss  # noqa: E731
    per_group = jax.jit(jax.vmap(f))(lp, old, adv, m)
    for i in range(3):
        np.testing.assert_allclose(per_group[i], np_policy(lp[i], old[i], adv[i], m[i],
                                                           aggregation="token-mean")["loss"], rtol=2e-5)


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(beta=0.1), ValueError, r"`beta`=0.1 weighs a KL penalty .* no `ref_logprobs`"),
    (dict(clip_epsilon=-0.1), ValueError, "`clip_epsilon` must be a finite number"),
    (dict(clip_epsilon_high=float("inf")), ValueError, "`clip_epsilon_high`"),
    (dict(aggregation="mean"), ValueError, "`aggregation` must be one of"),
    (dict(kl_estimator="k5"), ValueError, "`kl_estimator` must be one of"),
])
def test_clipped_policy_loss_bad_options(kw, exc, msg):
    lp, old, adv, _, m = _rollouts(20)
    with pytest.raises(exc, match=msg):
        losses.clipped_policy_loss(lp, old, adv, m, **kw)


def test_clipped_policy_loss_bad_shapes():
    lp, old, adv, ref, m = _rollouts(21)
    with pytest.raises(ValueError, match=r"`advantages` must have shape \(4,\) .* or \(4, 6\)"):
        losses.clipped_policy_loss(lp, old, adv[:3], m)
    with pytest.raises(ValueError, match="`old_logprobs` must have the shape of `logprobs`"):
        losses.clipped_policy_loss(lp, old[:, :3], adv, m)
    with pytest.raises(ValueError, match="`mask` must have the shape"):
        losses.clipped_policy_loss(lp, old, adv, m[:, :3])
    with pytest.raises(ValueError, match="`ref_logprobs` must have the shape"):
        losses.clipped_policy_loss(lp, old, adv, m, ref_logprobs=ref[:2], beta=0.1)
    with pytest.raises(TypeError, match="`advantages` must have a floating dtype"):
        losses.clipped_policy_loss(lp, old, adv.astype(int), m)


# --- group-relative advantages ---


@pytest.mark.parametrize("normalize_std,ddof", [(True, 1), (True, 0), (False, 1)])
def test_group_relative_advantages_match_numpy(normalize_std, ddof):
    r = rng(22).normal(size=(2, 12))
    r[0, :4] = 0.5                                      # one group of equal rewards
    got = J(losses.group_relative_advantages, group_size=4, normalize_std=normalize_std,
            ddof=ddof)(jnp.asarray(r, jnp.float32))
    want = np_group_advantages(r, 4, normalize_std, 1e-4, ddof)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(got[0, :4], 0.0)
    with jax.enable_x64(True):
        got = J(losses.group_relative_advantages, group_size=4, normalize_std=normalize_std,
                ddof=ddof, eps=1e-6)(r)
        np.testing.assert_allclose(got, np_group_advantages(r, 4, normalize_std, 1e-6, ddof), **F64)


@HSET
@given(groups=st.sampled_from([1, 3]), G=st.sampled_from([2, 5]), seed=st.integers(0, 2**16),
       binary=st.booleans())
def test_group_relative_advantages_properties(groups, G, seed, binary):
    g = rng(seed)
    r = (g.random(groups * G) < 0.5).astype(np.int32) if binary else g.normal(size=groups * G)
    out = J(losses.group_relative_advantages, group_size=G)(r)
    assert out.dtype == jnp.float32
    a = np.asarray(out, np.float64)
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a.reshape(groups, G).sum(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(a, np_group_advantages(r.astype(np.float64), G), rtol=2e-5, atol=2e-5)
    order = np.argsort(r.reshape(groups, G), axis=-1, kind="stable")
    assert np.all(np.diff(np.take_along_axis(a.reshape(groups, G), order, -1), axis=-1) >= -1e-6)


def test_group_relative_advantages_jit_and_dtype():
    r = rng(23).normal(size=8)
    got = jax.jit(lambda x: losses.group_relative_advantages(x, 4))(jnp.asarray(r, jnp.bfloat16))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, np_group_advantages(bf16_round(r), 4), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("args,kw,exc,msg", [
    ((np.zeros(4), 1), {}, ValueError, "`group_size` must be at least 2 .* got 1"),
    ((np.zeros(6), 4), {}, ValueError, r"whole groups of 4 samples, got rewards.shape=\(6,\)"),
    ((np.array([0.0, np.nan, 1.0, 1.0]), 2), {}, ValueError, r"rewards\[1\] = nan"),
    ((np.array([[0.0, 1.0], [np.inf, 1.0]]), 2), {}, ValueError, r"rewards\[1, 0\] = inf"),
    ((np.zeros(4), 2.0), {}, TypeError, "`group_size` must be an int"),
    ((np.zeros(4), 2), dict(eps=0.0), ValueError, "`eps`"),
    ((np.zeros(4), 2), dict(ddof=2), ValueError, "`ddof` must be 0 or 1"),
    ((np.zeros(4, complex), 2), {}, TypeError, "`rewards` must be real numbers"),
])
def test_group_relative_advantages_bad_input(args, kw, exc, msg):
    with pytest.raises(exc, match=msg):
        losses.group_relative_advantages(*args, **kw)


def test_new_names_are_exported_from_losses():
    for name in ("token_logprobs", "sequence_logprobs", "dpo_loss", "ipo_loss", "orpo_loss",
                 "simpo_loss", "clipped_policy_loss", "kl_penalty", "group_relative_advantages",
                 "PreferenceLossOutput", "PolicyLossOutput"):
        assert name in losses.__all__ and callable(getattr(losses, name))
