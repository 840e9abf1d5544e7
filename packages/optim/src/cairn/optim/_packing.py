"""Packed flat buffers: the representation element-wise transforms compute on.

A pytree of arrays is described by a static :class:`Layout` (tree structure,
per-leaf paths, shapes and dtypes, and how leaves are grouped). Leaves are
grouped by dtype (and by sharding when the arrays carry a non-trivial one); each
group is stored as one flat 1-D buffer. :class:`Packed` is a JAX pytree whose
children are those buffers and whose static data is the layout, so it can be
jitted, donated, checkpointed and vmapped like any other state.

Packing costs one concatenate per group; unpacking costs one slice and reshape
per leaf. When ``offsets`` (held in optimizer state) are available, unpacking
uses ``dynamic_slice`` at runtime offsets, which makes the per-leaf kernels
identical for leaves of identical shape so XLA compiles each distinct shape once
instead of once per leaf.

The runtime offsets are not one scalar per leaf: every jitted call pays a fixed
cost per input and output buffer (about 1 us each on CPU), and 1,000 leaves
would add 2,000 buffers to every step. Instead ``offsets`` is a small table of
int32 scalars holding ``v * 8**d`` (digit ``v`` at base-8 position ``d``); a
leaf's offset is the sum of ``D`` table entries, one per base-8 digit of its
static offset, so every leaf's kernel has the same code (``D`` scalar adds and a
dynamic slice) while the table has at most ``8 * D`` entries (``D`` = 7 for
offsets below 2**21).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn.core_array import tree_paths

__all__ = ["Layout", "Packed", "layout_of", "pack", "unpack"]


@dataclasses.dataclass(frozen=True)
class Group:
    """One flat buffer: leaves of one dtype (and sharding)."""

    name: str
    dtype: str
    sharding: Any
    leaves: tuple[int, ...]  # leaf indices in flatten order
    offsets: tuple[int, ...]  # start of each leaf inside the buffer
    sizes: tuple[int, ...]
    total: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static description of how a pytree maps onto flat buffers (hashable)."""

    treedef: Any
    paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    groups: tuple[Group, ...]
    leaf_group: tuple[tuple[int, int], ...]  # leaf index -> (group index, position)
    # per-leaf layout: group i is leaf i alone and its buffer keeps the leaf's own shape
    # (and sharding): "packing" is then no work at all
    shaped: bool = False

    @property
    def num_leaves(self) -> int:
        return len(self.paths)

    def describe_mismatch(self, other: Layout) -> str:
        """Human-readable difference between two layouts (names the paths)."""
        mine, theirs = set(self.paths), set(other.paths)
        if mine != theirs:
            missing = sorted(mine - theirs)[:5]
            extra = sorted(theirs - mine)[:5]
            return f"missing paths {missing}, unexpected paths {extra}"
        for p, s1, d1, s2, d2 in zip(self.paths, self.shapes, self.dtypes, other.shapes,
                                      other.dtypes):
            if s1 != s2 or d1 != d2:
                return f"at path {p!r}: expected {d1}{list(s1)}, got {d2}{list(s2)}"
        return "same leaves but different grouping (sharding)"


def _sharding_key(x) -> Any:
    """A hashable key of a concrete array's sharding, or None when trivial."""
    sh = getattr(x, "sharding", None)
    if sh is None or isinstance(x, jax.core.Tracer):
        return None
    try:
        if len(sh.device_set) <= 1 or sh.is_fully_replicated:
            return None
    except Exception:  # noqa: BLE001 - exotic shardings: group them apart by repr
        return repr(sh)
    spec = getattr(sh, "spec", None)
    mesh = getattr(sh, "mesh", None)
    if spec is not None and mesh is not None:
        return (tuple(mesh.shape.items()), str(spec))
    return repr(sh)


def _canon(dtype) -> str:
    return np.dtype(dtype).name if not hasattr(dtype, "name") else str(jnp.dtype(dtype).name)


def layout_of(tree: Any, *, use_sharding: bool = True, per_leaf: bool = False) -> Layout:
    """Compute the :class:`Layout` of a pytree of arrays (a :class:`Packed` gives its own).

    ``per_leaf=True`` gives every leaf its own buffer, in the leaf's own shape (packing is
    then no work and a sharded leaf keeps its sharding). This is the layout of the default,
    per-parameter optimizer state; the grouped layout (one flat buffer per dtype) is the
    opt-in of :func:`cairn.optim.pack`.

    Args:
      tree: a pytree of arrays (or a :class:`Packed`, whose layout is returned).
      use_sharding: put leaves with different shardings in different groups.
      per_leaf: give every leaf its own buffer in its own shape (the default per-parameter state
        layout) instead of one flat buffer per dtype.
    """
    if isinstance(tree, Packed):
        return tree.layout
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    paths = tuple(tree_paths(tree))
    shapes: list[Any] = []
    dtypes: list[Any] = []
    keys: list[Any] = []
    for x in leaves:
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            x = jnp.asarray(x)
        shapes.append(tuple(int(d) for d in x.shape))
        dtypes.append(_canon(x.dtype))
        keys.append((dtypes[-1], _sharding_key(x) if use_sharding else None,
                     len(keys) if per_leaf else None))
    order: dict[Any, list[int]] = {}
    for i, k in enumerate(keys):
        order.setdefault(k, []).append(i)
    groups = []
    leaf_group: list[Any] = [None] * len(leaves)
    name_counts: dict[str, int] = {}
    for gi, (k, idxs) in enumerate(order.items()):
        sizes = tuple(int(np.prod(shapes[i], dtype=np.int64)) for i in idxs)
        offs = tuple(int(o) for o in np.concatenate([[0], np.cumsum(sizes)[:-1]])) if idxs else ()
        n = name_counts.get(k[0], 0)
        name_counts[k[0]] = n + 1
        name = k[0] if n == 0 else f"{k[0]}_{n}"
        groups.append(Group(name, k[0], k[1], tuple(idxs), offs, sizes, int(sum(sizes))))
        for pos, i in enumerate(idxs):
            leaf_group[i] = (gi, pos)
    return Layout(treedef, paths, tuple(shapes), tuple(dtypes), tuple(groups), tuple(leaf_group),
                  per_leaf)


class Packed:
    """Flat buffers (one per group of a :class:`Layout`) standing for a pytree.

    ``offsets`` is an optional tuple of int32 scalars from which each leaf's start in
    its buffer is computed at run time; see the module docstring.

    Args:
      layout: the :class:`Layout` saying which leaf sits where in which buffer.
      buffers: one flat array per group of ``layout`` (stored as a tuple).
      offsets: optional int32 scalars from which each leaf's start in its buffer is computed at run
        time; None uses the layout's static offsets.
    """

    __slots__ = ("layout", "buffers", "offsets")

    def __init__(self, layout: Layout, buffers: Any, offsets: Any = None) -> None:
        self.layout = layout
        self.buffers = tuple(buffers)
        self.offsets = None if offsets is None else tuple(offsets)

    def unpack(self, offsets: Any = None) -> Any:
        """The ordinary pytree view of these buffers.

        Args:
          offsets: per-leaf offsets to read at (as from :func:`~cairn.optim.layout_of`); None uses
            the static layout.
        """
        return unpack(self, offsets)

    def map(self, fn: Callable, *others: Packed) -> Packed:
        """Apply ``fn`` buffer-wise (``fn(buf, *other_bufs)``).

        Args:
          fn: called as ``fn(buf, *other_bufs)`` on each group's buffer; returns the new buffer.
          others: more :class:`Packed` values with the same layout, whose buffers are passed
            alongside.
        """
        return Packed(self.layout, [fn(*bs) for bs in zip(self.buffers, *(o.buffers for o in others))])

    def astype(self, dtype: jax.typing.DTypeLike | None) -> Packed:
        """These buffers cast to ``dtype`` (same layout and offsets).

        Args:
          dtype: the target dtype; None returns ``self`` unchanged.
        """
        if dtype is None:
            return self
        return Packed(self.layout, [b.astype(dtype) for b in self.buffers], self.offsets)

    def with_offsets(self, offsets: Any) -> Packed:
        """The same buffers with other run-time ``offsets``.

        Args:
          offsets: a tuple of int32 scalars (one per leaf start), or None to drop them.
        """
        return Packed(self.layout, self.buffers, offsets)

    def drop_offsets(self) -> Packed:
        return Packed(self.layout, self.buffers) if self.offsets is not None else self

    def __repr__(self) -> str:
        groups = ", ".join(f"{g.name}: {getattr(b, 'dtype', '?')}[{g.total}]"
                           for g, b in zip(self.layout.groups, self.buffers))
        return f"Packed({self.layout.num_leaves} leaves: {groups})"

    def __getitem__(self, path: str):
        """The leaf at ``path`` (core_array path convention)."""
        try:
            i = self.layout.paths.index(path)
        except ValueError:
            raise KeyError(f"no leaf at path {path!r}; paths start with "
                           f"{list(self.layout.paths[:5])}") from None
        gi, pos = self.layout.leaf_group[i]
        if self.layout.shaped:
            return self.buffers[gi]
        g = self.layout.groups[gi]
        o, n = g.offsets[pos], g.sizes[pos]
        return self.buffers[gi][o:o + n].reshape(self.layout.shapes[i])


class LazyParams(Packed):
    """Pytree params standing for their packed buffers, packed only when read.

    :func:`~cairn.optim._base.chain` hands these to the transformations that need params:
    one that reads ``.buffers`` gets exactly what packing gives (one concatenate per group,
    done once); :func:`add_decayed_weights` instead keeps its term pending
    (:class:`PendingDecay`) so that an AdamW step on pytree params never packs them.
    """

    __slots__ = ("tree", "_packed")

    def __init__(self, layout: Layout, tree: Any) -> None:
        self.layout = layout
        self.offsets = None
        self.tree = tree
        self._packed: Sequence[jax.Array] | None = None

    @property
    def buffers(self) -> Sequence[jax.Array]:  # type: ignore[override]
        if self._packed is None:
            self._packed = pack(self.tree, self.layout, what="params").buffers
        return self._packed

    def leaves(self) -> list[jax.Array] | None:
        """The params leaves in flatten order when they match the layout, else None."""
        leaves, treedef = jax.tree_util.tree_flatten(self.tree)
        if treedef != self.layout.treedef:
            return None
        out = []
        for i, x in enumerate(leaves):
            if not hasattr(x, "dtype"):
                x = jnp.asarray(x)
            if tuple(x.shape) != self.layout.shapes[i] or _canon(x.dtype) != self.layout.dtypes[i]:
                return None
            out.append(x)
        return out


class PendingDecay(Packed):
    """Updates ``U`` with a pending weight-decay term: ``scales(U + wd * params)``.

    ``decay_buffer(gi, u_buf, p_buf, wd)`` adds the term to a whole group buffer and
    ``decay_leaf(i, u_leaf, p_leaf, wd)`` to one leaf (same element-wise operations, same
    cast order); ``scales`` are ``(fn, arg)`` pairs applied after it, in order, as
    ``x = fn(x, arg)``. Reading ``.buffers`` materialises the term (packing the params, as
    without laziness); :func:`unpack` instead adds it leaf by leaf, inside each leaf's
    slice kernel, so the params are never packed.
    """

    __slots__ = ("raw", "params", "decay_buffer", "decay_leaf", "wd", "scales", "_done")

    def __init__(self, layout: Layout, raw: Any, params: LazyParams, decay_buffer: Callable,
                 decay_leaf: Callable, wd: jax.Array,
                 scales: tuple = (), offsets: Any = None) -> None:
        self.layout = layout
        self.offsets = None if offsets is None else tuple(offsets)
        self.raw = tuple(raw)
        self.params = params
        self.decay_buffer = decay_buffer
        self.decay_leaf = decay_leaf
        self.wd = wd
        self.scales = tuple(scales)
        self._done: tuple | None = None

    def scalars(self) -> tuple:
        """``(wd, *scale args)``: the scalars the pending term uses."""
        return (self.wd,) + tuple(a for _, a in self.scales)

    def _finish(self, x, scalars):
        for (fn, _), a in zip(self.scales, scalars[1:]):
            x = fn(x, a)
        return x

    @property
    def buffers(self) -> Sequence[jax.Array]:  # type: ignore[override]
        if self._done is None:
            sc = self.scalars()
            self._done = tuple(
                self._finish(self.decay_buffer(gi, u, w, sc[0]), sc)
                for gi, (u, w) in enumerate(zip(self.raw, self.params.buffers)))
        return self._done

    def finish_leaf(self, i: int, x: Any, w: Any, scalars: tuple) -> jax.Array:
        """Leaf ``i`` of the final updates from its slice ``x`` of ``U`` and param ``w``."""
        return self._finish(self.decay_leaf(i, x, w, scalars[0]), scalars)

    def scaled(self, fn: Callable, arg: Any) -> PendingDecay:
        """These updates followed by the element-wise ``fn(x, arg)`` (still pending)."""
        return PendingDecay(self.layout, self.raw, self.params, self.decay_buffer,
                            self.decay_leaf, self.wd, self.scales + ((fn, arg),),
                            self.offsets)


def _flatten_with_keys(p: Packed):
    keys = [jax.tree_util.DictKey(g.name) for g in p.layout.groups]
    children = list(zip(keys, p.buffers))
    if p.offsets is not None:
        children += [(jax.tree_util.DictKey(f"offset_{i}"), o) for i, o in enumerate(p.offsets)]
    return children, (p.layout, p.offsets is not None)


def _flatten(p: Packed):
    children = list(p.buffers) + (list(p.offsets) if p.offsets is not None else [])
    return children, (p.layout, p.offsets is not None)


def _unflatten(aux, children):
    layout, has_off = aux
    n = len(layout.groups)
    children = list(children)
    return Packed(layout, children[:n], children[n:] if has_off else None)


jax.tree_util.register_pytree_with_keys(Packed, _flatten_with_keys, _unflatten, _flatten)
# the lazy forms flatten to their materialised buffers and come back as plain Packed
jax.tree_util.register_pytree_with_keys(LazyParams, _flatten_with_keys, _unflatten, _flatten)
jax.tree_util.register_pytree_with_keys(PendingDecay, _flatten_with_keys, _unflatten, _flatten)


def _path_diff(layout: Layout, tree) -> tuple[list, list]:
    """For a mismatch message: up to 5 paths only in ``layout`` and up to 5 only in ``tree``."""
    try:
        got = tuple(tree_paths(tree))
    except Exception:  # noqa: BLE001
        got = ()
    want, have = set(layout.paths), set(got)
    return [p for p in layout.paths if p not in have][:5], [p for p in got if p not in want][:5]


def pack(tree: Any, layout: Layout, *, what: str = "updates", cast: bool = False) -> Packed:
    """Pack ``tree`` into the buffers of ``layout`` (one concatenate per group).

    Raises ``ValueError`` naming the path when the tree does not match the layout
    and ``TypeError`` naming the path when a leaf has the wrong dtype.
    """
    if isinstance(tree, Packed):
        if tree.layout != layout:
            raise ValueError(f"{what} layout does not match the optimizer state: "
                             f"{layout.describe_mismatch(tree.layout)}")
        return tree
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if treedef != layout.treedef:
        missing, extra = _path_diff(layout, tree)
        raise ValueError(
            f"{what} tree structure does not match the params the optimizer was "
            f"initialised with: missing paths {missing}, unexpected paths {extra} "
            f"(expected {treedef_str(layout)})")
    bufs = []
    for g in layout.groups:
        parts = []
        for i in g.leaves:
            x = leaves[i]
            if not hasattr(x, "dtype"):
                x = jnp.asarray(x)
            if tuple(x.shape) != layout.shapes[i]:
                raise ValueError(f"{what} at path {layout.paths[i]!r} has shape {tuple(x.shape)}, "
                                 f"expected {layout.shapes[i]}")
            if _canon(x.dtype) != g.dtype:
                if cast:
                    x = x.astype(g.dtype)
                else:
                    raise TypeError(f"{what} at path {layout.paths[i]!r} has dtype "
                                    f"{_canon(x.dtype)}, expected {g.dtype} (the dtype of the "
                                    f"params the optimizer was initialised with)")
            parts.append(x if layout.shaped else jnp.ravel(x))
        if not parts:
            bufs.append(jnp.zeros((0,), g.dtype))
        elif len(parts) == 1:
            bufs.append(parts[0])
        else:
            bufs.append(jnp.concatenate(parts))
    if any(len(g.leaves) > 1 for g in layout.groups):
        # Materialise the buffers: without the barrier XLA fuses the many-operand
        # concatenate into every consumer (slow to compile and to run).
        bufs = list(jax.lax.optimization_barrier(tuple(bufs)))
    return Packed(layout, bufs)


def treedef_str(layout: Layout) -> str:
    ps = list(layout.paths[:6])
    more = "" if len(layout.paths) <= 6 else f" ... ({len(layout.paths)} leaves)"
    return f"paths {ps}{more}"


def unpack(p: Packed, offsets: Any = None) -> Any:
    """Rebuild the pytree from packed buffers (one slice + reshape per leaf).

    Args:
      p: the :class:`Packed` buffers.
      offsets: run-time leaf offsets to read at; None uses ``p.offsets`` (or the static layout).

    Raises:
      ValueError: ``offsets`` does not fit the layout.
    """
    layout = p.layout
    if offsets is None:
        offsets = p.offsets
    leaves: list[Any] = [None] * layout.num_leaves
    plan = None
    if offsets is not None:
        plan = _offset_plan(layout)
        if len(offsets) != len(plan[0]):
            raise ValueError(f"runtime offsets table has {len(offsets)} entries, the layout "
                             f"needs {len(plan[0])}; pass the optimizer state created by "
                             f"init() for these params")
    finish = None
    bufs = None
    scalars = ()
    if isinstance(p, PendingDecay):
        # add the pending weight-decay term per leaf, inside the leaf's slice kernel,
        # reading the params leaves (no packing of the params)
        w_leaves = p.params.leaves()
        if w_leaves is not None:
            bufs = p.raw
            scalars = p.scalars()

            def finish(i, x):
                return p.finish_leaf(i, x, w_leaves[i], scalars)
    if bufs is None:
        bufs = p.buffers
    if any(len(g.leaves) > 1 for g in layout.groups):
        # Materialise once so each per-leaf slice reads a buffer, not a fused computation.
        bufs = jax.lax.optimization_barrier(tuple(bufs))
    for gi, g in enumerate(layout.groups):
        buf = bufs[gi]
        if len(g.leaves) == 1:
            i = g.leaves[0]
            leaves[i] = buf.reshape(layout.shapes[i])
            if finish is not None:
                leaves[i] = finish(i, leaves[i])
            continue
        for pos, i in enumerate(g.leaves):
            n = g.sizes[pos]
            if offsets is not None:
                start = _runtime_offset(plan, offsets, gi, pos)
                piece = jax.lax.dynamic_slice(buf, (start,), (n,), allow_negative_indices=False)
            else:
                o = g.offsets[pos]
                piece = buf[o:o + n]
            shape = layout.shapes[i]
            leaves[i] = piece if tuple(piece.shape) == shape else jax.lax.reshape(piece, shape)
            if finish is not None:
                leaves[i] = finish(i, leaves[i])
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)


_DIGIT_BASE = 8


@functools.lru_cache(maxsize=64)
def _offset_plan(layout: Layout):
    """Static plan of the runtime offset table of ``layout`` (see the module docstring).

    Returns ``(values, picks)``: ``values`` are the table entries (entry 0 is zero) and
    ``picks[(gi, pos)]`` the ``D`` table indices whose sum is that leaf's offset. Only
    leaves of groups with more than one leaf are unpacked by slicing, so only they count.
    """
    b = _DIGIT_BASE
    starts = {(gi, pos): o for gi, g in enumerate(layout.groups) if len(g.leaves) > 1
              for pos, o in enumerate(g.offsets)}
    biggest = max(starts.values(), default=0)
    ndigits = 1
    while b ** ndigits <= biggest:
        ndigits += 1
    # one zero per digit position: a leaf's D summands are then always D distinct
    # buffers, so every leaf's kernel has the same parameter list (a repeated zero
    # buffer would give XLA a different fused computation to compile)
    values = [0] * ndigits
    index: dict[tuple[int, int], int] = {(d, 0): d for d in range(ndigits)}
    picks = {}
    for key, o in starts.items():
        row = []
        for d in range(ndigits):
            v = (o // b ** d) % b
            if (d, v) not in index:
                index[(d, v)] = len(values)
                values.append(v * b ** d)
            row.append(index[(d, v)])
        picks[key] = tuple(row)
    return tuple(values), picks


def _runtime_offset(plan, offsets, gi: int, pos: int):
    row = plan[1][(gi, pos)]
    start = offsets[row[0]]
    for j in row[1:]:
        start = jax.lax.add(start, offsets[j])  # lax, not jnp: no per-add dispatch in the trace
    return start


def make_offsets(layout: Layout) -> Any:
    """The runtime offset table of ``layout``: a few int32 scalars (see the module docstring)."""
    values, _ = _offset_plan(layout)
    return tuple(jnp.asarray(v, dtype=jnp.int32) for v in values)


def offset_table_size(layout: Layout) -> int:
    """Number of scalars in the runtime offset table of ``layout``."""
    return len(_offset_plan(layout)[0])


def zeros(layout: Layout, dtype: jax.typing.DTypeLike | None = None, fill: float = 0.0) -> Packed:
    """Packed buffers of ``fill`` for ``layout`` (buffer dtype = ``dtype`` or the group's)."""
    if layout.shaped:
        return Packed(layout, [jnp.full(layout.shapes[g.leaves[0]], fill, dtype or g.dtype)
                               for g in layout.groups])
    return Packed(layout, [jnp.full((g.total,), fill, dtype or g.dtype) for g in layout.groups])


def find_offsets(state: Any, layout: Layout) -> Any:
    """The runtime offsets stored in ``state`` for ``layout``, or None."""
    for x in jax.tree_util.tree_leaves(state, is_leaf=lambda t: isinstance(t, Packed)):
        if isinstance(x, Packed) and x.offsets is not None and x.layout == layout:
            return x.offsets
    return None


def find_layout(state: Any) -> Layout | None:
    """The layout of the first packed buffer found in ``state``, or None."""
    for x in jax.tree_util.tree_leaves(state, is_leaf=lambda t: isinstance(t, Packed)):
        if isinstance(x, Packed):
            return x.layout
    return None


def segment_ids(layout: Layout, gi: int) -> jax.Array:
    """Per-element leaf position within group ``gi`` (int32 vector)."""
    g = layout.groups[gi]
    return jnp.asarray(np.repeat(np.arange(len(g.leaves), dtype=np.int32), g.sizes))


def strip_offsets(state: Any) -> Any:
    """``state`` with the runtime offsets removed from every :class:`Packed` in it."""
    return jax.tree_util.tree_map(
        lambda x: x.drop_offsets() if isinstance(x, Packed) else x, state,
        is_leaf=lambda x: isinstance(x, Packed))


# --- per-parameter state ---


def state_buffers(state: Any, layout: Layout, *, what: str) -> Sequence[jax.Array]:
    """The buffers of one moment of optimizer state, lined up with ``layout``'s groups.

    ``state`` is either :class:`Packed` (the opt-in packed state) or a pytree with the
    parameters' structure (the default per-parameter state, one leaf per parameter, in the
    parameter's shape). Raises ``ValueError`` naming the path when the tree does not match.
    """
    if isinstance(state, Packed):
        if state.layout != layout:
            raise ValueError(f"{what}: the updates do not match the state built by init(): "
                             f"{state.layout.describe_mismatch(layout)}")
        return state.buffers
    leaves, treedef = jax.tree_util.tree_flatten(state)
    if treedef != layout.treedef:
        extra, missing = _path_diff(layout, state)
        raise ValueError(f"{what}: the updates do not match the state built by init(): "
                         f"missing paths {missing} (in the state, not in the updates), "
                         f"unexpected paths {extra} (in the updates, not in the state)")
    if not layout.shaped:
        raise ValueError(f"{what} is per-parameter but the updates are packed buffers; "
                         f"packed updates need packed state (optim.pack(tx) or init() on "
                         f"packed params)")
    for i, x in enumerate(leaves):
        if tuple(np.shape(x)) != layout.shapes[i]:
            raise ValueError(f"{what}: updates at path {layout.paths[i]!r} has shape "
                             f"{layout.shapes[i]}, expected {tuple(np.shape(x))} (the shape of "
                             f"the state built by init())")
    return tuple(leaves)


def state_like(old: Any, layout: Layout, buffers: Any) -> Any:
    """New state of the same form as ``old`` (Packed, or a per-parameter tree) from buffers."""
    if isinstance(old, Packed):
        return Packed(layout, buffers, old.offsets)
    return jax.tree_util.tree_unflatten(layout.treedef, list(buffers))


_PACK_STATE = contextvars.ContextVar("cairn_optim_pack_state", default=False)


def packing_state() -> bool:
    """True inside ``optim.pack(tx).init``: element-wise state is then packed per dtype."""
    return _PACK_STATE.get()


@contextlib.contextmanager
def pack_state() -> Iterator[None]:
    """Within this block, element-wise transformations' ``init`` builds packed state."""
    token = _PACK_STATE.set(True)
    try:
        yield
    finally:
        _PACK_STATE.reset(token)


def transient_flat(p: Packed) -> Sequence[jax.Array]:
    """The buffers of ``p`` for a reduction over all of them (a global norm).

    Per-parameter buffers in a single-device process are raveled and concatenated per
    dtype, inside the jitted step only (nothing is stored): one reduction kernel instead of
    one per leaf, and the same summation order as packed state. With several devices the
    per-parameter buffers are returned as they are, since concatenating sharded leaves
    would gather them.
    """
    if not p.layout.shaped or len(p.buffers) <= 1 or jax.device_count() > 1:
        return p.buffers
    by_dtype: dict[str, list] = {}
    for b in p.buffers:
        by_dtype.setdefault(_canon(b.dtype), []).append(jnp.ravel(b))
    flat = tuple(jnp.concatenate(bs) if len(bs) > 1 else bs[0] for bs in by_dtype.values())
    # materialised once: fused into its consumer, the many-operand concatenate is slow
    return jax.lax.optimization_barrier(flat)
