"""Orbax's per-leaf control: ``SaveArgs``, ``RestoreArgs``, ``ArrayRestoreArgs``,
``PLACEHOLDER`` and ``Transform``, turned into a target that :func:`restore` understands.

A restore target here is built from up to three trees, matched by path string: ``item``
(the result's structure: arrays, ``jax.ShapeDtypeStruct`` s, scalars), ``restore_args``
(per leaf: NumPy or device array, dtype, sharding) and ``transforms`` (per leaf: which
checkpoint path to read it from). Dtypes are cast to the requested ones, as in Orbax.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from cairn.checkpoint import metadata as value_metadata
from cairn.checkpoint._errors import TargetMismatchError
from cairn.checkpoint._restore import LeafMetadata, metadata_of, restore_dir, saved_sharding
from cairn.checkpoint._tree import is_prng_key
from cairn.core_array import (
    ArraySpec,
    as_numpy_dtype,
    canonical_dtype,
    flatten_with_paths,
    map_with_path,
    unflatten,
)

#: A leaf of a restore target that is not read: it comes back as ``PLACEHOLDER`` (Orbax's
#: ``ocp.PLACEHOLDER``, the Ellipsis object).
PLACEHOLDER = ...


@dataclass(frozen=True)
class SaveArgs:
    """How to save one leaf (Orbax's ``SaveArgs``): ``dtype`` casts it before it is written.

    ``chunk_byte_size`` and ``shard_axes`` are accepted for compatibility; our chunking is
    automatic (at most 64 MiB per chunk, one chunk per shard or smaller).

    Args:
      aggregate: must be ``False`` (Orbax deprecated it).
      dtype: the dtype the leaf is cast to before writing, or ``None`` (as is).
      chunk_byte_size: accepted for compatibility: a positive int or ``None``.
      shard_axes: accepted for compatibility: a tuple of axis indices.

    Raises:
      NotImplementedError: ``aggregate=True`` (deprecated in Orbax).
      ValueError: a malformed ``chunk_byte_size`` or ``shard_axes``.
    """

    aggregate: bool = False
    dtype: Any = None
    chunk_byte_size: int | None = None
    shard_axes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.aggregate:
            raise NotImplementedError("SaveArgs(aggregate=True) (deprecated in Orbax) is not supported")
        if self.chunk_byte_size is not None and not (
            isinstance(self.chunk_byte_size, int) and self.chunk_byte_size > 0
        ):
            raise ValueError(f"SaveArgs chunk_byte_size must be a positive int, got {self.chunk_byte_size!r}")
        if not all(isinstance(a, int) for a in self.shard_axes):
            raise ValueError(f"SaveArgs shard_axes must be a tuple of ints, got {self.shard_axes!r}")


@dataclass(frozen=True)
class RestoreArgs:
    """How to restore one leaf (Orbax's ``RestoreArgs``).

    ``restore_type``: ``np.ndarray`` for a NumPy array, ``jax.Array`` (or ``None``: as
    saved) for a device array; ``dtype`` casts the value.

    Args:
      restore_type: ``np.ndarray``, ``jax.Array`` or ``None`` (as saved).
      dtype: the dtype to cast to, or ``None`` (as saved).
    """

    restore_type: Any = None
    dtype: Any = None


@dataclass(frozen=True)
class ArrayRestoreArgs(RestoreArgs):
    """Restore one leaf as a ``jax.Array`` with ``sharding`` (or ``NamedSharding(mesh,
    mesh_axes)``), optionally cast to ``dtype`` (Orbax's ``ArrayRestoreArgs``).
    ``global_shape`` (or ``shape``) other than the saved shape needs ``strict=False``: the
    array is then truncated, or padded with zeros, to it.

    Args:
      restore_type: ``jax.Array`` (the default).
      dtype: the dtype to cast to, or ``None`` (as saved).
      mesh: a ``jax.sharding.Mesh``, used with ``mesh_axes`` when ``sharding`` is not given.
      mesh_axes: a ``PartitionSpec`` over ``mesh``.
      sharding: the ``jax.sharding.Sharding`` of the restored array.
      global_shape: the shape to restore to (truncate or zero-pad; needs ``strict=False``).
      shape: the same as ``global_shape`` (Orbax accepts both).
      strict: ``False`` allows ``global_shape``/``shape`` to differ from the saved shape.
    """

    restore_type: Any = jax.Array
    mesh: Any = None
    mesh_axes: Any = None
    sharding: Any = None
    global_shape: tuple[int, ...] | None = None
    shape: tuple[int, ...] | None = None
    strict: bool = True

    def resolved_sharding(self) -> Any:
        if self.sharding is not None:
            return self.sharding
        if self.mesh is not None and self.mesh_axes is not None:
            return jax.sharding.NamedSharding(self.mesh, self.mesh_axes)
        return None


@dataclass(frozen=True)
class Transform:
    """Where one leaf of the result comes from (Orbax's ``Transform``): the checkpoint path
    ``original_key`` (default: the leaf's own path), then ``value_fn(value)`` if given. With
    ``use_fallback`` a path the checkpoint lacks keeps the ``item``'s value.
    ``multi_value_fn(path, original_tree)`` computes the leaf from the whole original tree
    (:func:`apply_transformations` only; a restore refuses it).

    Args:
      original_key: the checkpoint path (a ``/``-joined path string) to read, or ``None``
        for the leaf's own path.
      multi_value_fn: ``fn(path, original_tree)`` computing the leaf from the whole tree
        (:func:`apply_transformations` only), or ``None``.
      use_fallback: a path the checkpoint lacks keeps the target ``item``'s value.
      value_fn: applied to the value read, or ``None``.
    """

    original_key: str | None = None
    multi_value_fn: Callable[..., Any] | None = None
    use_fallback: bool = False
    value_fn: Callable[[Any], Any] | None = None



def _leaf_or_empty(x: Any) -> bool:
    return x is None or x is Ellipsis or _is_leaf(x)


def _find_transform(flat_tf: Mapping[str, Transform], p: str) -> tuple[Transform | None, str | None]:
    """The transform of new-tree path ``p`` (an exact key, else the first key that matches
    as a regular expression) and the original path it reads (backreferences expanded)."""
    tf = flat_tf.get(p)
    if tf is not None:
        return tf, tf.original_key or p
    for pattern, tf in flat_tf.items():
        m = re.fullmatch(pattern, p)
        if m is not None:
            return tf, m.expand(tf.original_key) if tf.original_key else p
    return None, None


def apply_transformations(original_tree: Any, transformations: Any, new_tree: Any,
                          default_to_original: bool = True) -> Any:
    """``new_tree`` with each leaf taken from ``original_tree`` as ``transformations`` say
    (Orbax's ``apply_transformations``, in memory).

    A leaf of ``new_tree`` with a :class:`Transform` (keys are paths, or regular
    expressions matched against paths, whose groups ``original_key`` may use as ``\\1``)
    reads the original leaf at ``original_key`` (default: its own path), then
    ``value_fn``; ``multi_value_fn(path, original_tree)`` computes it instead. A leaf with
    no transform reads its own path of the original when ``default_to_original``, else
    keeps its value. A leaf whose transform has ``use_fallback`` reads the *other* tree
    than the default: ``new_tree``'s value when ``default_to_original``, else the
    original's (``ValueError`` if the original lacks it), as in Orbax. A source the
    original lacks keeps ``new_tree``'s value when the leaf has no transform and raises
    ``ValueError`` otherwise.

    Args:
      original_tree: the tree to read from (e.g. what a checkpoint held).
      transformations: a tree (or flat dict by path) of :class:`Transform`.
      new_tree: the result's structure; its values are the fallbacks.
      default_to_original: see above.

    >>> apply_transformations({"a": 1, "c": {"e": 3}},
    ...                       {"x": Transform(original_key="c/e", value_fn=lambda v: v * 2)},
    ...                       {"a": None, "new": 7, "x": None})
    {'a': 1, 'new': 7, 'x': 6}
    """
    flat_orig = flatten_with_paths(original_tree, is_leaf=_is_leaf)
    flat_new = flatten_with_paths(new_tree, is_leaf=_leaf_or_empty)
    flat_tf = flatten_with_paths(transformations, is_leaf=lambda x: isinstance(x, Transform))
    for k, tf in flat_tf.items():
        if not isinstance(tf, Transform):
            raise TypeError(f"transformations leaves must be Transform, got {type(tf).__name__} at {k!r}")
    out: dict[str, Any] = {}
    for p, fallback in flat_new.items():
        tf, src = _find_transform(flat_tf, p)
        if tf is not None and tf.multi_value_fn is not None:
            out[p] = tf.multi_value_fn(p, original_tree)
            continue
        if tf is None and not default_to_original:
            out[p] = fallback
            continue
        if tf is not None and tf.use_fallback:
            # the "fallback tree" is the one the default does not read (Orbax's rule)
            if default_to_original:
                out[p] = fallback
            elif (src or p) in flat_orig:
                out[p] = flat_orig[src or p]
            else:
                raise ValueError(f"transformation of {p!r} falls back to the original tree, which lacks {src or p!r}")
            continue
        src = src or p
        if src in flat_orig:
            v = flat_orig[src]
            out[p] = tf.value_fn(v) if tf is not None and tf.value_fn is not None else v
        elif tf is None:
            out[p] = fallback
        else:
            raise ValueError(f"transformation of {p!r} reads {src!r}, which the original tree lacks")
    return map_with_path(lambda p, x: out.get(p, x), new_tree, is_leaf=_leaf_or_empty)


# --- saving ---
def apply_save_args(item: Any, save_args: Any, where: str) -> Any:
    """``item`` with each leaf cast to its :class:`SaveArgs` ``dtype``."""
    if save_args is None:
        return item
    if isinstance(save_args, SaveArgs):
        return _cast_leaf(item, save_args, where)
    flat = flatten_with_paths(save_args, is_leaf=lambda x: isinstance(x, SaveArgs))
    unknown = sorted(set(flat) - set(flatten_with_paths(item)))
    if unknown:
        raise ValueError(f"{where}: save_args has paths {unknown} that the saved tree lacks")
    return map_with_path(lambda p, x: _cast_leaf(x, flat[p], f"{where} at {p!r}") if p in flat else x, item)


def _cast_leaf(x: Any, sa: Any, where: str) -> Any:
    if not isinstance(sa, SaveArgs):
        raise TypeError(f"{where}: save_args leaves must be ocp.SaveArgs, got {type(sa).__name__}")
    if sa.dtype is None:
        return x
    if isinstance(x, jax.Array):
        return x.astype(sa.dtype)
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x).astype(sa.dtype)
    raise TypeError(f"{where}: SaveArgs(dtype=...) needs an array leaf, got {type(x).__name__}")


# --- restoring ---
@dataclass
class RestoreRequest:
    """One pytree restore in Orbax's terms (see the module docstring)."""

    item: Any = None
    restore_args: Any = None
    transforms: Any = None
    default_to_original: bool = True
    partial: bool = False
    strict: bool = True
    fallback_sharding: Any = None
    fixes: dict[str, tuple[tuple[int, ...], Any]] = field(default_factory=dict)


def _is_restore_leaf(x: Any) -> bool:
    return isinstance(x, (RestoreArgs, Transform)) or x is PLACEHOLDER


def _is_array_like(x: Any) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic))


def _is_leaf(x: Any) -> bool:
    return _is_restore_leaf(x) or _is_array_like(x)


def restore_tree(directory: str, req: RestoreRequest, where: str) -> Any:
    """Restore the pytree checkpoint in ``directory`` as ``req`` asks."""
    if req.item is None and req.restore_args is None:
        if req.transforms is not None:
            raise ValueError(f"{where}: transforms need an item (the result's structure)")
        return restore_dir(directory)
    saved = metadata_of(directory)
    if req.transforms is not None:
        return _restore_transformed(directory, req, saved, where)
    target, patterns = build_target(req, saved, where)
    got = restore_dir(directory, target, paths=patterns, partial=req.partial, cast=True)
    return _apply_fixes(got, req.fixes)


def _ra_lookup(restore_args: Any) -> Callable[[str], Any]:
    if isinstance(restore_args, RestoreArgs):
        return lambda _p: restore_args
    flat = {} if restore_args is None else flatten_with_paths(restore_args, is_leaf=_is_restore_leaf)
    return flat.get


def build_target(req: RestoreRequest, saved: Mapping[str, LeafMetadata], where: str) -> tuple[Any, list[str] | None]:
    """A target in :func:`restore`'s terms and the path patterns to read (``None``: all;
    ``PLACEHOLDER`` leaves are left out and come back unchanged).

    Raises:
      TargetMismatchError: ``restore_args`` alone name paths the checkpoint lacks.
    """
    base = req.item if req.item is not None else req.restore_args
    ra_of = _ra_lookup(req.restore_args)
    wanted: list[str] = []
    missing: list[str] = []

    def leaf(path: str, t: Any) -> Any:
        ra = ra_of(path)
        if t is PLACEHOLDER or ra is PLACEHOLDER:
            return PLACEHOLDER
        wanted.append(re.escape(path))
        user = None if isinstance(t, RestoreArgs) else t
        meta = saved.get(path)
        if meta is None:
            if user is None:
                missing.append(path)
            return user
        return _target_leaf(path, user, ra, meta, req, f"{where} at {path!r}")

    target = map_with_path(leaf, base, is_leaf=_is_leaf)
    skipped = _skipped_paths(base, saved)
    if missing:
        raise TargetMismatchError(
            f"{where}: restore_args name paths the checkpoint lacks: {missing} (it holds {sorted(saved)})"
        )
    covered = flatten_with_paths(base, is_leaf=_is_leaf)
    if len(wanted) == len(covered) and not skipped:
        return target, None
    # PLACEHOLDER leaves make the read partial: a saved leaf must still be named (as a
    # value or a PLACEHOLDER of that leaf) unless the restore is partial
    extra = [] if req.partial else sorted(p for p in saved if p not in covered and not _under(p, skipped))
    if extra:
        raise TargetMismatchError(
            f"{where}: User-provided restore item and on-disk value differ: the checkpoint's paths {extra[:8]} are "
            "neither in the item nor a PLACEHOLDER leaf (a PLACEHOLDER stands for one leaf; pass "
            "partial_restore=True to skip saved paths)"
        )
    # one alternation, not one pattern per leaf: each saved path is matched once
    return target, (["(?:" + "|".join(wanted) + ")"] if wanted else [])


def _skipped_paths(base: Any, saved: Mapping[str, LeafMetadata]) -> list[str]:
    """The paths where the target holds ``None`` and the checkpoint holds data: as in
    Orbax, that part is not read and comes back as ``None``."""
    flat = flatten_with_paths(base, is_leaf=lambda x: x is None or _is_leaf(x))
    return [p for p, v in flat.items() if v is None and any(q == p or q.startswith(p + "/") for q in saved)]


def _under(path: str, prefixes: list[str]) -> bool:
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def _target_leaf(
    path: str, t: Any, ra: RestoreArgs | None, meta: LeafMetadata, req: RestoreRequest, where: str
) -> Any:
    """One target leaf: the user's ``t`` adjusted by ``ra``. A ``jax.ShapeDtypeStruct``
    without sharding, or no target, follows the saved kind (NumPy stays NumPy, as in Orbax).
    A shape other than saved, if allowed (``strict=False``), is read as saved and recorded
    in ``req.fixes`` to be truncated or padded afterwards."""
    if t is not None and getattr(t, "dtype", None) is not None and is_prng_key(t):
        return t  # a typed PRNG key target: the core reads its key data and wraps it
    if meta.kind == "scalar":
        if ra is not None and ra.restore_type is np.ndarray and not isinstance(meta.value, str):
            req.fixes[path] = ((), None)  # a saved Python number asked for as a NumPy array: 0-d after the read
            return meta.value
        return t if t is not None and not _is_array_like(t) else meta.value
    saved_shape = tuple(meta.shape)
    shape = tuple(t.shape) if hasattr(t, "shape") else saved_shape
    if isinstance(ra, ArrayRestoreArgs):
        shape = tuple(ra.global_shape or ra.shape or shape)
    if ra is not None and ra.dtype is not None:
        dtype = np.dtype(ra.dtype)
    elif getattr(t, "dtype", None) is not None:
        dtype = np.dtype(t.dtype)
    else:
        dtype = as_numpy_dtype(meta.dtype)
    want = _want_leaf(t, ra, meta, shape, dtype, req.fallback_sharding)
    strict = req.strict and not (isinstance(ra, ArrayRestoreArgs) and not ra.strict)
    if shape != saved_shape and not strict:
        if len(shape) != len(saved_shape):
            raise ValueError(f"{where}: cannot pad or truncate shape {saved_shape} to {shape} (another rank)")
        req.fixes[path] = (shape, want.sharding if isinstance(want, jax.ShapeDtypeStruct) else None)
        return ArraySpec(saved_shape, canonical_dtype(dtype))
    return want


def _want_leaf(t: Any, ra: RestoreArgs | None, meta: LeafMetadata, shape: tuple, dtype: np.dtype, fallback: Any) -> Any:
    if isinstance(ra, ArrayRestoreArgs):
        sharding = ra.resolved_sharding() or getattr(t, "sharding", None) or _default_sharding(meta, fallback)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    if ra is not None and ra.restore_type is np.ndarray:
        return ArraySpec(shape, canonical_dtype(dtype))
    if isinstance(t, jax.Array) or (isinstance(t, jax.ShapeDtypeStruct) and t.sharding is not None):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=t.sharding)
    if isinstance(t, np.generic):
        return np.zeros((), dtype)[()]
    if isinstance(t, np.ndarray):
        return ArraySpec(shape, canonical_dtype(dtype))
    if meta.kind == "jax" or (ra is not None and ra.restore_type is jax.Array):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=_default_sharding(meta, fallback))
    return ArraySpec(shape, canonical_dtype(dtype))


def _default_sharding(meta: LeafMetadata, fallback: Any) -> Any:
    """The saved sharding if it fits the devices, else ``fallback``, else the first device."""
    entry = {"kind": "jax", "sharding": {"mesh": meta.mesh}, "spec": meta.spec.to_json()}
    return saved_sharding(entry) or fallback or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _apply_fixes(tree: Any, fixes: Mapping[str, tuple[tuple[int, ...], Any]]) -> Any:
    """Truncate or zero-pad the leaves in ``fixes`` to their requested shape (and place them
    with their requested sharding, if any)."""
    if not fixes:
        return tree

    def fix(path: str, x: Any) -> Any:
        if path not in fixes:
            return x
        shape, sharding = fixes[path]
        host = np.asarray(x)[tuple(slice(0, n) for n in shape)]
        out = np.zeros(shape, host.dtype)
        out[tuple(slice(0, n) for n in host.shape)] = host
        return jax.device_put(out, sharding) if sharding is not None else out

    return map_with_path(fix, tree, is_leaf=_is_leaf)


def _restore_transformed(directory: str, req: RestoreRequest, saved: Mapping[str, LeafMetadata], where: str) -> Any:
    """``transforms``: read each result leaf from its ``original_key`` (or its own path
    when ``default_to_original``); leaves with no source keep the ``item``'s value."""
    if req.item is None:
        raise ValueError(f"{where}: transforms need an item (the result's structure)")
    flat_item = flatten_with_paths(req.item, is_leaf=_is_leaf)
    flat_tf = flatten_with_paths(req.transforms, is_leaf=lambda x: isinstance(x, Transform))
    if any(isinstance(tf, Transform) and tf.multi_value_fn is not None for tf in flat_tf.values()):
        raise NotImplementedError(f"{where}: Transform(multi_value_fn=...) is not supported in a restore; use value_fn")
    unknown = sorted(set(flat_tf) - set(flat_item))
    if unknown:
        raise ValueError(f"{where}: transforms name paths {unknown} that the item lacks")
    ra_of = _ra_lookup(req.restore_args)
    source: dict[str, str] = {}
    targets: dict[str, Any] = {}
    for p, t in flat_item.items():
        tf = flat_tf.get(p)
        if not isinstance(tf, (Transform, type(None))):
            raise TypeError(f"{where}: transforms leaves must be ocp.Transform, got {type(tf).__name__} at {p!r}")
        src = (tf.original_key or p) if tf is not None else (p if req.default_to_original else None)
        if src is None or (src not in saved and (tf is None or tf.use_fallback)):
            continue
        if src not in saved:
            raise TargetMismatchError(f"{where}: transform of {p!r} reads {src!r}, which the checkpoint lacks")
        user = None if t is PLACEHOLDER else t
        source[p] = src
        targets.setdefault(src, _target_leaf(src, user, ra_of(p), saved[src], req, f"{where} at {p!r}"))
    got = flatten_with_paths(restore_dir(directory, unflatten(targets), partial=True, cast=True), is_leaf=_is_leaf)
    got = flatten_with_paths(_apply_fixes(unflatten(got), req.fixes), is_leaf=_is_leaf) if req.fixes else got

    def value(p: str, x: Any) -> Any:
        if p not in source:
            return x
        tf = flat_tf.get(p)
        v = got[source[p]]
        return tf.value_fn(v) if tf is not None and tf.value_fn is not None else v

    return map_with_path(value, req.item, is_leaf=_is_leaf)


def _leaf_restore_args(leaf: Any, sharding: Any, set_global_shape: bool, strict: bool) -> Any:
    """The ``RestoreArgs`` that restore ``leaf``'s kind of value (see :func:`construct_restore_args`)."""
    if isinstance(leaf, LeafMetadata):
        if leaf.kind == "scalar":
            return RestoreArgs(restore_type=type(leaf.value))
        if leaf.kind == "jax" and sharding is not None:
            return ArrayRestoreArgs(restore_type=jax.Array, sharding=sharding, dtype=as_numpy_dtype(leaf.dtype),
                                    global_shape=tuple(leaf.shape) if set_global_shape else None, strict=strict)
        return RestoreArgs(restore_type=np.ndarray, dtype=as_numpy_dtype(leaf.dtype))
    if isinstance(leaf, value_metadata.StringMetadata):
        return RestoreArgs(restore_type=str)
    if isinstance(leaf, value_metadata.ScalarMetadata):  # Orbax's: a Python scalar of that dtype
        kind = np.dtype(leaf.dtype).kind if leaf.dtype is not None else "i"
        return RestoreArgs(restore_type={"b": bool, "f": float, "c": complex}.get(kind, int), dtype=leaf.dtype)
    if isinstance(leaf, value_metadata.ArrayMetadata):
        leaf = jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype,
                                    sharding=leaf.sharding if isinstance(leaf.sharding, jax.sharding.Sharding) else None)
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = sharding if sharding is not None else getattr(leaf, "sharding", None)
        if sharding is not None:
            return ArrayRestoreArgs(restore_type=jax.Array, sharding=sharding, dtype=leaf.dtype,
                                    global_shape=tuple(leaf.shape) if set_global_shape else None, strict=strict)
        return RestoreArgs(restore_type=np.ndarray, dtype=leaf.dtype)
    if isinstance(leaf, (np.ndarray, np.generic)):
        return RestoreArgs(restore_type=np.ndarray, dtype=leaf.dtype)
    if isinstance(leaf, (bool, int, float, complex, str)):
        return RestoreArgs(restore_type=type(leaf))
    raise TypeError(
        f"construct_restore_args: cannot restore a leaf of type {type(leaf).__name__} (expected a jax.Array, "
        "jax.ShapeDtypeStruct, NumPy array or scalar, Python scalar, str or LeafMetadata)"
    )


def construct_restore_args(target: Any, sharding_tree: Any = None, set_global_shape: bool = True,
                           support_layout: bool = False, strict: bool = True) -> Any:
    """A tree of per-leaf restore arguments shaped like ``target`` (Orbax's
    ``checkpoint_utils.construct_restore_args``): a device array (or one whose
    ``sharding_tree`` entry is a sharding) gets ``ArrayRestoreArgs(sharding, global_shape,
    dtype)``, a NumPy array ``RestoreArgs(np.ndarray, dtype)``, a Python scalar or string
    ``RestoreArgs(its type)``. ``target`` may also be :func:`metadata` 's ``LeafMetadata``
    tree.

    Args:
      target: the tree to restore onto (arrays, ``jax.ShapeDtypeStruct`` s, scalars,
        ``LeafMetadata``).
      sharding_tree: a tree like ``target`` of ``jax.sharding.Sharding`` (or ``None`` per
        leaf: the leaf's own sharding, if any); ``None`` for all.
      set_global_shape: put each array's shape in its ``ArrayRestoreArgs``.
      support_layout: not supported (``True`` raises ``NotImplementedError``).
      strict: the ``ArrayRestoreArgs.strict`` of every array.

    >>> construct_restore_args({"w": np.zeros(3, np.float32), "n": 2})["n"]
    RestoreArgs(restore_type=<class 'int'>, dtype=None)
    """
    if support_layout:
        raise NotImplementedError("construct_restore_args(support_layout=True) is not supported")
    flat = flatten_with_paths(target, is_leaf=lambda x: isinstance(x, (LeafMetadata, value_metadata.Metadata)))
    shardings: dict[str, Any] = {}
    if sharding_tree is not None:
        shardings = flatten_with_paths(sharding_tree, is_leaf=lambda x: x is None)
        unknown = sorted(set(shardings) - set(flat))
        if unknown:
            raise ValueError(f"construct_restore_args: sharding_tree paths {unknown[:5]} are not in the target")
    out = {p: _leaf_restore_args(v, shardings.get(p), set_global_shape, strict) for p, v in flat.items()}
    return map_with_path(lambda p, _: out[p], target, is_leaf=lambda x: isinstance(x, (LeafMetadata, value_metadata.Metadata)))
