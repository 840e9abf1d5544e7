"""cairn.optim state + cairn.checkpoint: optimizer state is keyed by parameter path, so a
checkpoint made before a model change restores the moments of the parameters that still
exist and the new ones start fresh; sharded state restores onto the same or another mesh
with each moment sharded like its parameter (8 fake CPU devices, in a subprocess)."""

from __future__ import annotations

import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import checkpoint as ckpt
from cairn import nn, optim
from cairn.core_array import flatten_with_paths


def _params(names, seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"l1": (4, 8), "l2": (8, 8), "l3": (8, 2)}
    return {n: {"kernel": jnp.asarray(rng.normal(size=shapes[n]), jnp.float32),
                "bias": jnp.zeros(shapes[n][1], jnp.float32)} for n in names}


def _train(tx, params, steps, seed=1):
    state = tx.init(params)
    rng = np.random.default_rng(seed)
    step = jax.jit(lambda p, s, g: (lambda u, s: (optim.apply_updates(p, u), s))(
        *tx.update(g, s, p)))
    for _ in range(steps):
        grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), params)
        params, state = step(params, state, grads)
    return params, state


def _restore_existing(directory, target):
    """Restore every target path the checkpoint has; the others keep the target's values."""
    saved = set(ckpt.metadata(directory))
    wanted = [re.escape(p) for p in flatten_with_paths(target) if p in saved]
    return ckpt.restore(directory, target, paths=wanted, partial=True)


def test_partial_restore_by_path_after_a_model_change(tmp_path):
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2))
    old_params, old_state = _train(tx, _params(["l1", "l2"]), steps=3)
    ckpt.save(tmp_path / "old", {"params": old_params, "opt": old_state})

    # the model loses l2 and gains l3
    new_params = _params(["l1", "l3"], seed=5)
    target = {"params": new_params, "opt": tx.init(new_params)}
    got = _restore_existing(tmp_path / "old", target)

    old = flatten_with_paths({"params": old_params, "opt": old_state})
    fresh = flatten_with_paths(target)
    got_flat = flatten_with_paths(got)
    assert set(got_flat) == set(fresh)
    for path, value in got_flat.items():
        want = old[path] if path in old else fresh[path]
        np.testing.assert_array_equal(np.asarray(value), np.asarray(want), err_msg=path)
    # the moments of the kept layer came back, the new layer's start at zero
    assert float(jnp.abs(got["opt"][1][0].mu["l1"]["kernel"]).sum()) > 0
    assert float(jnp.abs(got["opt"][1][0].mu["l3"]["kernel"]).sum()) == 0
    assert int(got["opt"][1][0].count) == 3
    # training continues from the restored state
    _train(tx, got["params"], steps=1)
    step = jax.jit(lambda p, s, g: tx.update(g, s, p))
    _, s = step(got["params"], got["opt"], jax.tree.map(jnp.ones_like, got["params"]))
    assert int(s[1][0].count) == 4


def test_nn_optimizer_state_restores_by_path_into_a_changed_model(tmp_path):
    class Old(nn.Module):
        def __init__(self, rngs):
            self.l1 = nn.Linear(4, 8, rngs=rngs)
            self.l2 = nn.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.l1(x))

    class New(nn.Module):
        def __init__(self, rngs):
            self.l1 = nn.Linear(4, 8, rngs=rngs)
            self.head = nn.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            return self.head(self.l1(x))

    model = Old(nn.Rngs(0))
    opt = nn.Optimizer(model, optim.adamw(1e-2), wrt=nn.Param)

    @nn.jit
    def step(model, opt, x):
        opt.update(model, nn.grad(lambda m: jnp.sum(m(x) ** 2))(model))

    for _ in range(2):
        step(model, opt, jnp.ones((2, 4)))
    ckpt.save(tmp_path / "c", {"model": nn.state(model), "opt": nn.state(opt, nn.OptState)})
    saved = ckpt.metadata(tmp_path / "c")
    assert "opt/opt_state/0/mu/l1/kernel" in saved and "opt/opt_state/0/nu/l2/bias" in saved

    new = New(nn.Rngs(1))
    new_opt = nn.Optimizer(new, optim.adamw(1e-2), wrt=nn.Param)
    got = _restore_existing(tmp_path / "c", {"model": nn.state(new),
                                             "opt": nn.state(new_opt, nn.OptState)})
    nn.update(new, got["model"])
    nn.update(new_opt, got["opt"])
    now = flatten_with_paths(nn.state(new_opt))
    before = flatten_with_paths(nn.state(opt))
    np.testing.assert_array_equal(np.asarray(now["opt_state/0/mu/l1/kernel"]),
                                  np.asarray(before["opt_state/0/mu/l1/kernel"]))
    assert float(jnp.abs(now["opt_state/0/mu/head/kernel"]).sum()) == 0
    assert int(now["opt_state/0/count"]) == 2
    step(new, new_opt, jnp.ones((2, 4)))


SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from cairn import checkpoint as ckpt, optim
    from cairn.core_array import flatten_with_paths

    directory = sys.argv[1]
    devs = np.array(jax.devices())

    def layout(mesh, specs):
        return {k: NamedSharding(mesh, s) for k, s in specs.items()}

    def make(shardings):
        rng = np.random.default_rng(0)
        shapes = {"l1": (64, 128), "l2": (128, 64), "bias": (128,)}
        return {k: jax.device_put(jnp.asarray(rng.normal(size=shapes[k]), jnp.float32), sh)
                for k, sh in shardings.items()}

    def check(params, state, label):
        pflat = flatten_with_paths(params)
        for k, v in flatten_with_paths(state).items():
            for m in ("1/0/mu/", "1/0/nu/"):
                if k.startswith(m):
                    p = pflat[k[len(m):]]
                    assert v.sharding.is_equivalent_to(p.sharding, p.ndim), (label, k, v.sharding)
                    assert v.addressable_shards[0].data.nbytes == p.addressable_shards[0].data.nbytes

    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2))
    mesh = Mesh(devs.reshape(2, 4), ("data", "model"))
    src_specs = {"l1": P("data", "model"), "l2": P("model", "data"), "bias": P("model")}
    src = layout(mesh, src_specs)
    params = make(src)
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: (lambda u, s: (optim.apply_updates(p, u), s))(
        *tx.update(g, s, p)))
    grads = jax.tree.map(lambda x: x * 0.1, params)
    for _ in range(2):
        params, state = step(params, state, grads)
    check(params, state, "trained")
    ckpt.save(directory, {"params": params, "opt": state})
    saved = flatten_with_paths({"params": params, "opt": state})

    meshes = {"same mesh": (mesh, src_specs),
              "fsdp mesh": (Mesh(devs, ("fsdp",)),
                            {"l1": P("fsdp", None), "l2": P(None, "fsdp"), "bias": P()}),
              "4x2 mesh": (Mesh(devs.reshape(4, 2), ("data", "model")),
                           {"l1": P("model", "data"), "l2": P("data", None), "bias": P("data")})}
    for label, (m, specs) in meshes.items():
        shardings = layout(m, specs)
        fresh = make(shardings)
        target = {"params": fresh, "opt": tx.init(fresh)}   # shardings come from the target
        got = ckpt.restore(directory, target)
        check(got["params"], got["opt"], label)
        for k, v in flatten_with_paths(got).items():
            np.testing.assert_array_equal(np.asarray(v), np.asarray(saved[k]), err_msg=k)
        # and jitted steps keep the new layout
        p2, s2 = step(got["params"], got["opt"], jax.tree.map(lambda x: x * 0.1, got["params"]))
        check(p2, s2, label + " after a step")
        print("OK", label)
""")


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.multiprocess
def test_sharded_state_restores_onto_same_and_other_meshes(tmp_path, run_on_cpu_devices):
    r = run_on_cpu_devices(SCRIPT, str(tmp_path / "ckpt"))
    assert r.returncode == 0 and "OK 4x2 mesh" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


_LM = r"""
import json, sys
sys.path.insert(0, {lm!r})
import lm_config, lm_train
cfg = lm_config.load_config({config!r}, {overrides!r})
r = lm_train.train(cfg, quiet=True)
print("RESULT " + json.dumps({{k: r[k] for k in ("per_device_param_bytes",
                                                 "per_device_optimizer_bytes", "params")}}))
"""


@pytest.mark.multiprocess
@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_lm_recipe_reports_per_device_param_and_optimizer_bytes(tmp_path, run_on_cpu_devices):
    import json
    import pathlib

    lm = pathlib.Path(__file__).resolve().parents[2] / "examples" / "lm"
    tiny = ["model.d_model=32", "model.num_layers=1", "model.num_heads=4", "model.num_kv_heads=2",
            "model.mlp_dim=64", "data.seq_len=32", "data.batch_size=8", "data.num_train=600",
            "data.num_eval=16", "data.max_digits=2", "data.num_shards=2",
            "optim.warmup_steps=1", "train.steps=3", "train.log_every=1",
            "checkpoint.every=3", "train.progress=false", "data.num_workers=0",
            f'run.dir="{tmp_path}"', "mesh.data=4", "mesh.model=2"]
    code = _LM.format(lm=str(lm), config=str(lm / "config.toml"), overrides=tiny)
    out = run_on_cpu_devices(code)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads([x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1][7:])
    total = r["params"] * 4  # float32
    # sharded 8 ways (rules permitting): far below a full replica per device
    assert r["per_device_param_bytes"] < total
    # AdamW: two moments sharded like the params, plus a few replicated scalars
    extra = r["per_device_optimizer_bytes"] - 2 * r["per_device_param_bytes"]
    assert 0 <= extra <= 64, r
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["per_device_optimizer_bytes"] == r["per_device_optimizer_bytes"]


_NN_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    from cairn import checkpoint as ckpt, nn, optim
    from cairn.core_array import LogicalAxisRules, flatten_with_paths

    directory = sys.argv[1]
    devs = np.array(jax.devices())
    init = nn.initializers.lecun_normal()

    class Model(nn.Module):
        def __init__(self, rngs):
            self.l1 = nn.Linear(64, 128, rngs=rngs, use_bias=False,
                                kernel_init=nn.with_partitioning(init, ("embed", "mlp")))
            self.l2 = nn.Linear(128, 64, rngs=rngs, use_bias=False,
                                kernel_init=nn.with_partitioning(init, ("mlp", "embed")))

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    @nn.jit
    def step(model, opt, x):
        opt.update(model, nn.grad(lambda m: jnp.mean(m(x) ** 2))(model))

    def check(model, opt, label):
        params = flatten_with_paths(nn.state(model, nn.Param))
        flat = flatten_with_paths(nn.state(opt))
        for mo in ("mu", "nu"):
            for path, p in params.items():
                v = flat[f"opt_state/0/{mo}/{path}"]
                assert v.sharding.is_equivalent_to(p.sharding, p.ndim), (label, mo, path,
                                                                          v.sharding, p.sharding)

    layouts = {"data x model": (Mesh(devs.reshape(2, 4), ("data", "model")),
                                LogicalAxisRules([("embed", "data"), ("mlp", "model")])),
               "fsdp": (Mesh(devs, ("fsdp",)),
                        LogicalAxisRules([("embed", "fsdp"), ("mlp", None)]))}
    mesh, rules = layouts["data x model"]
    model = nn.sharded_init(Model, nn.Rngs(0), mesh=mesh, rules=rules)
    opt = nn.Optimizer(model, optim.adamw(1e-3), wrt=nn.Param)
    x = jnp.ones((8, 64))
    step(model, opt, x)
    step(model, opt, x)
    check(model, opt, "trained")
    ckpt.save(directory, {"model": nn.state(model), "opt": nn.state(opt, nn.OptState)})
    saved = flatten_with_paths(nn.state(opt, nn.OptState))
    for label, (mesh, rules) in layouts.items():
        m = nn.sharded_init(Model, nn.Rngs(1), mesh=mesh, rules=rules)
        o = nn.Optimizer(m, optim.adamw(1e-3), wrt=nn.Param)
        got = ckpt.restore(directory, {"model": nn.state(m), "opt": nn.state(o, nn.OptState)})
        nn.update(m, got["model"])
        nn.update(o, got["opt"])
        check(m, o, label + " restored")
        now = flatten_with_paths(nn.state(o, nn.OptState))
        for k, v in saved.items():
            np.testing.assert_array_equal(np.asarray(now[k]), np.asarray(v), err_msg=k)
        step(m, o, x)
        step(m, o, x)
        check(m, o, label + " after nn.jit steps")
        print("OK", label)
""")


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.multiprocess
def test_nn_optimizer_state_restores_sharded_onto_same_and_fsdp_mesh(tmp_path, run_on_cpu_devices):
    r = run_on_cpu_devices(_NN_SCRIPT, str(tmp_path / "ckpt"))
    assert r.returncode == 0 and "OK fsdp" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
