"""Modules, variables, containers: behaviour and error messages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import nn
from cairn.core_array import flatten_with_paths


class Lin(nn.Module):
    def __init__(self, din, dout, rngs, deterministic=False):
        self.kernel = nn.Param(jax.random.normal(rngs.params(), (din, dout)) / np.sqrt(din))
        self.bias = nn.Param(jnp.zeros((dout,)))
        self.deterministic = deterministic
        self.din, self.dout = din, dout

    def __call__(self, x):
        if x.shape[-1] != self.din:
            raise ValueError(f"Lin expects {self.din} features, got {x.shape}")
        return x @ self.kernel + self.bias


class Net(nn.Module):
    def __init__(self, rngs):
        self.layers = [Lin(2, 3, rngs), Lin(3, 1, rngs)]
        self.stats = nn.BatchStat(jnp.zeros(()))
        self.use_running_average = False

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        self.stats.value = self.stats.value + 1
        return x


def test_variable_arithmetic_and_access():
    w = nn.Param(jnp.arange(6.0).reshape(2, 3), tag="w")
    x = jnp.ones((4, 2))
    np.testing.assert_allclose(x @ w, x @ w.value)
    np.testing.assert_allclose(np.asarray(w + 1), np.arange(6.0).reshape(2, 3) + 1)
    np.testing.assert_allclose(np.asarray(2 * w), 2 * np.arange(6.0).reshape(2, 3))
    np.testing.assert_allclose(jnp.sum(w), 15.0)
    assert w.shape == (2, 3) and w.ndim == 2 and w.dtype == jnp.float32
    assert w[...] is w.value
    w[0, 0] = 10.0
    assert float(w.value[0, 0]) == 10.0
    w.value = jnp.zeros((2, 3))
    assert float(jnp.sum(w.value)) == 0.0
    assert w.tag == "w" and w.metadata == {"tag": "w"}
    with pytest.raises(AttributeError, match="no metadata"):
        _ = w.nonexistent
    with pytest.raises(TypeError, match="another Variable"):
        w.value = nn.Param(jnp.zeros(3))
    # NNX's accessor spelling reads and writes the same value
    w.set_value(jnp.ones((2, 3)))
    assert w.get_value() is w.value and float(jnp.sum(w.get_value())) == 6.0
    with pytest.raises(TypeError, match="another Variable"):
        w.set_value(nn.Param(jnp.zeros(3)))


def test_standalone_variable_pytree_path_is_value():
    v = nn.BatchStat(jnp.ones(2))
    assert list(flatten_with_paths(v)) == ["value"]
    v2 = jax.tree.map(lambda x: x * 2, v)
    assert type(v2) is nn.BatchStat and float(v2.value.sum()) == 4.0


def test_module_paths_have_no_value_suffix():
    m = Net(nn.Rngs(0))
    expected = ["layers/0/kernel", "layers/0/bias", "layers/1/kernel", "layers/1/bias", "stats"]
    assert list(flatten_with_paths(m)) == expected
    assert list(flatten_with_paths(nn.state(m))) == expected
    assert nn.state(m).flat_paths() == expected
    assert isinstance(m.layers, nn.List)


def test_module_is_pytree_roundtrip_with_jax_jit():
    m = Net(nn.Rngs(0))
    m2 = jax.jit(lambda m: m)(m)
    assert type(m2) is Net and m2 is not m
    for a, b in zip(jax.tree.leaves(m), jax.tree.leaves(m2)):
        np.testing.assert_array_equal(a, b)
    assert m2.layers[0].din == 2
    doubled = jax.tree.map(lambda x: 2 * x, m)
    np.testing.assert_allclose(doubled.layers[0].kernel.value, 2 * m.layers[0].kernel.value)


def test_train_eval_set_attributes():
    m = Net(nn.Rngs(0))
    m.eval()
    assert m.use_running_average is True
    assert all(layer.deterministic is True for layer in m.layers)
    m.train()
    assert m.use_running_average is False and m.layers[1].deterministic is False
    m.set_attributes(din=7, raise_if_not_found=False)
    assert m.layers[0].din == 7 and m.layers[1].din == 7
    m.set_attributes(Lin, deterministic=True)
    assert m.layers[0].deterministic is True
    with pytest.raises(AttributeError, match="nope"):
        m.set_attributes(nope=1)


def test_iter_modules_paths():
    m = Net(nn.Rngs(0))
    paths = [(p, type(mod).__name__) for p, mod in m.iter_modules()]
    assert paths == [("", "Net"), ("layers", "List"), ("layers/0", "Lin"), ("layers/1", "Lin")]
    assert [k for k, _ in m.iter_children()] == ["layers"]


def test_plain_array_attribute_is_data_and_containers_of_arrays_are_refused():
    m = Lin(2, 2, nn.Rngs(0))
    with pytest.raises(TypeError, match=r"Lin.kernel holds a Param; assign the array to Lin.kernel.value"):
        m.kernel = jnp.zeros((2, 2))
    m.extra = np.zeros(3)  # a plain array: data, a State entry at its path
    st = nn.state(m)
    assert isinstance(st["extra"], np.ndarray) and "extra" not in nn.state(m, nn.Param)
    with pytest.raises(ValueError, match="Found data on value of type 'tuple'.*nn.List"):
        m.extra2 = (jnp.zeros(3), 1)
    assert not hasattr(m, "extra2")  # the refused assignment left nothing behind


def test_shared_reference_kept_in_graph_mode_refused_in_tree_mode():
    rngs = nn.Rngs(0)
    layer = Lin(2, 2, rngs)

    class Tied(nn.Module):
        def __init__(self):
            self.a = layer
            self.b = nn.List([layer])

    t = Tied()
    gd, st = nn.split(t)
    assert st.flat_paths() == ["a/kernel", "a/bias"]  # held once, at the first path
    t2 = nn.merge(gd, st)
    assert t2.a is t2.b[0] and t2.a.kernel is st["a"]["kernel"]
    with pytest.raises(nn.SharedReferenceError, match=r"found at paths 'a' and 'b/0'"):
        nn.split(t, graph=False)

    class TiedVar(nn.Module):
        def __init__(self):
            self.w = nn.Param(jnp.ones(2))
            self.inner = Lin(2, 2, rngs)
            self.inner.kernel = self.w

    assert nn.state(TiedVar()).flat_paths() == ["w", "inner/bias"]
    with nn.set_graph_mode(False), pytest.raises(ValueError, match=r"'w' and 'inner/kernel'"):
        nn.state(TiedVar())


def test_list_dict_sequential():
    rngs = nn.Rngs(1)
    seq = nn.Sequential(Lin(2, 4, rngs), jax.nn.relu, Lin(4, 1, rngs))
    x = jnp.ones((5, 2))
    ref = jax.nn.relu(x @ seq.layers[0].kernel + seq.layers[0].bias) @ seq.layers[2].kernel + seq.layers[2].bias
    np.testing.assert_allclose(seq(x), ref, rtol=1e-6)
    assert nn.state(seq).flat_paths() == ["layers/0/kernel", "layers/0/bias", "layers/2/kernel", "layers/2/bias"]
    d = nn.Dict(enc=Lin(2, 2, rngs), dec=Lin(2, 2, rngs))
    assert d.enc is d["enc"] and set(d) == {"enc", "dec"}
    assert nn.state(d).flat_paths()[0] == "enc/kernel"
    d["extra"] = Lin(2, 1, rngs)
    assert "extra/kernel" in nn.state(d).flat_paths()
    with pytest.raises(TypeError, match="strings without '/'"):
        d["a/b"] = Lin(1, 1, rngs)
    lst = nn.List([Lin(1, 1, rngs)])
    lst.append(Lin(1, 2, rngs))
    assert nn.state(lst).flat_paths() == ["0/kernel", "0/bias", "1/kernel", "1/bias"]
    del lst[0]
    assert nn.state(lst).flat_paths() == ["0/kernel", "0/bias"]


def test_tuple_of_modules_is_a_subtree():
    rngs = nn.Rngs(0)

    class Pair(nn.Module):
        def __init__(self):
            self.pair = (Lin(1, 1, rngs), nn.Param(jnp.ones(2)))

    p = Pair()
    assert nn.state(p).flat_paths() == ["pair/0/kernel", "pair/0/bias", "pair/1"]
    assert list(flatten_with_paths(p)) == ["pair/0/kernel", "pair/0/bias", "pair/1"]
    p2 = nn.clone(p)
    assert p2.pair[0] is not p.pair[0] and isinstance(p2.pair[1], nn.Param)


def test_sow_and_perturb():
    class M(nn.Module):
        def __init__(self):
            self.w = nn.Param(jnp.array(2.0))

        def __call__(self, x):
            h = x * self.w
            self.sow(nn.Intermediate, "h", h)
            h = self.perturb("hp", h)
            return (h**2).sum()

    m = M()
    m(jnp.ones(3))
    m(jnp.ones(3))
    assert isinstance(m.h, nn.Intermediate) and len(m.h.value) == 2
    inter = nn.pop(m, nn.Intermediate)
    assert inter.flat_paths() == ["h", "hp"]  # Perturbation is an Intermediate
    assert not hasattr(m, "h")
    m(jnp.ones(3))
    grads = nn.grad(lambda m, x: m(x), wrt=nn.Perturbation)(m, jnp.ones(3))
    # d/dh sum(h^2) = 2h = 4
    np.testing.assert_allclose(grads["hp"].value, 4.0 * np.ones(3))


def test_repr_is_readable():
    r = repr(Net(nn.Rngs(0)))
    assert "Net(" in r and "kernel=Param(float32[2, 3])" in r and "0: Lin(" in r
    assert "layers/0/kernel" in repr(nn.state(Net(nn.Rngs(0))))


def test_rngs_streams_and_errors():
    rngs = nn.Rngs(params=0, dropout=1)
    a, b = rngs.params(), rngs.params()
    assert not np.array_equal(jax.random.key_data(a), jax.random.key_data(b))
    assert int(rngs.params.count.value) == 2
    np.testing.assert_array_equal(
        jax.random.key_data(a), jax.random.key_data(jax.random.fold_in(jax.random.key(0), 0))
    )
    assert rngs["dropout"] is rngs.dropout
    with pytest.raises(AttributeError, match=r"No RngStream named 'noise'.*streams: \['params', 'dropout'\]"):
        rngs.noise()
    with pytest.raises(AttributeError, match="No RngStream named 'noise'"):
        rngs["noise"]
    d = nn.Rngs(5)
    assert d.anything is d.default
    f = rngs.fork()
    assert set(f.streams()) == {"params", "dropout"} and f.params is not rngs.params
    s = rngs.split(4)
    assert s.dropout.key.value.shape == (4,)
    assert rngs.normal((3,), stream="params").shape == (3,)
    with pytest.raises(TypeError, match="int seed or a PRNG key"):
        nn.Rngs("seed")


def test_module_calls_open_named_scopes_while_tracing():
    # each submodule call is traced under jax.named_scope(<its path below the caller>), so
    # the program names the module every op came from (profiles, cairn.quant rules)
    class Block(nn.Module):
        def __init__(self, rngs):
            self.up = nn.Linear(4, 8, rngs=rngs)
            self.down = nn.Linear(8, 4, rngs=rngs)

        def __call__(self, x):
            h = self.up(x)
            return self.down(h * h)

    class Model(nn.Module):
        def __init__(self, rngs):
            self.blocks = [Block(rngs), Block(rngs)]

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    model = Model(nn.Rngs(0))
    jaxpr = jax.make_jaxpr(lambda m, x: m(x))(model, jnp.ones((2, 4)))
    scopes = {str(e.source_info.name_stack) for e in jaxpr.jaxpr.eqns}
    assert {"blocks/0/up", "blocks/0/down", "blocks/1/up", "blocks/1/down", "blocks/0", "blocks/1"} <= scopes
    lowered = nn.jit(lambda m, x: m(x)).lower(model, jnp.ones((2, 4))).as_text(debug_info=True)
    assert "blocks/1/down" in lowered
    # eager calls are unchanged (no scope machinery left behind)
    np.testing.assert_allclose(np.asarray(model(jnp.ones((2, 4)))), np.asarray(nn.jit(lambda m, x: m(x))(model, jnp.ones((2, 4)))), rtol=1e-6)
