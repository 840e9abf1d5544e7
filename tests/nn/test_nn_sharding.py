"""Sharding by logical names, on 8 fake CPU devices (in a subprocess, because the device
count must be set before JAX starts)."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from cairn import nn
    from cairn.core_array import LogicalAxisRules, flatten_with_paths

    assert jax.device_count() == 8, jax.devices()
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    rules = LogicalAxisRules([("embed", "data"), ("mlp", "model")])

    def init(key, shape):
        return jax.random.normal(key, shape)

    class Lin(nn.Module):
        def __init__(self, rngs):
            self.kernel = nn.Param(nn.with_partitioning(init, ("embed", "mlp"))(rngs.params(), (8, 16)))
            self.bias = nn.Param(nn.with_partitioning(lambda k, s: jnp.zeros(s), ("mlp",))(rngs.params(), (16,)))
            self.scale = nn.Param(jnp.ones((16,)))

        def __call__(self, x):
            return x @ self.kernel + self.bias * self.scale

    expected = {
        "kernel": P("data", "model"),
        "bias": P("model"),
        "scale": P(),
    }

    def check(model, what):
        for path, v in flatten_with_paths(nn.state(model)).items():
            sh = v.sharding
            assert isinstance(sh, NamedSharding), (what, path, sh)
            assert sh.spec == expected[path] or (expected[path] == P() and all(s is None for s in sh.spec)), (what, path, sh.spec)
            if path == "kernel":
                # each device holds only its shard
                assert v.addressable_shards[0].data.shape == (4, 4), (what, v.addressable_shards[0].data.shape)

    # 1. compiled creation: every parameter written directly in its sharding
    model = nn.sharded_init(Lin, nn.Rngs(0), mesh=mesh, rules=rules)
    check(model, "sharded_init")
    eager_ref = Lin(nn.Rngs(0))
    np.testing.assert_allclose(np.asarray(model.kernel.value), np.asarray(eager_ref.kernel.value), rtol=1e-6)

    # 2. creation inside nn.jit under the context
    with nn.sharding_rules(rules, mesh):
        m2 = nn.jit(Lin)(nn.Rngs(0))
        m3 = Lin(nn.Rngs(0))   # eager: device_put into the sharding
    for path in ("kernel", "bias"):
        assert flatten_with_paths(nn.state(m2))[path].sharding.spec == expected[path]
        assert flatten_with_paths(nn.state(m3))[path].sharding.spec == expected[path]

    # 2b. no full replica first: eager creation under the context runs the initializer
    # compiled with out_shardings, so each device computes only its shard; creation
    # inside nn.jit / sharded_init is partitioned by XLA. In every per-device program
    # no array has the full (64, 128) shape, only the (32, 32) shard.
    from cairn.nn import _sharding

    class Big(nn.Module):
        def __init__(self, rngs):
            self.kernel = nn.Param(nn.with_partitioning(init, ("embed", "mlp"))(rngs.params(), (64, 128)))

    _sharding._BORN_SHARDED.clear()
    with nn.sharding_rules(rules, mesh):
        eager = Big(nn.Rngs(0))
    assert eager.kernel.value.sharding.spec == P("data", "model")
    assert eager.kernel.value.addressable_shards[0].data.shape == (32, 32)
    np.testing.assert_allclose(np.asarray(eager.kernel.value), np.asarray(Big(nn.Rngs(0)).kernel.value), rtol=1e-6)
    (born,) = _sharding._BORN_SHARDED.values()
    texts = {"eager": born.lower([jax.random.key(0)]).compile().as_text()}
    with nn.sharding_rules(rules, mesh):
        texts["nn.jit"] = nn.jit(Big).lower(nn.Rngs(0)).compile().as_text()
    for what, text in texts.items():
        assert "f32[64,128]" not in text, (what, text)
        assert "f32[32,32]" in text, (what, text)
    # a rank mismatch between names and the initializer's result is named
    with nn.sharding_rules(rules, mesh):
        try:
            nn.with_partitioning(init, ("embed",))(jax.random.key(0), (4, 8))
        except ValueError as e:
            assert "has 1 entries but the initializer returned an array of shape (4, 8)" in str(e), e
        else:
            raise AssertionError("rank mismatch not detected")

    # 3. abstract model for checkpoint restore
    abstract = nn.abstract_model(Lin, nn.Rngs(0), mesh=mesh, rules=rules)
    a = abstract.kernel.value
    assert isinstance(a, jax.ShapeDtypeStruct) and a.shape == (8, 16)
    assert a.sharding.spec == P("data", "model")
    assert abstract.scale.value.sharding.spec == P()

    # 4. partition specs of the state
    specs = nn.get_partition_spec(nn.state(model), rules, mesh)
    assert specs["kernel"].value == P("data", "model") and specs["scale"].value == P()
    shard = nn.get_named_sharding(model, mesh, rules)
    assert shard["bias"].value == NamedSharding(mesh, P("model"))

    # 5. a jitted update keeps the shardings
    step = nn.jit(lambda m: setattr(m.kernel, "value", m.kernel.value * 2))
    step(model)
    check(model, "after step")

    # 6. the optimizer's one-device scalars (step, Adam's count) are replicated over the
    # parameters' mesh, so a state restored into its own shardings (as a checkpoint
    # restore does) is accepted by jit next to the sharded parameters
    import optax

    opt = nn.Optimizer(model, optax.adam(1e-2), wrt=nn.Param)
    for path, v in flatten_with_paths(nn.state(opt, nn.OptState)).items():
        assert isinstance(v.sharding, NamedSharding) and v.sharding.mesh == mesh, (path, v.sharding)
    assert opt.step.value.sharding.spec == P()
    assert flatten_with_paths(nn.state(opt, nn.OptState))["opt_state/0/mu/kernel"].sharding.spec == P("data", "model")
    restored = jax.tree.map(lambda x: jax.device_put(np.asarray(x), x.sharding), nn.state(opt))
    nn.update(opt, restored)

    def train_step(model, opt, x):
        grads = nn.grad(lambda m: jnp.sum(m(x) ** 2))(model)
        opt.update(model, grads)

    before = np.asarray(model.kernel.value)
    nn.jit(train_step)(model, opt, jnp.ones((2, 8)))
    assert int(opt.step.value) == 1 and not np.array_equal(before, np.asarray(model.kernel.value))
    print("OK")
    """
)


@pytest.mark.multiprocess
@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_sharding_on_eight_fake_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
