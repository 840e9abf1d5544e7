"""Path convention: flatten / unflatten round trips and every error path."""

import collections
import dataclasses
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.core_array import (
    PathError,
    flatten_with_paths,
    map_with_path,
    match_paths,
    path_matches,
    tree_paths,
    unflatten,
)

Point = collections.namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Block:
    kernel: object
    bias: object = None


def test_convention_on_mixed_containers():
    tree = {
        "layers": [Block(kernel=1, bias=2), Block(kernel=3)],
        "pt": Point(4, (5, 6)),
        7: "seven",
        "none": None,
    }
    flat = flatten_with_paths(tree)
    # int and str keys sort separately in Python; our keys here are mixed, so the
    # insertion order is kept for the dict; the *set* of paths is the convention.
    assert set(flat) == {"layers/0/kernel", "layers/0/bias", "layers/1/kernel", "pt/x", "pt/y/0", "pt/y/1", "7"}
    assert flat["pt/y/1"] == 6 and flat["7"] == "seven"
    back = unflatten(flat, like=tree)
    assert back == tree
    assert type(back["pt"]) is Point and type(back["layers"][0]) is Block


def test_sorted_dict_order_matches_jax():
    jax = pytest.importorskip("jax")
    tree = {"b": {"z": 1, "a": 2}, "a": [3, {"k": 4}], "c": (5,)}
    ours = list(flatten_with_paths(tree).values())
    assert ours == jax.tree_util.tree_leaves(tree)


def test_ordered_dict_keeps_insertion_order():
    tree = OrderedDict([("z", 1), ("a", 2)])
    assert list(flatten_with_paths(tree)) == ["z", "a"]
    assert unflatten({"z": 10, "a": 20}, like=tree) == OrderedDict([("z", 10), ("a", 20)])


def test_defaultdict_round_trip_keeps_type():
    d = collections.defaultdict(list, {"b": 1, "a": 2})
    back = unflatten(flatten_with_paths(d), like=d)
    assert isinstance(back, collections.defaultdict) and back.default_factory is list and dict(back) == dict(d)


def test_root_leaf_has_empty_path():
    assert flatten_with_paths(5) == {"": 5}
    assert unflatten({"": 5}) == 5
    assert unflatten({"": 5}, like=0) == 5


def test_none_is_empty_subtree():
    assert flatten_with_paths({"a": None, "b": [None, 1]}) == {"b/1": 1}
    assert unflatten({"b/1": 9}, like={"a": None, "b": [None, 1]}) == {"a": None, "b": [None, 9]}


def test_jax_registered_pytree_uses_key_paths():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    @jax.tree_util.register_pytree_with_keys_class
    class Pair:
        def __init__(self, left, right):
            self.left, self.right = left, right

        def tree_flatten_with_keys(self):
            ga = jax.tree_util.GetAttrKey
            return ((ga("left"), self.left), (ga("right"), self.right)), None

        @classmethod
        def tree_unflatten(cls, aux, children):
            return cls(*children)

    tree = {"p": Pair(jnp.ones(2), [jnp.zeros(1)])}
    flat = flatten_with_paths(tree)
    assert list(flat) == ["p/left", "p/right/0"]
    back = unflatten({k: v + 1 for k, v in flat.items()}, like=tree)
    assert isinstance(back["p"], Pair)
    np.testing.assert_array_equal(back["p"].right[0], np.ones(1))


def test_optax_state_paths():
    pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    state = optax.adam(1e-3).init({"w": jnp.ones(2)})
    assert tree_paths(state) == ["0/count", "0/mu/w", "0/nu/w"]


@pytest.mark.parametrize(
    "tree, fragment",
    [
        ({"a/b": 1}, "contains '/'"),
        ({"": 1}, "empty string key"),
        ({(1, 2): 1}, "type tuple"),
        ({1.5: 1}, "type float"),
        ({True: 1}, "type bool"),
        ({1: 1, "1": 2}, "same path component '1'"),
        ({"x": {"a/b": 1}}, "under 'x'"),
    ],
)
def test_bad_keys_raise_clear_errors(tree, fragment):
    with pytest.raises(PathError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        flatten_with_paths(tree)


def test_unflatten_lists_every_difference():
    with pytest.raises(PathError) as e:
        unflatten({"a": 1, "c": 2, "d": 3}, like={"a": 0, "b": 0, "e": [0]})
    msg = str(e.value)
    assert "missing 2" in msg and "'b'" in msg and "'e/0'" in msg
    assert "unexpected 2" in msg and "'c'" in msg and "'d'" in msg


def test_none_template_is_the_empty_tree():
    assert flatten_with_paths(None) == {}
    assert unflatten({}, like=None) is None
    with pytest.raises(PathError, match="unexpected 1: 'a'"):
        unflatten({"a": 1}, like=None)
    assert unflatten({}, like={"a": [], "b": {}, "c": ()}) == {"a": [], "b": {}, "c": ()}


@pytest.mark.parametrize(
    "flat, fragment",
    [
        ({"a//b": 1}, "empty component"),
        ({"/a": 1}, "empty component"),
        ({"a/": 1}, "empty component"),
        ({("a",): 1}, "is a tuple, expected a str"),
        ({3: 1}, "is a int, expected a str"),
    ],
)
def test_unflatten_without_like_rejects_bad_paths(flat, fragment):
    with pytest.raises(PathError, match=fragment):
        unflatten(flat)


def test_unflatten_needs_a_mapping():
    with pytest.raises(PathError, match="expects a mapping"):
        unflatten([("a", 1)])


def test_is_leaf_sees_none():
    tree = {"a": None, "b": [None, 1]}
    is_none = lambda x: x is None  # noqa: E731
    assert flatten_with_paths(tree, is_leaf=is_none) == {"a": None, "b/0": None, "b/1": 1}
    assert unflatten({"a": 1, "b/0": 2, "b/1": 3}, like=tree, is_leaf=is_none) == {"a": 1, "b": [2, 3]}


def test_unflatten_without_like_conflicts():
    with pytest.raises(PathError, match="below leaf 'a'"):
        unflatten({"a": 1, "a/b": 2})
    with pytest.raises(PathError, match="both a leaf and a subtree"):
        unflatten({"a/b": 2, "a": 1})
    with pytest.raises(PathError, match="root path"):
        unflatten({"": 1, "a": 2})


def test_map_with_path_and_mismatch():
    out = map_with_path(lambda p, x, y: (p, x + y), {"a": 1, "b": [2]}, {"a": 10, "b": [20]})
    assert out == {"a": ("a", 11), "b": [("b/0", 22)]}
    with pytest.raises(PathError, match="tree 0 vs tree 1"):
        map_with_path(lambda p, x, y: x, {"a": 1}, {"b": 1})


def test_match_paths_full_match_and_errors():
    tree = {"embed": 1, "layers": [{"kernel": 2, "bias": 3}], "head": {"kernel": 4}}
    assert match_paths(tree, r".*kernel") == ["head/kernel", "layers/0/kernel"]
    assert match_paths(tree, "kernel") == []  # full match, not search
    assert match_paths(["a/b", "c"], "a/.*") == ["a/b"]
    assert path_matches(r"layers/\d+/.*", "layers/0/bias")
    with pytest.raises(PathError, match="invalid path pattern"):
        path_matches("(", "x")


def test_is_leaf():
    tree = {"a": (1, 2), "b": [3]}
    assert flatten_with_paths(tree, is_leaf=lambda x: isinstance(x, tuple)) == {"a": (1, 2), "b/0": 3}


# --- hypothesis: exact round trip over random nested containers ---

keys = st.text(alphabet="abcdefghij_0123456789", min_size=1, max_size=4)
leaves = st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=3), st.none())
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(keys, children, max_size=4).map(lambda d: OrderedDict(reversed(list(d.items())))),
        st.dictionaries(st.integers(0, 99), children, max_size=3),
        st.builds(Point, children, children),
        st.builds(Block, children, children),
    ),
    max_leaves=25,
)


def _same_types(a, b):
    """``==`` ignores container types (a list equals nothing but a list, but an OrderedDict
    equals a dict and a namedtuple equals a tuple); check the types along the way too."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, dict):
        # a plain dict comes back in sorted-key order, as from jax.tree_util;
        # an OrderedDict keeps its order
        assert list(a) == list(b) if isinstance(a, OrderedDict) else set(a) == set(b)
        for k in a:
            _same_types(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        for x, y in zip(a, b):
            _same_types(x, y)
    elif isinstance(a, Block):
        _same_types(a.kernel, b.kernel)
        _same_types(a.bias, b.bias)


@settings(max_examples=60, deadline=None)
@given(trees)
def test_round_trip_is_exact(tree):
    flat = flatten_with_paths(tree)
    back = unflatten(flat, like=tree)
    assert back == tree
    _same_types(back, tree)
    # every path is distinct and uses only the separator between components
    assert len(flat) == len(set(flat))
    assert all(not p.startswith("/") and "//" not in p for p in flat)


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(keys, st.dictionaries(keys, st.integers(), min_size=1, max_size=3), max_size=4))
def test_nested_str_dicts_round_trip_without_like(tree):
    tree = {k: v for k, v in tree.items() if v}
    assert unflatten(flatten_with_paths(tree)) == tree
