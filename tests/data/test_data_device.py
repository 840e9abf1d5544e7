"""device_put: arrays on a JAX device, state restores with and without workers."""

import numpy as np
import pytest

from cairn.data import (
    MapDataset,
    assert_equal_output_after_checkpoint,
    device_put,
)


def _triple(x):
    return x * 3


def test_device_put_with_jax():
    jax = pytest.importorskip("jax")
    ds = device_put(MapDataset.range(8).batch(4).to_iter_dataset(), jax.devices()[0])
    it = iter(ds)
    out = list(it)
    assert all(isinstance(b, jax.Array) for b in out)
    assert [np.asarray(b).tolist() for b in out] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    it.set_state({"next_index": 1})
    assert np.asarray(next(it)).tolist() == [4, 5, 6, 7]
    it.close()


@pytest.mark.multiprocess
def test_device_put_restores_after_every_step_with_and_without_workers():
    jax = pytest.importorskip("jax")
    dev = jax.devices()[0]
    base = MapDataset.range(60).shuffle(seed=2).map(_triple).batch(4).to_iter_dataset()
    assert_equal_output_after_checkpoint(device_put(base, dev))
    # Workers forked by a process that already runs JAX (they never call it), restored
    # into 0 workers and back.
    two = device_put(base.mp_prefetch(2), dev, buffer_size=3)
    assert_equal_output_after_checkpoint(two, restore_ds=device_put(base, dev), max_steps=None)
    assert_equal_output_after_checkpoint(device_put(base, dev), restore_ds=two, max_steps=3)
    with iter(two) as it:
        out = list(it)
    assert all(isinstance(b, jax.Array) for b in out)
    assert [np.asarray(b).tolist() for b in out] == [b.tolist() for b in base]
