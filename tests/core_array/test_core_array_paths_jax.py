"""Paths on registered JAX pytrees: the same strings and order as ``jax.tree_util``.

The reference is JAX itself: ``tree_flatten_with_path`` gives the leaves and their key
paths, rendered with ``keystr(simple=True, separator='/')``. Skipped without JAX (the
``tests_package(core_array)`` venv has none; the rest of core_array is tested there).
"""

import collections
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

jax = pytest.importorskip("jax")
tu = jax.tree_util

from cairn.core_array import (  # noqa: E402
    ArraySpec,
    PathError,
    QArray,
    QuantLayout,
    flatten_with_paths,
    map_with_path,
    unflatten,
)

Point = collections.namedtuple("Point", ["x", "y"])


@tu.register_pytree_node_class
class Node:
    """A custom node without keys: JAX names its children by flattened index."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def tree_flatten(self):
        return (self.a, self.b), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    def __eq__(self, other):
        return type(other) is Node and (self.a, self.b) == (other.a, other.b)

    def __repr__(self):
        return f"Node({self.a!r}, {self.b!r})"


@tu.register_pytree_with_keys_class
class Keyed:
    """A custom node with DictKey entries (keys carried as aux data)."""

    def __init__(self, d):
        self.d = dict(d)

    def tree_flatten_with_keys(self):
        return [(tu.DictKey(k), v) for k, v in self.d.items()], tuple(self.d)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(dict(zip(aux, children)))

    def __eq__(self, other):
        return type(other) is Keyed and self.d == other.d

    def __repr__(self):
        return f"Keyed({self.d!r})"


@tu.register_dataclass
@dataclasses.dataclass
class Registered:
    param: object
    width: int = dataclasses.field(default=0, metadata={"static": True})


def _jax_reference(tree):
    """Paths and leaves as JAX itself renders them."""
    pairs, _ = tu.tree_flatten_with_path(tree)
    return [tu.keystr(kp, simple=True, separator="/") for kp, _ in pairs], [leaf for _, leaf in pairs]


def test_custom_nodes_none_leaves_and_empty_containers():
    tree = {
        "n": Node(None, [1, {}, ()]),
        "e": [],
        "d": {},
        "t": (),
        "x": Node(Node(2, None), 3),
        "k": Keyed({"b": 4, "a": None}),
        "r": Registered([5, 6], width=7),
    }
    flat = flatten_with_paths(tree)
    paths, leaves = _jax_reference(tree)
    assert list(flat) == paths == ["k/b", "n/1/0", "r/param/0", "r/param/1", "x/0/0", "x/1"]
    assert list(flat.values()) == leaves
    back = unflatten({p: v * 10 for p, v in flat.items()}, like=tree)
    assert back["n"] == Node(None, [10, {}, ()]) and back["x"] == Node(Node(20, None), 30)
    assert back["k"] == Keyed({"b": 40, "a": None}) and back["r"] == Registered([50, 60], width=7)
    assert (back["e"], back["d"], back["t"]) == ([], {}, ())
    assert tu.tree_structure(back) == tu.tree_structure(tree)


def test_is_leaf_none_matches_jax():
    tree = {"a": None, "b": [None, 1], "c": Node(None, 2)}
    is_none = lambda x: x is None  # noqa: E731
    flat = flatten_with_paths(tree, is_leaf=is_none)
    pairs, _ = tu.tree_flatten_with_path(tree, is_leaf=is_none)
    assert list(flat) == [tu.keystr(kp, simple=True, separator="/") for kp, _ in pairs]
    assert flat == {"a": None, "b/0": None, "b/1": 1, "c/0": None, "c/1": 2}
    back = unflatten({p: "x" for p in flat}, like=tree, is_leaf=is_none)
    assert back == {"a": "x", "b": ["x", "x"], "c": Node("x", "x")}


@pytest.mark.parametrize(
    "node, fragment",
    [
        (Keyed({"a/b": 1}), "key 'a/b' under 'k' contains '/'"),
        (Keyed({(1, 2): 1}), "key (1, 2) of type tuple under 'k'"),
        (Keyed({1.5: 1}), "key 1.5 of type float under 'k'"),
        (Keyed({"": 1}), "empty string key under 'k'"),
        (Keyed({1: 1, "1": 2}), "same path component '1'"),
    ],
)
def test_bad_keys_in_registered_nodes_raise(node, fragment):
    with pytest.raises(PathError) as e:
        flatten_with_paths({"k": node})
    assert fragment in str(e.value)


def test_jax_arrays_and_map_with_path_keep_structure():
    jnp = jax.numpy
    tree = {"layers": [Registered(jnp.ones((2, 3)), 1), Registered(jnp.zeros(3), 2)], "head": Node(jnp.ones(1), None)}
    out = map_with_path(lambda p, x: x + len(p), tree)
    assert tu.tree_structure(out) == tu.tree_structure(tree)
    np.testing.assert_array_equal(out["layers"][0].param, np.full((2, 3), 1 + len("layers/0/param")))
    np.testing.assert_array_equal(out["head"].a, np.full(1, 1 + len("head/0")))


def test_core_array_types_walk_like_their_jax_registration():
    """ArraySpec and QuantLayout are leaves (JAX does not register them); QArray has the
    children of its pytree. The walker handles them itself, so the answer is the same
    without JAX (test_core_array_without_jax checks that side)."""
    q = QArray(np.zeros((2, 4), np.int8), np.ones((2, 2), np.float32), qtype="int8", layout=QuantLayout.per_tile(1, 2))
    qz = QArray(np.zeros((2, 4), np.int8), np.ones((2, 2), np.float32), np.zeros((2, 2), np.int8),
                qtype="int8", layout=QuantLayout.per_tile(1, 2))
    tree = {"spec": ArraySpec((2, 3), "bfloat16", ("batch", None)), "layout": QuantLayout.per_channel(0), "q": q, "qz": qz}
    flat = flatten_with_paths(tree)
    paths, leaves = _jax_reference(tree)
    assert list(flat) == paths == ["layout", "q/qvalue", "q/scale", "qz/qvalue", "qz/scale", "qz/zero_point", "spec"]
    assert all(a is b for a, b in zip(flat.values(), leaves))
    back = unflatten(flat, like=tree)
    assert back["spec"] is tree["spec"] and isinstance(back["qz"], QArray) and back["qz"].layout == qz.layout


# --- hypothesis: random trees mixing plain containers and registered nodes ---

keys = st.text(alphabet="abcdefgh_0123456789", min_size=1, max_size=3)
leaves = st.one_of(st.integers(), st.text(max_size=2))
trees = st.recursive(
    st.one_of(leaves, st.none()),
    lambda c: st.one_of(
        st.lists(c, max_size=3),
        st.lists(c, max_size=3).map(tuple),
        st.dictionaries(keys, c, max_size=3),
        st.builds(Point, c, c),
        st.builds(Node, c, c),
        st.dictionaries(keys, c, max_size=3).map(Keyed),
        st.builds(Registered, c, st.integers(0, 3)),
    ),
    max_leaves=20,
)


@settings(max_examples=80, deadline=None)
@given(trees)
def test_paths_and_order_equal_jax_and_round_trip(tree):
    flat = flatten_with_paths(tree)
    paths, jleaves = _jax_reference(tree)
    assert list(flat) == paths
    assert list(flat.values()) == jleaves
    back = unflatten(flat, like=tree)
    assert back == tree
    assert tu.tree_structure(back) == tu.tree_structure(tree)
