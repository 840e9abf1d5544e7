"""Bad input raises early, naming what was wrong.

- Layer constructors: a non-int, zero or negative size, a bad kernel size, stride or
  dilation, a rate outside [0, 1], heads that do not divide the features, a negative
  epsilon raise at construction (``TypeError`` for a wrong type, ``ValueError`` for a
  wrong value), and the message names the layer and the argument. Before, e.g.
  ``Linear(16.5, 8)`` and ``Conv(..., kernel_size=0)`` were accepted until the call.
- ``nn.update`` / ``nn.merge``: a state with the wrong shape or dtype for a variable
  raises naming the path and the expected and actual shape / dtype (before: accepted,
  failing later inside ``dot_general`` without a path). The idioms that legitimately
  change values keep working: mapped / stacked states under ``jax.vmap`` / ``lax.scan``,
  float casts in ``merge``, abstract (``ShapeDtypeStruct``) models, tracers under jit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import nn


def R():
    return nn.Rngs(0)


# (id, constructor, exception type, text the message must contain)
BAD_CONSTRUCTORS = [
    ("Linear-float-in", lambda: nn.Linear(16.5, 8, rngs=R()), TypeError, "Linear: in_features"),
    ("Linear-zero-out", lambda: nn.Linear(4, 0, rngs=R()), ValueError, "Linear: out_features"),
    ("Linear-str", lambda: nn.Linear("4", 2, rngs=R()), TypeError, "Linear: in_features"),
    ("Linear-bool", lambda: nn.Linear(True, 2, rngs=R()), TypeError, "Linear: in_features"),
    ("LinearGeneral-neg", lambda: nn.LinearGeneral(4, (2, -3), rngs=R()), ValueError,
     "LinearGeneral: out_features[1]"),
    ("LinearGeneral-float", lambda: nn.LinearGeneral(4.0, 3, rngs=R()), TypeError,
     "LinearGeneral: in_features"),
    ("Einsum-zero-kernel", lambda: nn.Einsum("bd,dh->bh", (4, 0), rngs=R()), ValueError,
     "Einsum: kernel_shape[1]"),
    ("Conv-kernel-0", lambda: nn.Conv(3, 4, kernel_size=0, rngs=R()), ValueError,
     "Conv: kernel_size[0]"),
    ("Conv-kernel-empty", lambda: nn.Conv(3, 4, kernel_size=(), rngs=R()), ValueError,
     "Conv: kernel_size"),
    ("Conv-kernel-float", lambda: nn.Conv(3, 4, kernel_size=(3, 2.5), rngs=R()), TypeError,
     "Conv: kernel_size[1]"),
    ("Conv-stride-0", lambda: nn.Conv(3, 4, (3, 3), strides=0, rngs=R()), ValueError,
     "Conv: strides[0]"),
    ("Conv-stride-rank", lambda: nn.Conv(3, 4, (3, 3), strides=(1, 1, 1), rngs=R()),
     ValueError, "Conv: strides"),
    ("Conv-dilation-neg", lambda: nn.Conv(3, 4, 3, kernel_dilation=-1, rngs=R()), ValueError,
     "Conv: kernel_dilation[0]"),
    ("Conv-input-dilation-0", lambda: nn.Conv(3, 4, 3, input_dilation=0, rngs=R()), ValueError,
     "Conv: input_dilation[0]"),
    ("Conv-float-features", lambda: nn.Conv(3.5, 4, 3, rngs=R()), TypeError, "Conv: in_features"),
    ("Conv-groups-0", lambda: nn.Conv(4, 4, 3, feature_group_count=0, rngs=R()), ValueError,
     "Conv: feature_group_count"),
    ("Conv-groups-divide", lambda: nn.Conv(4, 6, 3, feature_group_count=4, rngs=R()),
     ValueError, "feature_group_count"),
    ("Conv-padding-float", lambda: nn.Conv(3, 4, 3, padding=1.5, rngs=R()), TypeError,
     "Conv: cannot interpret padding"),
    ("ConvTranspose-kernel-0", lambda: nn.ConvTranspose(3, 4, (0, 2), rngs=R()), ValueError,
     "ConvTranspose: kernel_size[0]"),
    ("ConvTranspose-stride-0", lambda: nn.ConvTranspose(3, 4, 2, strides=0, rngs=R()),
     ValueError, "ConvTranspose: strides[0]"),
    ("ConvTranspose-out-0", lambda: nn.ConvTranspose(3, 0, 2, rngs=R()), ValueError,
     "ConvTranspose: out_features"),
    ("Embed-zero", lambda: nn.Embed(0, 4, rngs=R()), ValueError, "Embed: num_embeddings"),
    ("Embed-float", lambda: nn.Embed(10, 4.5, rngs=R()), TypeError, "Embed: features"),
    ("Dropout-rate-high", lambda: nn.Dropout(1.5), ValueError, "Dropout: rate"),
    ("Dropout-rate-neg", lambda: nn.Dropout(-0.1), ValueError, "Dropout: rate"),
    ("Dropout-rate-nan", lambda: nn.Dropout(float("nan")), ValueError, "Dropout: rate"),
    ("Dropout-rate-str", lambda: nn.Dropout("0.1"), TypeError, "Dropout: rate"),
    ("LayerNorm-zero", lambda: nn.LayerNorm(0, rngs=R()), ValueError, "LayerNorm: num_features"),
    ("LayerNorm-eps-neg", lambda: nn.LayerNorm(4, epsilon=-1e-5, rngs=R()), ValueError,
     "LayerNorm: epsilon"),
    ("RMSNorm-float", lambda: nn.RMSNorm(4.5, rngs=R()), TypeError, "RMSNorm: num_features"),
    ("RMSNorm-eps-str", lambda: nn.RMSNorm(4, epsilon="1e-6", rngs=R()), TypeError,
     "RMSNorm: epsilon"),
    ("GroupNorm-groups-0", lambda: nn.GroupNorm(4, num_groups=0, rngs=R()), ValueError,
     "GroupNorm: num_groups"),
    ("GroupNorm-divide", lambda: nn.GroupNorm(6, num_groups=4, rngs=R()), ValueError,
     "num_groups"),
    ("GroupNorm-group-size-float", lambda: nn.GroupNorm(4, None, group_size=2.0, rngs=R()),
     TypeError, "GroupNorm: group_size"),
    ("InstanceNorm-neg", lambda: nn.InstanceNorm(-2, rngs=R()), ValueError,
     "InstanceNorm: num_features"),
    ("BatchNorm-momentum", lambda: nn.BatchNorm(4, momentum=1.5, rngs=R()), ValueError,
     "BatchNorm: momentum"),
    ("BatchNorm-eps-inf", lambda: nn.BatchNorm(4, epsilon=float("inf"), rngs=R()), ValueError,
     "BatchNorm: epsilon"),
    ("MHA-heads-0", lambda: nn.MultiHeadAttention(0, 8, rngs=R()), ValueError,
     "MultiHeadAttention: num_heads"),
    ("MHA-heads-divide", lambda: nn.MultiHeadAttention(3, 8, rngs=R()), ValueError,
     "divisible by num_heads"),
    ("MHA-kv-heads-divide", lambda: nn.MultiHeadAttention(4, 8, num_kv_heads=3, rngs=R()),
     ValueError, "num_kv_heads"),
    ("MHA-in-float", lambda: nn.MultiHeadAttention(2, 8.0, rngs=R()), TypeError,
     "MultiHeadAttention: in_features"),
    ("MHA-qkv-0", lambda: nn.MultiHeadAttention(2, 8, qkv_features=0, rngs=R()), ValueError,
     "MultiHeadAttention: qkv_features"),
    ("MHA-dropout", lambda: nn.MultiHeadAttention(2, 8, dropout_rate=2.0, rngs=R()), ValueError,
     "MultiHeadAttention: dropout_rate"),
    ("MHA-rope-base", lambda: nn.MultiHeadAttention(2, 8, rope_base=0.0, rngs=R()), ValueError,
     "MultiHeadAttention: rope_base"),
    ("LSTMCell-hidden-0", lambda: nn.LSTMCell(3, 0, rngs=R()), ValueError,
     "LSTMCell: hidden_features"),
    ("GRUCell-float", lambda: nn.GRUCell(3.5, 4, rngs=R()), TypeError, "GRUCell: in_features"),
    ("SimpleCell-neg", lambda: nn.SimpleCell(3, -4, rngs=R()), ValueError,
     "SimpleCell: hidden_features"),
    ("RNN-unroll-0", lambda: nn.RNN(nn.SimpleCell(3, 4, rngs=R()), unroll=0), ValueError,
     "RNN: unroll"),
    ("LoRA-rank-0", lambda: nn.LoRA(4, 0, 4, rngs=R()), ValueError, "LoRA: lora_rank"),
    ("LoRA-alpha-str", lambda: nn.LoRA(4, 2, 4, alpha="2", rngs=R()), TypeError, "LoRA: alpha"),
    ("LoRALinear-rank-float", lambda: nn.LoRALinear(4, 4, lora_rank=1.5, rngs=R()), TypeError,
     "LoRA: lora_rank"),
    ("RotaryEmbedding-float", lambda: nn.RotaryEmbedding(8.0), TypeError,
     "RotaryEmbedding: head_dim"),
    ("RotaryEmbedding-base", lambda: nn.RotaryEmbedding(8, base=-1.0), ValueError,
     "RotaryEmbedding: base"),
    ("max_pool-window-0", lambda: nn.max_pool(jnp.ones((1, 4, 4, 1)), (0, 2)), ValueError,
     "max_pool: window_shape[0]"),
    ("avg_pool-window-float", lambda: nn.avg_pool(jnp.ones((1, 4, 1)), (2.5,)), TypeError,
     "avg_pool: window_shape[0]"),
    ("min_pool-stride-0", lambda: nn.min_pool(jnp.ones((1, 4, 1)), (2,), (0,)), ValueError,
     "min_pool: strides[0]"),
]


@pytest.mark.parametrize(
    "make,exc,text", [c[1:] for c in BAD_CONSTRUCTORS], ids=[c[0] for c in BAD_CONSTRUCTORS]
)
def test_bad_constructor_argument_raises_naming_it(make, exc, text):
    with pytest.raises(exc) as info:
        make()
    assert text in str(info.value), str(info.value)


def test_good_constructor_arguments_are_stored_as_python_ints():
    conv = nn.Conv(np.int64(3), 4, kernel_size=[3, np.int32(2)], strides=2, rngs=R())
    assert conv.kernel_size == (3, 2) and conv.strides == (2, 2)
    assert type(conv.in_features) is int and conv.kernel[...].shape == (3, 2, 3, 4)
    assert nn.Linear(np.int64(3), 2, rngs=R()).in_features == 3
    assert nn.Dropout(1).rate == 1.0 and nn.Dropout(0).rate == 0.0
    assert nn.LayerNorm(4, epsilon=0, rngs=R()).epsilon == 0.0
    assert nn.Einsum("bd,dh->bh", (4, 2), (), rngs=R()).bias[...].shape == ()


# --- update / merge ---


def _model():
    return nn.Sequential(nn.Linear(3, 4, rngs=nn.Rngs(0)), nn.Linear(4, 2, rngs=nn.Rngs(1)))


def _with(state, path, value):
    """A copy of ``state`` with the value at ``path`` (a tuple) replaced."""
    out = jax.tree.map(lambda x: x, state)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]].value = value
    return out


BAD_VALUES = [
    ("transposed-kernel", ("layers", 0, "kernel"), jnp.zeros((4, 3)), "shape", "(3, 4)", "(4, 3)"),
    ("short-bias", ("layers", 1, "bias"), jnp.zeros((3,)), "shape", "(2,)", "(3,)"),
    ("int-kernel", ("layers", 1, "kernel"), jnp.zeros((4, 2), jnp.int32), "dtype", "float32",
     "int32"),
    ("bool-bias", ("layers", 0, "bias"), np.zeros((4,), bool), "dtype", "float32", "bool"),
]


@pytest.mark.parametrize(
    "path,value,what,expected,got", [c[1:] for c in BAD_VALUES], ids=[c[0] for c in BAD_VALUES]
)
def test_update_rejects_wrong_shape_or_dtype_naming_the_path(path, value, what, expected, got):
    m = _model()
    before = nn.state(m)["layers"][0]["kernel"][...]
    bad = _with(nn.state(m), path, value)
    with pytest.raises(ValueError) as info:
        nn.update(m, bad)
    msg = str(info.value)
    assert "/".join(map(str, path)) in msg and what in msg, msg
    assert f"expected {expected}, got {got}" in msg, msg
    np.testing.assert_array_equal(nn.state(m)["layers"][0]["kernel"][...], before)


@pytest.mark.parametrize(
    "path,value,what,expected,got", [c[1:] for c in BAD_VALUES], ids=[c[0] for c in BAD_VALUES]
)
def test_merge_rejects_wrong_shape_or_dtype_naming_the_path(path, value, what, expected, got):
    m = _model()
    gd, st = nn.split(m)
    with pytest.raises(ValueError) as info:
        nn.merge(gd, _with(st, path, value))
    msg = str(info.value)
    assert "/".join(map(str, path)) in msg and f"expected {expected}, got {got}" in msg, msg


def test_merge_checks_under_jit_at_trace_time():
    gd, st = nn.split(_model())
    bad = _with(st, ("layers", 0, "kernel"), jnp.zeros((4, 3)))
    with pytest.raises(ValueError, match="layers/0/kernel"):
        jax.jit(lambda s: nn.merge(gd, s)(jnp.ones((1, 3))))(bad)


def test_update_and_merge_accept_the_legitimate_idioms():
    m = _model()
    x = jnp.ones((1, 3))
    gd, st = nn.split(m)
    # same shapes and dtypes, new values (eager and traced)
    new = jax.tree.map(lambda v: v + 1.0, st)
    nn.update(m, new)
    np.testing.assert_allclose(m(x), nn.merge(gd, new)(x))
    jax.jit(lambda s: nn.merge(gd, s)(x))(st)
    # stacked states: vmap / scan over a leading axis, and the stacked module itself
    stacked = jax.tree.map(lambda v: jnp.stack([v, 2 * v]), st)
    assert jax.vmap(lambda s: nn.merge(gd, s)(x))(stacked).shape == (2, 1, 2)
    _, ys = jax.lax.scan(lambda c, s: (c, nn.merge(gd, s)(x)), 0, stacked)
    assert ys.shape == (2, 1, 2)
    nn.merge(gd, stacked)
    # a float cast for inference
    bf16 = jax.tree.map(lambda v: v.astype(jnp.bfloat16), st)
    assert nn.merge(gd, bf16).layers[0].kernel[...].dtype == jnp.bfloat16
    # an abstract model gets real values
    abstract = nn.abstract_model(_model)
    nn.update(abstract, st)
    np.testing.assert_allclose(abstract(x), m(x))
    # update inside a jitted function (tracers: shapes are static)
    def step(model, d):
        nn.update(model, jax.tree.map(lambda v: v - d, nn.state(model, nn.Param)))
        return model(x)

    nn.jit(step)(m, 0.5)
