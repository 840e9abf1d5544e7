"""Record structures (_tree): batching errors name paths in the core_array convention."""

import collections
import re

import numpy as np
import pytest

from cairn.core_array import PathError, flatten_with_paths
from cairn.data import StructureMismatchError, stack_records
from cairn.data._tree import StructureChecker, first_mismatch, structure_of

Point = collections.namedtuple("Point", "x y")


def _record(n=3):
    return {"feat": [np.zeros(n), {"ids": np.arange(n)}], "pt": Point(1, np.zeros(2)), "s": "a"}


def test_leaf_paths_are_core_array_paths():
    rec = _record()
    leaves = [p for p, sig in structure_of(rec).items() if sig[0] in ("ndarray", "leaf")]
    assert leaves == list(flatten_with_paths(rec))  # same strings, same (insertion) order here


def test_structure_of_gives_containers_their_own_paths():
    s = structure_of(_record())
    assert s[""] == ("dict", ("feat", "pt", "s"))
    assert s["feat"] == ("sequence", "list", 2)
    assert s["feat/1"] == ("dict", ("ids",))
    assert s["pt"] == ("sequence", "Point", 2) and s["pt/x"] == ("leaf", "int")
    assert structure_of({"a": 1}, path="outer") == {
        "outer": ("dict", ("a",)),
        "outer/a": ("leaf", "int"),
    }


def test_structure_of_rejects_keys_that_are_not_path_components():
    with pytest.raises(PathError, match=r"key 2\.5 of type float under 'a'"):
        structure_of({"a": {2.5: 1}})
    with pytest.raises(PathError, match=r"'x/y' under 'a' contains '/'"):
        structure_of({"a": {"x/y": 1}})


def test_first_mismatch_names_the_path():
    assert first_mismatch(_record(), _record()) is None
    other = _record()
    other["feat"][1]["ids"] = np.arange(4)
    path, why = first_mismatch(_record(), other)
    assert path == "feat/1/ids" and "shape (3,)" in why and "shape (4,)" in why
    other = _record()
    other["feat"] = np.zeros(2)
    assert first_mismatch(_record(), other) == (
        "feat",
        "expected a list of length 2 (as in the first record), got an array of dtype float64 and shape (2,)",
    )
    assert first_mismatch({"a": np.zeros(3)}, {"a": np.zeros(4)}, check_shapes=False) is None
    assert first_mismatch({"a": 1}, {"a": 1, "b": 2})[0] == ""
    assert first_mismatch(Point(1, 2), Point(1, "x"))[0] == "y"


def test_batching_errors_name_record_and_path():
    with pytest.raises(ValueError, match=r"at path 'feat/0' record 1 has shape \(4,\)"):
        stack_records([_record(3), _record(4)])
    bad = _record()
    bad["feat"][1] = {"other": 1}
    with pytest.raises(
        ValueError, match=r"record 1 differs from record 0 at path 'feat/1': expected a dict"
    ):
        stack_records([_record(), bad])
    with pytest.raises(ValueError, match=r"at path 'outer/feat/0'"):
        stack_records([_record(3), _record(4)], path="outer")
    with pytest.raises(ValueError, match="empty list"):
        stack_records([])


@pytest.mark.parametrize("key", [(1, 2), 2.5, True, "x/y", ""])
def test_keys_that_cannot_be_path_components_batch_and_err_clearly(key):
    ok = stack_records([{"a": {key: np.zeros(2)}}, {"a": {key: np.ones(2)}}])
    assert ok["a"][key].shape == (2, 2)  # any key batches; paths only name errors
    with pytest.raises(
        ValueError, match=re.escape(f"at key {key!r} under path 'a' record 1 has shape (3,)")
    ):
        stack_records([{"a": {key: np.zeros(2)}}, {"a": {key: np.zeros(3)}}])
    with pytest.raises(
        ValueError,
        match=re.escape(f"differs from record 0 at key {key!r} under path 'a': expected a dict"),
    ):
        stack_records([{"a": {key: {"b": 1}}}, {"a": {key: {"c": 1}}}])


def test_debug_checker_names_the_path_and_survives_odd_keys():
    c = StructureChecker("map")
    c.check({"a": {"b": np.zeros(2)}})
    c.check({"a": {"b": np.zeros(2)}})
    with pytest.raises(
        StructureMismatchError, match=r"element 2 .* stage 'map' .* at path 'a/b'"
    ) as e:
        c.check({"a": {"b": np.zeros(3)}})
    assert e.value.path == "a/b"
    c = StructureChecker("map")
    c.check({"a": {(1, 2): 1}})
    with pytest.raises(StructureMismatchError, match=r"at key \(1, 2\) under path 'a'") as e:
        c.check({"a": {(1, 2): "s"}}, where=lambda: "record 7")
    assert e.value.path == "a" and "record 7" in str(e.value)


def test_positions_below_an_odd_key_list_the_remaining_keys():
    with pytest.raises(ValueError, match=re.escape("at key (1, 2), 'b' under path 'a' record 1")):
        stack_records([{"a": {(1, 2): {"b": np.zeros(2)}}}, {"a": {(1, 2): {"b": np.zeros(3)}}}])
