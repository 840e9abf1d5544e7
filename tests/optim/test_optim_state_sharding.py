"""Per-parameter optimizer state: keyed by the parameters' paths and sharded exactly like
them, from init through jitted steps (8 fake CPU devices, in a subprocess: the device
count must be set before JAX starts)."""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import optim
from cairn.core_array import flatten_with_paths

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from cairn import optim
    from cairn.core_array import flatten_with_paths

    def per_device_bytes(tree):
        total = 0
        for x in jax.tree.leaves(tree):
            shard = x.addressable_shards[0].data
            total += shard.size * shard.dtype.itemsize
        return total

    def check(mesh, params, label):
        put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
        params = {k: put(v, s) for k, (v, s) in params.items()}
        pflat = flatten_with_paths(params)
        grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5, p.dtype), params)
        cases = {
            "adamw": (optim.adamw(1e-3), ("0/mu", "0/nu")),
            "clip+adamw": (optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3)),
                           ("1/0/mu", "1/0/nu")),
            "lion": (optim.lion(1e-3), ("0/mu",)),
            "sgd momentum": (optim.sgd(1e-3, momentum=0.9), ("0/trace",)),
            "rmsprop": (optim.rmsprop(1e-3), ("0/nu",)),
            "muon (2-D)": (optim.muon(1e-3), ("inner_states/muon/0/mu",)),
            "adafactor (unfactored)": (optim.adafactor(1e-3, min_dim_size_to_factor=10**6),
                                       ("0/v",)),
        }
        for name, (tx, moments) in cases.items():
            state = tx.init(params)
            step = jax.jit(lambda p, s, g: (lambda u, s: (optim.apply_updates(p, u), s))(
                *tx.update(g, s, p)))
            p2, s2 = params, state
            for when in ("init", "step 1", "step 2"):
                sflat = flatten_with_paths(s2)
                for m in moments:
                    got = {k[len(m) + 1:]: v for k, v in sflat.items() if k.startswith(m + "/")}
                    # muon's matrix part holds the 2-D parameters only
                    want = [k for k, p in pflat.items() if "muon" not in m or p.ndim == 2]
                    assert sorted(got) == sorted(want), (label, name, m, sorted(got))
                    for path, v in got.items():
                        p = pflat[path]
                        assert v.shape == p.shape, (label, name, when, path)
                        assert v.sharding.is_equivalent_to(p.sharding, p.ndim), (
                            label, name, when, path, v.sharding, p.sharding)
                    assert per_device_bytes(got) == per_device_bytes(
                        {k: pflat[k] for k in want}), (label, name, when)
                if when != "step 2":
                    p2, s2 = step(p2, s2, grads)
            # the steps match the same optimizer on unsharded copies
            plain = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), params)
            ref_p, ref_s = plain, tx.init(plain)
            g_plain = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), grads)
            for _ in range(2):
                u, ref_s = tx.update(g_plain, ref_s, ref_p)
                ref_p = optim.apply_updates(ref_p, u)
            for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(ref_p)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
        # factored state: Adafactor's row / column factors follow the kept axis
        tx = optim.adafactor(1e-3, min_dim_size_to_factor=8)
        s = tx.init(params)
        for path, p in pflat.items():
            if p.ndim == 2:
                big = int(np.argmax(p.shape))
                row = flatten_with_paths(s)[f"0/v_row/{path}"]
                keep = [a for a in range(2) if a != big]
                assert row.sharding.spec == P(*[tuple(p.sharding.spec)[a] for a in keep]), (
                    path, row.sharding)
        print("OK", label)

    devs = np.array(jax.devices())
    mesh = Mesh(devs.reshape(2, 4), ("data", "model"))
    check(mesh, {"l1": (jnp.ones((64, 128)), P("data", "model")),
                 "l2": (jnp.ones((128, 64)), P("model", "data")),
                 "bias": (jnp.zeros((128,)), P("model")),
                 "scale": (jnp.ones(()), P())}, "data x model")
    fsdp = Mesh(devs, ("fsdp",))
    check(fsdp, {"l1": (jnp.ones((64, 128)), P("fsdp", None)),
                 "l2": (jnp.ones((128, 64)), P("fsdp", None)),
                 "bias": (jnp.zeros((128,)), P())}, "fsdp")
""")


@pytest.mark.multiprocess
@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_state_is_sharded_like_params_from_init_through_jitted_steps(run_on_cpu_devices):
    r = run_on_cpu_devices(SCRIPT)
    assert r.returncode == 0 and "OK fsdp" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_state_paths_are_moment_then_param_path():
    params = {"l1": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}, "l2": [jnp.ones(4)]}
    state = optim.adamw(1e-3).init(params)
    paths = sorted(flatten_with_paths(state))
    assert paths == ["0/count", "0/mu/l1/bias", "0/mu/l1/kernel", "0/mu/l2/0",
                     "0/nu/l1/bias", "0/nu/l1/kernel", "0/nu/l2/0",
                     "1/count", "1/weight_decay", "2/count", "2/learning_rate"]
    mu = state[0].mu
    assert jax.tree.structure(mu) == jax.tree.structure(params)
    assert mu["l1"]["kernel"].shape == (3, 2)


def test_pack_opt_in_keeps_flat_buffers_and_same_numbers():
    rng = np.random.default_rng(0)
    params = {f"w{i}": jnp.asarray(rng.normal(size=(i + 2,)), jnp.float32) for i in range(6)}
    grads = jax.tree.map(lambda x: x * 0.3 - 0.1, params)
    tx, ptx = optim.adamw(1e-2), optim.pack(optim.adamw(1e-2))
    s, ps = tx.init(params), ptx.init(params)
    assert isinstance(ps[0].mu, optim.Packed) and len(ps[0].mu.buffers) == 1
    assert not any(isinstance(x, optim.Packed) for x in jax.tree.leaves(
        s, is_leaf=lambda x: isinstance(x, optim.Packed)))
    for _ in range(3):
        u, s = tx.update(grads, s, params)
        pu, ps = ptx.update(grads, ps, params)
        for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(pu)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for k in params:
        np.testing.assert_array_equal(np.asarray(s[0].mu[k]), np.asarray(ps[0].mu[k]))


def test_state_of_another_optimizer_is_named_not_attribute_error():
    params = {"w": jnp.ones(3)}
    adam, sgd = optim.adam(1e-3), optim.sgd(1e-3)
    adam.init(params)
    with pytest.raises(optim.StateMismatchError,
                       match=r"chain position 0 \(scale_by_adam\).*ScaleByAdamState.*EmptyState"):
        adam.update(params, sgd.init(params), params)
    lion = optim.lion(1e-3)
    with pytest.raises(optim.StateMismatchError, match=r"tuple of 3 member states"):
        lion.update(params, adam.init(params), params)
    # nested chains name the path of the member
    outer = optim.chain(optim.clip(1.0), optim.adam(1e-3))
    other = optim.chain(optim.clip(1.0), optim.sgd(1e-3))
    outer.init(params)
    with pytest.raises(optim.StateMismatchError, match=r"chain position 1/0 "):
        outer.update(params, other.init(params), params)
    # a transformation used alone names itself
    sba = optim.scale_by_adam()
    sba.init(params)
    with pytest.raises(optim.StateMismatchError, match="scale_by_adam.*ScaleByLionState"):
        sba.update(params, optim.scale_by_lion().init(params), params)
    # the old AttributeError is gone, and the error is still a ValueError/TypeError
    assert issubclass(optim.StateMismatchError, TypeError)
    assert issubclass(optim.StateMismatchError, ValueError)


def test_state_tree_mismatch_names_the_path():
    params = {"a": jnp.ones(3), "b": jnp.ones(2)}
    tx = optim.adam(1e-3)
    state = tx.init({"a": jnp.ones(3), "c": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"'b'.*'c'|'c'.*'b'"):
        tx.update(params, state, params)
    state = tx.init({"a": jnp.ones(4), "b": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"path 'a' has shape \(3,\), expected \(4,\)"):
        tx.update(params, state, params)
