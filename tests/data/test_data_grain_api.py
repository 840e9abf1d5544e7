"""Grain's public dataset API that Grain's own test suite relies on (issue 30).

Each test pins one behaviour found by ``tools/compat_suites.py grain``: generic
subscripting, Grain-style custom datasets and iterators, ``IterDataset.map_with_index`` /
``seed``, ``experimental.batch_and_pad``, ``DatasetOptions`` with the filter-ratio check,
and the ``grain.python`` checkpoint names.
"""

from __future__ import annotations

import collections
import functools
import json
import logging

import numpy as np
import pytest

import cairn.data as grain
from cairn.data.experimental import DatasetOptions, WithOptionsIterDataset, batch_and_pad

# --- generics and Grain-style subclasses ---


def test_dataset_classes_are_generic():
    assert grain.MapDataset[int] is not None and grain.IterDataset[str] is not None
    assert grain.DatasetIterator[int] is not None

    def f(ds: grain.MapDataset[int]) -> grain.IterDataset[int]:
        return ds.to_iter_dataset()

    assert list(f(grain.MapDataset.range(3))) == [0, 1, 2]


class Plus(grain.MapDataset[int]):
    """Grain's protocol: __init__(parents), __len__, __getitem__ (past len: next epoch)."""

    def __init__(self, parent: grain.MapDataset[int], k: int) -> None:
        super().__init__(parent)
        self.k = k

    def __len__(self) -> int:
        return len(self._parent)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        return self._parent[index] + self.k


def test_custom_map_dataset_with_getitem_composes_with_every_step():
    base = grain.MapDataset.range(5)
    ds = Plus(base, 100)
    assert ds.parents == (base,) and ds._parent is base
    assert list(ds) == [100, 101, 102, 103, 104]
    assert ds[7] == 102  # index past the end: epoch 1, element 2
    assert [b.tolist() for b in ds.batch(2)] == [[100, 101], [102, 103], [104]]
    shuffled = list(Plus(base.shuffle(seed=3), 100))
    assert sorted(shuffled) == list(range(100, 105)) and shuffled == [x + 100 for x in base.shuffle(seed=3)]
    # over a reshuffling repeat the custom step reads epoch 1 through its parent
    rep = Plus(base.shuffle(seed=3).repeat(2), 0)
    assert list(rep) == list(base.shuffle(seed=3).repeat(2))
    # the batched read used by workers and chunks goes through __getitem__
    assert ds._getitems(range(1, 4)) == [101, 102, 103]
    assert ds.__getitems__([4, 0]) == [104, 100]
    it = iter(ds.to_iter_dataset())
    next(it)
    state = it.get_state()
    rest = list(it)
    it2 = iter(ds.to_iter_dataset())
    it2.set_state(state)
    assert list(it2) == rest == [101, 102, 103, 104]


def test_map_dataset_init_checks_its_parents():
    with pytest.raises(TypeError, match=r"parents\[1\] is a list, expected a MapDataset"):
        Plus.__bases__[0].__init__(object.__new__(Plus), [grain.MapDataset.range(2), [1]])
    two = grain.MapDataset.range(2)
    node = object.__new__(Plus)
    grain.MapDataset.__init__(node, [two, two])
    assert node.parents == (two, two) and not hasattr(node, "_parent")


class EveryOther(grain.IterDataset[int]):
    """Grain's protocol: __init__(parents), __iter__ returning a DatasetIterator."""

    def __init__(self, parent: grain.IterDataset[int]) -> None:
        super().__init__(parent)

    def __iter__(self) -> grain.DatasetIterator[int]:
        return EveryOtherIterator(self._parent.__iter__())


class EveryOtherIterator(grain.DatasetIterator[int]):
    def __init__(self, parent: grain.DatasetIterator[int]) -> None:
        super().__init__(parent)

    def __next__(self) -> int:
        x = next(self._parent)
        next(self._parent, None)
        return x

    def get_state(self) -> dict:
        return self._parent.get_state()

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state)


def test_custom_iter_dataset_and_iterator_compose_with_steps_and_state():
    ds = EveryOther(grain.MapDataset.range(10).to_iter_dataset()).map(lambda x: x * 10).batch(2)
    assert [b.tolist() for b in ds] == [[0, 20], [40, 60], [80]]
    it = iter(ds)
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    rest = [b.tolist() for b in it]
    it2 = iter(ds)
    it2.set_state(state)
    assert [b.tolist() for b in it2] == rest == [[40, 60], [80]]
    assert EveryOther(grain.MapDataset.range(3)).parents[0].__class__ is grain.MapDataset.range(3).__class__
    assert "EveryOtherIterator" in iter(EveryOther(grain.MapDataset.range(3).to_iter_dataset())).summary()


def test_iter_dataset_init_rejects_non_datasets():
    with pytest.raises(TypeError, match="parents must be a IterDataset or MapDataset or a sequence of them, got int"):
        EveryOther(3)
    with pytest.raises(TypeError, match=r"parents\[1\] is a str, expected a IterDataset or MapDataset"):
        EveryOther([grain.MapDataset.range(2), "x"])


# --- IterDataset.map_with_index and IterDataset.seed ---


def test_iter_map_with_index_counts_output_elements_and_resumes():
    ds = grain.MapDataset.range(20).to_iter_dataset().filter(lambda x: x % 3 == 0)
    out = list(ds.map_with_index(lambda k, x: (k, x)))
    assert out == list(enumerate([0, 3, 6, 9, 12, 15, 18]))
    batched = grain.MapDataset.range(7).to_iter_dataset().batch(3).map_with_index(lambda k, b: k * 100 + len(b))
    assert list(batched) == [3, 103, 201]
    it = iter(ds.map_with_index(lambda k, x: (k, x)))
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    assert state["count"] == 3
    it2 = iter(ds.map_with_index(lambda k, x: (k, x)))
    it2.set_state(state)
    assert list(it2) == out[3:]


class IndexTag(grain.transforms.MapWithIndex):
    def map_with_index(self, index, element):
        return f"{index}:{element}"


def test_iter_map_with_index_takes_a_transform_object_and_rejects_others():
    ds = grain.MapDataset.source(["a", "b"]).to_iter_dataset()
    assert list(ds.map_with_index(IndexTag())) == ["0:a", "1:b"]
    with pytest.raises(TypeError, match="map_with_index"):
        ds.map_with_index(3)
    it = iter(ds.map_with_index(IndexTag()))
    with pytest.raises(ValueError, match="count"):
        it.set_state({"version": 1, "parent": it.get_state()["parent"], "count": -1})


def test_iter_seed_is_the_default_seed_of_random_map():
    def draw(x, rng):
        return int(rng.integers(1 << 30))

    ds = grain.MapDataset.range(50).to_iter_dataset().batch(5)
    seeded = ds.seed(11)
    a = list(seeded.random_map(draw))
    assert a == list(ds.random_map(draw, seed=11))
    assert a != list(ds.seed(12).random_map(draw))
    assert list(seeded.random_map(draw, seed=5)) == list(ds.random_map(draw, seed=5))  # explicit wins
    assert [b.tolist() for b in seeded] == [b.tolist() for b in ds]  # seed passes elements through
    it, plain = iter(seeded), iter(ds)
    next(it), next(plain)
    assert it.get_state() == plain.get_state()  # seed adds nothing to the state
    # a MapDataset seed reaches the random_map folded into to_iter_dataset()
    m = grain.MapDataset.range(8).seed(4)
    assert list(m.to_iter_dataset().random_map(draw)) == list(m.random_map(draw, seed=4))
    with pytest.raises(TypeError, match="seed must be an int"):
        ds.seed("x")


# --- experimental.batch_and_pad ---


def test_batch_and_pad_pads_a_short_batch_with_pad_value_in_each_dtype():
    Pair = collections.namedtuple("Pair", "a b")
    recs = [{"x": np.full((2, 3), i, np.int16), "p": Pair(np.float32(i), np.array([i, -i]))} for i in range(1, 3)]
    out = batch_and_pad(recs, batch_size=4, pad_value=7)
    want_x = np.stack([r["x"] for r in recs] + [np.full((2, 3), 7, np.int16)] * 2)
    np.testing.assert_array_equal(out["x"], want_x)
    assert out["x"].dtype == np.int16 and isinstance(out["p"], Pair)
    np.testing.assert_array_equal(out["p"].a, np.array([1, 2, 7, 7], np.float32))
    assert out["p"].a.dtype == np.float32
    np.testing.assert_array_equal(out["p"].b, np.array([[1, -1], [2, -2], [7, 7], [7, 7]]))
    full = batch_and_pad(recs, batch_size=2)
    np.testing.assert_array_equal(full["x"], np.stack([r["x"] for r in recs]))


def test_batch_and_pad_as_batch_fn_keeps_the_remainder_at_full_size():
    pad = functools.partial(batch_and_pad, batch_size=3)
    got = [b.tolist() for b in grain.MapDataset.range(1, 5).batch(3, batch_fn=pad)]
    assert got == [[1, 2, 3], [4, 0, 0]]
    got = [b.tolist() for b in grain.MapDataset.range(1, 5).to_iter_dataset().batch(3, batch_fn=pad)]
    assert got == [[1, 2, 3], [4, 0, 0]]


def test_batch_and_pad_errors():
    with pytest.raises(ValueError, match="Cannot batch 0 values"):
        batch_and_pad([], batch_size=2)
    with pytest.raises(ValueError, match="Cannot batch 3 values to 2"):
        batch_and_pad([1, 2, 3], batch_size=2)
    with pytest.raises(ValueError, match="record 1"):
        batch_and_pad([np.zeros(2), np.zeros(3)], batch_size=4)


# --- DatasetOptions, WithOptionsIterDataset, the filter-ratio check ---


def test_dataset_options_defaults_validation_and_merge():
    d = DatasetOptions()
    assert (d.filter_warn_threshold_ratio, d.filter_raise_threshold_ratio) == (0.9, None)
    outer = DatasetOptions(filter_raise_threshold_ratio=0.5)
    inner = DatasetOptions(filter_raise_threshold_ratio=0.1, filter_warn_threshold_ratio=None)
    m = outer.merge(inner)
    assert (m.filter_warn_threshold_ratio, m.filter_raise_threshold_ratio) == (None, 0.5)
    assert outer.merge(None) is outer
    assert DatasetOptions().merge(inner) == inner
    with pytest.raises(ValueError, match=r"filter_raise_threshold_ratio must be None or a number in \[0, 1\], got 2"):
        DatasetOptions(filter_raise_threshold_ratio=2)
    with pytest.raises(TypeError, match="unknown field"):
        DatasetOptions(filter_ratio=0.1)
    with pytest.raises(TypeError, match="must be a DatasetOptions"):
        WithOptionsIterDataset(grain.MapDataset.range(3).to_iter_dataset(), {"x": 1})


def _drop_all(x):
    return False


@pytest.mark.parametrize("where", ["folded", "after_batch"])
def test_a_filter_that_drops_everything_warns_once(where, caplog):
    if where == "folded":  # folded into the MapDataset read by to_iter_dataset
        ds = grain.MapDataset.range(3000).to_iter_dataset().filter(_drop_all)
    else:  # an iterator-level filter
        ds = grain.MapDataset.range(3000).to_iter_dataset().batch(1).filter(_drop_all)
    with caplog.at_level(logging.WARNING, logger="cairn.data"):
        assert list(ds) == []
    msgs = [r.getMessage() for r in caplog.records if r.name == "cairn.data"]
    assert len(msgs) == 1
    assert "filter(_drop_all) skipped 100.00 % of the last seen" in msgs[0]
    assert "filter_warn_threshold_ratio" in msgs[0]


def test_no_warning_below_the_threshold_or_when_turned_off(caplog):
    half = grain.MapDataset.range(3000).to_iter_dataset().filter(lambda x: x % 2 == 0)
    off = WithOptionsIterDataset(
        grain.MapDataset.range(3000).to_iter_dataset().filter(_drop_all),
        DatasetOptions(filter_warn_threshold_ratio=None),
    )
    with caplog.at_level(logging.WARNING, logger="cairn.data"):
        assert len(list(half)) == 1500
        assert list(off) == []
    assert not [r for r in caplog.records if r.name == "cairn.data"]


@pytest.mark.parametrize("workers", [0, 2])
def test_raise_threshold_stops_the_pipeline_naming_the_filter(workers):
    ds = grain.MapDataset.range(5000).to_iter_dataset().filter(lambda x: x < 5).mp_prefetch(workers)
    strict = WithOptionsIterDataset(ds, DatasetOptions(filter_raise_threshold_ratio=0.95))
    it = iter(strict)
    assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"filter\(.*<lambda>\) skipped 9\d\.\d\d % of the last seen \d+ elements"):
        next(it)
    it.close()
    # the same data without the option just ends
    assert list(ds) == [0, 1, 2, 3, 4]


def test_outer_options_win_over_inner_ones():
    ds = grain.MapDataset.range(2000).to_iter_dataset().batch(1).filter(_drop_all)
    inner = WithOptionsIterDataset(ds, DatasetOptions(filter_raise_threshold_ratio=0.5))
    outer = WithOptionsIterDataset(inner, DatasetOptions(filter_raise_threshold_ratio=None))
    assert list(outer) == []
    with pytest.raises(ValueError, match="skipped 100.00 %"):
        list(inner)
    it = iter(WithOptionsIterDataset(grain.MapDataset.range(4), DatasetOptions()))
    next(it)
    assert it.get_state() == {"version": 1, "next_index": 1}  # the parent's state


# --- grain.python's checkpoint names ---


def test_pygrain_checkpoint_names_save_and_restore_a_data_loader(tmp_path):
    """Grain's data loader tutorial: ``import grain.python as grain`` and an Orbax manager."""
    ocp = pytest.importorskip("orbax.checkpoint")
    assert grain.PyGrainCheckpointHandler is grain.checkpoint.CheckpointHandler
    loader = grain.DataLoader(
        data_source=list(range(40)),
        sampler=grain.IndexSampler(40, shard_options=grain.NoSharding(), shuffle=True, seed=0, num_epochs=1),
        operations=[grain.Batch(4)],
        worker_count=0,
    )
    it = iter(loader)
    for _ in range(3):
        next(it)
    assert issubclass(grain.PyGrainCheckpointSave, ocp.args.CheckpointArgs)
    mngr = ocp.CheckpointManager(tmp_path / "orbax")
    assert mngr.save(step=3, args=grain.PyGrainCheckpointSave(it), force=True)
    mngr.wait_until_finished()
    after = [next(it).tolist() for _ in range(3)]
    restored = mngr.restore(3, args=grain.PyGrainCheckpointRestore(it))
    assert [next(it).tolist() for _ in range(3)] == after
    assert restored is it
    mngr.close()
    with pytest.raises(AttributeError, match="PyGrainNothing"):
        grain.PyGrainNothing  # noqa: B018


# --- select_from_datasets, zip, limit, repeat and flat_map on iterators ---


class Alternate(grain.DatasetSelectionMap):
    def __len__(self):
        return 7

    def __getitem__(self, index):
        return index % 2, index // 2


def test_select_from_datasets_follows_the_selection_map():
    a, b = grain.MapDataset.range(4), grain.MapDataset.range(100, 104)
    ds = grain.MapDataset.select_from_datasets([a, b], Alternate())
    assert len(ds) == 7 and list(ds) == [0, 100, 1, 101, 2, 102, 3]
    assert ds[8] == 100  # epoch 1 reads epoch 1 of the inputs (unshuffled: the same)
    assert grain.transforms.DatasetSelectionMap is grain.DatasetSelectionMap

    class Bad(Alternate):
        def __getitem__(self, index):
            return 5, 0

    with pytest.raises(IndexError, match=r"selection_map\[0\] picks dataset 5, but there are 2 datasets"):
        list(grain.MapDataset.select_from_datasets([a, b], Bad()))
    with pytest.raises(TypeError, match="selection_map needs __len__ and __getitem__"):
        grain.MapDataset.select_from_datasets([a, b], 3)


def test_zip_map_and_iter_datasets():
    from cairn.data.experimental import ZipIterDataset, ZipMapDataset

    a = grain.MapDataset.range(4)
    b = grain.MapDataset.source(["w", "x", "y", "z"])
    z = ZipMapDataset([a, b])
    assert list(z) == [(0, "w"), (1, "x"), (2, "y"), (3, "z")] and z[2] == (2, "y")
    odd = ZipMapDataset([a.filter(lambda x: x % 2), b])
    assert list(odd) == [(1, "x"), (3, "z")]
    with pytest.raises(ValueError, match=r"same length, got lengths \[4, 3\]"):
        ZipMapDataset([a, grain.MapDataset.range(3)])
    zi = ZipIterDataset([a.to_iter_dataset(), b.to_iter_dataset().batch(2)], strict=False)
    assert [(x, list(y)) for x, y in zi] == [(0, ["w", "x"]), (1, ["y", "z"])]
    with pytest.raises(ValueError, match="input 1 is shorter than input 0"):
        list(ZipIterDataset([a.to_iter_dataset(), grain.MapDataset.range(2).to_iter_dataset()]))
    with pytest.raises(ValueError, match="input 1 is longer than input 0"):
        list(ZipIterDataset([grain.MapDataset.range(2).to_iter_dataset(), a.to_iter_dataset()]))
    it = iter(ZipIterDataset([a, b]))
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    it2 = iter(ZipIterDataset([a, b]))
    it2.set_state(state)
    assert list(it2) == list(it) == [(1, "x"), (2, "y"), (3, "z")]
    with pytest.raises(ValueError, match="a list of 2 input states"):
        it2.set_state({"version": 1, "inputs": [state["inputs"][0]]})


def test_limit_iter_dataset_stops_and_resumes():
    from cairn.data.experimental import LimitIterDataset

    ds = LimitIterDataset(grain.MapDataset.range(100).to_iter_dataset().filter(lambda x: x % 5 == 0), count=4)
    assert list(ds) == [0, 5, 10, 15]
    assert list(LimitIterDataset(grain.MapDataset.range(2).to_iter_dataset(), count=9)) == [0, 1]
    it = iter(ds)
    next(it)
    state = it.get_state()
    it2 = iter(ds)
    it2.set_state(state)
    assert list(it2) == [5, 10, 15]
    with pytest.raises(ValueError, match="count must be an int >= 1, got 0"):
        LimitIterDataset(grain.MapDataset.range(3).to_iter_dataset(), count=0)


def test_repeat_iter_dataset_restarts_its_input():
    from cairn.data.experimental import RepeatIterDataset

    base = grain.MapDataset.range(5).to_iter_dataset().filter(lambda x: x != 2).batch(2)
    ds = RepeatIterDataset(base, num_epochs=3)
    got = [b.tolist() for b in ds]
    assert got == [[0, 1], [3, 4]] * 3
    endless = iter(RepeatIterDataset(base))
    assert [next(endless).tolist() for _ in range(5)] == [[0, 1], [3, 4], [0, 1], [3, 4], [0, 1]]
    assert list(RepeatIterDataset(grain.MapDataset.range(0).to_iter_dataset())) == []  # no endless loop
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    assert state["epoch"] == 1
    it2 = iter(ds)
    it2.set_state(state)
    assert [b.tolist() for b in it2] == got[3:]
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="num_epochs must be None or an int >= 1"):
            RepeatIterDataset(base, num_epochs=bad)


class Explode(grain.transforms.FlatMap):
    max_fan_out = 3

    def flat_map(self, x):
        return [x] * (x % 3)


def test_flat_map_iter_dataset_resumes_inside_an_element():
    from cairn.data.experimental import FlatMapIterDataset

    ds = FlatMapIterDataset(grain.MapDataset.range(6).to_iter_dataset(), Explode())
    want = [1, 2, 2, 4, 5, 5]
    assert list(ds) == want
    for k in range(len(want) + 1):
        it = iter(ds)
        for _ in range(k):
            next(it)
        state = json.loads(json.dumps(it.get_state()))
        it2 = iter(ds)
        it2.set_state(state)
        assert list(it2) == want[k:]
    with pytest.raises(TypeError, match="must have a flat_map method"):
        FlatMapIterDataset(grain.MapDataset.range(2).to_iter_dataset(), object())


class Inc(grain.transforms.Map):
    def map(self, x):
        return x + 1


class KeepEven(grain.transforms.Filter):
    def filter(self, x):
        return x % 2 == 0


def test_apply_transformations_maps_each_transform_to_its_step():
    from cairn.data.experimental import apply_transformations

    ops = [Inc(), KeepEven(), IndexTag(), grain.Batch(2)]
    m = apply_transformations(grain.MapDataset.range(8), ops[:2] + [grain.Batch(2)])
    # MapDataset.batch leaves filtered elements out of their batch (cairn.data's documented rule)
    assert [b.tolist() for b in m] == [[2], [4], [6], [8]]
    it = grain.MapDataset.range(8).to_iter_dataset().apply(ops)
    assert [b.tolist() for b in it] == [["0:2", "1:4"], ["2:6", "3:8"]]
    assert list(grain.MapDataset.range(3).apply(Explode())) == [1, 2, 2]
    assert list(grain.MapDataset.range(3).to_iter_dataset().apply(Explode())) == [1, 2, 2]
    with pytest.raises(NotImplementedError, match="TfAdd is not a transformation a dataset can apply"):
        apply_transformations(grain.MapDataset.range(3), TfAdd())


class TfAdd(grain.transforms.TfRandomMap):
    def np_random_map(self, x, rng):
        return x + 1


def test_tf_random_map_is_refused_by_pipelines():
    with pytest.raises(TypeError, match="random_map"):
        grain.MapDataset.range(3).random_map(TfAdd(), seed=0)


def test_sampler_protocol_and_allow_nones():
    assert isinstance(grain.IndexSampler(4, shard_options=grain.NoSharding()), grain.Sampler)
    assert isinstance(grain.samplers.SequentialSampler(4, grain.NoSharding()), grain.samplers.Sampler)
    assert not isinstance(3, grain.Sampler)
    ds = grain.MapDataset.range(6).filter(lambda x: x % 3 == 0)
    assert list(ds.to_iter_dataset(allow_nones=True)) == [0, None, None, 3, None, None]
    assert list(ds.to_iter_dataset(allow_nones=True).map(lambda x: x)) == [0, None, None, 3, None, None]
    assert list(ds.to_iter_dataset()) == [0, 3]
    assert grain.MapDataset.range(2).to_iter_dataset().parents[0].__class__.__name__ == "RangeMapDataset"


def test_multithread_prefetch_keeps_elements_order_and_state():
    from cairn.data.experimental import multithread_prefetch

    root = grain.MapDataset.range(3000).shuffle(seed=1).to_iter_dataset().filter(lambda x: x % 7)
    stepped = root.batch(5).map(lambda b: b.sum())
    for ds in (root, stepped):
        fast = multithread_prefetch(ds, num_threads=3, buffer_size=2)
        want = [np.asarray(x).tolist() for x in ds]
        assert [np.asarray(x).tolist() for x in fast] == want
        it = iter(fast)
        for _ in range(17):
            next(it)
        state = json.loads(json.dumps(it.get_state()))
        it.close()
        again = iter(ds)
        again.set_state(state)  # the state is ds's own
        assert [np.asarray(x).tolist() for x in again] == want[17:]
    assert multithread_prefetch(root, num_threads=0, buffer_size=1) is root
    assert multithread_prefetch(root, 4, 1)._read_options.num_threads == 4
    with pytest.raises(ValueError, match="num_threads must be an int >= 0, got -1"):
        multithread_prefetch(root, -1, 1)
    with pytest.raises(ValueError, match="buffer_size must be an int >= 1, got 0"):
        multithread_prefetch(root, 1, 0)
    with pytest.raises(ValueError, match="sequential_slice=True is not supported"):
        multithread_prefetch(root, 2, 1, sequential_slice=True)
    with pytest.raises(TypeError, match="expects an IterDataset"):
        multithread_prefetch(grain.MapDataset.range(3), 2, 1)


def test_window_shuffle_map_dataset_permutes_within_windows_per_epoch():
    from cairn.data.experimental import WindowShuffleMapDataset

    ds = WindowShuffleMapDataset(grain.MapDataset.range(43), window_size=10, seed=42)
    assert len(ds) == 43
    e0, e1 = ds._getitems(range(43)), ds._getitems(range(43, 86))  # Grain-style global indices
    for e in (e0, e1):
        for k in range(0, 43, 10):
            assert sorted(e[k:k + 10]) == list(range(k, min(k + 10, 43)))
    assert e0 != e1 and e0 != list(range(43))
    assert [ds[i] for i in range(43, 86)] == e1 == list(ds.repeat(2))[43:]
    assert list(ds) == e0
    other = WindowShuffleMapDataset(grain.MapDataset.range(43), window_size=10, seed=43)
    assert list(other) != e0
    with pytest.raises(ValueError, match="window_size must be an int >= 1, got 0"):
        WindowShuffleMapDataset(grain.MapDataset.range(3), window_size=0, seed=1)


def test_window_shuffle_iter_dataset_permutes_windows_and_resumes_anywhere():
    from cairn.data.experimental import WindowShuffleIterDataset

    src = grain.MapDataset.range(23).to_iter_dataset().filter(lambda x: x != 5)
    ds = WindowShuffleIterDataset(src, window_size=4, seed=7)
    out = list(ds)
    kept = [x for x in range(23) if x != 5]
    assert sorted(out) == kept and out != kept
    for k in range(0, len(kept), 4):
        assert sorted(out[k:k + 4]) == kept[k:k + 4]
    for k in range(len(out) + 1):
        it = iter(ds)
        for _ in range(k):
            next(it)
        state = json.loads(json.dumps(it.get_state()))
        it2 = iter(ds)
        it2.set_state(state)
        assert list(it2) == out[k:], k
    with pytest.raises(TypeError, match="seed must be an int"):
        WindowShuffleIterDataset(src, window_size=4, seed="a")
