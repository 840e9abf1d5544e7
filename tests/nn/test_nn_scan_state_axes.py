"""Issue 30, Flax NNX's own suite: per-variable axes in ``nn.scan`` (StateAxes, prefix
modules, a None argument holding Variables), StateAxes on a module a vmapped
``__init__`` fills, and the smaller surface fixes (``LoRA`` call arguments,
``State == dict``, ``with_partitioning(sharding=)``, ``nn.A``)."""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import nn


class Stack(nn.Module):
    def __init__(self, n: int):
        self.w = nn.Param(jnp.arange(n * 2, dtype=jnp.float32).reshape(n, 2))  # scanned
        self.scale = nn.BatchStat(jnp.float32(3.0))  # broadcast
        self.count = nn.Variable(jnp.int32(0))  # carried


AXES = nn.StateAxes({nn.Param: 0, nn.BatchStat: None, ...: nn.Carry})


def test_scan_state_axes_slices_broadcasts_and_carries():
    m = Stack(4)
    w0 = np.asarray(m.w[...], np.float64)

    @nn.scan(in_axes=(AXES, nn.Carry), out_axes=(nn.Carry, 0))
    def step(mod, h):
        assert mod.w.shape == (2,)
        y = h * mod.scale[...] + mod.w[...]
        mod.w[...] = mod.w[...] * 2.0  # scanned: comes back stacked
        mod.scale[...] = mod.scale[...] + 100.0  # broadcast: every step sees 3, not kept
        mod.count[...] = mod.count[...] + 1  # carried: threaded through the steps
        return y, y.sum()

    h, ys = step(m, jnp.ones(2, jnp.float32))
    ref_h, ref_ys = np.ones(2), []
    for row in w0:  # float64 reference loop
        ref_h = ref_h * 3.0 + row
        ref_ys.append(ref_h.sum())
    np.testing.assert_allclose(np.asarray(h), ref_h, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ys), ref_ys, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(m.w[...]), w0 * 2.0, rtol=1e-6)
    assert float(m.scale[...]) == 3.0
    assert int(m.count[...]) == 4


def test_scan_state_axes_on_an_axis_other_than_zero():
    m = Stack(3)
    m.w.value = jnp.asarray(m.w[...]).T  # (2, 3): scan along axis 1
    w0 = np.asarray(m.w[...])
    axes = nn.StateAxes({nn.Param: 1, ...: None})

    @nn.scan(in_axes=(axes, nn.Carry), out_axes=(nn.Carry, 0))
    def step(mod, h):
        mod.w[...] = mod.w[...] + 1.0
        return h + mod.w[...].sum(), mod.w[...]

    h, ys = step(m, jnp.float32(0.0))
    np.testing.assert_allclose(float(h), float((w0 + 1.0).sum()), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ys), (w0 + 1.0).T, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(m.w[...]), w0 + 1.0, rtol=1e-6)


def test_scan_prefix_module_axes():
    rngs = nn.Rngs(params=0, dropout=1).split({"params": 3}).broadcast({"dropout": 3})
    axes = nn.prefix(rngs, {...: 0})

    @nn.scan(in_axes=(axes,), out_axes=0)
    def draw(r):
        return r.params(), r.dropout()

    pk, dk = draw(rngs)
    assert pk.shape == (3,) and dk.shape == (3,)
    pd = np.asarray(jax.random.key_data(pk))
    dd = np.asarray(jax.random.key_data(dk))
    assert not np.array_equal(pd[0], pd[1]) and not np.array_equal(pd[1], pd[2])
    assert np.array_equal(dd[0], dd[1]) and np.array_equal(dd[1], dd[2])


def test_scan_none_argument_with_a_variable_is_threaded():
    v = nn.Variable(jnp.array(1))

    @nn.scan(in_axes=(None, nn.Carry, 0))
    def fn(var, carry, x):
        var[...] = var[...] + 1
        return carry + x, carry

    carry, ys = fn(v, jnp.array(0), jnp.arange(3))
    assert int(v[...]) == 4
    assert int(carry) == 3
    np.testing.assert_array_equal(np.asarray(ys), [0, 0, 1])


def test_scan_state_axes_errors():
    with pytest.raises(ValueError, match="Cannot broadcast output state. Got StateAxes"):
        nn.scan(lambda a, b: (a, b), in_axes=(nn.Carry, 0),
                out_axes=(nn.Carry, nn.StateAxes({...: None})))
    with pytest.raises(TypeError, match="is for a module argument"):
        nn.scan(lambda a, b: (a, b), in_axes=(nn.Carry, AXES))(jnp.zeros(()), jnp.zeros(3))
    m = Stack(2)

    @nn.scan(in_axes=(AXES, nn.Carry), out_axes=(nn.Carry, 0))
    def grows(mod, h):
        mod.extra = nn.Variable(h)  # `...` is carried: a new carried variable cannot be
        return h, h  # stacked over the steps

    with pytest.raises(ValueError, match="added the variable 'extra' to Stack with axis"):
        grows(m, jnp.float32(0.0))

    @nn.scan(in_axes=(AXES, nn.Carry), out_axes=(nn.Carry, 0))
    def removes(mod, h):
        del mod.extra_param
        return h, h

    m.extra_param = p = nn.Param(jnp.zeros(2))
    with pytest.raises(ValueError, match="structure of Stack changed in a step"):
        removes(m, jnp.float32(0.0))
    assert m.extra_param is p  # the failed scan left the caller's module as it was


def test_vmap_init_with_state_axes_stacks_only_the_mapped_variables():
    axes = nn.StateAxes({(nn.Param, nn.RngState): 0, ...: None})

    class Block(nn.Module):
        @nn.split_rngs(splits=5)
        @nn.vmap(in_axes=(axes, axes))
        def __init__(self, rngs: nn.Rngs):
            self.linear = nn.Linear(3, 3, rngs=rngs)
            self.node = nn.Variable(jnp.ones((2,)))

        @nn.scan(in_axes=(axes, nn.Carry), out_axes=nn.Carry)
        def __call__(self, x):
            return nn.gelu(self.linear(x))

    b = Block(rngs=nn.Rngs(0))
    assert b.linear.kernel.shape == (5, 3, 3) and b.linear.bias.shape == (5, 3)
    assert b.node.shape == (2,)
    x = np.ones((1, 3), np.float64)
    y = b(jnp.ones((1, 3)))
    k, bias = np.asarray(b.linear.kernel[...], np.float64), np.asarray(b.linear.bias[...], np.float64)
    for i in range(5):  # float64 reference: tanh-approximate gelu, as nn.gelu's default
        z = x @ k[i] + bias[i]
        x = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))
    np.testing.assert_allclose(np.asarray(y), x, rtol=2e-5, atol=1e-6)
    with pytest.raises(ValueError, match="matches none of the filters"):
        nn.vmap(lambda m: None, in_axes=(nn.StateAxes({nn.BatchStat: 0}),))(b)


class Base(nn.Module):
    def __call__(self, x, w):
        return x @ w


def test_lora_passes_call_arguments_to_its_base_module():
    lora = nn.LoRA(3, 2, 4, base_module=Base(), rngs=nn.Rngs(0))
    lora.lora_b.value = jnp.ones((2, 4))
    x = jax.random.normal(jax.random.key(1), (2, 3))
    w = jnp.arange(12.0).reshape(3, 4) / 10
    y = lora(x, w=w)
    xa, a, b = (np.asarray(t, np.float64) for t in (x, lora.lora_a[...], lora.lora_b[...]))
    np.testing.assert_allclose(np.asarray(y), xa @ a @ b + xa @ np.asarray(w), rtol=1e-5, atol=1e-6)
    plain = nn.LoRA(3, 2, 4, rngs=nn.Rngs(0))
    assert plain(x, w=None).shape == (2, 4)  # None arguments are fine with no base module
    with pytest.raises(TypeError, match="passed to base_module, but this LoRA has none"):
        plain(x, w)


def test_state_compares_with_a_dict():
    m = nn.LoRA(3, 2, 4, rngs=nn.Rngs(0))
    _, lora, params = nn.split(m, nn.LoRAParam, nn.Param)
    assert params == {}
    assert not (lora == {})
    v = nn.Param(jnp.float32(2.0))
    assert nn.State({"a": v}) == {"a": v}
    assert not (nn.State({"a": v}) == {"a": 1.0})  # not a mapping of Variables
    assert nn.State({}) != 3


def test_with_partitioning_takes_flax_sharding_keyword():
    init = nn.initializers.zeros
    a = nn.with_partitioning(init, ("embed", None))
    b = nn.with_partitioning(init, sharding=("embed", None))
    key = jax.random.key(0)
    assert nn.Param(a(key, (2, 3))).sharding_names == nn.Param(b(key, (2, 3))).sharding_names
    assert nn.Param(b(key, (2, 3))).sharding_names == ("embed", None)
    with pytest.raises(TypeError, match="give the axis names once"):
        nn.with_partitioning(init)
    with pytest.raises(TypeError, match="give the axis names once"):
        nn.with_partitioning(init, ("a",), sharding=("a",))


def test_a_is_a_type_variable_for_generic_variables():
    assert isinstance(nn.A, typing.TypeVar)

    class Broadcast(nn.Variable[nn.A]):
        pass

    v = Broadcast(jnp.ones(2))
    assert isinstance(v, nn.Variable) and v.shape == (2,)


def test_scan_in_axes_pytree_prefix_for_a_plain_argument():
    def step(carry, x):
        carry = carry + x["a"] * x["b"]
        return carry, carry

    xs = {"a": jnp.arange(4.0), "b": jnp.array(2.0)}  # "a" scanned, "b" broadcast
    total, partial = nn.scan(step, in_axes=(nn.Carry, {"a": 0, "b": None}),
                             out_axes=(nn.Carry, 0))(jnp.array(1.0), xs)
    np.testing.assert_allclose(partial, 1.0 + 2.0 * np.cumsum(np.arange(4.0)))
    assert float(total) == 1.0 + 2.0 * 6.0
    with pytest.raises(ValueError, match="nn.Carry is a whole argument"):
        nn.scan(step, in_axes=(nn.Carry, {"a": nn.Carry}), out_axes=(nn.Carry, 0))


def test_scan_step_may_sow_into_a_module_with_state_axes():
    class Acc(nn.Module):
        def __init__(self):
            self.w = nn.Param(jnp.arange(3.0) + 1.0)

    axes = nn.StateAxes({(nn.Param, nn.Intermediate): 0, ...: None})

    def step(m, c, x):
        c = c + x * m.w.value
        m.sow(nn.Intermediate, "trace", c)
        return c, None

    m = Acc()
    xs = np.arange(6.0, dtype=np.float32).reshape(3, 2)  # 3 steps of 2 features each
    m.w.value = jnp.arange(6.0).reshape(3, 2)  # one weight row per step
    c, _ = nn.scan(step, in_axes=(axes, nn.Carry, 0), out_axes=(nn.Carry, 0))(m, jnp.zeros(2), xs)
    partial = np.cumsum(xs * np.arange(6.0).reshape(3, 2), axis=0)
    np.testing.assert_allclose(c, partial[-1])
    # the sown value of each step, stacked along the scanned axis (a tuple per sow)
    np.testing.assert_allclose(m.trace.value[0], partial)
    # a variable added with a carried axis cannot be stacked: a clear error
    bad = nn.StateAxes({nn.Param: 0, ...: nn.Carry})
    with pytest.raises(ValueError, match="added the variable"):
        nn.scan(step, in_axes=(bad, nn.Carry, 0), out_axes=(nn.Carry, 0))(Acc2(), jnp.zeros(2), xs)


class Acc2(nn.Module):
    def __init__(self):
        self.w = nn.Param(jnp.ones((3, 2)))


def test_state_axes_map_prefix_gives_the_first_matching_filters_axis():
    axes = nn.StateAxes({nn.BatchStat: None, nn.Param: 0, ...: 1})
    assert axes.map_prefix(("layer", "kernel"), nn.Param(jnp.ones(2))) == 0
    assert axes.map_prefix(("bn", "mean"), nn.BatchStat(jnp.ones(2))) is None
    assert axes.map_prefix(("count",), nn.Variable(jnp.ones(()))) == 1  # the catch-all
    only = nn.StateAxes({nn.Param: 0})
    with pytest.raises(ValueError, match=r"StateAxes: 'bn/mean' matches none of the filters"):
        only.map_prefix(("bn", "mean"), nn.BatchStat(jnp.ones(2)))
