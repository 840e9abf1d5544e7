"""key_name / join_path / path_of / compile_pattern / is_checkpointable: the pieces every
package builds its paths and matches from, checked against flatten_with_paths."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cairn.core_array import (
    PathError,
    compile_pattern,
    flatten_with_paths,
    is_checkpointable,
    join_path,
    key_name,
    path_of,
)

_keys = st.one_of(
    st.text(alphabet=st.characters(blacklist_characters="/", blacklist_categories=("Cs",)), min_size=1, max_size=6),
    st.integers(min_value=0, max_value=10**6),
)


def _nested(keys: list, leaf: object) -> object:
    tree = leaf
    for k in reversed(keys):
        tree = {k: tree}
    return tree


@given(st.lists(_keys, min_size=1, max_size=5))
def test_path_of_equals_the_flatten_path(keys):
    # the path a key tuple names is the path flatten_with_paths gives the same leaf
    assert list(flatten_with_paths(_nested(keys, 1))) == [path_of(keys)]


@given(st.lists(_keys, min_size=1, max_size=5))
def test_join_path_folds_to_path_of(keys):
    path = ""
    for k in keys:
        path = join_path(path, k)
    assert path == path_of(keys)


def test_key_names():
    assert key_name("kernel") == "kernel"
    assert key_name(0) == "0" and key_name(12) == "12"
    assert path_of(()) == ""
    assert join_path("", "a") == "a" and join_path("a", 1) == "a/1"


@pytest.mark.parametrize(
    "bad, fragment",
    [("", "empty string key"), ("a/b", "contains '/'"), (True, "type bool"), (1.5, "type float"), (("a",), "type tuple")],
)
def test_bad_keys_name_the_parent(bad, fragment):
    with pytest.raises(PathError, match=re.escape(fragment)) as info:
        join_path("layers/0", bad)
    assert "layers/0" in str(info.value)


def test_jax_key_entries_are_named_like_flatten():
    jax = pytest.importorskip("jax")
    tree = {"a": [1, {"b": 2}], "c": (3,)}
    kps = [kp for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert [path_of(kp) for kp in kps] == list(flatten_with_paths(tree))


def test_compile_pattern_is_cached_and_full_match():
    rx = compile_pattern(r"layers/\d+/kernel")
    assert rx is compile_pattern(r"layers/\d+/kernel")
    assert rx.fullmatch("layers/3/kernel") and not rx.fullmatch("x/layers/3/kernel")
    assert compile_pattern(rx) is rx


@pytest.mark.parametrize("bad", ["(", "[a-", 3])
def test_compile_pattern_errors_name_the_pattern(bad):
    with pytest.raises(PathError, match="pattern"):
        compile_pattern(bad)


def test_is_checkpointable():
    class Good:
        def get_state(self):
            return {}

        def set_state(self, state):
            pass

    class NotCallable:
        get_state = 1
        set_state = 2

    assert is_checkpointable(Good())
    assert not is_checkpointable(NotCallable())
    assert not is_checkpointable({"get_state": 1, "set_state": 2})
