"""Sharding rules on a real multi-device CPU mesh (8 host devices in a subprocess).

XLA's device count is fixed when JAX starts, so the checks run in a fresh interpreter with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``. Every shard's index and data is
compared with slices computed by hand from the rules (the reference), not from JAX.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("jax")

SCRIPT = textwrap.dedent(
    r"""
    import json
    import jax
    import numpy as np
    from cairn.core_array import ArraySpec, LogicalAxisRules, logical_to_partition_spec, named_sharding

    assert jax.device_count() == 8, jax.device_count()
    P = jax.sharding.PartitionSpec
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    rules = LogicalAxisRules([
        ("batch", "data"), ("embed", "fsdp"), ("embed", "model"), ("mlp", "model"),
        ("heads", ("data", "model")), ("vocab", None),
    ])
    out = {}

    def shards(x):
        return sorted(
            ([[s.start or 0, s.stop if s.stop is not None else d] for s, d in zip(sh.index, x.shape)],
             np.asarray(sh.data).tolist())
            for sh in x.addressable_shards
        )

    base = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    for name, axes in {"batch_embed": ("batch", "embed"), "batch_mlp": ("batch", "mlp"),
                       "embed_mlp": ("embed", "mlp"), "heads_vocab": ("heads", "vocab"),
                       "none_batch": (None, "batch")}.items():
        ns = named_sharding(mesh, axes, rules)
        out[name] = {
            "spec": [list(e) if isinstance(e, tuple) else e for e in ns.spec],
            "shards": shards(jax.device_put(base, ns)),
        }
    # the spec round-trips through ArraySpec: from a sharded array, to a ShapeDtypeStruct
    x = jax.device_put(base, named_sharding(mesh, ("batch", "embed"), rules))
    spec = ArraySpec.from_array(x, logical_axes=("batch", "embed"))
    sds = spec.to_shape_dtype_struct(mesh)
    out["array_spec"] = [spec.to_json(), sds.sharding.spec == x.sharding.spec, sds.sharding.mesh == mesh]
    # a jitted function honours the rules as its out_shardings
    f = jax.jit(lambda a: a * 2, out_shardings=named_sharding(mesh, ("heads", None), rules))
    out["jit"] = shards(f(base))
    # without a mesh, fsdp is chosen for embed (first rule); with this mesh it is skipped
    out["no_mesh"] = list(logical_to_partition_spec(("embed",), rules))
    print("RESULT" + json.dumps(out))
    """
)


MESH_SHAPE = {"data": 2, "model": 4}


def _ref_shards(base, spec, mesh_shape=MESH_SHAPE):
    """The distinct (index, data) shards for a partition spec, computed by hand.

    Dimension d split over mesh axes (a, b, ...) has prod(sizes) equal blocks; every
    device holds one block per dim, so the set of distinct shards is the product of blocks.
    """
    import itertools

    import numpy as np

    per_dim = []
    for d, entry in enumerate(list(spec) + [None] * (base.ndim - len(spec))):
        names = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        parts = int(np.prod([mesh_shape[n] for n in names])) if names else 1
        size = base.shape[d] // parts
        per_dim.append([(i * size, (i + 1) * size) for i in range(parts)])
    out = []
    for blocks in itertools.product(*per_dim):
        sl = tuple(slice(a, b) for a, b in blocks)
        out.append(([[a, b] for a, b in blocks], base[sl].tolist()))
    # each device holds one shard; replicated blocks appear several times
    n_distinct = len(out)
    return sorted(out * (8 // n_distinct))


def test_rules_on_an_eight_device_mesh():
    import numpy as np

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("RESULT", 1)[1])
    base = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    expected_specs = {
        "batch_embed": ["data", "model"],  # embed: fsdp is not in the mesh, so the next rule
        "batch_mlp": ["data", "model"],
        "embed_mlp": ["model", None],  # model is taken by embed, so mlp is replicated
        "heads_vocab": [["data", "model"], None],
        "none_batch": [None, "data"],
    }
    for name, spec in expected_specs.items():
        assert out[name]["spec"] == spec, name
        got = [(idx, data) for idx, data in out[name]["shards"]]
        assert got == _ref_shards(base, spec), name
    spec_json, same_spec, same_mesh = out["array_spec"]
    assert spec_json == {"shape": [8, 12], "dtype": "float32", "logical_axes": ["batch", "embed"], "sharding": ["data", "model"]}
    assert same_spec and same_mesh
    assert [(i, d) for i, d in out["jit"]] == _ref_shards(base * 2, [["data", "model"], None])
    assert out["no_mesh"] == ["fsdp"]
