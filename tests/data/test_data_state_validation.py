"""set_state validates every field of every iterator state: type, range, keys, version.

Each case tampers with one field of a valid state (taken mid-stream) and expects a
``ValueError`` naming the iterator kind, the field's path in the nested state and what
was expected. Before, mix accepted an index of -1, '5' or 5.5, interleave accepted 14
of 21 bad states (then failed later with IndexError/TypeError), FirstFitPack accepted
``emitted=10**9``, and unknown keys and ``"version": 99`` were accepted everywhere.
"""

import copy
import json
import re

import numpy as np
import pytest

from cairn.data import (
    FirstFitPackIterDataset,
    InterleaveIterDataset,
    IterDataset,
    MapDataset,
    ReadOptions,
)


class _Delete:
    def __repr__(self):
        return "DELETED"


_DEL = _Delete()  # remove the key


def _root():
    return MapDataset.range(50).to_iter_dataset(ReadOptions(chunk_records=4))


def _random_map():
    return (
        MapDataset.range(40).to_iter_dataset().batch(3).random_map(lambda b, r: b + r.integers(9))
    )


def _interleave():
    return InterleaveIterDataset(
        [MapDataset.range(k * 100, k * 100 + 3 + k).to_iter_dataset() for k in range(5)],
        cycle_length=2,
    )


def _mix():
    return IterDataset.mix(
        [MapDataset.range(30).to_iter_dataset(), MapDataset.range(100, 140).to_iter_dataset()],
        weights=[2, 1],
    )


def _seqs():
    return MapDataset.range(30).map(lambda i: np.arange(1 + (i * 7) % 5) + 10 * i)


def _pack():
    return FirstFitPackIterDataset(_seqs().to_iter_dataset(), length_struct=8, num_packing_bins=3)


def _mp_root():
    return _root().mp_prefetch(2)


PIPELINES = {
    "root": (_root, 5),
    "random_map": (_random_map, 3),
    "interleave": (_interleave, 4),
    "mix": (_mix, 7),
    "pack": (_pack, 4),
}

ROOT = "MapDataset iterator"
INTER = "interleave iterator"
MIX = "mix iterator"
PACK = "FirstFitPack iterator"
RMAP = "random_map iterator"

# (pipeline, path to tamper ('' = the whole state), new value, kind, path in the message, expected)
CASES = [
    ("root", "", [1, 2], ROOT, "", "a dict"),
    ("root", "next_index", "5", ROOT, "next_index", "an int in [0, 50]"),
    ("root", "next_index", 5.5, ROOT, "next_index", "an int in [0, 50]"),
    ("root", "next_index", True, ROOT, "next_index", "an int in [0, 50]"),
    ("root", "next_index", None, ROOT, "next_index", "an int in [0, 50]"),
    ("root", "next_index", -1, ROOT, "next_index", "an int in [0, 50]"),
    ("root", "next_index", 51, ROOT, "next_index", "an int in [0, 50]"),
    ("root", "next_index", _DEL, ROOT, "next_index", "a value"),
    ("root", "extra", 1, ROOT, "extra", "no field 'extra'"),
    ("root", "version", 99, ROOT, "version", "one of [1]"),
    ("root", "version", "1", ROOT, "version", "one of [1]"),
    ("root", "version", True, ROOT, "version", "one of [1]"),
    ("random_map", "count", -1, RMAP, "count", "an int >= 0"),
    ("random_map", "count", "2", RMAP, "count", "an int >= 0"),
    ("random_map", "count", 2.0, RMAP, "count", "an int >= 0"),
    ("random_map", "parent/next_index", -1, ROOT, "parent/next_index", "an int in [0, 40]"),
    ("random_map", "parent/version", 2, ROOT, "parent/version", "one of [1]"),
    ("random_map", "parent", _DEL, RMAP, "parent", "a value"),
    ("random_map", "extra", {}, RMAP, "extra", "no field"),
    ("interleave", "next_to_open", -1, INTER, "next_to_open", "an int in [0, 5]"),
    ("interleave", "next_to_open", 6, INTER, "next_to_open", "an int in [0, 5]"),
    ("interleave", "next_to_open", "2", INTER, "next_to_open", "an int in [0, 5]"),
    ("interleave", "next_to_open", 2.0, INTER, "next_to_open", "an int in [0, 5]"),
    ("interleave", "slot", 2, INTER, "slot", "an int in [0, 1]"),
    ("interleave", "slot", -1, INTER, "slot", "an int in [0, 1]"),
    ("interleave", "slot", False, INTER, "slot", "an int in [0, 1]"),
    ("interleave", "open", {}, INTER, "open", "a list of 2 entries"),
    ("interleave", "open", [None], INTER, "open", "a list of 2 entries"),
    ("interleave", "open", [None, None, None], INTER, "open", "a list of 2 entries"),
    ("interleave", "open/0", "x", INTER, "open/0", "null or [input index, input state]"),
    ("interleave", "open/0", [0], INTER, "open/0", "null or [input index, input state]"),
    (
        "interleave",
        "open/0/0",
        4,
        INTER,
        "open/0/0",
        "the index of an input opened before next_to_open",
    ),
    (
        "interleave",
        "open/0/0",
        -1,
        INTER,
        "open/0/0",
        "the index of an input opened before next_to_open",
    ),
    (
        "interleave",
        "open/0/0",
        "1",
        INTER,
        "open/0/0",
        "the index of an input opened before next_to_open",
    ),
    ("interleave", "open/1/1/next_index", -1, ROOT, "open/1/1/next_index", "an int in [0, "),
    ("interleave", "open/1/1/next_index", 10**9, ROOT, "open/1/1/next_index", "an int in [0, "),
    ("interleave", "open/1/1/bogus", 0, ROOT, "open/1/1/bogus", "no field 'bogus'"),
    ("interleave", "extra", 0, INTER, "extra", "no field"),
    ("interleave", "version", 99, INTER, "version", "one of [1]"),
    ("interleave", "slot", _DEL, INTER, "slot", "a value"),
    ("mix", "index", -1, MIX, "index", "an int >= 0"),
    ("mix", "index", "5", MIX, "index", "an int >= 0"),
    ("mix", "index", 5.5, MIX, "index", "an int >= 0"),
    ("mix", "index", True, MIX, "index", "an int >= 0"),
    ("mix", "inputs", [], MIX, "inputs", "a list of the states of the 2 inputs"),
    ("mix", "inputs", "x", MIX, "inputs", "a list of the states of the 2 inputs"),
    ("mix", "inputs/1/next_index", 10**9, ROOT, "inputs/1/next_index", "an int in [0, 40]"),
    ("mix", "inputs/0/next_index", "3", ROOT, "inputs/0/next_index", "an int in [0, 30]"),
    ("mix", "inputs/0", None, ROOT, "inputs/0", "a dict"),
    ("mix", "extra", 0, MIX, "extra", "no field"),
    ("mix", "version", 99, MIX, "version", "one of [1]"),
    ("mix", "index", _DEL, MIX, "index", "a value"),
    ("pack", "emitted", 10**9, PACK, "emitted", "an int in [0, 2]"),
    ("pack", "emitted", -1, PACK, "emitted", "an int in [0, 2]"),
    ("pack", "emitted", "1", PACK, "emitted", "an int in [0, 2]"),
    ("pack", "emitted", 1.0, PACK, "emitted", "an int in [0, 2]"),
    ("pack", "window", -1, PACK, "window", "an int >= 0"),
    ("pack", "window", 1.5, PACK, "window", "an int >= 0"),
    ("pack", "parent/next_index", -1, ROOT, "parent/next_index", "an int in [0, 30]"),
    ("pack", "parent/next_index", 31, ROOT, "parent/next_index", "an int in [0, 30]"),
    ("pack", "parent", "x", ROOT, "parent", "a dict"),
    ("pack", "extra", 0, PACK, "extra", "no field"),
    ("pack", "version", 99, PACK, "version", "one of [1]"),
    ("pack", "emitted", _DEL, PACK, "emitted", "a value"),
]


def _mid_state(name):
    make, steps = PIPELINES[name]
    it = iter(make())
    for _ in range(steps):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    rest = list(it)
    return make, state, rest


def _tamper(state, path, value):
    state = copy.deepcopy(state)
    if not path:
        return value
    *head, last = path.split("/")
    node = state
    for k in head:
        node = node[int(k)] if isinstance(node, list) else node[k]
    if isinstance(node, list):
        node[int(last)] = value
    elif value is _DEL:
        del node[last]
    else:
        node[last] = value
    return state


@pytest.mark.parametrize(
    "name,path,value,kind,where,expected", CASES, ids=[f"{c[0]}:{c[1]}={c[2]!r}" for c in CASES]
)
def test_tampered_field_is_rejected_naming_kind_path_and_expectation(
    name, path, value, kind, where, expected
):
    make, state, rest = _mid_state(name)
    it = iter(make())
    for _ in range(2):  # a used iterator: a rejected state must leave it where it was
        next(it)
    before = it.get_state()
    bad = _tamper(state, path, value)
    at = f"at {where!r}" if where else "(the whole state)"
    with pytest.raises(
        ValueError, match=re.escape(f"invalid {kind} state {at}: expected {expected}")
    ):
        it.set_state(bad)
    assert it.get_state() == before
    it.set_state(state)  # and a valid state still resumes exactly
    assert _same(list(it), rest)


def test_messages_name_field_and_value():
    _, state, _ = _mid_state("mix")
    it = iter(_mix())
    with pytest.raises(ValueError) as info:
        it.set_state(_tamper(state, "inputs/1/next_index", 10**9))
    assert str(info.value) == (
        "invalid MapDataset iterator state at 'inputs/1/next_index': expected an int in "
        "[0, 40], got 1000000000"
    )
    assert info.value.path == "inputs/1/next_index" and info.value.kind == "MapDataset iterator"


def test_pack_emitted_beyond_the_rows_of_its_window():
    """Within [0, num_bins - 1] but more rows than the window at that position packs."""
    ds = FirstFitPackIterDataset(
        MapDataset.range(4).map(lambda i: np.full(8, i)).to_iter_dataset(),
        length_struct=8,
        num_packing_bins=3,
        shuffle_bins=False,
    )  # every element fills a row: windows of 3 rows, then 1 row
    it = iter(ds)
    ok = {"version": 1, "parent": {"version": 1, "next_index": 0}, "emitted": 2, "window": 0}
    it.set_state(ok)
    assert [int(r[0][0]) for r in it] == [2, 3]
    it = iter(ds)
    with pytest.raises(ValueError, match="at 'emitted': expected less than 1 .*packs into 1 rows"):
        it.set_state({"parent": {"next_index": 3}, "emitted": 2, "window": 1})
    assert [int(r[0][0]) for r in it] == [0, 1, 2, 3]  # left where it was


def _strip_versions(state):
    if isinstance(state, dict):
        return {k: _strip_versions(v) for k, v in state.items() if k != "version"}
    if isinstance(state, list):
        return [_strip_versions(v) for v in state]
    return state


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_states_carry_a_version_and_versionless_states_still_resume(name):
    """States written before versions existed (cairn-data 0.1.0 main) read as version 1."""
    make, state, rest = _mid_state(name)
    assert state["version"] == 1
    old = _strip_versions(state)
    assert "version" not in json.dumps(old)
    it = iter(make())
    it.set_state(old)
    assert it.get_state() == state
    assert _same(list(it), rest)


@pytest.mark.multiprocess
def test_mp_prefetch_iterator_validates_the_same_way():
    it = iter(_mp_root())
    next(it)
    with pytest.raises(ValueError, match="invalid mp_prefetch iterator state at 'next_index'"):
        it.set_state({"version": 1, "next_index": -1})
    with pytest.raises(ValueError, match="at 'version': expected one of \\[1\\]"):
        it.set_state({"version": 99, "next_index": 3})
    it.set_state({"next_index": 3})
    assert list(it) == list(range(3, 50))
    it.close()


def _same(a, b):
    if len(a) != len(b):
        return False
    return all(
        all(np.array_equal(x, y) for x, y in zip(u, v))
        if isinstance(u, tuple)
        else np.array_equal(u, v)
        for u, v in zip(a, b)
    )


def test_rejected_state_leaves_a_prefetching_iterator_where_it_was():
    """The prefetch thread reads ahead of the consumer; a rejected state must not lose
    the elements it had read (the input is put back at the consumer's position)."""
    it = iter(_root().prefetch(4))
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="at 'next_index'"):
        it.set_state({"version": 1, "next_index": -1})
    assert it.get_state() == {"version": 1, "next_index": 3}
    assert list(it) == list(range(3, 50))
