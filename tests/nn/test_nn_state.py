"""split / merge / state / update / clone / pop, filters, pure dicts, paths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn import nn
from cairn.core_array import flatten_with_paths


class Lin(nn.Module):
    def __init__(self, din, dout, rngs):
        self.kernel = nn.Param(jax.random.normal(rngs.params(), (din, dout)))
        self.bias = nn.Param(jnp.zeros((dout,)))

    def __call__(self, x):
        return x @ self.kernel + self.bias


class Block(nn.Module):
    def __init__(self, widths, rngs):
        self.layers = [Lin(a, b, rngs) for a, b in zip(widths[:-1], widths[1:])]
        self.mean = nn.BatchStat(jnp.zeros((widths[-1],)))
        self.cache = nn.Cache(jnp.ones(()))
        self.name = "block"


def _model(widths=(2, 3, 4)):
    return Block(widths, nn.Rngs(0))


def test_split_merge_reuses_variables_and_roundtrips():
    m = _model()
    gd, state = nn.split(m)
    m2 = nn.merge(gd, state)
    assert m2 is not m and m2.layers[0] is not m.layers[0]
    assert m2.layers[0].kernel is m.layers[0].kernel  # same Variable objects
    m3 = nn.merge(gd, state, copy=True)
    assert m3.layers[0].kernel is not m.layers[0].kernel
    assert m3.name == "block" and isinstance(m3.layers, nn.List)
    assert nn.graphdef(m3) == gd and hash(nn.graphdef(m3)) == hash(gd)


def test_split_with_filters_and_exhaustiveness():
    m = _model()
    gd, params, stats, rest = nn.split(m, nn.Param, nn.BatchStat, ...)
    assert params.flat_paths() == ["layers/0/kernel", "layers/0/bias", "layers/1/kernel", "layers/1/bias"]
    assert stats.flat_paths() == ["mean"] and rest.flat_paths() == ["cache"]
    m2 = nn.merge(gd, params, stats, rest)
    assert m2.cache is m.cache
    with pytest.raises(ValueError, match=r"'mean' \(BatchStat\) matched none of the filters"):
        nn.split(m, nn.Param, nn.Cache)
    with pytest.raises(ValueError, match=r"no variable at \['mean'\]"):
        nn.merge(gd, params, rest)


def test_state_filters():
    m = _model()
    paths = lambda f: nn.state(m, f).flat_paths()  # noqa: E731
    assert paths(nn.OfType(nn.BatchStat)) == ["mean"]
    assert paths(nn.PathContains("bias")) == ["layers/0/bias", "layers/1/bias"]
    assert paths(nn.PathContains(1)) == ["layers/1/kernel", "layers/1/bias"]
    assert paths(r"layers/\d+/kernel") == ["layers/0/kernel", "layers/1/kernel"]
    assert paths(nn.Any(nn.BatchStat, nn.Cache)) == ["mean", "cache"]
    assert paths(nn.All(nn.Param, nn.PathContains(0))) == ["layers/0/kernel", "layers/0/bias"]
    assert paths(nn.Not(nn.Param)) == ["mean", "cache"]
    assert len(paths(nn.Everything())) == 6 and paths(nn.Nothing()) == []
    assert paths([nn.Cache, "mean"]) == ["mean", "cache"]
    assert paths(lambda p, v: v.ndim == 2) == ["layers/0/kernel", "layers/1/kernel"]
    p, s = nn.state(m, nn.Param, nn.BatchStat)
    assert len(p.flat_paths()) == 4 and s.flat_paths() == ["mean"]


def test_unknown_filter_errors():
    m = _model()
    with pytest.raises(TypeError, match=r"unknown filter 3 of type int"):
        nn.state(m, 3)
    assert nn.state(m, int) == nn.State({})  # a plain type selects plain data leaves
    with pytest.raises(ValueError, match="invalid path regex"):
        nn.state(m, "layers/(")
    with pytest.raises(TypeError, match="OfType expects a class"):
        nn.OfType(3)


def test_state_nested_access_and_pytree():
    m = _model()
    s = nn.state(m)
    assert s["layers"][0]["kernel"] is m.layers[0].kernel
    assert s.layers[1].bias is m.layers[1].bias
    assert list(s) == ["layers", "mean", "cache"] and "mean" in s and len(s) == 3
    with pytest.raises(KeyError):
        s["nope"]
    with pytest.raises(AttributeError, match="no key 'nope'"):
        _ = s.nope
    shapes = jax.tree.map(lambda x: x.shape, s)
    assert isinstance(shapes, nn.State) and shapes["layers"][0]["kernel"].value == (2, 3)
    assert isinstance(shapes["mean"], nn.BatchStat)
    fp = flatten_with_paths(s)
    assert list(fp) == ["layers/0/kernel", "layers/0/bias", "layers/1/kernel", "layers/1/bias", "mean", "cache"]
    assert fp["mean"] is m.mean.value
    s2 = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s))(s)
    np.testing.assert_allclose(s2["cache"].value, 2.0)


def test_pure_dict_roundtrip_and_errors():
    m = _model()
    s = nn.state(m)
    pure = nn.to_pure_dict(s)
    assert set(pure) == {"layers", "mean", "cache"} and set(pure["layers"]) == {0, 1}
    new = jax.tree.map(lambda x: x + 1.0, pure)
    nn.replace_by_pure_dict(s, new)
    np.testing.assert_allclose(m.cache.value, 2.0)  # in place, through the shared Variables
    # string keys for list indices are accepted (e.g. from a checkpoint)
    strkeys = {"layers": {str(k): v for k, v in new["layers"].items()}, "mean": new["mean"], "cache": new["cache"]}
    nn.replace_by_pure_dict(s, strkeys)
    del new["layers"][1]["bias"]
    with pytest.raises(KeyError, match=r"no value for 'layers/1/bias' \(missing key 'bias' at 'layers/1'\)"):
        nn.replace_by_pure_dict(s, new)


def test_update_and_errors():
    m = _model()
    other = _model((2, 3, 4))
    nn.update(other, nn.state(m, nn.Param))
    for a, b in zip(jax.tree.leaves(nn.state(m, nn.Param)), jax.tree.leaves(nn.state(other, nn.Param))):
        np.testing.assert_array_equal(a, b)
    assert other.layers[0].kernel is not m.layers[0].kernel
    bad = nn.State({"layers": {5: {"kernel": nn.Param(jnp.ones(1))}}})
    with pytest.raises(ValueError, match=r"Block has no variable at 'layers/5/kernel'"):
        nn.update(m, bad)


def test_clone_is_independent():
    m = _model()
    c = nn.clone(m)
    c.layers[0].kernel.value = jnp.zeros((2, 3))
    assert float(jnp.abs(m.layers[0].kernel.value).sum()) > 0
    import copy

    d = copy.deepcopy(m)
    assert d.mean is not m.mean


def test_pop():
    m = _model()
    cache = nn.pop(m, nn.Cache)
    assert cache.flat_paths() == ["cache"] and not hasattr(m, "cache")
    assert "cache" not in nn.state(m).flat_paths()


def test_structure_change_invalidates_cache():
    m = _model()
    gd1 = nn.graphdef(m)
    assert nn.graphdef(m) is gd1  # cached
    m.layers[0].kernel.value = jnp.zeros((2, 3))  # value change: not structural
    assert nn.graphdef(m) is gd1
    m.layers[1].extra = nn.Param(jnp.ones(1))
    gd2 = nn.graphdef(m)
    assert gd2 != gd1 and "layers/1/extra" in nn.state(m).flat_paths()
    m.name = "other"
    assert nn.graphdef(m) != gd2
    m.mean.note = "metadata"  # variable metadata is structural too
    assert nn.graphdef(m).node != gd2.node


@settings(max_examples=10, deadline=None)
@given(
    widths=st.lists(st.integers(1, 4), min_size=2, max_size=5),
    seed=st.integers(0, 2**16),
)
@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_property_split_merge_and_pure_dict_roundtrip(widths, seed):
    m = Block(tuple(widths), nn.Rngs(seed))
    gd, *states = nn.split(m, nn.Param, ...)
    m2 = nn.merge(gd, *states, copy=True)
    assert nn.graphdef(m2) == gd
    a = flatten_with_paths(m)
    b = flatten_with_paths(m2)
    assert list(a) == list(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    pure = nn.to_pure_dict(nn.state(m2))
    m3 = nn.clone(m2)
    nn.replace_by_pure_dict(nn.state(m3), jax.tree.map(lambda x: x * 0 + 7, pure))
    assert all(float(jnp.max(jnp.abs(x - 7))) == 0 for x in jax.tree.leaves(m3))
    nn.replace_by_pure_dict(nn.state(m3), pure)
    for x, y in zip(jax.tree.leaves(m3), jax.tree.leaves(m)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
@settings(max_examples=10, deadline=None)
@given(widths=st.lists(st.integers(1, 5), min_size=2, max_size=4))
def test_property_eval_shape_shapes(widths):
    abstract = nn.eval_shape(lambda: Block(tuple(widths), nn.Rngs(0)))
    concrete = Block(tuple(widths), nn.Rngs(0))
    sa, sc = flatten_with_paths(abstract), flatten_with_paths(concrete)
    assert list(sa) == list(sc)
    for k in sa:
        assert isinstance(sa[k], jax.ShapeDtypeStruct)
        assert sa[k].shape == sc[k].shape and sa[k].dtype == sc[k].dtype
