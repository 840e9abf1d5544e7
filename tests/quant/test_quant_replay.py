"""Eager calls of a quantized function run a compiled replay, cached per call signature.

The cache is checked by what it must do: the program is rewritten once per signature (a
new signature rewrites again), results equal the op-by-op re-evaluation (``jax.disable_jit``)
and a float64 NumPy statement of the quantized math, new weights and new calibrated scales
are used at once (nothing stale is baked in), and the number of signatures held is bounded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import quant
from cairn.quant import _replay as replay

RULE = quant.QuantizationRule(weight_qtype="int8", act_qtype="int8")


def _params(scale: float = 1.0) -> dict:
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"l1": {"kernel": jax.random.normal(k1, (8, 16)) * scale}, "l2": {"kernel": jax.random.normal(k2, (16, 4)) * scale}}


def _mlp(p, x):
    return jnp.tanh(x @ p["l1"]["kernel"]) @ p["l2"]["kernel"]


def _q(a: np.ndarray, axis: int) -> np.ndarray:
    """Symmetric int8 quantize-dequantize along ``axis`` (``scale = absmax / 127.5``), float64."""
    scale = np.max(np.abs(a), axis=axis, keepdims=True) / 127.5
    return np.clip(np.round(a / scale), -127, 127) * scale


def _reference(p: dict, x: np.ndarray) -> np.ndarray:
    """w8a8: per-token activation scales, per-output-channel weight scales."""
    w1, w2 = (np.asarray(p[k]["kernel"], np.float64) for k in ("l1", "l2"))
    h = np.tanh(_q(np.asarray(x, np.float64), 1) @ _q(w1, 0))
    return _q(h, 1) @ _q(w2, 0)


def _counting(provider: quant.QuantizationProvider) -> list:
    seen: list = []
    inner = provider._handle

    def handle(site, invals):
        seen.append(site.module_path)
        return inner(site, invals)

    provider._handle = handle
    return seen


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_eager_calls_rewrite_once_per_signature():
    traced: list = []

    def fn(p, x):
        traced.append(x.shape)
        return _mlp(p, x)

    provider = quant.PtqProvider([RULE])
    rewrites = _counting(provider)
    q = quant.quantize(fn, provider)
    p, x = _params(), jax.random.normal(jax.random.key(1), (5, 8))
    outs = [q(p, x) for _ in range(3)]
    assert traced == [(5, 8)] and rewrites == ["l1", "l2"]  # traced and rewritten once, then replayed
    x2 = jax.random.normal(jax.random.key(2), (7, 8))
    q(p, x2)
    q(p, x2)
    assert traced == [(5, 8), (7, 8)] and rewrites == ["l1", "l2"] * 2  # a new signature: once more
    for out in outs:
        np.testing.assert_allclose(np.asarray(out, np.float64), _reference(p, x), rtol=1e-4, atol=1e-4)
    with jax.disable_jit():  # the op-by-op re-evaluation, no compiled replay
        uncached = q(p, x)
    np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(uncached), rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_new_weights_and_new_scales_are_never_stale():
    q_provider = quant.PtqProvider([RULE])
    q = quant.quantize(_mlp, q_provider)
    x = jax.random.normal(jax.random.key(1), (5, 8))
    first = q(_params(), x)
    p2 = _params(3.0)
    second = q(p2, x)  # same signature, other weights: the replay takes them as arguments
    np.testing.assert_allclose(np.asarray(second, np.float64), _reference(p2, x), rtol=1e-4, atol=1e-4)
    assert not np.allclose(np.asarray(first), np.asarray(second))

    static = quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)])
    qs = quant.quantize(_mlp, static)
    outs = []
    for batch_scale in (1.0, 4.0):  # recalibrating changes the static scales the replay must use
        quant.calibrate(_mlp, static, [(_params(), x * batch_scale)])
        got = qs(_params(), x)
        with jax.disable_jit():
            want = qs(_params(), x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
        outs.append(np.asarray(got))
    assert not np.allclose(outs[0], outs[1])


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_the_cache_is_bounded_and_traced_calls_are_unaffected(monkeypatch):
    monkeypatch.setattr(replay, "MAX_ENTRIES", 4)
    q = quant.quantize(_mlp, quant.PtqProvider([RULE]))
    p = _params()
    for n in range(1, 11):  # ten signatures, traced (not compiled): the cache keeps the last four
        jax.eval_shape(q, p, jnp.ones((n, 8)))
    assert len(q._traces) == 4
    x = jax.random.normal(jax.random.key(3), (5, 8))
    eager, jitted, grad = q(p, x), jax.jit(q)(p, x), jax.grad(lambda x: jnp.sum(q(p, x)))(x)
    assert len(q._traces) == 4
    np.testing.assert_allclose(np.asarray(eager), np.asarray(jitted), rtol=1e-6, atol=1e-6)
    assert grad.shape == x.shape


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_outputs_that_are_inputs_are_not_copied():
    def fn(p, x):  # returns its weights, as a model call returns the model, and a constant
        return _mlp(p, x), p, 3

    q = quant.quantize(fn, quant.PtqProvider([RULE]))
    p, x = _params(), jax.random.normal(jax.random.key(1), (5, 8))
    with jax.disable_jit():
        *_, op_by_op = q(p, x)
    for _ in range(2):  # the first call compiles, the second replays
        y, back, three = q(p, x)
        assert back["l1"]["kernel"] is p["l1"]["kernel"] and back["l2"]["kernel"] is p["l2"]["kernel"]
        assert three == 3 and type(three) is type(op_by_op)
        np.testing.assert_allclose(np.asarray(y, np.float64), _reference(p, x), rtol=1e-4, atol=1e-4)
