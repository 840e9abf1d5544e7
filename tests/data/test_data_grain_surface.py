"""Grain's submodules on cairn.data: namespaces, experimental, checkpoint handler (no JAX)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

import cairn.data as grain
from cairn.data import MapDataset


def test_submodules_are_thin_reexports():
    assert grain.transforms.Map is grain.MapTransform
    assert grain.transforms.RandomMap is grain.RandomMapTransform
    assert grain.transforms.Filter is grain.FilterTransform
    assert grain.transforms.Batch is grain.Batch
    assert grain.samplers.IndexSampler is grain.IndexSampler
    assert grain.sharding.NoSharding is grain.NoSharding
    assert grain.sources.RangeDataSource is grain.RangeDataSource
    assert grain.multiprocessing.MultiprocessingOptions is grain.MultiprocessingOptions
    assert grain.experimental.assert_equal_output_after_checkpoint is grain.assert_equal_output_after_checkpoint
    for mod in (grain.transforms, grain.samplers, grain.sharding, grain.sources,
                grain.multiprocessing, grain.experimental, grain.checkpoint):
        assert mod.__all__ and all(hasattr(mod, n) for n in mod.__all__)


def test_importing_the_submodules_does_not_import_jax():
    code = ("import sys, cairn.data as g; g.experimental.device_put; g.checkpoint.CheckpointSave; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_transform_classes_drive_dataset_steps():
    class Shift(grain.transforms.MapWithIndex):
        def map_with_index(self, index, element):
            return index * 100 + element

    class Even(grain.transforms.Filter):
        def filter(self, element):
            return element % 2 == 0

    class Noise(grain.transforms.RandomMap):
        def random_map(self, element, rng):
            return element + int(rng.integers(10))

    ds = MapDataset.range(4).map_with_index(Shift())
    assert list(ds) == [0, 101, 202, 303]
    assert list(MapDataset.range(6).filter(Even())) == [0, 2, 4]
    a = list(MapDataset.range(5).random_map(Noise(), seed=3))
    assert a == list(MapDataset.range(5).random_map(Noise(), seed=3))
    with pytest.raises(TypeError):
        grain.transforms.Map()  # abstract: map() must be defined


def test_random_access_data_source_base():
    class Squares(grain.sources.RandomAccessDataSource):
        def __len__(self):
            return 5

        def __getitem__(self, i):
            return i * i

    assert list(MapDataset.source(Squares()).batch(2)) [-1].tolist() == [16]
    with pytest.raises(TypeError):
        grain.sources.RandomAccessDataSource()


def test_map_dataset_indices_past_the_end_read_the_next_epoch():
    ds = MapDataset.range(6).shuffle(seed=2)
    second = [ds[6 + i] for i in range(6)]
    assert sorted(second) == list(range(6)) and second != [ds[i] for i in range(6)]
    rep = MapDataset.range(3).shuffle(seed=1).repeat(2)
    assert [rep[i] for i in range(6, 12)] == [rep.repeat(2)[i] for i in range(6, 12)]
    assert MapDataset.range(4).map(lambda x: x + 1)[9] == 2
    with pytest.raises(IndexError, match="length 0"):
        MapDataset.range(0)[3]


# --- experimental ---
def test_thread_prefetch_iter_dataset():
    base = MapDataset.range(10).shuffle(seed=1).to_iter_dataset()
    ds = grain.experimental.ThreadPrefetchIterDataset(base, prefetch_buffer_size=3)
    assert list(ds) == list(base)
    assert grain.experimental.ThreadPrefetchIterDataset(base, prefetch_buffer_size=0) is base
    assert list(pickle.loads(pickle.dumps(ds))) == list(base)
    grain.experimental.assert_equal_output_after_checkpoint(ds)
    with pytest.raises(ValueError, match="prefetch_buffer_size must be an int >= 0, got -1"):
        grain.experimental.ThreadPrefetchIterDataset(base, prefetch_buffer_size=-1)


def test_device_put_signature_checks_without_jax():
    with pytest.raises(TypeError, match="expects an IterDataset, got RangeMapDataset"):
        grain.experimental.device_put(MapDataset.range(3), None)
    with pytest.raises(ValueError, match="prefetch_buffer_size"):
        grain.experimental.device_put(MapDataset.range(3).to_iter_dataset(), None, cpu_buffer_size=-2)


def test_pick_performance_config_fits_the_budget():
    big = MapDataset.range(50).map(lambda i: np.zeros(2**18, np.float32))  # 1 MiB each
    cfg = grain.experimental.pick_performance_config(big, ram_budget_mb=16, max_workers=8, max_buffer_size=None)
    ro, mp = cfg.read_options, cfg.multiprocessing_options
    chunk_bytes = ro.chunk_records * 2**20
    in_flight = ro.prefetch_buffer_size * chunk_bytes + mp.num_workers * mp.per_worker_buffer_size * chunk_bytes
    assert in_flight <= 16 * 2**20 and mp.num_workers >= 1
    small = grain.experimental.pick_performance_config(
        MapDataset.range(1000).to_iter_dataset(), ram_budget_mb=1024, max_workers=2, max_buffer_size=3
    )
    assert small.multiprocessing_options.num_workers == 2 and small.read_options.prefetch_buffer_size == 3
    out = list(big.to_iter_dataset(read_options=ro).mp_prefetch(mp).map(lambda a: a.shape))
    assert out == [(2**18,)] * 50
    with pytest.raises(ValueError, match="ram_budget_mb must be a positive int, got 0"):
        grain.experimental.pick_performance_config(big, ram_budget_mb=0, max_workers=None, max_buffer_size=None)
    with pytest.raises(ValueError, match="no elements"):
        grain.experimental.pick_performance_config(MapDataset.range(0), ram_budget_mb=1, max_workers=1, max_buffer_size=1)
    with pytest.raises(TypeError, match="MapDataset or IterDataset, got list"):
        grain.experimental.pick_performance_config([1], ram_budget_mb=1, max_workers=1, max_buffer_size=1)


# --- checkpoint ---
def test_checkpoint_handler_round_trip(tmp_path):
    ds = MapDataset.range(20).shuffle(seed=4).to_iter_dataset()
    it = iter(ds)
    for _ in range(7):
        next(it)
    h = grain.checkpoint.CheckpointHandler()
    h.save(tmp_path / "it", args=grain.checkpoint.CheckpointSave(it))
    files = os.listdir(tmp_path / "it")
    assert files == ["process_0-of-1.json"]
    assert json.loads((tmp_path / "it" / files[0]).read_text()) == it.get_state()
    rest = list(it)
    fresh = iter(ds)
    assert h.restore(tmp_path / "it", args=grain.checkpoint.CheckpointRestore(fresh)) is fresh
    assert list(fresh) == rest
    other = iter(ds)
    h.restore(str(tmp_path / "it"), item=other)
    assert list(other) == rest
    h.close()
    with pytest.raises(FileNotFoundError, match="no iterator state"):
        h.restore(tmp_path / "missing", item=iter(ds))
    with pytest.raises(TypeError, match="needs an iterator with get_state"):
        h.save(tmp_path / "x", item=[1, 2])


def test_checkpoint_args_and_handler_interface(tmp_path):
    ck = grain.checkpoint
    # Without Orbax imported, the argument classes are plain wrappers of ``.item``.
    assert ck.__getattr__("CheckpointSave") is ck.CheckpointSave
    assert ck.CheckpointRestore(item=3).item == 3
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        ck.Nope  # noqa: B018
    h = ck.CheckpointHandler()
    assert h.structure(tmp_path) is None and h.metadata(tmp_path) is None and h.finalize(tmp_path) is None
    assert ck.CheckpointHandler.typestr() == "cairn.data.checkpoint.CheckpointHandler"


def test_flat_map_transform_is_an_interface():
    class Repeat(grain.transforms.FlatMap):
        max_fan_out = 3

        def flat_map(self, element):
            yield from [element] * self.max_fan_out

    assert list(Repeat().flat_map(2)) == [2, 2, 2]
    assert grain.experimental.FlatMapTransform is grain.transforms.FlatMap


def test_flat_map_map_dataset():
    class Upto(grain.transforms.FlatMap):
        max_fan_out = 3

        def flat_map(self, element):
            return range(element % 4)

    ds = grain.experimental.FlatMapMapDataset(MapDataset.range(6).shuffle(seed=1), Upto())
    base = [MapDataset.range(6).shuffle(seed=1)[i] for i in range(6)]
    assert len(ds) == 18
    assert list(ds) == [j for x in base for j in range(x % 4)]
    second_epoch = [ds[18 + i] for i in range(18)]
    assert sorted(x for x in second_epoch if x is not None) == sorted(ds)
    grain.experimental.assert_equal_output_after_checkpoint(ds.to_iter_dataset())
    assert list(ds.to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=2))) == list(ds)

    class TooMany(Upto):
        def flat_map(self, element):
            return [element] * 4

    with pytest.raises(ValueError, match="element 0 gave 4 outputs, more than max_fan_out=3"):
        grain.experimental.FlatMapMapDataset(MapDataset.range(2), TooMany())[0]
    with pytest.raises(ValueError, match="max_fan_out must be a positive int, got 0"):
        grain.experimental.FlatMapMapDataset(MapDataset.range(2), type("Z", (Upto,), {"max_fan_out": 0})())
    with pytest.raises(TypeError, match="must have a flat_map method, got int"):
        grain.experimental.FlatMapMapDataset(MapDataset.range(2), 3)
