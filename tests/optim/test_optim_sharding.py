"""Opt-in packed buffers (optim.pack) are grouped per sharding (run in a subprocess with 4
fake CPU devices)."""

from __future__ import annotations

import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from cairn import optim
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    row = NamedSharding(mesh, P("data", None))
    col = NamedSharding(mesh, P(None, "model"))
    params = {"a": jax.device_put(jnp.ones((4, 4)), row),
              "b": jax.device_put(jnp.ones((4, 2)), row),
              "c": jax.device_put(jnp.ones((4, 4)), col),
              "d": jnp.zeros((3,))}
    layout = optim.layout_of(params)
    groups = sorted(sorted(layout.paths[i] for i in g.leaves) for g in layout.groups)
    assert groups == [["a", "b"], ["c"], ["d"]], groups
    tx = optim.pack(optim.adamw(0.1))  # opt-in packed state: one buffer per sharding
    state = tx.init(params)
    assert len(state[0].mu.buffers) == 3
    grads = jax.tree.map(jnp.ones_like, params)
    new, state = jax.jit(lambda p, s, g: (lambda u, s: (optim.apply_updates(p, u), s))(
        *tx.update(g, s, p)))(params, state, grads)
    ref_tx = optim.adamw(0.1)
    plain = jax.tree.map(np.asarray, params)
    u, _ = ref_tx.update(jax.tree.map(np.ones_like, plain), ref_tx.init(plain), plain)
    for k in params:
        np.testing.assert_allclose(np.asarray(new[k]), plain[k] + np.asarray(u[k]), rtol=1e-6)
    print("OK")
""")


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.multiprocess
def test_layout_groups_by_sharding_and_step_matches_unsharded(run_on_cpu_devices):
    r = run_on_cpu_devices(SCRIPT, devices=4, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-2000:]
