"""grain.experimental and grain.checkpoint as Grain's docs use them, beside real Grain.

Patterns from google/grain docs/tutorials/dataset_advanced_tutorial.md (Orbax
checkpointing of a ``DatasetIterator``), docs/tutorials/dataset_basic_tutorial.md
(``pick_performance_config`` feeding ``to_iter_dataset`` / ``mp_prefetch``) and the
``device_put`` docstring, on small in-memory sources (the docs read TFDS). The same code
runs with ``grain`` and with ``cairn.data``; element outputs are compared exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

import cairn.data

grain_real = pytest.importorskip("grain")


def _pipeline(grain):
    return grain.MapDataset.source(list(range(30))).map(lambda x: {"label": x, "sq": x * x}).batch(4)


@pytest.mark.parametrize("grain", [grain_real, cairn.data], ids=["grain", "cairn"])
def test_orbax_checkpoint_manager_saves_the_iterator(grain, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    ds_iter = iter(_pipeline(grain).to_iter_dataset())
    num_steps = 4
    for _ in range(num_steps):
        next(ds_iter)
    mngr = ocp.CheckpointManager(tmp_path / "orbax")
    assert mngr.save(step=num_steps, args=grain.checkpoint.CheckpointSave(ds_iter), force=True)
    mngr.wait_until_finished()
    assert (tmp_path / "orbax" / "4" / "default" / "process_0-of-1.json").is_file()
    after = [next(ds_iter)["label"].tolist() for _ in range(3)]
    mngr.restore(num_steps, args=grain.checkpoint.CheckpointRestore(ds_iter))
    assert [next(ds_iter)["label"].tolist() for _ in range(3)] == after == [
        [16, 17, 18, 19], [20, 21, 22, 23], [24, 25, 26, 27]
    ]
    mngr.close()


def test_thread_prefetch_and_device_put_match_grain():
    jax = pytest.importorskip("jax")
    outs = []
    for grain in (grain_real, cairn.data):
        ds = grain.experimental.ThreadPrefetchIterDataset(
            _pipeline(grain).to_iter_dataset(), prefetch_buffer_size=3
        )
        ds = grain.experimental.device_put(
            ds, jax.devices("cpu")[0], cpu_buffer_size=4, device_buffer_size=2
        )
        got = list(ds)
        assert all(isinstance(b["sq"], jax.Array) for b in got)
        outs.append(got)
    assert len(outs[0]) == len(outs[1]) == 8
    for a, b in zip(*outs):
        for k in ("label", "sq"):
            assert a[k].dtype == b[k].dtype and np.array_equal(np.asarray(a[k]), np.asarray(b[k]))


def test_pick_performance_config_feeds_the_same_steps():
    outs = []
    for grain in (grain_real, cairn.data):
        ds = grain.MapDataset.source(list(range(64))).map(lambda x: np.full(8, x, np.int32))
        performance_config = grain.experimental.pick_performance_config(
            ds=ds, ram_budget_mb=64, max_workers=None, max_buffer_size=None
        )
        assert performance_config.multiprocessing_options.num_workers >= 1
        it_ds = ds.to_iter_dataset(read_options=performance_config.read_options).batch(16)
        outs.append([b.tolist() for b in it_ds])
    assert outs[0] == outs[1]
