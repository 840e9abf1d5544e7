"""A restore without a target gives back the containers that were saved (issue 18)."""

import collections
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cairn.checkpoint as cc
from cairn.checkpoint import _fs, _structure

Point = collections.namedtuple("Point", ["x", "y"])


def _same(a, b):
    """Equal as trees, including container types, dict key order and leaf values."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, (np.ndarray, jax.Array)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    else:
        assert a == b


def test_list_tuple_none_int_keys_order_and_empty_containers(tmp_path):
    tree = {
        "z": [42, 43],
        "a": (np.arange(3), None, [np.float32(2.5)]),
        "m": {3: "three", 1: "one"},
        "e": {},
        "l": [],
        "j": jnp.arange(4.0),
        "o": collections.OrderedDict([("b", 1), ("a", 2)]),
    }
    cc.save(tmp_path / "c", tree)
    got = cc.restore(tmp_path / "c")
    want = dict(tree, o={"b": 1, "a": 2})  # an OrderedDict comes back as a dict, same order
    _same(got, want)


def test_a_saved_list_is_not_a_dict_of_index_strings(tmp_path):
    cc.save(tmp_path / "c", [42, 43])
    assert cc.restore(tmp_path / "c") == [42, 43]


def test_namedtuple_comes_back_as_a_dict_of_fields_as_in_orbax(tmp_path):
    cc.save(tmp_path / "c", {"p": Point(np.ones(2), 2.5)})
    got = cc.restore(tmp_path / "c")
    assert list(got["p"]) == ["x", "y"] and got["p"]["y"] == 2.5


def test_a_target_still_decides_the_structure(tmp_path):
    cc.save(tmp_path / "c", {"p": Point(np.ones(2), 2.5)})
    got = cc.restore(tmp_path / "c", {"p": Point(np.zeros(2), 0.0)})
    assert isinstance(got["p"], Point) and got["p"].y == 2.5


def test_paths_selection_gives_nested_dicts_as_before(tmp_path):
    cc.save(tmp_path / "c", {"z": [1, 2, 3]})
    assert cc.restore(tmp_path / "c", paths="z/1") == {"z": {"1": 2}}


def test_checkpoint_without_stored_structure_restores_as_nested_dicts(tmp_path):
    cc.save(tmp_path / "c", {"z": [42, 43], "b": {"c": 1}})
    meta_file = os.path.join(tmp_path, "c", "_METADATA.json")
    meta = _fs.read_json(meta_file)
    del meta["structure"]  # as written by cairn-checkpoint 0.1
    os.remove(meta_file)
    _fs.write_json_durable(meta_file, meta)
    assert cc.restore(tmp_path / "c") == {"b": {"c": 1}, "z": {"0": 42, "1": 43}}


def test_structure_not_matching_the_leaves_is_reported_as_corrupt(tmp_path):
    cc.save(tmp_path / "c", {"z": [42, 43]})
    meta_file = os.path.join(tmp_path, "c", "_METADATA.json")
    meta = _fs.read_json(meta_file)
    meta["structure"] = {"dict": [["z", {"list": ["L", "L", "L"]}]]}
    os.remove(meta_file)
    _fs.write_json_durable(meta_file, meta)
    with pytest.raises(cc.CheckpointCorruptError, match="_METADATA.json.*structure"):
        cc.restore(tmp_path / "c")


def test_structure_json_is_plain_json():
    s = _structure.describe({"a": [1, (None,)], 2: Point(1, 2)}, {"a/0": 1, "2/x": 1, "2/y": 2})
    assert json.loads(json.dumps(s)) == s
    assert _structure.leaf_paths_of(s) == {"a/0", "2/x", "2/y"}


_leaf = st.one_of(st.integers(-5, 5), st.text("ab", max_size=2), st.none(),
                  st.builds(lambda n: np.arange(n, dtype=np.int16), st.integers(0, 3)))
_trees = st.recursive(
    _leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.lists(kids, max_size=3).map(tuple),
        st.dictionaries(st.text("xyz", min_size=1, max_size=2), kids, max_size=3),
    ),
    max_leaves=8,
)


@settings(max_examples=15, deadline=None)
@given(tree=_trees)
def test_round_trip_property(tmp_path_factory, tree):
    d = tmp_path_factory.mktemp("s") / "c"
    cc.save(d, {"t": tree})
    _same(cc.restore(d), {"t": tree})


def test_saved_sharding_comes_back_without_a_target(run_on_cpu_devices, tmp_path):
    code = """
import sys, jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import cairn.checkpoint as cc
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
x = jax.device_put(np.arange(16.0).reshape(4, 4), NamedSharding(mesh, P("data", "model")))
cc.save(sys.argv[1], {"x": x, "y": jax.numpy.ones(3)})
got = cc.restore(sys.argv[1])
assert got["x"].sharding.spec == P("data", "model"), got["x"].sharding
assert dict(got["x"].sharding.mesh.shape) == {"data": 2, "model": 2}
assert len(got["x"].addressable_shards) == 4
np.testing.assert_array_equal(np.asarray(got["x"]), np.arange(16.0).reshape(4, 4))
print("ok")
"""
    r = run_on_cpu_devices(code, str(tmp_path / "c"), devices=4)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_other_pytree_nodes_come_back_as_nested_dicts(tmp_path):
    import dataclasses

    @dataclasses.dataclass
    class Layer:
        w: np.ndarray
        extra: dict

    tree = {"layers": [Layer(np.ones(2), {"b": 1, "a": [2]}), Layer(np.zeros(1), {"b": 3, "a": [4]})], "ab": 5}
    cc.save(tmp_path / "c", tree)
    got = cc.restore(tmp_path / "c")
    assert got["ab"] == 5 and isinstance(got["layers"], list)
    assert got["layers"][1] == {"w": got["layers"][1]["w"], "extra": {"a": {"0": 4}, "b": 3}}
    np.testing.assert_array_equal(got["layers"][0]["w"], np.ones(2))
