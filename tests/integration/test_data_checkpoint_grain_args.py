"""A cairn.data iterator saved by cairn.checkpoint through Grain's argument objects.

The two packages never import each other: ``cairn.data.checkpoint.CheckpointSave``
wraps the iterator as ``.item`` and the manager saves any Checkpointable's state.
"""

from __future__ import annotations

import numpy as np

import cairn.checkpoint as ocp
import cairn.data as grain


def _pipeline():
    return (
        grain.MapDataset.range(40).shuffle(seed=7).map(lambda x: x * 2).batch(4).to_iter_dataset()
    )


def test_manager_saves_and_restores_an_iterator_in_a_composite(tmp_path):
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    it = iter(_pipeline())
    for _ in range(3):
        next(it)
    mngr = ocp.CheckpointManager(
        tmp_path / "ckpt", options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    )
    assert mngr.save(
        3,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(params), ds=grain.checkpoint.CheckpointSave(it)
        ),
    )
    mngr.wait_until_finished()
    expected = [b.tolist() for b in it]

    fresh = iter(_pipeline())
    restored = mngr.restore(
        3,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(params), ds=grain.checkpoint.CheckpointRestore(fresh)
        ),
    )
    assert restored.ds is fresh
    np.testing.assert_array_equal(np.asarray(restored.state["w"]), params["w"])
    assert [b.tolist() for b in fresh] == expected
    mngr.close()


def test_data_loader_iterator_through_the_manager(tmp_path):
    loader = grain.DataLoader(
        data_source=list(range(30)),
        sampler=grain.samplers.IndexSampler(num_records=30, shuffle=True, seed=1, num_epochs=2),
        operations=[grain.transforms.Batch(batch_size=5)],
    )
    it = iter(loader)
    next(it)
    mngr = ocp.CheckpointManager(tmp_path / "dl")
    mngr.save(1, args=ocp.args.Composite(ds=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
    expected = [b.tolist() for b in it]
    again = iter(loader)
    mngr.restore(1, args=ocp.args.Composite(ds=grain.checkpoint.CheckpointRestore(again)))
    assert [b.tolist() for b in again] == expected
    mngr.close()


def test_single_iterator_args_without_a_composite(tmp_path):
    # Grain's tutorial form: mngr.save(step, args=grain.checkpoint.CheckpointSave(it)) alone
    it = iter(_pipeline())
    next(it)
    mngr = ocp.CheckpointManager(tmp_path / "one", options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))
    assert mngr.save(1, args=grain.checkpoint.CheckpointSave(it))
    expected = [b.tolist() for b in it]
    fresh = iter(_pipeline())
    assert mngr.restore(1, args=grain.checkpoint.CheckpointRestore(fresh)) is fresh
    assert [b.tolist() for b in fresh] == expected
    try:
        mngr.save(2, args=object())
    except TypeError as e:
        assert "wrap a Checkpointable as .item" in str(e)
    else:
        raise AssertionError("a bare object as args must be refused")
    mngr.close()
