"""nn.Optimizer with cairn.optim: the state is keyed by parameter path
(``opt_state/0/mu/layers/0/kernel``) and, on 8 fake CPU devices, each moment is sharded
exactly like its parameter from construction through nn.jit steps."""

from __future__ import annotations

import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from cairn import nn, optim
from cairn.core_array import flatten_with_paths


class _MLP(nn.Module):
    def __init__(self, rngs):
        self.layers = nn.List([nn.Linear(4, 8, rngs=rngs), nn.Linear(8, 2, rngs=rngs)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_optimizer_state_paths_follow_parameter_paths():
    model = _MLP(nn.Rngs(0))
    opt = nn.Optimizer(model, optim.adamw(1e-3), wrt=nn.Param)
    paths = set(flatten_with_paths(nn.state(opt)))
    params = set(flatten_with_paths(nn.state(model, nn.Param)))
    for moment in ("opt_state/0/mu", "opt_state/0/nu"):
        assert {p[len(moment) + 1:] for p in paths if p.startswith(moment + "/")} == params
    assert "opt_state/0/mu/layers/0/kernel" in paths

    @nn.jit
    def step(model, opt, x):
        grads = nn.grad(lambda m: jnp.sum(m(x) ** 2))(model)
        opt.update(model, grads)

    x = jnp.ones((3, 4))
    step(model, opt, x)
    step(model, opt, x)
    flat = flatten_with_paths(nn.state(opt))
    assert set(flat) == paths
    assert flat["opt_state/0/mu/layers/0/kernel"].shape == (4, 8)
    assert float(jnp.abs(flat["opt_state/0/mu/layers/1/bias"]).sum()) > 0


def test_optimizer_with_packed_opt_in_keeps_buffer_paths():
    model = _MLP(nn.Rngs(0))
    opt = nn.Optimizer(model, optim.pack(optim.adamw(1e-3)), wrt=nn.Param)
    paths = set(flatten_with_paths(nn.state(opt)))
    assert "opt_state/0/mu/float32" in paths
    assert not any(p.startswith("opt_state/0/mu/layers") for p in paths)


SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from cairn import nn, optim
    from cairn.core_array import LogicalAxisRules, flatten_with_paths

    def per_device_bytes(values):
        return sum(v.addressable_shards[0].data.nbytes for v in values)

    def run(mesh, rules, names, label):
        init = nn.initializers.lecun_normal()

        class Model(nn.Module):
            def __init__(self, rngs):
                self.l1 = nn.Linear(64, 128, rngs=rngs, use_bias=False,
                                    kernel_init=nn.with_partitioning(init, names[0]))
                self.l2 = nn.Linear(128, 64, rngs=rngs, use_bias=False,
                                    kernel_init=nn.with_partitioning(init, names[1]))

            def __call__(self, x):
                return self.l2(jax.nn.relu(self.l1(x)))

        model = nn.sharded_init(Model, nn.Rngs(0), mesh=mesh, rules=rules)
        params = flatten_with_paths(nn.state(model, nn.Param))
        for tx_name, tx, moments in (("adamw", optim.adamw(1e-3), ("mu", "nu")),
                                     ("lion", optim.lion(1e-4), ("mu",))):
            m = nn.sharded_init(Model, nn.Rngs(0), mesh=mesh, rules=rules)
            opt = nn.Optimizer(m, tx, wrt=nn.Param)

            @nn.jit
            def step(m, opt, x):
                opt.update(m, nn.grad(lambda m: jnp.mean(m(x) ** 2))(m))

            x = jnp.ones((8, 64))
            for when in ("init", "step 1", "step 2"):
                flat = flatten_with_paths(nn.state(opt))
                for mo in moments:
                    pre = f"opt_state/0/{mo}/"
                    got = {k[len(pre):]: v for k, v in flat.items() if k.startswith(pre)}
                    assert sorted(got) == sorted(params), (label, tx_name, when, sorted(got))
                    for path, v in got.items():
                        p = params[path]
                        assert v.sharding.is_equivalent_to(p.sharding, p.ndim), (
                            label, tx_name, when, path, v.sharding, p.sharding)
                    assert per_device_bytes(got.values()) == per_device_bytes(params.values())
                if when != "step 2":
                    step(m, opt, x)
        print("OK", label)

    devs = np.array(jax.devices())
    mesh = Mesh(devs.reshape(2, 4), ("data", "model"))
    rules = LogicalAxisRules([("embed", "data"), ("mlp", "model")])
    run(mesh, rules, (("embed", "mlp"), ("mlp", "embed")), "data x model")
    fsdp = Mesh(devs, ("fsdp",))
    rules = LogicalAxisRules([("embed", "fsdp"), ("mlp", None)])
    run(fsdp, rules, (("embed", "mlp"), ("mlp", "embed")), "fsdp")
""")


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.multiprocess
def test_optimizer_state_sharded_like_params_through_nn_jit_steps(run_on_cpu_devices):
    r = run_on_cpu_devices(SCRIPT)
    assert r.returncode == 0 and "OK fsdp" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_optimizer_numbers_match_plain_optim_loop():
    model = _MLP(nn.Rngs(1))
    params = {k: np.asarray(v) for k, v in flatten_with_paths(nn.state(model, nn.Param)).items()}
    opt = nn.Optimizer(model, optim.adamw(1e-2), wrt=nn.Param)
    x = jnp.ones((3, 4))
    grads = nn.grad(lambda m: jnp.sum(m(x) ** 2))(model)
    g = {k: np.asarray(v) for k, v in flatten_with_paths(grads).items()}
    opt.update(model, grads)
    tx = optim.adamw(1e-2)
    key = lambda k: k.replace("/", ".")  # noqa: E731 - flat dict keys without separators
    pj = {key(k): jnp.asarray(v) for k, v in params.items()}
    u, _ = tx.update({key(k): jnp.asarray(v) for k, v in g.items()}, tx.init(pj), pj)
    got = flatten_with_paths(nn.state(model, nn.Param))
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), params[k] + np.asarray(u[key(k)]),
                                   rtol=1e-6)
