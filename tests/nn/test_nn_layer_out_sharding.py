"""The layers' ``out_sharding=`` call argument (Flax NNX's spmd_test, issue 30): the output
is laid out as asked on a mesh with explicit axes, and its values are those of the plain
call (checked against float64 NumPy formulas). On four virtual CPU devices in a subprocess."""

from __future__ import annotations

import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P, AxisType, reshard
    from cairn import nn
    assert jax.device_count() == 4, jax.devices()
    explicit = (AxisType.Explicit, AxisType.Explicit)

    def spec(y):
        return str(jax.typeof(y))

    mesh = jax.make_mesh((2, 2), ("X", "Y"), axis_types=explicit)
    with jax.set_mesh(mesh):
        x = reshard(jnp.arange(8.0).reshape(2, 4), P("X", None))
        lin = nn.Linear(4, 6, rngs=nn.Rngs(0))
        ref = np.asarray(x, np.float64) @ np.asarray(lin.kernel[...], np.float64) + np.asarray(
            lin.bias[...], np.float64)
        for layer in (lin, nn.LinearGeneral(4, 6, rngs=nn.Rngs(0)),
                      nn.Einsum("ab,bc->ac", (4, 6), (6,), rngs=nn.Rngs(0))):
            y0, y1 = layer(x), layer(x, out_sharding=P("X", "Y"))
            assert spec(y0) == "float32[2@X,6]", spec(y0)
            assert spec(y1) == "float32[2@X,6@Y]", spec(y1)
            np.testing.assert_allclose(np.asarray(y1), ref, rtol=1e-5, atol=1e-5)

        conv = nn.Conv(4, 8, kernel_size=(3,), rngs=nn.Rngs(0))
        xc = reshard(jnp.arange(32.0).reshape(2, 4, 4) / 10, P("X", None, None))
        yc = conv(xc, out_sharding=P("X", "Y", None))
        assert spec(yc) == "float32[2@X,4@Y,8]", spec(yc)
        np.testing.assert_allclose(np.asarray(yc), np.asarray(conv(xc)), rtol=1e-6)
        # no batch axis: the result is resharded after the convolution
        y2 = conv(jnp.arange(16.0).reshape(4, 4), out_sharding=P("Y", None))
        assert spec(y2) == "float32[4@Y,8]", spec(y2)
        ct = nn.ConvTranspose(4, 8, kernel_size=(3,), rngs=nn.Rngs(0))
        assert spec(ct(xc, out_sharding=P("X", "Y", None))) == "float32[2@X,4@Y,8]"

        emb = reshard(nn.Embed(num_embeddings=8, features=4, rngs=nn.Rngs(0)), P("X"))
        ids = reshard(jnp.array([3, 0, 7, 1]), P("Y"))
        try:
            emb(ids)  # the lookup's sharding is ambiguous without out_sharding
        except Exception:
            pass
        else:
            raise AssertionError("ambiguous lookup must raise")
        rows = emb(ids, out_sharding=P("X"))
        assert spec(rows) == "float32[4@X,4]", spec(rows)
        np.testing.assert_array_equal(np.asarray(rows), np.asarray(emb.embedding[...])[[3, 0, 7, 1]])
        logits = nn.Embed(10, 4, rngs=nn.Rngs(0))
        q = reshard(jnp.arange(8.0).reshape(2, 4), P("X", None))
        assert spec(logits.attend(q)) == "float32[2@X,10]"
        la = logits.attend(q, out_sharding=P("X", "Y"))
        assert spec(la) == "float32[2@X,10@Y]", spec(la)
        np.testing.assert_allclose(
            np.asarray(la), np.asarray(q, np.float64) @ np.asarray(logits.embedding[...], np.float64).T,
            rtol=1e-5)

        # dropout's mask follows the input's layout (eager and under jax.jit)
        for drop in (nn.Dropout(0.5, deterministic=False, rngs=nn.Rngs(0)),
                     nn.Dropout(0.5, deterministic=False, broadcast_dims=(0,), rngs=nn.Rngs(0))):
            yd = drop(x)
            assert spec(yd) == "float32[2@X,4]", spec(yd)
            kept = np.asarray(yd) != 0
            np.testing.assert_allclose(np.asarray(yd)[kept], 2 * np.asarray(x)[kept])
            assert spec(jax.jit(lambda v, r: drop(v, rngs=r))(x, nn.Rngs(1))) == "float32[2@X,4]"

    mesh = jax.make_mesh((2, 2), ("fsdp", "tp"), axis_types=explicit)
    with jax.set_mesh(mesh):
        xq = reshard(jax.random.uniform(jax.random.key(0), (4, 5, 16)), P("fsdp", None, "tp"))
        mha = nn.MultiHeadAttention(
            num_heads=4, in_features=16, qkv_features=8, num_kv_heads=2,
            kernel_metadata={"out_sharding": P("fsdp", "tp", None)},
            out_kernel_metadata={"out_sharding": P("tp", None, "fsdp")},
            rngs=nn.Rngs(0), decode=False)
        out = mha(xq, out_sharding=P("fsdp", None, "tp"), qkv_sharding=P("fsdp", None, "tp", None))
        assert spec(out) == "float32[4@fsdp,5,16@tp]", spec(out)
    print("OK")
    """
)


@pytest.mark.multiprocess
def test_layer_out_sharding_on_four_devices(run_on_cpu_devices):
    r = run_on_cpu_devices(SCRIPT, devices=4, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_out_sharding_none_leaves_a_custom_dot_general_alone():
    # a user's dot_general without the out_sharding keyword keeps working when it is None
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cairn import nn

    def my_dot(x, w, dims, precision=None, preferred_element_type=None):
        return jax.lax.dot_general(x, w, dims)

    layer = nn.Linear(3, 2, dot_general=my_dot, rngs=nn.Rngs(0))
    x = jnp.arange(6.0).reshape(2, 3)
    want = np.asarray(x, np.float64) @ np.asarray(layer.kernel[...], np.float64)
    np.testing.assert_allclose(np.asarray(layer(x)), want + np.asarray(layer.bias[...]), rtol=1e-5)
