"""``ocp.metadata``: Orbax's value-metadata classes (issue 30): their equality, a composite
item's ``.tree`` of them, ``construct_restore_args`` on them, and the module still callable
as ``cairn.checkpoint.metadata(directory)``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cairn.checkpoint as ocp
from cairn.checkpoint.metadata import ArrayMetadata, ItemMetadata, ScalarMetadata, StringMetadata


def test_module_is_callable_as_the_metadata_function(tmp_path):
    ocp.save(tmp_path / "c", {"w": np.zeros((2, 3), np.float32)})
    m = ocp.metadata(tmp_path / "c")["w"]
    assert (m.shape, m.dtype, m.kind) == ((2, 3), "float32", "numpy")
    from cairn.checkpoint import metadata

    assert metadata is ocp.metadata and metadata(tmp_path / "c") == ocp.metadata(tmp_path / "c")


def test_equality_follows_orbax_name_and_directory_never_count():
    assert ScalarMetadata(name="a", directory="x", dtype=np.int64) == ScalarMetadata(name="b", directory=None,
                                                                                      dtype=jnp.int64)
    assert ScalarMetadata(name="a", directory=None, dtype=np.int32) != ScalarMetadata(name="a", directory=None,
                                                                                       dtype=np.int64)
    a = ArrayMetadata(name="w", directory=None, shape=(2, 4), sharding=None, dtype=np.float32)
    assert a == ArrayMetadata(name="v", directory="d", shape=[2, 4], sharding=None, dtype="float32")
    assert a != ArrayMetadata(name="w", directory=None, shape=(4, 2), sharding=None, dtype=np.float32)
    assert a != ArrayMetadata(name="w", directory=None, shape=(2, 4), sharding=None, dtype=np.float64)
    assert a != ScalarMetadata(name="w", directory=None, dtype=np.float32)  # another kind
    assert StringMetadata(name="s", directory=None) == StringMetadata(name="t", directory="d")
    assert StringMetadata(name="s", directory=None) != a


def test_composite_item_metadata_tree_of_value_metadata(tmp_path):
    ck = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    state = {"a": 1, "b": {"w": jnp.ones((2, 3), jnp.bfloat16), "s": "hi", "l": [np.float32(2.0)]}}
    ck.save(tmp_path / "c", args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     cfg=ocp.args.JsonSave({"k": 1})))
    md = ck.metadata(tmp_path / "c")
    assert set(md.item_metadata) == {"state", "cfg"} and md.item_metadata.cfg == "json"
    item = md.item_metadata.state
    assert isinstance(item, ItemMetadata) and item is not None and item["b/w"].shape == (2, 3)
    tree = item.tree
    assert tree == {"a": ScalarMetadata(name="a", directory=None, dtype=jnp.int64),
                    "b": {"w": ArrayMetadata(name="w", directory=None, shape=(2, 3), sharding=None,
                                             dtype=jnp.bfloat16),
                          "s": StringMetadata(name="s", directory=None),
                          "l": [ScalarMetadata(name="0", directory=None, dtype=np.float32)]}}
    assert tree["a"].name == "a" and tree["b"]["w"].directory == tmp_path / "c" / "state"
    # still a pytree of its LeafMetadata, as the dict it is
    assert sorted(m.path for m in jax.tree.leaves(md["state"], is_leaf=lambda x: isinstance(x, ocp.LeafMetadata))) \
        == ["a", "b/l/0", "b/s", "b/w"]


def test_construct_restore_args_on_value_metadata():
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    target = {
        "i": ScalarMetadata(name="i", directory=None, dtype=np.int32),
        "f": ScalarMetadata(name="f", directory=None, dtype=np.float64),
        "n": ArrayMetadata(name="n", directory=None, shape=(2, 4), sharding=None, dtype=np.float32),
        "j": ArrayMetadata(name="j", directory=None, shape=(2, 4), sharding=sharding, dtype=np.float32),
        "s": StringMetadata(name="s", directory=None),
    }
    got = ocp.checkpoint_utils.construct_restore_args(target)
    assert got["i"] == ocp.RestoreArgs(restore_type=int, dtype=np.int32)
    assert got["f"].restore_type is float
    assert got["n"] == ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.float32)
    assert isinstance(got["j"], ocp.ArrayRestoreArgs) and got["j"].sharding == sharding
    assert got["j"].global_shape == (2, 4) and got["s"] == ocp.RestoreArgs(restore_type=str)


@pytest.mark.parametrize("bad", [object(), b"bytes"])
def test_construct_restore_args_still_names_an_unknown_leaf(bad):
    with pytest.raises(TypeError, match="cannot restore a leaf of type"):
        ocp.checkpoint_utils.construct_restore_args({"x": bad})


def test_composite_metadata_lists_a_known_items_folder_without_a_saved_item_as_none(tmp_path):
    handler = ocp.CompositeCheckpointHandler(state=ocp.StandardCheckpointHandler(),
                                             datasets=ocp.StandardCheckpointHandler())
    ocp.Checkpointer(handler).save(tmp_path / "c", args=ocp.args.Composite(state=ocp.args.StandardSave({"a": 1})))
    assert set(handler.metadata(tmp_path / "c")) == {"state"}  # no folder: not listed
    (tmp_path / "c" / "datasets").mkdir()
    (tmp_path / "c" / "datasets" / "data.txt").write_text("not a checkpoint")
    (tmp_path / "c" / "other").mkdir()  # no handler for it: not listed
    md = handler.metadata(tmp_path / "c")
    assert md["datasets"] is None and md.item_metadata["datasets"] is None and "other" not in md
    assert md.item_metadata.state.tree == {"a": ScalarMetadata(name="a", directory=None, dtype=np.int64)}
    assert md.item_handlers["datasets"] is None


def test_metadata_tree_to_abstract_target_and_restore(tmp_path):
    ck = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    state = {"w": jnp.arange(6.0).reshape(2, 3), "x": np.ones(3, np.int32), "n": 3}
    ck.save(tmp_path / "c", args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    tree = ck.metadata(tmp_path / "c").item_metadata.state.tree
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    assert abstract["w"] == jax.ShapeDtypeStruct((2, 3), jnp.float32)
    assert abstract["x"] == jax.ShapeDtypeStruct((3,), np.int32) and abstract["n"].shape == ()
    assert ocp.utils.to_shape_dtype_struct(tree["n"], scalar_dtype=np.int32).dtype == np.int32
    assert ocp.utils.to_shape_dtype_struct(tree["w"], dtype=jnp.bfloat16).dtype == jnp.bfloat16
    got = ck.restore(tmp_path / "c", args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))).state
    np.testing.assert_array_equal(got["w"], state["w"])
    np.testing.assert_array_equal(got["x"], state["x"])
    assert got["n"] == 3
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("d",))
    sharded = ArrayMetadata(name="w", directory=None, shape=(2, 3), dtype=np.float32,
                            sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    assert ocp.utils.to_shape_dtype_struct(sharded).sharding == sharded.sharding
