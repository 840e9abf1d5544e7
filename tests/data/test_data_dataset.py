"""The base classes: indexing, graph rendering, debug checks, chained IterDataset steps, no JAX needed."""

import subprocess
import sys

import numpy as np
import pytest

from cairn.data import MapDataset, StructureMismatchError


def test_indexing():
    ds = MapDataset.range(10).map(lambda x: x + 1)
    assert ds[0] == 1 and ds[-1] == 10
    assert list(ds[2:8:3]) == [3, 6]
    # As in Grain, an index past the end reads the next epoch; only negative ones past -len fail.
    assert ds[10] == 1 and ds[23] == 4
    with pytest.raises(IndexError, match="out of range .* length 10"):
        ds[-11]
    with pytest.raises(TypeError, match="integers or slices"):
        ds["a"]
    with pytest.raises(IndexError, match="index 12 is out of range"):
        ds.__getitems__([1, 12])


def test_graph_rendering():
    g = (
        MapDataset.concatenate([MapDataset.range(3), MapDataset.range(2).shuffle(seed=1)])
        .batch(2)
        .graph()
    )
    lines = g.splitlines()
    assert lines[0].startswith("batch(2)")
    assert "concatenate(2 datasets)" in lines[1] and "<input 1>" in g and "shuffle(seed=1)" in g


def test_debug_mode_names_first_mismatch():
    recs = [{"x": np.zeros(3)}] * 5 + [{"x": np.zeros(3, np.int32)}]
    it = iter(MapDataset.source(recs).to_iter_dataset(debug=True))
    for _ in range(5):
        next(it)
    with pytest.raises(
        StructureMismatchError, match="element 5 .* path 'x'.*dtype float64.*got .*int32"
    ):
        next(it)
    it = iter(MapDataset.source([{"a": 1}, {"a": 1, "b": 2}]).to_iter_dataset(debug=True).batch(1))
    next(it)
    with pytest.raises(StructureMismatchError, match="differs from the first element"):
        next(it)


def test_iter_steps_match_reference():
    ds = MapDataset.range(30).to_iter_dataset()
    out = list(
        ds.map(lambda x: x + 1)
        .filter(lambda x: x % 4 != 0)
        .batch(4, drop_remainder=True)
        .map(lambda b: b.tolist())
    )
    ref = [x + 1 for x in range(30) if (x + 1) % 4 != 0]
    assert out == [ref[i : i + 4] for i in range(0, len(ref) - 3, 4)]
    assert [b.tolist() for b in ds.batch(8)][-1] == list(range(24, 30))
    r = ds.batch(2).random_map(lambda b, rng: b + rng.integers(100), seed=1)
    assert [x.tolist() for x in r] == [x.tolist() for x in r]
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        ds.batch(0)


def test_imports_and_runs_without_jax():
    code = (
        "import sys; sys.modules['jax'] = None\n"
        "import cairn.data as cd\n"
        "ds = cd.MapDataset.range(20).shuffle(seed=1).map(lambda x: x * 2).batch(5).to_iter_dataset()\n"
        "it = iter(ds); next(it); st = it.get_state(); assert len(list(it)) == 3\n"
        "assert 'jax' not in [m for m in sys.modules if sys.modules[m] is not None and m.split('.')[0] == 'jax']\n"
        "try:\n    cd.ShardByJaxProcess()\nexcept ImportError as e:\n    assert 'needs JAX' in str(e)\nelse:\n    raise SystemExit('no error')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
