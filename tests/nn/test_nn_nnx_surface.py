"""The Flax NNX names added for issue 18: RNG helpers, views, display, Pytree/data,
Carry axes on scan, state functions, GraphDef as a jit static argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn import nn


class Block(nn.Module):
    def __init__(self, rngs):
        self.linear = nn.Linear(3, 3, rngs=rngs)
        self.drop = nn.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.linear(x))


# --- samplers ---


@pytest.mark.parametrize(
    "name,args",
    [
        ("normal", ((2, 3),)),
        ("uniform", ((4,),)),
        ("bernoulli", (0.3, (5,))),
        ("randint", ((3,), 0, 10)),
        ("truncated_normal", (-1.0, 1.0, (3,))),
        ("permutation", (6,)),
        ("categorical", (jnp.zeros((2, 4)),)),
        ("gumbel", ((2,),)),
    ],
)
def test_samplers_are_jax_random_with_the_next_key(name, args):
    rngs = nn.Rngs(3)
    got = getattr(rngs, name)(*args)
    key = jax.random.fold_in(jax.random.key(3), 0)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(getattr(jax.random, name)(key, *args)))
    assert int(rngs.default.count.value) == 1
    # the same methods on a stream
    s = nn.Rngs(params=3).params
    np.testing.assert_array_equal(np.asarray(getattr(s, name)(*args)), np.asarray(got))


def test_sampler_stream_keyword_and_stream_split_broadcast():
    rngs = nn.Rngs(0, noise=5)
    a = rngs.normal((2,), stream="noise")
    key = jax.random.fold_in(jax.random.key(5), 0)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(jax.random.normal(key, (2,))))
    assert rngs.noise.split(4).key.shape == (4,)
    b = rngs.noise.broadcast((2, 3))
    assert b.key.shape == (2, 3)
    kd = jax.random.key_data(b.key.value)
    assert (kd == kd[0, 0]).all()


# --- split_rngs / fork_rngs / reseed ---


@settings(max_examples=10, deadline=None)
@given(st.one_of(st.integers(1, 4), st.tuples(st.integers(1, 3), st.integers(1, 3))))
def test_split_rngs_shapes_and_restore(splits):
    rngs = nn.Rngs(params=0, dropout=1)
    key0 = jax.random.key_data(rngs.params.key.value)
    shape = (splits,) if isinstance(splits, int) else splits
    with nn.split_rngs(rngs, splits=splits, only="params") as backups:
        assert rngs.params.key.shape == shape
        assert rngs.params.count.value.shape == shape
        assert rngs.dropout.key.shape == ()
        assert len(backups) == 1
    assert rngs.params.key.shape == ()
    np.testing.assert_array_equal(jax.random.key_data(rngs.params.key.value), key0)
    assert int(rngs.params.count.value) == 1  # the split drew one key


def test_split_rngs_keys_are_split_of_next_key():
    rngs = nn.Rngs(7)
    nn.split_rngs(rngs, splits=3)
    want = jax.random.split(jax.random.fold_in(jax.random.key(7), 0), 3)
    np.testing.assert_array_equal(jax.random.key_data(rngs.default.key.value), jax.random.key_data(want))


def test_split_rngs_decorator_with_vmap_and_squeeze():
    @nn.split_rngs(splits=4)
    @nn.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return nn.Linear(2, 3, rngs=rngs)

    rngs = nn.Rngs(0)
    m = make(rngs)
    assert m.kernel.shape == (4, 2, 3)
    assert rngs.default.key.shape == ()
    k = m.kernel.value
    assert not np.allclose(k[0], k[1])
    r = nn.Rngs(0)
    nn.split_rngs(r, splits=1, squeeze=True)
    assert r.default.key.shape == ()
    with pytest.raises(ValueError, match="squeeze=True needs splits=1"):
        nn.split_rngs(r, splits=2, squeeze=True)


def test_fork_rngs_and_restore():
    model = Block(nn.Rngs(params=0, dropout=1))
    before = jax.random.key_data(model.drop.rngs.key.value)
    backups = nn.fork_rngs(model, split={"dropout": 3, ...: None})
    assert model.drop.rngs.key.shape == (3,)
    nn.restore_rngs(backups)
    np.testing.assert_array_equal(jax.random.key_data(model.drop.rngs.key.value), before)

    @nn.fork_rngs()
    def draw(rngs):
        return rngs.normal(())

    r = nn.Rngs(0)
    a, b = draw(r), draw(r)
    assert float(a) != float(b)


@pytest.mark.parametrize("graph,graph_updates", [(True, False), (False, True), (False, False)])
def test_split_and_fork_rngs_outside_full_graph_mode_return_copies(graph, graph_updates):
    rngs = nn.Rngs(params=0, dropout=1)
    key0 = np.asarray(jax.random.key_data(rngs.params.key.value))
    split = nn.split_rngs(rngs, splits=5, only="params", graph=graph, graph_updates=graph_updates)
    assert isinstance(split, nn.Rngs) and split is not rngs
    assert split.params.key.shape == (5,) and split.dropout.key.shape == ()
    # the copy's keys are jax.random.split of the stream's next key (fold_in of count 0)
    want = jax.random.split(jax.random.fold_in(jax.random.key(0), 0), 5)
    np.testing.assert_array_equal(jax.random.key_data(split.params.key.value), jax.random.key_data(want))
    # the caller's Rngs is untouched: key, shape and counter
    assert rngs.params.key.shape == () and int(rngs.params.count.value) == 0
    np.testing.assert_array_equal(jax.random.key_data(rngs.params.key.value), key0)
    forked = nn.fork_rngs(rngs, graph=graph, graph_updates=graph_updates)
    assert forked is not rngs and forked.params.key.shape == ()
    assert not np.array_equal(np.asarray(jax.random.key_data(forked.params.key.value)), key0)
    np.testing.assert_array_equal(jax.random.key_data(rngs.params.key.value), key0)

    # the decorator hands the function split copies and leaves the caller's Rngs alone
    @nn.split_rngs(splits=3, graph=graph, graph_updates=graph_updates)
    def shapes(r):
        return r.params.key.shape, r.dropout.key.shape

    assert shapes(rngs) == ((3,), (3,))
    assert rngs.params.key.shape == () and int(rngs.params.count.value) == 0


def test_reseed_repeats_dropout_and_policies():
    model = Block(nn.Rngs(params=0, dropout=1))
    x = jnp.ones((1, 3))
    y1 = model(x)
    y2 = model(x)
    nn.reseed(model, dropout=1)
    y3 = model(x)
    assert not np.allclose(y1, y2)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y3))
    r = nn.Rngs(dropout=0)
    nn.split_rngs(r, splits=2)
    with pytest.raises(ValueError, match="match_shape"):
        nn.reseed(r, dropout=3)
    nn.reseed(r, dropout=3, policy="match_shape")
    assert r.dropout.key.shape == (2,)
    with pytest.raises(ValueError, match="policy must be"):
        nn.reseed(r, dropout=3, policy="bogus")


# --- view / with_attributes / recursive_map ---


def test_view_shares_variables_and_errors():
    b = Block(nn.Rngs(0))
    ev = nn.view(b, deterministic=True)
    assert ev.drop.deterministic and not b.drop.deterministic
    assert ev.linear.kernel is b.linear.kernel
    b.linear.kernel.value = b.linear.kernel.value + 1  # seen through the view
    np.testing.assert_array_equal(np.asarray(ev.linear(jnp.ones((1, 3)))), np.asarray(b.linear(jnp.ones((1, 3)))))
    with pytest.raises(ValueError, match="use_running_average"):
        nn.view(b, use_running_average=True)
    nn.view(b, use_running_average=True, raise_if_not_found=False)
    only = nn.with_attributes(b, only=nn.Linear, deterministic=True, raise_if_not_found=False)
    assert not only.drop.deterministic
    with pytest.raises(TypeError, match="expected a module"):
        nn.view([b], deterministic=True)
    with pytest.raises(TypeError, match="only"):
        nn.view(b, only=3, deterministic=True)


def test_eval_train_modes():
    b = Block(nn.Rngs(0))
    assert b.eval() is b and b.drop.deterministic
    assert not b.train().drop.deterministic


def test_recursive_map_replaces_modules_bottom_up():
    m = nn.Sequential(nn.Linear(2, 2, rngs=nn.Rngs(0)), nn.Linear(2, 2, rngs=nn.Rngs(1)))

    def swap(path, x):
        if isinstance(x, nn.Linear):
            return nn.Sequential(x, nn.relu)
        return x

    new = nn.recursive_map(swap, m)
    assert isinstance(new.layers[0], nn.Sequential)
    assert isinstance(m.layers[0], nn.Linear)  # the original is unchanged
    assert new.layers[0].layers[0].kernel is m.layers[0].kernel
    out = new(jnp.ones((1, 2)))
    assert out.shape == (1, 2)


# --- display / Pytree / data / static ---


def test_display_prints_repr(capsys):
    m = nn.Linear(2, 3, rngs=nn.Rngs(0))
    nn.display(m, nn.state(m))
    out = capsys.readouterr().out
    assert out.startswith("Linear(") and "State(" in out


def test_pytree_data_static():
    class Counter(nn.Pytree):
        def __init__(self):
            self.count = nn.data(jnp.array(0))
            self.items = nn.data([jnp.ones(2), jnp.zeros(2)])
            self.name = nn.static("c")

    c = Counter()
    assert isinstance(c, nn.Module) and isinstance(c.count, jax.Array)
    leaves = jax.tree.leaves(c)
    assert len(leaves) == 3
    assert c.name == "c"
    with pytest.raises(TypeError, match="state, not static"):
        nn.static(jnp.ones(2))


# --- scan with Carry ---


def test_scan_in_axes_out_axes_forms():
    xs = jnp.arange(5.0)
    total = nn.scan(lambda c, x: c + x, in_axes=(nn.Carry, 0), out_axes=nn.Carry)(0.0, xs)
    assert float(total) == 10.0
    c, ys = nn.scan(lambda x, c, k: (c + x, x * k), in_axes=(0, nn.Carry, None))(xs, 1.0, 2.0)
    assert float(c) == 11.0
    np.testing.assert_array_equal(np.asarray(ys), np.asarray(xs * 2))
    ys = nn.scan(lambda x: x + 1, in_axes=(0,), out_axes=0)(xs)
    np.testing.assert_array_equal(np.asarray(ys), np.asarray(xs + 1))
    with pytest.raises(ValueError, match="nn.Carry, an int, None"):
        nn.scan(lambda c, x: (c, x), in_axes=(nn.Carry, "1"))
    with pytest.raises(ValueError, match="the other must also have Carry"):
        nn.scan(lambda c, x: c, in_axes=(nn.Carry, 0), out_axes=0)
    with pytest.raises(ValueError, match="multiple Carry"):
        nn.scan(lambda c, x: c, in_axes=(nn.Carry, nn.Carry), out_axes=nn.Carry)
    with pytest.raises(ValueError, match="Cannot broadcast output state"):
        nn.scan(lambda c, x: (c, x), in_axes=(nn.Carry, 0), out_axes=(nn.Carry, None))
    with pytest.raises(ValueError, match="entries for 2 arguments"):
        nn.scan(lambda c, x: c, in_axes=(nn.Carry, 0, 0), out_axes=nn.Carry)(0.0, xs)


def test_scan_over_stacked_modules_with_carry_first_module():
    @nn.split_rngs(splits=3)
    @nn.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return nn.Linear(2, 2, rngs=rngs)

    layers = make(nn.Rngs(0))
    fwd = nn.scan(lambda layer, x: layer(x), in_axes=(0, nn.Carry), out_axes=nn.Carry)
    y = fwd(layers, jnp.ones((1, 2)))
    ref = np.ones((1, 2), np.float64)
    for i in range(3):
        ref = ref @ np.asarray(layers.kernel.value[i], np.float64) + np.asarray(layers.bias.value[i], np.float64)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5)


# --- state functions, Variable.from_metadata, WithTag ---


def test_state_functions_and_from_metadata():
    m = Block(nn.Rngs(params=0, dropout=1))
    s = nn.state(m)
    doubled = nn.map_state(lambda p, v: v.value * 2 if p[-1] == "kernel" else v, s)
    np.testing.assert_array_equal(np.asarray(doubled["linear"]["kernel"].value), 2 * np.asarray(m.linear.kernel.value))
    params, rest = nn.split_state(s, nn.Param, ...)
    assert set(nn.merge_state(params, rest).flat_paths()) == set(s.flat_paths())
    assert nn.filter_state(s, nn.WithTag("dropout")).flat_paths() == ["drop/rngs/key", "drop/rngs/count"]
    v = nn.Param.from_metadata(jnp.ones(2), {"sharding_names": ("a",)})
    assert type(v) is nn.Param and v.sharding_names == ("a",)


def test_graphdef_is_a_static_argument_of_plain_jax_jit():
    m = nn.Linear(2, 3, rngs=nn.Rngs(0))
    gd, st_ = nn.split(m)
    gd2, _ = nn.split(nn.Linear(2, 3, rngs=nn.Rngs(1)))
    assert gd == gd2 and hash(gd) == hash(gd2)
    f = jax.jit(lambda g, s, x: nn.merge(g, s)(x), static_argnums=0)
    x = jnp.ones((1, 2))
    np.testing.assert_allclose(np.asarray(f(gd, st_, x)), np.asarray(m(x)), rtol=1e-6)
    assert f._cache_size() == 1
    f(gd2, st_, x)  # an equal GraphDef hits the same compiled program
    assert f._cache_size() == 1


def test_iter_graph_children_first_and_set_view_hook():
    m = nn.Sequential(nn.Linear(2, 2, rngs=nn.Rngs(0)), nn.Dropout(0.5))
    items = list(nn.iter_graph(m))
    paths = [p for p, _ in items]
    assert paths[-1] == () and items[-1][1] is m
    assert paths.index(("layers", 0, "kernel")) < paths.index(("layers", 0))
    kinds = {p: type(v).__name__ for p, v in items}
    assert kinds[("layers", 0, "kernel")] == "Param" and kinds[("layers", 1, "rate")] == "float"

    class Printer(nn.Module):
        def __init__(self):
            self.msg = None

        def set_view(self, msg=None):
            if msg is not None:
                self.msg = msg.upper()

    p = Printer()
    v = nn.view(p, msg="hi")
    assert v.msg == "HI" and p.msg is None
