"""Axis metadata across mapped axes (Flax NNX's ``transform_metadata``, issue 30): the
partition name of a mapped axis leaves the sharding names inside, comes back after, and
is inserted into those of variables made inside."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import nn


def _param(value, names):
    return nn.Param(jnp.asarray(value), out_sharding=names, eager_sharding=False)


def test_transform_metadata_removes_then_restores_and_inserts():
    v = _param(0, ("din", "dout"))
    seen = []

    @nn.transform_metadata(in_axes=0, out_axes=1, partition="din")
    def f(v):
        seen.append(v.out_sharding)
        v[...] += 1
        return _param(10, ("dmid", "dout"))

    v2 = f(v)
    assert seen == [("dout",)]
    assert v.out_sharding == ("din", "dout") and int(v[...]) == 1  # values changed stay
    assert v2.out_sharding == ("dmid", "din", "dout") and int(v2[...]) == 10


def test_none_partition_and_padding():
    v = _param(1, (None, "dout"))

    @nn.transform_metadata(in_axes=0, out_axes=3, partition=None)
    def f(v):
        assert v.out_sharding == ("dout",)
        return _param(10, ("a",))

    out = f(v)
    assert v.out_sharding == (None, "dout")
    # index past the end: padded with None up to the new axis
    assert out.out_sharding == ("a", None, None, None)


def test_wrong_name_at_the_mapped_axis_raises_and_restores():
    v = _param(0, ("din", "dout"))
    f = nn.transform_metadata(lambda v: v, in_axes=1, partition="din")
    with pytest.raises(ValueError, match="expected to remove 'din' at index 1"):
        f(v)
    assert v.out_sharding == ("din", "dout")
    with pytest.raises(ValueError, match="partition_name"):
        nn.vmap(lambda x: x, transform_metadata={"nickname": "x"})


def test_vmap_init_with_transform_metadata_stacks_names_and_hooks():
    adds, removes = [], []

    class Tracked(nn.Param):
        def add_axis(self, axis_index, axis_name):
            adds.append((axis_index, axis_name))
            super().add_axis(axis_index, axis_name)

        def remove_axis(self, axis_index, axis_name):
            removes.append((axis_index, axis_name))
            super().remove_axis(axis_index, axis_name)

    class Layer(nn.Module):
        @nn.vmap(in_axes=(0, 0), transform_metadata={nn.PARTITION_NAME: "layers", "nick": "n"})
        def __init__(self, key):
            self.w = Tracked(jax.random.normal(key, (2, 3)), out_sharding=("a", "b"), nick=("x", "y"))

        @nn.scan(in_axes=(0, nn.Carry), out_axes=nn.Carry,
                 transform_metadata={nn.PARTITION_NAME: "layers", "nick": "n"})
        def __call__(self, h):
            assert self.w.out_sharding == ("a", "b") and self.w.shape == (2, 3)
            return h @ self.w[...] @ self.w[...].T

    keys = jax.random.split(jax.random.key(0), 4)
    layer = Layer(keys)
    assert layer.w.shape == (4, 2, 3)
    assert layer.w.out_sharding == ("layers", "a", "b") and layer.w.nick == ("n", "x", "y")
    assert adds == [(0, "layers")] and removes == []
    h = layer(jnp.ones((1, 2)))
    assert layer.w.out_sharding == ("layers", "a", "b")
    assert removes == [(0, "layers")] and adds == [(0, "layers")] * 2
    # the scan computes the same as a plain loop over the stacked layers (float64 NumPy)
    w = np.asarray(layer.w[...], np.float64)
    ref = np.ones((1, 2))
    for i in range(4):
        ref = ref @ w[i] @ w[i].T
    np.testing.assert_allclose(np.asarray(h), ref, rtol=1e-4)
