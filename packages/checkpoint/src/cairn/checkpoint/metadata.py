"""``ocp.metadata``: Orbax's value-metadata classes, and, called, :func:`cairn.checkpoint.metadata`.

``cairn.checkpoint.metadata(directory)`` describes a checkpoint as ``{path: LeafMetadata}``
(one path convention across Cairn). Orbax's code names the same information with the
classes here: ``ArrayMetadata`` / ``ScalarMetadata`` / ``StringMetadata``, which a
composite item's metadata gives as its ``.tree`` (the saved tree with one of them per
leaf) and which ``checkpoint_utils.construct_restore_args`` accepts as a target. They
compare as Orbax's do: an ``ArrayMetadata`` by shape, sharding, dtype and storage, a
``ScalarMetadata`` by dtype, a ``StringMetadata`` equals any other (``name`` and
``directory`` never count).

This module is callable, so ``cairn.checkpoint.metadata(directory)`` keeps working while
``ocp.metadata.ScalarMetadata`` names the class.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
import types
from typing import Any

import jax

from cairn.checkpoint import _restore, _structure
from cairn.checkpoint._restore import LeafMetadata


@dataclasses.dataclass(eq=False)
class Metadata:
    """What a checkpoint holds at one leaf, as Orbax describes it.

    Args:
      name: the leaf's name (its key in its parent).
      directory: the item directory holding it (``None`` when not from a checkpoint).
    """

    name: str
    directory: Any

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Metadata)

    __hash__ = None  # type: ignore[assignment]  # compared by content, as Orbax's


@dataclasses.dataclass(eq=False)
class ArrayMetadata(Metadata):
    """An array leaf (``jax.Array`` or NumPy array).

    Args:
      name: the leaf's name.
      directory: the item directory holding it.
      shape: the saved shape.
      sharding: the saved sharding as a ``jax.sharding.PartitionSpec`` (a checkpoint records
        no devices), a ``jax.sharding.Sharding`` when built by the user, or ``None``.
      dtype: the saved dtype (a name that compares equal to the dtype objects, see
        :class:`~cairn.checkpoint.LeafMetadata`).
      storage: how it is stored (``None``: not described).
    """

    shape: tuple[int, ...]
    sharding: Any
    dtype: Any
    storage: Any = None

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ArrayMetadata) and tuple(self.shape) == tuple(other.shape)
                and self.sharding == other.sharding and _same_dtype(self.dtype, other.dtype)
                and self.storage == other.storage)


@dataclasses.dataclass(eq=False)
class ScalarMetadata(ArrayMetadata):
    """A Python or NumPy scalar leaf; compared by dtype alone.

    Args:
      name: the leaf's name.
      directory: the item directory holding it.
      shape: ``()``.
      sharding: ``None``.
      dtype: the scalar's dtype (``int64`` for a Python ``int``, ``float64`` for a ``float``).
      storage: ``None``.
    """

    shape: tuple[int, ...] = ()
    sharding: Any = None
    dtype: Any = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ScalarMetadata) and _same_dtype(self.dtype, other.dtype)


@dataclasses.dataclass(eq=False)
class StringMetadata(Metadata):
    """A ``str`` leaf; equal to any other ``StringMetadata``.

    Args:
      name: the leaf's name.
      directory: the item directory holding it.
    """

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StringMetadata)


def _same_dtype(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    try:
        return _restore.DTypeName(jax.numpy.dtype(a).name) == b
    except TypeError:
        return a == b


def from_leaf(leaf: LeafMetadata, directory: Any = None) -> Metadata:
    """The Orbax value-metadata object of one :class:`~cairn.checkpoint.LeafMetadata`.

    Args:
      leaf: a leaf of ``cairn.checkpoint.metadata(directory)``.
      directory: the item directory it was read from (kept as ``directory``).
    """
    name = leaf.path.rsplit("/", 1)[-1]
    if leaf.kind == "scalar":
        if isinstance(leaf.value, str):
            return StringMetadata(name=name, directory=directory)
        return ScalarMetadata(name=name, directory=directory, dtype=leaf.dtype)
    spec = None if leaf.sharding is None else jax.sharding.PartitionSpec(*leaf.sharding)
    if leaf.kind == "numpy_scalar":
        return ScalarMetadata(name=name, directory=directory, dtype=leaf.dtype)
    return ArrayMetadata(name=name, directory=directory, shape=tuple(leaf.shape), sharding=spec, dtype=leaf.dtype)


class ItemMetadata(dict):
    """One pytree item's metadata: the ``{path: LeafMetadata}`` dict, whose :attr:`tree` is
    the saved tree with Orbax's value-metadata object at each leaf.

    Args:
      leaves: the ``{path: LeafMetadata}`` dict.
      structure: the saved tree's container structure (``None`` for checkpoints that did not
        record it: nested dicts by path).
      directory: the item directory.
    """

    def __init__(self, leaves: dict[str, LeafMetadata], structure: Any = None, directory: Any = None) -> None:
        super().__init__(leaves)
        self.structure = structure
        self.directory = directory

    @property
    def tree(self) -> Any:
        """The saved tree with an ``ArrayMetadata`` / ``ScalarMetadata`` / ``StringMetadata`` per leaf."""
        values = {p: from_leaf(m, self.directory) for p, m in self.items()}
        if self.structure is not None:
            return _structure.rebuild(self.structure, values)
        out: dict[str, Any] = {}
        for path, v in values.items():
            node = out
            *parents, last = path.split("/")
            for key in parents:
                node = node.setdefault(key, {})
            node[last] = v
        return out


def _flatten_item(m: ItemMetadata) -> tuple[list[Any], tuple[tuple[str, ...], Any, Any]]:
    keys = tuple(sorted(m))
    return [m[k] for k in keys], (keys, m.structure, m.directory)


def _unflatten_item(aux: tuple[tuple[str, ...], Any, Any], children: list[Any]) -> ItemMetadata:
    keys, structure, directory = aux
    return ItemMetadata(dict(zip(keys, children, strict=True)), structure, directory)


# a pytree node like the dict it is, so jax.tree.map(f, metadata) reaches each LeafMetadata
jax.tree_util.register_pytree_node(ItemMetadata, _flatten_item, _unflatten_item)


def item_metadata_of(directory: str | os.PathLike) -> ItemMetadata:
    """The :class:`ItemMetadata` of a pytree item directory (no array data read).

    Args:
      directory: a pytree item's directory in a committed checkpoint.
    """
    meta = _restore.load_metadata(os.fspath(directory))
    leaves = {p: _restore._leaf_metadata(p, e) for p, e in meta["leaves"].items()}
    return ItemMetadata(leaves, meta.get("structure"), pathlib.Path(directory))


class _CallableModule(types.ModuleType):
    """This module, callable as :func:`cairn.checkpoint.metadata` (Orbax's ``ocp.metadata`` is
    a module; cairn's a function: both uses work)."""

    def __call__(self, directory: str | os.PathLike) -> dict[str, LeafMetadata]:
        """Every saved path's :class:`~cairn.checkpoint.LeafMetadata` (see
        ``cairn.checkpoint._checkpointer.metadata``).

        Args:
          directory: a committed checkpoint.
        """
        from cairn.checkpoint._checkpointer import metadata

        return metadata(directory)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["ArrayMetadata", "ItemMetadata", "Metadata", "ScalarMetadata", "StringMetadata", "from_leaf",
           "item_metadata_of"]
