"""What a ``Checkpointer`` writes for Orbax-style arguments, and how it reads it back.

* pytree arguments (``StandardSave``, ``PyTreeSave``, ``ArraySave``): a plain checkpoint
  directory, the same as :func:`save` writes (so :func:`restore` reads it too);
* ``JsonSave``: a directory holding ``item.json`` (checksummed JSON) and the ``COMMIT`` marker;
* ``Composite``: a directory with one subdirectory per item (each one of the above,
  without its own marker), ``_ITEMS.json`` naming each item's kind, and one ``COMMIT``.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax

from cairn.checkpoint import _args, _fs, _multihost, _restore, _tree
from cairn.checkpoint._errors import CheckpointError
from cairn.checkpoint._json_item import JSON_ITEM_FILE, jsonable, read_json_item, write_json_item
from cairn.checkpoint.logging.step_statistics import SaveStepStatistics
from cairn.checkpoint.metadata import item_metadata_of

ITEMS_FILE = "_ITEMS.json"
CUSTOM_METADATA_FILE = "_CUSTOM_METADATA.json"
_ITEM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


def plain_name(name: str) -> bool:
    """Whether ``name`` is a plain file-name part (letters, digits, ``_ . -``) other than
    the commit marker."""
    return bool(_ITEM_NAME.fullmatch(name)) and name != _fs.COMMIT_MARKER


def capture(args: _args.CheckpointArgs, *, copy_host: bool, compression: str | None) -> dict[str, Any]:
    """``{name: ("pytree", Snapshot) | ("json", value)}`` (name ``""`` for a single item):
    the blocking part of a save, done in the caller's thread."""
    items = dict(args) if isinstance(args, _args.Composite) else {"": args}
    if not items:
        raise ValueError("Composite() has no items to save")
    out: dict[str, Any] = {}
    for name, a in items.items():
        if name and (not _ITEM_NAME.fullmatch(name) or name == _fs.COMMIT_MARKER):
            raise ValueError(
                f"Composite item name {name!r} must be a plain file-name part (letters, digits, _ . -) "
                f"other than {_fs.COMMIT_MARKER!r}"
            )
        where = f"item {name!r}" if name else "save"
        tree = _args.to_saved_tree(a, where)
        if a.kind == "json":
            out[name] = ("json", jsonable(tree, where))
        else:
            out[name] = ("pytree", _tree.snapshot(tree, copy_host=copy_host, compression=compression))
    return out


class CheckpointMetadata(dict):
    """What a checkpointer's or handler's ``metadata(directory)`` returns: the dict of every
    saved path's :class:`~cairn.checkpoint.LeafMetadata` (per item for a composite, ``"json"``
    for JSON items), with Orbax's step-metadata fields as attributes.

    Args:
      leaves: the ``{path: LeafMetadata}`` (or ``{item: ...}``) dict.
      custom_metadata: the ``custom_metadata`` saved with the checkpoint (``{}`` if none).
      item_handlers: for a composite, each item's handler as ``typestr()`` (``None`` where
        not recorded); ``None`` for a single item.
      commit_timestamp_nsecs: when the checkpoint was committed (ns since the epoch), if known.
    """

    def __init__(self, leaves: dict[str, Any], custom_metadata: Any = None, *,
                 item_handlers: dict[str, str | None] | None = None,
                 commit_timestamp_nsecs: int | None = None) -> None:
        super().__init__(leaves)
        self.custom_metadata = {} if custom_metadata is None else custom_metadata
        self.item_handlers = item_handlers
        self.commit_timestamp_nsecs = commit_timestamp_nsecs
        self.init_timestamp_nsecs: int | None = None  # a Checkpointer does not record it
        self.metrics: dict[str, Any] = {}  # a Checkpointer saves no metrics (a manager's steps do)
        self.performance_metrics = SaveStepStatistics()  # not recorded for a Checkpointer's save

    @property
    def item_metadata(self) -> Any:
        """The leaves' metadata: for one item this dict itself, as a plain dict; for a
        composite an ``args.Composite`` of the items (``.state``, ``["state"]``), each pytree
        item an :class:`~cairn.checkpoint.metadata.ItemMetadata` (its ``.tree`` holds Orbax's
        value-metadata objects)."""
        return dict(self) if self.item_handlers is None else _args.Composite(dict(self))


def _flatten_metadata(m: CheckpointMetadata) -> tuple[list[Any], tuple[tuple[str, ...], Any]]:
    keys = tuple(sorted(m))
    return [m[k] for k in keys], (keys, m.custom_metadata)


def _unflatten_metadata(aux: tuple[tuple[str, ...], Any], children: list[Any]) -> CheckpointMetadata:
    keys, custom = aux
    return CheckpointMetadata(dict(zip(keys, children, strict=True)), custom)


# a pytree node like the dict it is, so jax.tree.map(f, metadata) reaches each LeafMetadata
jax.tree_util.register_pytree_node(CheckpointMetadata, _flatten_metadata, _unflatten_metadata)


def custom_metadata_of(args: Any, explicit: Any, where: str) -> Any:
    """The JSON-able ``custom_metadata`` a save stores: ``explicit`` if given, else the
    args' own field (``StandardSave(tree, custom_metadata=...)``)."""
    value = explicit if explicit is not None else getattr(args, "custom_metadata", None)
    return None if value is None else jsonable(value, f"{where}: custom_metadata")


def describe(directory: str) -> CheckpointMetadata:
    """:class:`CheckpointMetadata` of a directory written by :func:`write` (no array data)."""
    kinds = item_kinds(directory)
    out: dict[str, Any] = {
        n: (_restore.metadata_of(directory) if k == "pytree" else "json") if not n else
        (item_metadata_of(os.path.join(directory, n)) if k == "pytree" else "json")
        for n, k in kinds.items()
    }
    f = os.path.join(directory, CUSTOM_METADATA_FILE)
    custom = _fs.read_json(f, require_checksum=True) if os.path.isfile(f) else None
    handlers = None
    if "" not in out:
        recorded = _fs.read_json(os.path.join(directory, ITEMS_FILE), require_checksum=True).get("handlers")
        handlers = {n: recorded.get(n) if isinstance(recorded, dict) else None for n in out}
    marker = os.path.join(directory, _fs.COMMIT_MARKER)
    info = _fs.read_json(marker, require_checksum=True) if os.path.isfile(marker) else None
    when = info.get("time") if isinstance(info, dict) else None
    return CheckpointMetadata(out[""] if "" in out else out, custom, item_handlers=handlers,
                              commit_timestamp_nsecs=int(when * 1e9) if isinstance(when, (int, float)) else None)


def write(tmp: str, captured: dict[str, Any], *, compression: str | None, composite: bool,
          custom_metadata: Any = None, handlers: dict[str, str | None] | None = None) -> None:
    """Write captured items (and a JSON-able ``custom_metadata``) into the temporary
    directory ``tmp`` (the caller commits); a composite records ``handlers`` (each item's
    handler ``typestr()``)."""
    if custom_metadata is not None and _multihost.is_primary():
        _fs.write_json_durable(os.path.join(tmp, CUSTOM_METADATA_FILE), custom_metadata)
    for name, (kind, value) in captured.items():
        sub = os.path.join(tmp, name) if name else tmp
        if kind == "json":
            write_json_item(sub, value)
        else:
            if name:
                os.makedirs(sub, exist_ok=True)
            _tree.write(value, sub, compression=compression)
    if composite and _multihost.is_primary():
        kinds = {name: kind for name, (kind, _) in captured.items()}
        record: dict[str, Any] = {"items": kinds}
        if handlers:
            record["handlers"] = {n: h for n, h in handlers.items() if n in kinds}
        _fs.write_json_durable(os.path.join(tmp, ITEMS_FILE), record)
        _fs.fsync_dir(tmp)


def verify(directory: str) -> None:
    """Check the metadata of a directory written by :func:`write` (no array data)."""
    kinds = item_kinds(directory)
    for name, kind in kinds.items():
        sub = os.path.join(directory, name) if name else directory
        if kind == "json":
            read_json_item(sub)
        else:
            _restore.check_dir(sub)


def item_kinds(directory: str) -> dict[str, str]:
    """``{name: "pytree" | "json"}`` of a composite directory, ``{"": kind}`` of a single item."""
    f = os.path.join(directory, ITEMS_FILE)
    if os.path.isfile(f):
        meta = _fs.read_json(f, require_checksum=True)
        kinds = meta.get("items") if isinstance(meta, dict) else None
        if not isinstance(kinds, dict) or not all(k in ("pytree", "json") for k in kinds.values()):
            raise _fs.corrupt(f, "its content is not {'items': {name: kind}}")
        return kinds
    return {"": "json" if os.path.isfile(os.path.join(directory, JSON_ITEM_FILE)) else "pytree"}


def restore(directory: str, args: _args.CheckpointArgs | None) -> Any:
    """Read back what :func:`write` wrote: one item, or a :class:`Composite` of items
    (those named in a ``Composite`` ``args``, else all), each restored per its args."""
    kinds = item_kinds(directory)
    if "" in kinds:
        if isinstance(args, _args.Composite):
            raise CheckpointError(f"{directory} holds a single item, not a Composite")
        return _restore_one(directory, kinds[""], args, "restore")
    if args is not None and not isinstance(args, _args.Composite):
        raise TypeError(
            f"{directory} holds the items {sorted(kinds)}; restore it with args=ocp.args.Composite(...)"
        )
    wanted = dict(args) if args else dict.fromkeys(kinds)  # an empty Composite: every item, as in Orbax
    unknown = sorted(set(wanted) - set(kinds))
    if unknown:
        raise KeyError(f"{directory} has no item(s) {unknown}; it holds {sorted(kinds)}")
    return _args.Composite(
        {n: _restore_one(os.path.join(directory, n), kinds[n], a, f"item {n!r}") for n, a in wanted.items()}
    )


def _restore_one(sub: str, kind: str, args: _args.CheckpointArgs | None, where: str) -> Any:
    if args is not None and args.saving:
        raise TypeError(f"{where}: restore needs restore arguments, got {type(args).__name__}")
    if kind == "json":
        if args is not None and args.kind != "json":
            raise TypeError(f"{where} was saved with JsonSave; restore it with JsonRestore, not {type(args).__name__}")
        return read_json_item(sub)
    if args is not None and args.kind == "json":
        raise TypeError(f"{where} is a pytree; JsonRestore cannot read it")
    if args is None:
        return _restore.restore_dir(sub)
    return _args.restore_pytree(sub, args, f"{where} of {sub}")
