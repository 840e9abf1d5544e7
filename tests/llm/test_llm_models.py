"""Every family against transformers: logits of the committed fixtures, and save_pretrained's round trip.

The fixtures (tests/llm/fixtures/<variant>/) are tiny random checkpoints written by
transformers itself with its float32 logits (make_fixtures.py, `nox -s fixtures_hf`), so
these tests need no torch.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from llm_testlib import FIXTURES, VARIANTS, forward, load, reference
from safetensors import safe_open

from cairn import llm, nn

FAMILIES = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text"}


def test_every_family_has_a_fixture():
    types = {json.loads((FIXTURES / v / "config.json").read_text())["model_type"] for v in VARIANTS}
    assert types == FAMILIES == set(llm.supported_model_types())


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(variant):
    ids, expected = reference(variant)
    got = np.asarray(forward(load(variant), ids))
    assert got.shape == expected.shape == (2, 12, load(variant).config.vocab_size)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def _tensors(directory):
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_pretrained_writes_the_same_tensors_and_config(variant, tmp_path):
    files = llm.save_pretrained(load(variant), tmp_path, max_shard_size="48KB")
    original, written = _tensors(FIXTURES / variant), _tensors(tmp_path)
    assert sorted(written) == sorted(original)
    for name, arr in original.items():
        assert written[name].dtype == arr.dtype and written[name].shape == arr.shape, name
        assert written[name].tobytes() == arr.tobytes(), name
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((FIXTURES / variant / "config.json").read_text())
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files and len(files) > 1
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in original.values())


def test_save_in_one_file_then_reload_gives_the_same_logits(tmp_path):
    model = load("qwen3")
    assert llm.save_pretrained(model, tmp_path) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
    ids, _ = reference("qwen3")
    np.testing.assert_array_equal(np.asarray(forward(llm.from_pretrained(tmp_path), ids)), np.asarray(forward(model, ids)))


def test_resave_replaces_the_earlier_shards(tmp_path):
    model = load("mistral")
    llm.save_pretrained(model, tmp_path, max_shard_size="20KB")
    llm.save_pretrained(model, tmp_path, max_shard_size=10**9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_bfloat16_load_casts_each_tensor_and_saves_bfloat16(tmp_path):
    model = llm.from_pretrained(FIXTURES / "llama", dtype=jnp.bfloat16)
    assert {str(v[...].dtype) for _, v in nn.state(model).flat_items()} == {"bfloat16"}
    ids, expected = reference("llama")
    got = np.asarray(forward(model, ids))
    assert got.dtype == np.float32
    # bfloat16 keeps ~3 significant digits: the logits stay close, not equal
    assert np.abs(got - expected).max() < 0.05 * np.abs(expected).max()
    llm.save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    saved = _tensors(tmp_path)
    assert {str(a.dtype) for a in saved.values()} == {"bfloat16"}
    original = _tensors(FIXTURES / "llama")
    for name, arr in original.items():  # each saved tensor is the float32 one rounded to bfloat16
        np.testing.assert_array_equal(saved[name], arr.astype(ml_dtypes.bfloat16))


def test_max_shard_size_spellings():
    from cairn.llm._hf_files import parse_size

    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("48KB") == 48_000
    assert parse_size(123) == 123
    for bad in ("", "-1GB", "five", 0, True):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)


@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_gradients_reach_every_parameter_and_match_finite_differences():
    """One definition trains: the loss's gradient (through cairn.kernels' attention with a
    window and soft caps) is nonzero for every parameter and its directional derivative
    equals a central difference."""
    cfg = llm.config_from_hf({"model_type": "gemma2", "vocab_size": 40, "hidden_size": 16, "intermediate_size": 24,
                              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "head_dim": 4, "sliding_window": 3, "attn_logit_softcapping": 2.0})
    model = llm.CausalLM(cfg, rngs=nn.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 8)), jnp.int32)

    def loss(m):
        logp = jax.nn.log_softmax(m(ids[:, :-1]))
        return -jnp.take_along_axis(logp, ids[:, 1:, None], -1).mean()

    _, grads = nn.jit(nn.value_and_grad(loss))(model)
    flat = dict(grads.flat_state())
    assert len(flat) == 24 and all(float(jnp.abs(g[...]).max()) > 0 for g in flat.values())
    rng = np.random.default_rng(1)
    params = nn.state(model).flat_state()
    direction = {p: rng.standard_normal(v[...].shape) for p, v in params.items()}
    norm = np.sqrt(sum(float((d * d).sum()) for d in direction.values()))
    direction = {p: (d / norm).astype(np.float32) for p, d in direction.items()}  # a unit step overall
    slope = sum(float(jnp.vdot(flat[p][...], d)) for p, d in direction.items())

    def at(step):
        moved = nn.clone(model)
        nn.update(moved, nn.State.from_flat({p: params[p][...] + step * d for p, d in direction.items()}))
        return float(nn.jit(loss)(moved))

    eps = 1e-2
    assert (at(eps) - at(-eps)) / (2 * eps) == pytest.approx(slope, rel=5e-3)


def test_astype_casts_every_parameter_and_keeps_the_original():
    half = llm.from_pretrained(FIXTURES / "llama", dtype=jnp.bfloat16)
    full = half.astype(jnp.float32)
    assert full.dtype == jnp.float32 and half.dtype == jnp.bfloat16
    h, f = nn.state(half).flat_state(), nn.state(full).flat_state()
    assert h.keys() == f.keys()
    for p in h:
        assert f[p][...].dtype == jnp.float32 and h[p][...].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(f[p][...]), np.asarray(h[p][...]).astype(np.float32))
    ids = np.asarray([[3, 9, 27, 4]], np.int32)
    np.testing.assert_array_equal(np.asarray(forward(full, ids)),
                                  np.asarray(forward(half.astype("float32"), ids)))
    with pytest.raises(ValueError, match="floating dtype"):
        half.astype(jnp.int32)


def test_two_models_of_one_config_have_equal_structures_and_share_compiled_programs():
    # the layers' initializers and dtypes are static parts of the structure: equal ones
    # mean nn.jit and generate compile once for every model of a config, not once per object
    a = llm.from_pretrained(FIXTURES / "llama")
    b = llm.from_pretrained(FIXTURES / "llama", dtype="float32")
    c = llm.CausalLM(a.config, dtype=np.float32, rngs=nn.Rngs(3))
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) == jax.tree_util.tree_structure(c)
    assert jax.tree_util.tree_structure(a.astype(jnp.bfloat16)) == jax.tree_util.tree_structure(
        llm.CausalLM(a.config, dtype=jnp.bfloat16, rngs=nn.Rngs(0)))
    traces = []

    @nn.jit
    def f(model, ids):
        traces.append(1)
        return model(ids)

    ids = jnp.zeros((1, 4), jnp.int32)
    for m in (a, b, c):
        f(m, ids)
    assert len(traces) == 1


@functools.partial(nn.jit, static_argnums=2)
def _window(model, ids, start):
    return model(ids, logits_start=start)


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_start_gives_transformers_logits_from_there(variant):
    """``logits_start=s``: the last layer queries and projects only from ``s`` (sliding windows,
    soft caps, sandwich and q/k norms, MoE and tied heads included); the logits there are
    transformers' and equal the full pass's."""
    ids, expected = reference(variant)
    model = load(variant)
    full = np.asarray(forward(model, ids))
    s = 1 + 4 * VARIANTS.index(variant) % 11  # one compiled start per variant, 1 to 11 over them
    got = np.asarray(_window(model, ids, s))
    assert got.shape == (2, 12 - s, model.config.vocab_size)
    np.testing.assert_allclose(got, expected[:, s:], rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    np.testing.assert_allclose(got, full[:, s:], rtol=1e-5, atol=1e-5 * np.abs(full).max())


@pytest.mark.slow  # two un-jitted gradients of a fixture model
def test_logits_start_on_packed_rows_and_its_gradient():
    """Packed segments (segment_ids, restarted positions) keep their own attention in the
    window; the gradient of a loss on the window equals the full pass's."""
    model = load("llama")
    ids = jnp.asarray(np.random.default_rng(0).integers(3, model.config.vocab_size, (2, 12)), jnp.int32)
    seg = jnp.asarray([[1] * 5 + [2] * 5 + [0] * 2, [1] * 12], jnp.int32)
    pos = jnp.asarray([list(range(5)) * 2 + [0, 0], list(range(12))], jnp.int32)
    full = model(ids, positions=pos, segment_ids=seg)
    got = model(ids, positions=pos, segment_ids=seg, logits_start=4)
    np.testing.assert_allclose(np.asarray(got), np.asarray(full[:, 4:]), rtol=1e-5, atol=1e-5)
    g_win = nn.grad(lambda m: jnp.sum(jax.nn.log_softmax(m(ids, logits_start=6))[..., 3]))(model)
    g_full = nn.grad(lambda m: jnp.sum(jax.nn.log_softmax(m(ids)[:, 6:])[..., 3]))(model)
    for a, b in zip(jax.tree.leaves(g_win), jax.tree.leaves(g_full)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_bad_logits_start_is_refused():
    model = load("llama")
    ids = jnp.zeros((1, 4), jnp.int32)
    for bad in (-1, 4, 2.0, True):
        with pytest.raises(ValueError, match=r"logits_start must be an int in \[0, 4\)"):
            model(ids, logits_start=bad)
    with pytest.raises(ValueError, match="logits_start is for a full pass"):
        model(ids, cache=model.init_cache(1, 8), logits_start=1)
    with pytest.raises(ValueError, match="return_aux_loss .* cannot be combined with logits_start"):
        load("qwen3_moe")(ids, logits_start=1, return_aux_loss=True)
