"""The mixture-of-experts family (Qwen3-MoE): the sparse block against a float64 NumPy
reference, gradients into the router and every expert, the load-balancing loss, the
config keys that choose MoE layers, and per-expert tensors in the checkpoint.

Logits against transformers, the save round trip and cached decode run on the committed
``qwen3_moe`` fixture in test_llm_models.py and test_llm_cache.py.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from llm_testlib import FIXTURES, forward, load, reference
from safetensors.numpy import load_file, save_file

from cairn import llm, nn


def _config(**kw):
    d = {"model_type": "qwen3_moe", "vocab_size": 40, "hidden_size": 16, "intermediate_size": 24,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 12, "norm_topk_prob": True}
    return llm.config_from_hf({**d, **kw})


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _moe_reference(x, router, gate, up, down, k, norm):
    """float64, token by token: softmax router, top-k, optional renormalization, the
    weighted sum of the chosen experts' SwiGLU MLPs."""
    x = x.reshape(-1, x.shape[-1]).astype(np.float64)
    probs = _softmax(x @ router)
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        chosen = np.argsort(-probs[n], kind="stable")[:k]
        w = probs[n, chosen] / (probs[n, chosen].sum() if norm else 1.0)
        for wj, e in zip(w, chosen):
            g = x[n] @ gate[e]
            out[n] += wj * ((g / (1 + np.exp(-g)) * (x[n] @ up[e])) @ down[e])
    return out


def _weights(moe):
    return [np.asarray(a, np.float64) for a in (moe.router.kernel[...], moe.experts.gate[...],
                                                moe.experts.up[...], moe.experts.down[...])]


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.parametrize(("norm", "k", "skew"), [(True, 3, 0.0), (False, 2, 0.0), (True, 2, 8.0)])
def test_moe_block_equals_a_float64_reference(norm, k, skew):
    """Random tokens through one sparse block; ``skew`` pulls most tokens to expert 5, so
    several experts get no rows (empty groups of ragged_dot)."""
    cfg = _config(norm_topk_prob=norm, num_experts_per_tok=k)
    moe = llm.CausalLM(cfg, rngs=nn.Rngs(3)).layers[0].mlp
    moe.router.kernel[...] = moe.router.kernel[...] * 20 + skew * (jnp.arange(8) == 5)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 11, 16)), jnp.float32)
    y, router_logits = moe(x)
    want = _moe_reference(np.asarray(x), *_weights(moe), k, norm)
    assert y.shape == x.shape and router_logits.shape == (33, 8)
    np.testing.assert_allclose(np.asarray(y).reshape(33, 16), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(np.asarray(router_logits), np.asarray(x, np.float64).reshape(33, 16) @ _weights(moe)[0],
                               rtol=1e-5, atol=1e-5)


def test_layers_are_moe_by_decoder_sparse_step_and_mlp_only_layers():
    cfg = _config(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    model = llm.CausalLM(cfg, rngs=nn.Rngs(0))
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["MLP", "MoE", "MLP", "MLP", "MLP", "MoE"]
    assert not any(_config(num_experts=0).is_moe_layer(i) for i in range(2))


def test_expert_count_is_read_under_either_key_and_written_back_under_the_same():
    for key in ("num_experts", "num_local_experts"):
        d = {**json.loads(_config().hf), key: 6}
        d.pop("num_experts" if key == "num_local_experts" else "num_local_experts", None)
        cfg = llm.config_from_hf(d)
        assert cfg.num_experts == 6
        out = llm.config_to_hf(cfg)
        assert out[key] == 6 and ({"num_experts", "num_local_experts"} - {key}).isdisjoint(out)


@pytest.mark.parametrize(("kw", "match"), [({"num_experts_per_tok": 9}, "num_experts_per_tok"),
                                           ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
                                           ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
                                           ({"decoder_sparse_step": 0}, "decoder_sparse_step")])
def test_bad_expert_settings_are_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        _config(**kw)


@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_gradients_reach_the_router_and_every_expert_and_equal_a_dense_formulation():
    """The sparse block's gradients (sort, ragged_dot and scatter) equal those of the same
    function written densely (every expert on every token, weights zero off the top k)."""
    cfg = _config(num_experts_per_tok=2, norm_topk_prob=True)
    moe = llm.CausalLM(cfg, rngs=nn.Rngs(1)).layers[1].mlp
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 16, 16)), jnp.float32)
    target = jnp.asarray(np.random.default_rng(3).standard_normal((32, 16)), jnp.float32)

    def sparse(params):
        m = nn.clone(moe)
        nn.update(m, params)
        y, _ = m(x)
        return jnp.sum((y.reshape(32, 16) - target) ** 2)

    def dense(params):
        flat = {"/".join(map(str, p)): v[...] for p, v in params.flat_state().items()}
        r, g, u, d = (flat[n] for n in ("router/kernel", "experts/gate", "experts/up", "experts/down"))
        t = x.reshape(32, 16)
        probs = jax.nn.softmax(t @ r)
        top, idx = jax.lax.top_k(probs, 2)
        w = jnp.sum(jax.nn.one_hot(idx, 8) * (top / top.sum(-1, keepdims=True))[..., None], axis=1)  # [N, E]
        h = jax.nn.silu(jnp.einsum("nd,edm->nem", t, g)) * jnp.einsum("nd,edm->nem", t, u)
        y = jnp.einsum("nem,emd,ne->nd", h, d, w)
        return jnp.sum((y - target) ** 2)

    params = nn.state(moe)
    got, want = jax.grad(sparse)(params), jax.grad(dense)(params)
    for (p, g), (_, w) in zip(got.flat_state().items(), want.flat_state().items()):
        g, w = np.asarray(g[...]), np.asarray(w[...])
        assert np.abs(g).max() > 0, p
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5 * np.abs(w).max(), err_msg=str(p))
    gate_grad = np.asarray(dict(got.flat_state())[("experts", "gate")][...])
    assert (np.abs(gate_grad).reshape(8, -1).max(axis=1) > 0).all()  # every expert was chosen and learns


@pytest.mark.slow
def test_whole_model_gradients_reach_the_router_and_experts_of_every_moe_layer():
    cfg = _config(num_hidden_layers=3, mlp_only_layers=[1], num_experts=4, num_experts_per_tok=2)
    model = llm.CausalLM(cfg, rngs=nn.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 12)), jnp.int32)

    def loss(m):
        logits, aux = m(ids[:, :-1], return_aux_loss=True)
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, ids[:, 1:, None], -1).mean() + 0.01 * aux

    grads = dict(nn.jit(nn.grad(loss))(model).flat_state())
    for i in (0, 2):
        for name in ("router", "kernel"), ("experts", "gate"), ("experts", "up"), ("experts", "down"):
            g = np.asarray(grads[("layers", i, "mlp", *name)][...])
            assert np.abs(g).max() > 0, (i, name)
    assert all(float(jnp.abs(g[...]).max()) > 0 for g in grads.values())


def _aux_reference(router_logits, k, mask):
    e = router_logits[0].shape[-1]
    counts, prob_sum = np.zeros(e), np.zeros(e)
    for z in router_logits:
        p = _softmax(np.asarray(z, np.float64))
        for n in range(p.shape[0]):
            counts[np.argsort(-p[n])[:k]] += mask[n]
            prob_sum += mask[n] * p[n]
    rows = len(router_logits) * mask.sum()
    return e * np.sum(counts / rows * prob_sum / rows)


@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_load_balancing_loss_equals_its_formula_and_transformers():
    rng = np.random.default_rng(0)
    logits = [jnp.asarray(rng.standard_normal((10, 6)) * 2, jnp.float32) for _ in range(3)]
    mask = np.array([1, 1, 0, 1, 1, 1, 0, 0, 1, 1], np.float64)
    assert float(llm.load_balancing_loss(logits, 2, mask)) == pytest.approx(_aux_reference(logits, 2, mask), rel=1e-5)
    assert float(llm.load_balancing_loss(logits, 2)) == pytest.approx(_aux_reference(logits, 2, np.ones(10)), rel=1e-5)
    assert float(llm.load_balancing_loss([], 2)) == 0.0
    # transformers' aux_loss of the fixture (output_router_logits=True)
    ids, _ = reference("qwen3_moe")
    with np.load(FIXTURES / "qwen3_moe" / "reference.npz") as z:
        want = float(z["aux_loss"])
    logits, aux = nn.jit(lambda m, x: m(x, return_aux_loss=True))(load("qwen3_moe"), ids)
    assert float(aux) == pytest.approx(want, rel=1e-5)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(forward(load("qwen3_moe"), ids)))


@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_aux_loss_with_a_cache_ignores_the_padding():
    model = llm.CausalLM(_config(num_hidden_layers=1), rngs=nn.Rngs(0))
    ids = np.random.default_rng(0).integers(0, 40, (2, 6)).astype(np.int32)
    other = ids.copy()
    other[1, 3:] = (other[1, 3:] + 7) % 40  # different tokens in row 1's padding
    step = nn.jit(lambda m, t, c, n: m(t, cache=c, lengths=n, return_aux_loss=True))
    aux = [float(step(model, jnp.asarray(t), model.init_cache(2, 8), jnp.array([6, 3]))[2]) for t in (ids, other)]
    assert aux[0] == pytest.approx(aux[1], rel=1e-6)
    unmasked = float(step(model, jnp.asarray(other), model.init_cache(2, 8), jnp.array([6, 6]))[2])
    assert unmasked != pytest.approx(aux[1], rel=1e-6)
    dense = llm.CausalLM(_config(num_experts=0, num_hidden_layers=1), rngs=nn.Rngs(0))
    assert float(dense(jnp.asarray(ids), return_aux_loss=True)[1]) == 0.0


def test_experts_are_stacked_on_load_and_unstacked_on_save():
    """Expert ``e``'s ``[out, in]`` matrix is slice ``[e]`` of the model's ``[E, in, out]``
    kernel, and each is written back under its own name."""
    model = load("qwen3_moe")
    files = sorted(FIXTURES.joinpath("qwen3_moe").glob("*.safetensors"))
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    for e in range(4):
        for name, param in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            stacked = np.asarray(getattr(model.layers[2].mlp.experts, param)[...])
            np.testing.assert_array_equal(stacked[e], tensors[f"model.layers.2.mlp.experts.{e}.{name}.weight"].T)
    half = llm.from_pretrained(FIXTURES / "qwen3_moe", dtype=jnp.bfloat16)  # each expert cast as it is read
    got = np.asarray(half.layers[0].mlp.experts.down[...])
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got[3], tensors["model.layers.0.mlp.experts.3.down_proj.weight"].T.astype(jnp.bfloat16))
    assert type(model.layers[1].mlp).__name__ == "MLP"  # mlp_only_layers=[1]: dense names there
    assert "model.layers.1.mlp.gate_proj.weight" in tensors and "model.layers.1.mlp.gate.weight" not in tensors


def test_a_missing_expert_tensor_is_named(tmp_path):
    model = llm.CausalLM(_config(num_experts=3, num_experts_per_tok=2), rngs=nn.Rngs(0))
    llm.save_pretrained(model, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    tensors["model.layers.1.mlp.experts.3.up_proj.weight"] = np.zeros((12, 16), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(llm.CheckpointError, match=r"missing tensor\(s\): model\.layers\.1\.mlp\.experts\.2\.up_proj"
                       r"\.weight[\s\S]*unexpected tensor\(s\): model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        llm.from_pretrained(tmp_path)
