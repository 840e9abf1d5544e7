"""``optimizer_sharding`` metadata (Flax NNX's name) places a parameter's optimizer
state in its own sharding; on 4 fake CPU devices, in a subprocess (the device count
must be set before JAX starts)."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import types
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from cairn import nn

    assert jax.device_count() == 4, jax.devices()
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))

    # a hand-written Adam-like transformation: mu and nu shaped like the params
    tx = types.SimpleNamespace(
        init=lambda p: {"count": jnp.zeros((), jnp.int32),
                        "mu": jax.tree.map(jnp.zeros_like, p),
                        "nu": jax.tree.map(jnp.zeros_like, p)},
        update=lambda g, s, p=None: (jax.tree.map(lambda x: -0.1 * x, g),
                                     {**s, "count": s["count"] + 1}),
    )

    class M(nn.Module):
        def __init__(self):
            w = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P("data", "model")))
            self.w = nn.Param(w, optimizer_sharding=("model", None))
            self.v = nn.Param(jax.device_put(jnp.ones((4,)), NamedSharding(mesh, P("data"))),
                              optimizer_sharding=P(None))
            self.b = nn.Param(jax.device_put(jnp.ones((8,)), NamedSharding(mesh, P("model"))))

    m = M()
    opt = nn.Optimizer(m, tx, wrt=nn.Param)
    for part in ("mu", "nu"):
        st = opt.opt_state[part]
        assert st["w"].value.sharding.spec == P("model", None), st["w"].value.sharding
        assert st["v"].value.sharding.spec == P(None), st["v"].value.sharding
        assert st["b"].value.sharding.spec == P("model"), st["b"].value.sharding
    # the parameters themselves keep their own sharding
    assert m.w.value.sharding.spec == P("data", "model")
    opt.update(m, nn.state(m, nn.Param))
    np.testing.assert_allclose(np.asarray(m.w.value), 0.9)
    print("OK")
    """
)


def test_optimizer_sharding_metadata_places_the_state():
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
