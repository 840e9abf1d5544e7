"""batch on MapDataset and IterDataset against plain-Python references."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.data import MapDataset, stack_records


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 200), bs=st.integers(1, 70), drop=st.booleans())
def test_batch_matches_reference(n, bs, drop):
    ds = MapDataset.range(n).map(lambda x: np.array([x, -x])).batch(bs, drop_remainder=drop)
    ref = [np.array([[x, -x] for x in range(s, min(s + bs, n))]) for s in range(0, n, bs)]
    if drop:
        ref = [b for b in ref if len(b) == bs]
    got = list(ds)
    assert len(ds) == len(ref) == len(got)
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(g, r.reshape(-1, 2))


def test_batch_size_errors_and_batch_fn():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            MapDataset.range(3).batch(bad)
    ds = MapDataset.range(5).batch(2, batch_fn=lambda xs: sum(xs))
    assert list(ds) == [1, 5, 4]


def test_batch_structures():
    recs = [{"a": np.full(3, i), "b": (i, float(i)), "s": f"x{i}"} for i in range(5)]
    b = list(MapDataset.source(recs).batch(5))[0]
    np.testing.assert_array_equal(b["a"], np.repeat(np.arange(5)[:, None], 3, 1))
    assert b["b"][0].tolist() == list(range(5)) and b["b"][1].dtype == np.float64
    assert b["s"].dtype == object and b["s"].tolist() == [f"x{i}" for i in range(5)]
    with pytest.raises(
        ValueError, match="record 1 has shape \\(4,\\) but record 0 has shape \\(3,\\)"
    ):
        stack_records([{"a": np.zeros(3)}, {"a": np.zeros(4)}])
    with pytest.raises(ValueError, match="record 1 differs from record 0"):
        stack_records([{"a": 1}, {"b": 1}])


def test_batch_after_filter_drops_none_inside_batches():
    ds = MapDataset.range(10).filter(lambda x: x % 2 == 0).batch(4)
    assert [b.tolist() for b in ds] == [[0, 2], [4, 6], [8]]
    assert MapDataset.range(4).filter(lambda x: False).batch(2)[0] is None
