"""InMemoryDataSource / RangeDataSource and the shared index rules."""

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.data import InMemoryDataSource, RangeDataSource


@settings(max_examples=25, deadline=None)
@given(
    start=st.integers(-50, 50),
    stop=st.integers(-50, 50),
    step=st.integers(-7, 7).filter(lambda s: s != 0),
    data=st.data(),
)
def test_range_matches_python_range(start, stop, step, data):
    ref = range(start, stop, step)
    src = RangeDataSource(start, stop, step)
    assert len(src) == len(ref)
    assert [src[i] for i in range(len(ref))] == list(ref)
    if len(ref):
        idx = data.draw(st.lists(st.integers(-len(ref), len(ref) - 1), max_size=20))
        assert src.__getitems__(idx) == [ref[i] for i in idx]
        assert all(type(x) is int for x in src.__getitems__(idx))
    assert src.__getitems__([]) == []


@settings(max_examples=25, deadline=None)
@given(elems=st.lists(st.integers() | st.text(max_size=3)), data=st.data())
def test_in_memory_random_and_batched(elems, data):
    src = InMemoryDataSource(elems)
    assert len(src) == len(elems)
    if elems:
        idx = data.draw(st.lists(st.integers(-len(elems), len(elems) - 1), max_size=20))
        assert src.__getitems__(idx) == [elems[i] for i in idx]
        assert [src[i] for i in idx] == [elems[i] for i in idx]


def test_in_memory_numpy_rows():
    arr = np.arange(12).reshape(6, 2)
    src = InMemoryDataSource(arr)
    got = src.__getitems__(np.array([5, 0, -1]))
    np.testing.assert_array_equal(np.stack(got), arr[[5, 0, 5]])


@pytest.mark.parametrize("src", [InMemoryDataSource([1, 2, 3]), RangeDataSource(0, 3)])
def test_index_errors_name_index_and_length(src):
    with pytest.raises(IndexError, match=r"index 3 .*length 3"):
        src[3]
    with pytest.raises(IndexError, match=r"index -4 .*length 3"):
        src[-4]
    with pytest.raises(IndexError, match=r"index 7 \(position 1 of the batch\).*length 3"):
        src.__getitems__([0, 7])
    with pytest.raises(TypeError, match="integers"):
        src[1.5]
    with pytest.raises(TypeError, match="integers"):
        src.__getitems__([0.5])
    with pytest.raises(TypeError, match="bool"):
        src[True]


def test_empty_sources_say_empty():
    with pytest.raises(IndexError, match="empty"):
        InMemoryDataSource([])[0]
    assert len(RangeDataSource(5, 5)) == 0


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="step must not be 0"):
        RangeDataSource(0, 5, 0)
    with pytest.raises(TypeError, match="start must be an int"):
        RangeDataSource(0.5, 5)
    with pytest.raises(TypeError, match="sequence"):
        InMemoryDataSource(iter([1, 2]))


def test_pickle_round_trip():
    for src in (InMemoryDataSource(["a", "b"]), RangeDataSource(3, 30, 4)):
        back = pickle.loads(pickle.dumps(src))
        assert len(back) == len(src)
        assert back.__getitems__([1, 0]) == src.__getitems__([1, 0])
