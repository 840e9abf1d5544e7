"""Optimizer.update's extra Optax arguments (``grad=``, ``value_fn=``) in nn.grad's State
form, optimizer state sharding metadata, and Variables placed by their own
``out_sharding`` (a NamedSharding, a layout Format) or names without rules."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cairn import nn


def _mesh(types=(jax.sharding.AxisType.Auto,) * 2):
    return jax.make_mesh((1, 1), ("a", "b"), axis_types=types)


def test_lbfgs_linesearch_takes_state_grads_and_a_state_value_fn():
    model = nn.Linear(2, 3, rngs=nn.Rngs(0))
    x, y = jnp.ones((4, 2)), jnp.zeros((4, 3))
    opt = nn.Optimizer(model, optax.lbfgs(linesearch=optax.scale_by_zoom_linesearch(max_linesearch_steps=4)), wrt=nn.Param)
    graphdef = nn.split(model, nn.Param)[0]
    seen = []

    def value_fn(state):  # gets the parameters as a State, as the caller wrote it for
        seen.append(type(state))
        m = nn.merge(graphdef, state)
        return ((m(x) - y) ** 2).mean()

    def loss(m):
        return ((m(x) - y) ** 2).mean()

    @nn.jit
    def step(model, opt):
        value, grads = nn.value_and_grad(loss)(model)
        opt.update(model, grads, grad=grads, value=value, value_fn=value_fn)

    before = float(loss(model))
    step(model, opt)
    assert seen and all(t is nn.State for t in seen)
    assert float(loss(model)) < before


def test_optimizer_state_mirrors_the_parameter_sharding_names():
    with jax.set_mesh(_mesh()):
        model = nn.Linear(2, 3, use_bias=False, rngs=nn.Rngs(0), kernel_init=nn.with_partitioning(
            nn.initializers.lecun_normal(), sharding=("a", "b")))
        opt = nn.Optimizer(model, optax.adamw(0.1), wrt=nn.Param)
    state = nn.state(opt)
    mu = state["opt_state"][0]["mu"]["kernel"]
    assert mu.out_sharding == ("a", "b")
    assert nn.get_partition_spec(state)["opt_state"][0]["mu"]["kernel"].value == P("a", "b")
    assert "out_sharding" not in state["step"].metadata  # the counter mirrors no parameter


def test_get_partition_spec_without_rules_uses_the_names_as_mesh_axes():
    v = nn.Param(jnp.ones((2, 3)), sharding_names=("a", None))
    assert nn.get_partition_spec(v).value == P("a", None)
    assert nn.get_partition_spec(nn.Param(jnp.ones(2))).value == P()
    with nn.sharding_rules([("a", "b")], mesh=_mesh()):
        assert nn.get_partition_spec(v).value == P("b", None)


def test_variable_out_sharding_may_be_a_named_sharding_or_a_format():
    mesh = _mesh()
    ns = NamedSharding(mesh, P("a", None))
    v = nn.Variable(jnp.ones((4, 4)), out_sharding=ns)
    assert v.value.sharding.is_equivalent_to(ns, 2)
    assert nn.get_partition_spec(v).value == P("a", None)
    from jax.experimental.layout import Format, Layout

    f = nn.Variable(jnp.ones((4, 4)), out_sharding=Format(Layout(major_to_minor=(1, 0)), ns))
    assert f.value.sharding == ns
    np.testing.assert_array_equal(f.value, np.ones((4, 4)))


def test_variable_mesh_with_mixed_axis_types_is_refused():
    mixed = _mesh((jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit))
    with pytest.raises(ValueError, match="mixed axis types"):
        nn.Variable(jnp.ones((4, 4)), out_sharding=("a", "b"), mesh=mixed)
    v = nn.Variable(jnp.ones((4, 4)), out_sharding=("a", "b"), mesh=_mesh())
    assert v.value.sharding.spec == P("a", "b")


def test_out_sharding_and_sharding_names_read_each_other():
    a = nn.Param(jnp.ones((2, 3)), sharding_names=("a", None))
    b = nn.Param(jnp.ones((2, 3)), out_sharding=("a", None))
    assert a.out_sharding == ("a", None) and b.sharding_names == ("a", None)


def test_partitioned_init_inside_vmap_with_a_broadcast_key_under_set_mesh():
    # the key is broadcast (in_axes=None), so the initializer's value is concrete inside
    # the vmap trace, where the context mesh is abstract: it is constrained, not placed
    @nn.vmap(in_axes=(None,), out_axes=0, axis_size=3)
    def make(rngs):
        return nn.Linear(2, 4, rngs=rngs, kernel_init=nn.with_partitioning(
            nn.initializers.lecun_normal(), ("a", "b")))

    with jax.set_mesh(_mesh()):
        m = make(nn.Rngs(0))
    assert m.kernel.shape == (3, 2, 4)
    np.testing.assert_array_equal(m.kernel.value[0], m.kernel.value[1])  # same key each
