"""`nn.shard_map` on a real 4-device mesh (forced host devices, in a child process).

A data-parallel train step written with `nn.shard_map` (the loss averaged over the data
axis with `pmean`, module state mutated inside) must equal the same step on one device, and the
module's state must come back replicated as its spec says.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from cairn import nn

    assert jax.device_count() == 4, jax.devices()

    class Model(nn.Module):
        def __init__(self, rngs):
            self.l1 = nn.Linear(3, 8, rngs=rngs)
            self.l2 = nn.Linear(8, 2, rngs=rngs)
            self.calls = nn.BatchStat(jnp.zeros((), jnp.int32))

        def __call__(self, x):
            self.calls.value = self.calls.value + 1
            return self.l2(jnp.tanh(self.l1(x)))

    def loss(m, x, y):
        return jnp.mean((m(x) - y) ** 2)

    x = jax.random.normal(jax.random.key(1), (16, 3))
    y = jax.random.normal(jax.random.key(2), (16, 2))
    mesh = Mesh(np.array(jax.devices()), ("d",))

    # Params enter replicated (P()), so under shard_map's varying-axes checks the gradient
    # of a per-shard loss w.r.t. them is already summed over "d" (as for jax.shard_map);
    # averaging the loss over "d" first gives the global-mean gradient.
    def sharded_step(m, x, y):
        value, g = nn.value_and_grad(lambda m, x, y: jax.lax.pmean(loss(m, x, y), "d"))(m, x, y)
        nn.update(m, jax.tree.map(lambda p, d: p - 0.1 * d, nn.state(m, nn.Param), g))
        return value

    step = nn.jit(nn.shard_map(
        sharded_step, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P()))

    def plain_step(m, x, y):
        value, g = nn.value_and_grad(loss)(m, x, y)
        nn.update(m, jax.tree.map(lambda p, d: p - 0.1 * d, nn.state(m, nn.Param), g))
        return value

    plain = nn.jit(plain_step)
    ms, mp = Model(nn.Rngs(0)), Model(nn.Rngs(0))
    out = {"sharded": [], "plain": []}
    for _ in range(3):
        out["sharded"].append(float(step(ms, x, y)))
        out["plain"].append(float(plain(mp, x, y)))
    out["calls"] = int(ms.calls.value)
    out["max_param_diff"] = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(nn.state(ms, nn.Param)),
                        jax.tree.leaves(nn.state(mp, nn.Param))))
    out["kernel_replicated"] = bool(ms.l1.kernel.value.sharding.is_fully_replicated)
    out["kernel_devices"] = len(ms.l1.kernel.value.sharding.device_set)
    print("RESULT " + json.dumps(out))
    """
)


@pytest.mark.multiprocess
@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_shard_map_data_parallel_step_matches_one_device():
    pytest.importorskip("jax")
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    res = json.loads(line[len("RESULT ") :])
    # float32; the mean over 4 shards of 4 rows equals the mean over 16 rows up to rounding
    np.testing.assert_allclose(res["sharded"], res["plain"], rtol=1e-5, atol=1e-6)
    assert res["sharded"][2] < res["sharded"][0]  # the step trains
    assert res["max_param_diff"] < 1e-5
    assert res["calls"] == 3  # state mutated inside shard_map comes back, once per step
    assert res["kernel_replicated"] and res["kernel_devices"] == 4
