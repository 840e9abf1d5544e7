"""mix on MapDataset and IterDataset against an independent reference."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn.data import (
    IterDataset,
    MapDataset,
    MixIterDataset,
)


def test_map_mix_proportions_order_and_errors():
    a, b = MapDataset.range(0, 5), MapDataset.range(100, 103)
    m = MapDataset.mix(
        [MapDataset.range(0, 10_000), MapDataset.range(10**6, 10**6 + 10_000)], [0.7, 0.3]
    )
    xs = np.array(list(m))
    first = xs < 10**6
    # Each input in order, in the proportions asked for, ending before an input runs out.
    assert np.array_equal(xs[first], np.arange(first.sum()))
    assert np.array_equal(xs[~first] - 10**6, np.arange((~first).sum()))
    assert abs(first[:1000].mean() - 0.7) < 0.002
    assert first.sum() <= 10_000 and (~first).sum() <= 10_000
    assert len(m) == len(xs) and first.sum() in (9_999, 10_000)
    with pytest.raises(ValueError, match="weights must be finite"):
        MapDataset.mix([a, b], [-1, 2])
    with pytest.raises(ValueError, match="2 datasets but 3 weights"):
        MapDataset.mix([a, b], [1, 2, 3])


def _mix_reference(streams, weights, period=1000):
    """Independent weighted mix: input k owns the slots where its share of the first n
    slots, rounded to the period's largest-remainder counts, first exceeds its count."""
    w = np.asarray(weights, np.float64) / np.sum(weights)
    raw = w * period
    counts = np.floor(raw).astype(int)
    for k in np.argsort(-(raw - counts), kind="stable")[: period - counts.sum()]:
        counts[k] += 1
    events = sorted(((j + 0.5) / c, k) for k, c in enumerate(counts) for j in range(c))
    pattern = [k for _, k in events]
    its = [iter(s) for s in streams]
    out = []
    for n in range(10**9):
        try:
            out.append(next(its[pattern[n % period]]))
        except StopIteration:
            return out


@settings(max_examples=25, deadline=None)
@given(
    weights=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    sizes=st.lists(st.integers(0, 400), min_size=4, max_size=4),
)
def test_iter_mix_matches_reference_and_map_mix(weights, sizes):
    streams = [list(range(k * 1000, k * 1000 + n)) for k, n in enumerate(sizes[: len(weights)])]
    ds = IterDataset.mix([MapDataset.source(s).to_iter_dataset() for s in streams], weights)
    got = list(ds)
    assert got == _mix_reference(streams, weights)
    # the same pattern as MapDataset.mix over the same inputs
    assert got == list(MapDataset.mix([MapDataset.source(s) for s in streams], weights))


def test_iter_mix_filtered_inputs_resume_exactly():
    a = MapDataset.range(0, 500).filter(lambda x: x % 3 != 0).to_iter_dataset()
    b = MapDataset.range(1000, 1300).shuffle(seed=4).to_iter_dataset().batch(2)
    ds = IterDataset.mix([a, b], [2.0, 1.0])
    full = list(ds)
    kinds = {type(x).__name__ for x in full}
    assert len(full) > 300 and "int" in kinds and len(kinds) == 2  # elements and batches
    for k in (0, 1, 7, len(full) // 2, len(full)):
        it = iter(ds)
        head = [next(it) for _ in range(k)]
        state = it.get_state()
        it2 = iter(ds)
        it2.set_state(state)
        rest = list(it2)
        assert _same(head + rest, full), k
    assert ds.graph().count("mix(weights=[0.667, 0.333])") == 1


def _same(xs, ys):
    return len(xs) == len(ys) and all(np.array_equal(x, y) for x, y in zip(xs, ys))


def test_iter_mix_errors():
    a = MapDataset.range(4).to_iter_dataset()
    with pytest.raises(ValueError, match="weights must be finite"):
        IterDataset.mix([a, a], [1, float("nan")])
    with pytest.raises(ValueError, match="2 datasets but 1 weights"):
        IterDataset.mix([a, a], [1])
    with pytest.raises(ValueError, match="needs at least one dataset"):
        MixIterDataset([])
    with pytest.raises(TypeError, match="input 1 is a int"):
        IterDataset.mix([a, 3])
    it = iter(IterDataset.mix([a, a]))
    with pytest.raises(ValueError, match="mix iterator state at 'inputs': expected a value"):
        it.set_state({"index": 0})
    with pytest.raises(ValueError, match="the states of the 2 inputs"):
        it.set_state({"index": 0, "inputs": [{"next_index": 0}]})
