"""Variables placed by Flax NNX's ``out_sharding`` metadata under ``jax.set_mesh``,
``nn.use_eager_sharding`` and ``nn.as_abstract`` (issue 30, Flax's spmd_test), on four
virtual CPU devices in a subprocess."""

from __future__ import annotations

import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from cairn import nn
    assert jax.device_count() == 4, jax.devices()
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=auto)
    with jax.set_mesh(mesh):
        v = nn.Variable(jnp.ones((4, 4)), out_sharding=P("data", "model"))
        assert v.sharding.spec == P("data", "model"), v.sharding
        assert v.sharding.shard_shape((4, 4)) == (2, 2)
        w = nn.Param(jnp.ones((4, 8)), out_sharding=(None, "model"))
        assert w.sharding.shard_shape((4, 8)) == (4, 4)
        # a PartitionSpec shorter than the rank: the missing trailing axes are replicated
        s = nn.Param(jnp.ones((4, 8, 2)), out_sharding=P("data"))
        assert s.sharding.shard_shape((4, 8, 2)) == (2, 8, 2)
        try:
            nn.Param(jnp.ones((4, 8)), sharding_names=("data",))
        except ValueError as e:
            assert "has 1 entries for an array of rank 2" in str(e)
        else:
            raise AssertionError("sharding_names shorter than the rank must raise")
        with nn.use_eager_sharding(False):
            u = nn.Param(jnp.ones((4, 8)), out_sharding=(None, "model"))
        assert u.sharding.shard_shape((4, 8)) == (4, 8)
        lin = lambda: nn.Linear(4, 8, rngs=nn.Rngs(0), kernel_metadata={"out_sharding": ("data", "model")})
        a = nn.as_abstract(nn.eval_shape(lin))
        assert isinstance(a.kernel, nn.Param) and isinstance(a.kernel.value, jax.ShapeDtypeStruct)
        assert a.kernel.sharding.spec == P("data", "model") and a.bias.value.sharding is None

    # a with_partitioning variable made inside jax.jit under the mesh (abstract mesh there)
    class Foo(nn.Module):
        def __init__(self):
            self.w = nn.Param(nn.with_partitioning(lambda: jnp.ones((8, 2)), sharding=("model", "data"))())

    m2 = jax.make_mesh((2, 2), ("model", "data"), axis_types=auto)
    with jax.set_mesh(m2):
        foo = nn.merge(*jax.jit(lambda: nn.split(Foo()))())
    assert foo.w.sharding.shard_shape((8, 2)) == (4, 1)

    # a variable's own mesh wins over no context
    other = jax.make_mesh((1, 4), ("c", "d"), axis_types=auto)
    b = nn.as_abstract(nn.eval_shape(lambda: nn.Linear(
        4, 8, rngs=nn.Rngs(0), kernel_metadata={"out_sharding": ("c", "d"), "mesh": other})))
    assert b.kernel.sharding.mesh == other and b.kernel.sharding.spec == P("c", "d")
    assert nn.as_abstract(nn.Linear(2, 3, rngs=nn.Rngs(0))).kernel.value.shape == (2, 3)
    # logical_axis_rules (Flax's name) composed with a variable's own sharding_rules
    m3 = jax.make_mesh((2, 2), ("row", "col"), axis_types=auto)
    with jax.set_mesh(m3), nn.logical_axis_rules((("col-alias", "col"),)):
        w = nn.Param(nn.with_partitioning(lambda: jnp.ones((8, 2)), sharding=("row-alias", "col-alias"),
                                          sharding_rules=(("row-alias", "row"),))())
        b = nn.Param(nn.with_partitioning(lambda: jnp.zeros((2,)), sharding=("col-alias",))())
        try:
            nn.Param(jnp.ones((2,)), sharding=("col-alias",), sharding_rules=(("col-alias", "row"),))
        except ValueError as e:
            assert "inconsistent logical axis rules for 'col-alias'" in str(e), e
        else:
            raise AssertionError("conflicting rules must raise")
    assert w.sharding.spec == P("row", "col") and b.sharding.spec == P("col"), (w.sharding, b.sharding)
    print("OK")
    """
)


@pytest.mark.multiprocess
def test_out_sharding_under_set_mesh_on_four_devices(run_on_cpu_devices):
    r = run_on_cpu_devices(SCRIPT, devices=4, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
