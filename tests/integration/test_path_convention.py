"""One path convention: every package names a leaf by the string core_array gives it.

Issue 14: "A test walks the same trees through each package and asserts identical paths."
Each test walks one tree through :func:`cairn.core_array.flatten_with_paths` (the
reference) and through a package's public API, and compares the path strings:

- cairn.checkpoint: the paths a checkpoint stores (``metadata``, a manager step's
  ``item_metadata``, safetensors tensor names) and ``paths=`` selection;
- cairn.nn: ``State.flat_paths`` / ``flat_items``, ``GraphDef.path_strings``,
  ``PathRegex`` filters given exactly the reference paths;
- cairn.optim: per-parameter state (``mu``/``nu`` keyed like the params),
  ``layout_of(...).paths`` (what ``optim.pack`` packs by), masks by path rule and the
  paths named in a rule error;
- cairn.data: the paths named in batching errors and in debug-mode
  ``StructureMismatchError.path``, and the field keys the example codec stores.

A key that no path can hold (a ``str`` containing ``/``) is refused with
:class:`~cairn.core_array.PathError` wherever a package builds a path from it; the
packages that must accept such keys (data batching, where records with any keys batch)
never turn it into a path string: their errors name the key under its parent's path.

Only public APIs are used, so the packages' internal moves do not affect this file.
"""

from __future__ import annotations

import collections
import re
import struct

import jax.numpy as jnp
import numpy as np
import pytest

from cairn import checkpoint as ckpt
from cairn import data, nn, optim
from cairn.core_array import PathError, flatten_with_paths, path_of, unflatten

Point = collections.namedtuple("Point", ["x", "y"])


# --- trees ---


def _nested() -> dict:
    """Dicts (str and int keys), lists, tuples, a namedtuple, a None (empty subtree)."""
    rng = np.random.default_rng(0)

    def arr(*shape: int) -> np.ndarray:
        return rng.normal(size=shape).astype(np.float32)

    return {
        "embed": arr(4, 2),
        "blocks": [
            {"attn": (arr(2, 2), arr(2)), "skip": None},
            {"attn": (arr(2, 2), arr(2)), "mlp": [arr(2, 3), arr(3, 2)]},
        ],
        "point": Point(x=arr(1), y={"deep": [arr(2)]}),
        "by_id": {0: arr(1), 7: arr(2), 12: arr(3)},
    }


class MLP(nn.Module):
    """Layers held in a plain list, plus a norm: paths ``layers/<i>/kernel`` etc."""

    def __init__(self, rngs: nn.Rngs) -> None:
        self.layers = [nn.Linear(2, 3, rngs=rngs), nn.Linear(3, 3, rngs=rngs), nn.Linear(3, 1, rngs=rngs)]
        self.norm = nn.LayerNorm(1, rngs=rngs)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def _model() -> MLP:
    return MLP(nn.Rngs(0))


def _model_params() -> dict:
    return nn.to_pure_dict(nn.state(_model()))


TREES = {
    "nested": _nested,
    "model_params": _model_params,
    "optim_state": lambda: optim.adamw(1e-3).init(_model_params()),
}


def _paths(tree: object) -> list[str]:
    return list(flatten_with_paths(tree))


def _same(got: list[str] | tuple[str, ...], reference: list[str]) -> None:
    """The same path strings (each once); order is each package's own business."""
    assert len(got) == len(set(got)), f"duplicate paths: {got}"
    assert sorted(got) == sorted(reference)


# --- the reference itself ---


def test_reference_paths_of_the_nested_tree() -> None:
    """Pin the convention the other tests compare against (core_array's docs)."""
    assert sorted(_paths(_nested())) == sorted(
        [
            "embed",
            "blocks/0/attn/0",
            "blocks/0/attn/1",
            "blocks/1/attn/0",
            "blocks/1/attn/1",
            "blocks/1/mlp/0",
            "blocks/1/mlp/1",
            "point/x",
            "point/y/deep/0",
            "by_id/0",
            "by_id/7",
            "by_id/12",
        ]
    )


# --- cairn.checkpoint ---


@pytest.mark.parametrize("name", sorted(TREES))
def test_checkpoint_stores_every_leaf_under_its_core_array_path(tmp_path, name: str) -> None:
    tree = TREES[name]()
    ckpt.save(tmp_path / "ckpt", tree)
    _same(list(ckpt.metadata(tmp_path / "ckpt")), _paths(tree))
    # restoring onto the tree itself matches leaf for leaf (a path mismatch would raise)
    ckpt.restore(tmp_path / "ckpt", tree)


@pytest.mark.parametrize("name", sorted(TREES))
def test_checkpoint_manager_item_metadata_uses_core_array_paths(tmp_path, name: str) -> None:
    tree = TREES[name]()
    with ckpt.CheckpointManager(tmp_path, ckpt.CheckpointManagerOptions(enable_async=False)) as mngr:
        mngr.save(0, {"item": tree})
        meta = mngr.item_metadata(0)["item"]
    assert isinstance(meta, dict)
    _same(list(meta), _paths(tree))
    assert all(m.path == p for p, m in meta.items())


def test_checkpoint_paths_selection_matches_core_array_paths_exactly(tmp_path) -> None:
    tree = _nested()
    ckpt.save(tmp_path / "ckpt", tree)
    for path in _paths(tree):
        got = ckpt.restore(tmp_path / "ckpt", paths=re.escape(path))
        assert _paths(got) == [path]


def test_checkpoint_of_a_model_and_of_its_state_use_nn_paths(tmp_path) -> None:
    model = _model()
    ckpt.save(tmp_path / "state", nn.state(model))
    _same(list(ckpt.metadata(tmp_path / "state")), nn.state(model).flat_paths())
    ckpt.save(tmp_path / "model", model)
    _same(list(ckpt.metadata(tmp_path / "model")), nn.state(model).flat_paths())


def test_safetensors_names_tensors_by_core_array_path(tmp_path) -> None:
    tree = _nested()
    ckpt.save_safetensors(tmp_path / "w.safetensors", tree)
    _same(_paths(ckpt.load_safetensors(tmp_path / "w.safetensors")), _paths(tree))


# --- cairn.nn ---


def test_nn_state_paths_are_core_array_paths() -> None:
    model = _model()
    state = nn.state(model)
    reference = _paths(state)
    assert reference == _paths(model)  # the model pytree and its State agree
    assert state.flat_paths() == reference
    assert [p for p, _ in state.flat_items()] == reference
    _same(_paths(nn.to_pure_dict(state)), reference)
    graphdef, _ = nn.split(model)
    assert list(graphdef.path_strings) == reference
    # the key tuples of flat_state render (by core_array) to the same strings
    assert [path_of(p) for p in state.flat_state()] == reference


@pytest.mark.parametrize("path", _paths(_model()))
def test_nn_path_regex_selects_exactly_the_core_array_path(path: str) -> None:
    model = _model()
    assert nn.state(model, nn.PathRegex(re.escape(path))).flat_paths() == [path]


def test_nn_path_regex_compiles_like_core_array() -> None:
    with pytest.raises(PathError, match=re.escape("'layers/(")):
        nn.PathRegex("layers/(")


# --- cairn.optim ---


def test_optim_per_parameter_state_is_keyed_by_the_param_paths() -> None:
    params = _model_params()
    state = optim.adam(1e-3).init(params)
    reference = _paths(params)
    _same(_paths(state[0].mu), reference)
    _same(_paths(state[0].nu), reference)
    # and the state's own paths are the param paths under the state's fields
    assert {p for p in _paths(state) if p.startswith("0/mu/")} == {f"0/mu/{p}" for p in reference}
    # packed state (optim.pack) keeps the paths in its layout
    packed = optim.pack(optim.adam(1e-3)).init(params)[0].mu
    assert isinstance(packed, optim.Packed)
    _same(optim.layout_of(packed).paths, reference)


def test_optim_state_of_an_nn_state_is_keyed_by_nn_paths() -> None:
    state = nn.state(_model())
    opt_state = optim.adam(1e-3).init(state)
    _same(_paths(opt_state[0].mu), state.flat_paths())


@pytest.mark.parametrize("name", ["nested", "model_params"])
def test_optim_layout_paths_are_core_array_paths(name: str) -> None:
    tree = TREES[name]()
    _same(optim.layout_of(tree).paths, _paths(tree))
    _same(optim.layout_of(tree, per_leaf=True).paths, _paths(tree))


def _without_none() -> dict:
    tree = _nested()
    tree["blocks"][0].pop("skip")
    return tree


def _zeroed_by_mask(params: object, path: str) -> list[str]:
    """The paths whose update ``masked(scale(0), {re.escape(path): True})`` zeroes."""
    ones = _rebuild(params, {p: np.ones_like(g) for p, g in flatten_with_paths(params).items()})
    tx = optim.masked(optim.scale(0.0), {re.escape(path): True})
    updates, _ = tx.update(ones, tx.init(params), params)
    return [p for p, u in flatten_with_paths(updates).items() if not np.any(np.asarray(u))]


@pytest.mark.parametrize("tree", [_without_none, _model_params])
def test_optim_mask_rules_match_core_array_paths_exactly(tree) -> None:
    params = tree()
    for path in flatten_with_paths(params):
        assert _zeroed_by_mask(params, path) == [path]


def test_optim_mask_rules_with_a_none_subtree() -> None:
    """A None (empty subtree) in the params does not shift the mask (fixed in 27c440c)."""
    params = _nested()  # holds blocks/0/skip = None
    for path in flatten_with_paths(params):
        assert _zeroed_by_mask(params, path) == [path]


def test_optim_rule_errors_name_core_array_paths() -> None:
    params = _model_params()
    tx = optim.partition({"a": optim.sgd(1.0)}, {r"layers/0/.*": "a"})
    with pytest.raises(ValueError, match=re.escape("'layers/1/bias'")) as err:
        tx.init(params)
    assert "parameter at path 'layers/1/bias'" in str(err.value)


def _rebuild(like: object, flat: dict) -> object:
    return unflatten(flat, like=like)


# --- cairn.data ---


def _records_differing_at(tree: dict, path: str) -> list:
    """Two records equal to ``tree`` except that the leaf at ``path`` is one longer."""
    flat = flatten_with_paths(tree)
    other = dict(flat)
    other[path] = np.zeros(flat[path].size + 1, flat[path].dtype)
    return [tree, _rebuild(tree, other)]


def _data_records() -> dict:
    t = _without_none()  # a None in a record is a leaf to data, an empty subtree to core_array
    del t["by_id"]  # records are str-keyed dicts in data's examples
    return t


@pytest.mark.parametrize("path", _paths(_data_records()))
def test_data_batching_errors_name_the_core_array_path(path: str) -> None:
    records = _records_differing_at(_data_records(), path)
    with pytest.raises(ValueError, match=rf"at path {re.escape(repr(path))} "):
        data.stack_records(records)
    with pytest.raises(ValueError, match=rf"at path {re.escape(repr(path))} "):
        data.MapDataset.source(records).batch(2)[0]


@pytest.mark.parametrize("path", _paths(_data_records()))
def test_data_debug_structure_check_names_the_core_array_path(path: str) -> None:
    records = _records_differing_at(_data_records(), path)
    it = iter(data.MapDataset.source(records).to_iter_dataset(debug=True))
    next(it)
    with pytest.raises(data.StructureMismatchError) as err:
        next(it)
    assert err.value.path == path


def _codec_keys(blob: bytes, candidates: set[str]) -> set[str]:
    """Which of ``candidates`` an encode_example record stores as field keys, by its
    documented layout: magic, uint32 count, then per field uint16 key length, UTF-8 key..."""
    assert blob[:4] == b"CDX1"
    return {k for k in candidates if struct.pack("<H", len(k.encode())) + k.encode() in blob}


def test_data_codec_field_keys_are_core_array_paths() -> None:
    example = {
        "ids": np.arange(3, dtype=np.int32),
        "meta": {"lang": "en", "len": 3, "inner": {"score": 0.5, "raw": b"x"}},
        "mask": np.ones(3, bool),
    }
    reference = _paths(example)
    # the parents too: a field stored under its parent's key would show up
    candidates = set(reference) | {p.rsplit("/", 1)[0] for p in reference if "/" in p}
    blob = data.encode_example(example)
    assert _codec_keys(blob, candidates) == set(reference)
    assert struct.unpack_from("<I", blob, 4)[0] == len(reference)
    _same(_paths(data.decode_example(blob)), reference)


# --- keys that no path can hold ---


BAD = {"ok": {"a/b": np.zeros(1, np.float32)}}


def test_core_array_refuses_a_slash_in_a_key() -> None:
    with pytest.raises(PathError, match=re.escape("'a/b' under 'ok'")):
        flatten_with_paths(BAD)


def test_checkpoint_refuses_a_slash_in_a_key(tmp_path) -> None:
    with pytest.raises(PathError, match=re.escape("'a/b' under 'ok'")):
        ckpt.save(tmp_path / "c", BAD)
    with pytest.raises(PathError, match=re.escape("'a/b' under 'ok'")):
        ckpt.save_safetensors(tmp_path / "w.safetensors", BAD)
    with ckpt.CheckpointManager(tmp_path / "m", ckpt.CheckpointManagerOptions(enable_async=False)) as mngr:
        with pytest.raises(PathError, match=re.escape("'a/b' under 'ok'")):
            mngr.save(0, {"item": BAD})
        assert mngr.all_steps() == []


def test_nn_refuses_a_slash_in_a_key() -> None:
    state = nn.State({"ok": {"a/b": nn.Param(jnp.zeros(1))}})
    with pytest.raises(PathError, match=re.escape("'a/b' under 'ok'")):
        state.flat_paths()
    with pytest.raises(PathError, match=re.escape("'a/b' under 'ok'")):
        flatten_with_paths(state)
    # nn.Dict checks its keys when built (a TypeError, as it always was), naming the key
    with pytest.raises((PathError, TypeError), match=re.escape("'a/b'")):
        nn.Dict({"a/b": nn.Linear(1, 1, rngs=nn.Rngs(0))})


def test_optim_refuses_a_slash_in_a_key() -> None:
    params = {"ok": {"a/b": jnp.zeros(1)}}
    with pytest.raises(PathError, match=re.escape("'a/b' under 'ok'")):
        optim.layout_of(params)
    with pytest.raises(PathError, match=re.escape("'a/b' under 'ok'")):
        optim.masked(optim.sgd(1.0), r"ok/.*").init(params)


def test_data_codec_refuses_a_slash_in_a_key() -> None:
    with pytest.raises(ValueError, match=re.escape("'ok/a/b'")):
        data.encode_example({"ok": {"a/b": 1}})


def test_data_batching_never_turns_a_bad_key_into_a_path() -> None:
    """Records may have any keys (they batch); an error names such a key by repr under
    its parent's path, never as the colliding path string ``ok/a/b``."""
    good = data.stack_records([BAD, BAD])
    assert good["ok"]["a/b"].shape == (2, 1)
    records = [BAD, {"ok": {"a/b": np.zeros(2, np.float32)}}]
    with pytest.raises(ValueError) as err:
        data.stack_records(records)
    assert "key 'a/b' under path 'ok'" in str(err.value)
    assert "'ok/a/b'" not in str(err.value)
    it = iter(data.MapDataset.source(records).to_iter_dataset(debug=True))
    next(it)
    with pytest.raises(data.StructureMismatchError) as serr:
        next(it)
    assert serr.value.path == "ok"
    assert "key 'a/b' under path 'ok'" in str(serr.value)
