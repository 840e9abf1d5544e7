"""Plain data attributes (arrays, ``nn.data`` values) of modules, States with plain
leaves, and the tree helpers ``as_pure`` / ``restore_int_paths`` / ``find_duplicates``
/ ``to_tree`` / ``from_tree`` (issue 30)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from cairn import nn


class Scaled(nn.Module):
    """y = (x @ w) * scale + count, with ``scale`` and ``count`` plain arrays."""

    def __init__(self):
        self.w = nn.Param(jnp.arange(6.0).reshape(2, 3) / 10)
        self.scale = jnp.array(2.0)
        self.count = jnp.array(0)
        self.name = "s"

    def __call__(self, x):
        self.count = self.count + 1
        return (x @ self.w[...]) * self.scale


def test_array_attribute_is_a_plain_leaf_of_state_and_pytree():
    m = Scaled()
    gd, st = nn.split(m)
    assert sorted(st.flat_paths()) == ["count", "scale", "w"]
    assert isinstance(st["scale"], jax.Array) and not isinstance(st["scale"], nn.Variable)
    assert isinstance(st["w"], nn.Param)
    assert nn.state(m, nn.Param).flat_paths() == ["w"]  # optimizer / checkpoint filters
    assert sorted(nn.state(m, jax.Array).flat_paths()) == ["count", "scale"]
    assert len(jax.tree.leaves(m)) == 3
    m2 = nn.merge(gd, st)
    assert type(m2.scale) is type(m.scale) and float(m2.scale) == 2.0 and m2.name == "s"
    assert m2.w is m.w  # merge reuses the State's Variable objects


def test_update_writes_plain_values_and_jit_writes_back_a_data_attribute():
    m = Scaled()
    nn.update(m, nn.State({"scale": jnp.array(3.0)}))
    assert float(m.scale) == 3.0
    x = jnp.ones((4, 2))

    @nn.jit
    def f(m, x):
        return m(x)

    y1 = f(m, x)
    y2 = f(m, x)
    w = np.arange(6.0).reshape(2, 3) / 10
    np.testing.assert_allclose(np.asarray(y2), (np.ones((4, 2)) @ w) * 3.0, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    assert int(m.count) == 2  # the in-function `self.count + 1` came back twice


def test_grad_flows_through_a_data_attribute_like_jax():
    m = Scaled()
    x = jnp.ones((1, 2))

    def loss(m):
        return jnp.sum((x @ m.w[...]) * m.scale)

    g = nn.grad(loss)(m)  # gradient w.r.t. the Params only (Flax's default wrt)
    ref = jax.grad(lambda w: jnp.sum((x @ w) * 2.0))(m.w[...])
    np.testing.assert_allclose(np.asarray(g["w"][...]), np.asarray(ref), rtol=1e-6)
    # a hand-written functional form differentiates the data leaf too
    gd, params, rest = nn.split(m, nn.Param, ...)
    gs = jax.grad(lambda r: loss(nn.merge(gd, params, r)), allow_int=True)(rest)
    np.testing.assert_allclose(float(gs["scale"]), float(jnp.sum(x @ m.w[...])), rtol=1e-6)


def test_data_in_list_and_dict_containers_and_scan_carry():
    ls = nn.List([jnp.array(1), jnp.array(2), 3])
    assert [int(v) for v in jax.tree.leaves(ls)] == [1, 2]
    d = nn.Dict(a=jnp.ones(2), b="x")
    assert nn.state(d).flat_paths() == ["a"]

    class Acc(nn.Module):
        def __init__(self):
            self.total = jnp.array(0.0)

    def step(acc, x):
        acc.total = acc.total + x
        return acc, acc.total

    acc = Acc()
    _, ys = nn.scan(step, in_axes=(nn.Carry, 0), out_axes=(nn.Carry, 0))(
        acc, jnp.arange(4.0)
    )
    np.testing.assert_allclose(np.asarray(ys), np.cumsum(np.arange(4.0)))
    assert float(acc.total) == 6.0


def test_data_marks_and_static_validation():
    class Foo(nn.Pytree):
        def __init__(self, a, b, c):
            self.a = nn.data(a)
            self.b = nn.static(b)
            self.c = c

    foo = Foo(1, 2, jnp.array(3))
    assert len(jax.tree.leaves(foo)) == 2
    foo.a = nn.static(3)
    assert len(jax.tree.leaves(foo)) == 1
    foo.b = nn.data(4)
    assert len(jax.tree.leaves(foo)) == 2
    with pytest.raises(ValueError, match="Found data on value of type 'list'"):
        foo.a = ["hi", jnp.array(6)]
    with pytest.raises(ValueError, match="Found data in value of type"):
        foo.b = nn.static(jnp.array(4))
    # marks survive split / merge
    gd, st = nn.split(foo)
    assert jax.tree.leaves(nn.merge(gd, st)) == jax.tree.leaves(foo)

    class Late(nn.Module):
        def __init__(self):
            self.ls = []
            self.ls.append(jnp.array(1))

    with pytest.raises(ValueError, match="Found unexpected data on value of type 'list'"):
        Late()


def test_annotations_and_registered_data_types():
    @dataclasses.dataclass
    class Foo(nn.Pytree):
        a: nn.Data[int]
        b: nn.Static[int]
        c: jax.Array

    foo = Foo(a=1, b=2, c=jnp.array(3))
    assert len(jax.tree.leaves(foo)) == 2
    foo.a = nn.static(3)  # an explicit status overrides the annotation
    assert len(jax.tree.leaves(foo)) == 1
    with pytest.raises(ValueError, match="Found data on value of type 'list'"):
        foo.a = ["hi", jnp.array(6)]
    foo.c = nn.static(5)
    with pytest.raises(ValueError, match="Cannot assign data value of type 'ArrayImpl'"):
        foo.c = jnp.array(1)

    @nn.register_data_type
    @dataclasses.dataclass(frozen=True)
    class Box:
        v: int

    class Holder(nn.Pytree):
        def __init__(self):
            self.x = Box(1)

    h = Holder()
    assert nn.is_data(h.x) and nn.is_data(jnp.ones(1)) and not nn.is_data(1)
    assert nn.state(h)["x"] == Box(1)
    assert nn.has_data([1, jnp.ones(1), "s"])[0].shape == (1,)


def test_state_with_plain_leaves():
    st = nn.State({"kernel": P("a", None), "n": 3, "sub": {"w": nn.Param(jnp.ones(2))}})
    assert st.kernel == P("a", None) and st["n"] == 3
    st["n"] = 4
    assert st.n == 4
    leaves = jax.tree.leaves(st)
    assert len(leaves) == 3 and any(type(x) is int and x == 4 for x in leaves)  # the int itself
    st2 = jax.tree.map(lambda x: x, st)
    assert st2["n"] == 4 and isinstance(st2["sub"]["w"], nn.Param)
    assert nn.to_pure_dict(st)["n"] == 4
    node = {"a": {"c": nn.Param(jnp.array(2)), "d": 3}}
    nn.update(node, {"a": {"c": jnp.array(10)}})  # a plain value updates a Variable
    assert int(node["a"]["c"][...]) == 10 and node["a"]["d"] == 3


def test_as_pure_restore_int_paths_find_duplicates_to_from_tree():
    m = nn.Linear(2, 3, rngs=nn.Rngs(0))
    pure = nn.as_pure(nn.state(m))
    assert jax.tree.map(jnp.shape, pure.to_pure_dict()) == {"kernel": (2, 3), "bias": (3,)}
    assert not any(isinstance(v, nn.Variable) for v in pure.flat_state().values())
    assert nn.restore_int_paths({"0": {"a": 1}, "x": {"1": 2}}) == {0: {"a": 1}, "x": {1: 2}}
    with pytest.raises(TypeError, match="expected a mapping"):
        nn.restore_int_paths([1])

    class Shared(nn.Module):
        def __init__(self, rngs):
            self.a = nn.Linear(1, 1, rngs=rngs)
            self.b = nn.Linear(1, 1, rngs=rngs)
            self.c = self.a

    assert nn.find_duplicates(Shared(nn.Rngs(0))) == [[("a",), ("c",)]]
    assert nn.find_duplicates(m) == []
    tree = nn.to_tree((m, 1, {"b": m}), prefix=(0, None, 0))
    assert isinstance(tree[0], nn.NodeStates) and tree[0] is tree[2]["b"]
    back = nn.from_tree(tree)
    assert back[0] is back[2]["b"] and back[1] == 1
    np.testing.assert_array_equal(np.asarray(back[0].kernel[...]), np.asarray(m.kernel[...]))
    with pytest.raises(ValueError, match="Inconsistent aliasing detected"):
        nn.to_tree((m, 1, {"b": m}), prefix=(0, None, 1))


def test_pytree_root_leaves_are_state_updated_and_popped_in_place():
    node = {"a": {"b": 1, "c": nn.Param(jnp.array(2)), "d": 3}}
    nn.update(node, {"a": {"b": 4, "c": jnp.array(10)}})
    assert node["a"]["b"] == 4 and int(node["a"]["c"][...]) == 10 and node["a"]["d"] == 3
    node = {"a": {"b": jnp.array(1), "c": nn.Param(jnp.array(2)), "d": jnp.array(3.0)}}
    popped = nn.pop(node, (nn.Param, lambda _, x: x < 2))
    assert sorted(popped.flat_paths()) == ["a/b", "a/c"]
    assert list(node["a"]) == ["d"] and len(jax.tree.leaves(popped)) == 2
    ls = [jnp.array(0), jnp.array(5), jnp.array(1)]
    nn.pop(ls, lambda _, x: x < 2)  # two list items: removed last first
    assert [int(x) for x in ls] == [5]


def test_flatten_unflatten_of_pytrees_and_leaves():
    import collections

    x = jnp.array(1.0)
    gd, fs = nn.flatten(x)
    assert fs[0][1] is x and nn.unflatten(gd, fs) is x
    Point = collections.namedtuple("Point", ["y", "x"])
    gd, fs = nn.flatten(Point(y=nn.Param(jnp.array(1.0)), x=nn.Param(jnp.array(2.0))))
    assert [p for p, _ in fs] == [("x",), ("y",)]  # sorted by path
    g2 = nn.unflatten(gd, fs)
    assert isinstance(g2, Point) and float(g2.y[...]) == 1.0
    gd, fs = nn.flatten({"b": [nn.Param(jnp.array(1)), jnp.array(2)], "a": (nn.Param(jnp.array(3)), 4)})
    assert [p for p, _ in fs] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)] and fs[1][1] == 4
    back = nn.unflatten(gd, fs)
    assert back["a"][1] == 4 and int(back["b"][0][...]) == 1
    m = Scaled()
    gd, fs = nn.flatten(m)
    assert {p: type(v) for p, v in fs}[("scale",)] is type(m.scale)  # the plain value
    assert float(nn.unflatten(gd, fs).scale) == 2.0


def test_optimizer_trains_plain_array_attributes_and_returns_a_state_of_updates():
    class Model(nn.Module):
        def __init__(self):
            self.w = jnp.full((2,), 1.0)
            self.count = jnp.array(0)

    m = Model()
    opt = nn.Optimizer(m, _Sgd(0.5), wrt=lambda path, x: path[-1] == "w")
    grads = nn.State({"w": jnp.array([1.0, -2.0])})
    updates = opt.update(m, grads)
    np.testing.assert_allclose(np.asarray(m.w), [0.5, 2.0])  # w - 0.5 * g, by hand
    assert isinstance(updates, nn.State) and updates.flat_paths() == ["w"]
    np.testing.assert_allclose(np.asarray(updates["w"]), [-0.5, 1.0])
    assert int(m.count) == 0 and int(opt.step[...]) == 1


def test_deleting_the_last_entry_of_a_nested_view_keeps_it_empty():
    st = nn.State({"a": nn.Param(jnp.array(1)), "b": {"c": nn.Param(jnp.array(2))}})
    del st["b"]["c"]
    assert "b" in st and "c" not in st["b"] and len(jax.tree.leaves(st)) == 1


class _Sgd:
    """Plain SGD in Optax's init / update protocol (the reference of the test above)."""

    def __init__(self, lr):
        self.lr = lr

    def init(self, params):
        return ()

    def update(self, grads, state, params=None):
        return jax.tree.map(lambda g: -self.lr * g, grads), state


def test_get_value_and_set_value_overrides_route_item_access():
    class Shifted(nn.Param):
        def get_value(self, **kwargs):
            return super().get_value(**kwargs) + 3

    class Boxed(nn.Param):
        def set_value(self, value, **kwargs):
            super().set_value(value + 7, **kwargs)

    assert int(Shifted(jnp.array(1))[...]) == 4
    b = Boxed(jnp.array(1))
    b[...] = 5
    assert int(b.get_raw_value()) == 12 and int(b[...]) == 12
    v = Boxed(jnp.zeros(3))
    v[1] = 1.0  # an index write goes through set_value too: +7 on every element
    np.testing.assert_array_equal(np.asarray(v.raw_value), [7.0, 8.0, 7.0])
    assert int(nn.Param(jnp.array(1))[...]) == 1  # the base class reads directly


def test_pytree_false_class_is_a_jax_leaf_and_refused_in_tree_mode():
    class Opaque(nn.Pytree, pytree=False):
        def __init__(self):
            self.x = 1
            self.w = nn.Param(jnp.ones(2))

    o = Opaque()
    assert jax.tree.leaves(o) == [o]  # not a JAX pytree
    assert nn.state(o).flat_paths() == ["w"]  # the graph functions still see its state
    with pytest.raises(ValueError, match=r"pytree=False.*Found at path \(0,\)"):
        nn.flatten([o], graph=False)
    with pytest.raises(ValueError, match="pytree=False"):
        list(nn.iter_children(o, graph=False))
    assert [p for p, _ in nn.flatten([o])[1]] == [(0, "w")]  # graph mode walks it


def test_list_slices_are_plain_lists_and_slice_assignment_checks_items():
    ls = nn.List([1, 2, 3, 4])
    ls[1:3] = [6, 7]
    assert ls[1:3] == [6, 7] and type(ls[1:3]) is list and len(ls) == 4
    with pytest.raises(ValueError, match="Found data on value of type 'tuple'"):
        ls[0:1] = [(jnp.ones(1), 1)]


def test_optimizer_takes_the_module_of_gradients_jax_grad_returns():
    model = nn.Linear(4, 2, rngs=nn.Rngs(0))
    opt = nn.Optimizer(model, _Sgd(0.1), wrt=nn.Param)
    k0 = np.asarray(model.kernel[...])
    grads = jax.grad(lambda m, x: jnp.sum(m(x)))(model, jnp.ones(4))
    assert isinstance(grads, nn.Linear)
    opt.update(model, grads)
    # d/dW sum(x @ W + b) = x[:, None] broadcast: every entry of the kernel's gradient is 1
    np.testing.assert_allclose(np.asarray(model.kernel[...]), k0 - 0.1, rtol=1e-6)


def test_merge_of_plain_values_rebuilds_the_graphs_variables():
    m = Scaled()
    gd, st = nn.split(m)
    pure = nn.to_pure_dict(st)
    m2 = nn.merge(gd, pure)
    assert type(m2.w) is nn.Param and m2.w is not m.w  # a new Param of the graph's type
    np.testing.assert_array_equal(np.asarray(m2.w[...]), np.asarray(m.w[...]))
    assert isinstance(m2.scale, jax.Array)  # a data slot keeps the plain value


_SHARD_MAP_STATE_SPECS = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from cairn import nn
assert jax.device_count() == 4, jax.devices()
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("a",))
m = nn.Linear(16, 32, rngs=nn.Rngs(0))
graphdef, s = nn.split(m)
specs = nn.State({"kernel": P(None, "a"), "bias": P()})  # a State of plain specs

@nn.shard_map(mesh=mesh, in_specs=(specs,), out_specs=P(None, "a"))
def f(s):
    local = nn.merge(graphdef, s)  # the shard's shape: (16, 8), not the graph's (16, 32)
    assert local.kernel.shape == (16, 8) and local.bias.shape == (32,)
    return local.kernel[...]

np.testing.assert_array_equal(np.asarray(f(s)), np.asarray(m.kernel[...]))
print("ok")
"""


def test_shard_map_in_specs_as_a_state_of_plain_specs(run_on_cpu_devices):
    r = run_on_cpu_devices(_SHARD_MAP_STATE_SPECS, devices=4)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
