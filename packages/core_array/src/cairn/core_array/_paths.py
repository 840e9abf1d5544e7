"""The one path convention: a leaf's path is its keys joined by ``/``.

Dict keys are rendered as text (``int`` keys as decimals), sequence indices as decimals,
namedtuple / dataclass fields and attribute names as they are. ``None`` is an empty
subtree, as in JAX. Any other JAX-registered pytree node is walked through
``jax.tree_util`` key paths when JAX is importable, so Flax modules, Optax states and the
user's own registered classes get the same strings.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cairn.core_array._jax_compat import jax_tree_util

SEPARATOR = "/"

__all__ = [
    "SEPARATOR",
    "PathError",
    "key_name",
    "join_path",
    "path_of",
    "compile_pattern",
    "flatten_with_paths",
    "unflatten",
    "tree_paths",
    "map_with_path",
    "match_paths",
    "path_matches",
]


class PathError(ValueError):
    """A tree cannot be addressed by path strings, or two trees' paths disagree."""


def _join(prefix: str, key: str) -> str:
    return key if not prefix else prefix + SEPARATOR + key


def key_name(key: Any, parent: str = "") -> str:
    """One path component: the text a key contributes to a path.

    A ``str`` key (dict key or attribute name) is itself and must be non-empty and free
    of ``/``; an ``int`` (dict key or sequence index) is its decimal; a
    ``jax.tree_util`` key entry (``DictKey``, ``SequenceKey``, ``GetAttrKey``,
    ``FlattenedIndexKey``) is named by what it holds. ``parent`` is the path above the
    key, used only to say where a bad key sits.

    Args:
      key: a ``str``, ``int`` or ``jax.tree_util`` key entry.
      parent: the path above the key, named in the error for a bad key.

    >>> key_name("kernel"), key_name(3)
    ('kernel', '3')
    >>> key_name("a/b", parent="layers")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ...
    PathError: key 'a/b' under 'layers' contains '/', which would collide with the path separator; rename the key

    Raises:
      PathError: for an empty or ``/``-containing string, or a key of another type.
    """
    if isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool)):
        return _render_key(key, parent)
    if jax_tree_util() is not None and type(key).__module__.startswith("jax"):
        return _jax_key_name(key, parent)
    return _render_key(key, parent)


def join_path(parent: str, key: Any) -> str:
    """``parent`` extended by one key (named by :func:`key_name`); ``""`` is the root.

    Args:
      parent: the path so far (``""`` for the root).
      key: the key to append (anything :func:`key_name` accepts).

    >>> join_path("", "layers"), join_path("layers", 0), join_path("layers/0", "kernel")
    ('layers', 'layers/0', 'layers/0/kernel')
    """
    return _join(parent, key_name(key, parent))


def path_of(keys: Iterable[Any]) -> str:
    """The path string of a sequence of keys (a key tuple, or a ``jax.tree_util`` key path).

    Args:
      keys: the keys from the root down (each one :func:`key_name` accepts).

    >>> path_of(("layers", 0, "kernel"))
    'layers/0/kernel'
    >>> path_of(())
    ''
    """
    path = ""
    for key in keys:
        path = _join(path, key_name(key, path))
    return path


def _render_key(key: Any, prefix: str) -> str:
    """Render one dict key (or JAX key entry payload) as a path component."""
    if isinstance(key, str):
        if key == "":
            raise PathError(f"empty string key under {prefix or '<root>'!r}: a path component must be non-empty")
        if SEPARATOR in key:
            raise PathError(
                f"key {key!r} under {prefix or '<root>'!r} contains {SEPARATOR!r}, "
                "which would collide with the path separator; rename the key"
            )
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    raise PathError(
        f"key {key!r} of type {type(key).__name__} under {prefix or '<root>'!r} "
        "cannot be a path component: only str and int keys are supported"
    )


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _is_plain_dataclass(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _jax_key_name(entry: Any, prefix: str) -> str:
    tu: Any = jax_tree_util()  # not None: the key came from a JAX key path
    if isinstance(entry, tu.DictKey):
        return _render_key(entry.key, prefix)
    if isinstance(entry, tu.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, tu.GetAttrKey):
        return _render_key(entry.name, prefix)
    if isinstance(entry, tu.FlattenedIndexKey):
        return str(entry.key)
    return _render_key(getattr(entry, "key", entry), prefix)


def _dict_keys(d: dict) -> list:
    # JAX's order: insertion order for OrderedDict, sorted keys for every other dict.
    if isinstance(d, OrderedDict):
        return list(d)
    try:
        return sorted(d)
    except TypeError:
        return list(d)


def _rebuild_dict(x: dict, keys: list, vals: list) -> dict:
    if type(x) is dict:
        return dict(zip(keys, vals))
    out = copy.copy(x)
    out.clear()
    for k, v in zip(keys, vals):
        out[k] = v
    return out


# core_array's own types, so that they walk the same with and without JAX:
# leaf types (ArraySpec, QuantLayout: descriptions, not containers, and leaves for
# jax.tree_util too) and node types (QArray: the same children as its JAX pytree).
_LEAF_TYPES: set[type] = set()
_NODE_TYPES: dict[type, tuple[Callable[[Any], list[tuple[str, Any]]], Callable[[Any, list], Any]]] = {}


def _register_leaf_type(cls: type) -> None:
    _LEAF_TYPES.add(cls)


def _register_node_type(cls: type, children: Callable[[Any], list[tuple[str, Any]]], rebuild: Callable[[Any, list], Any]) -> None:
    """``children(x) -> [(component, child)]``; ``rebuild(x, new_children) -> new x``."""
    _NODE_TYPES[cls] = (children, rebuild)


def _children(x: Any, prefix: str) -> tuple[list[tuple[str, Any]], Callable[[list], Any]] | None:
    """One level of structure: ``[(component, child)], rebuild`` or ``None`` for a leaf."""
    if type(x) in _LEAF_TYPES:
        return None
    node = _NODE_TYPES.get(type(x))
    if node is not None:
        return node[0](x), functools.partial(node[1], x)
    if isinstance(x, dict):
        keys = _dict_keys(x)
        comps = [_render_key(k, prefix) for k in keys]
        return list(zip(comps, (x[k] for k in keys))), functools.partial(_rebuild_dict, x, keys)
    if _is_namedtuple(x):
        nt = type(x)
        return [(f, getattr(x, f)) for f in nt._fields], lambda vals: nt(*vals)
    if type(x) in (list, tuple):
        seq = type(x)
        return [(str(i), v) for i, v in enumerate(x)], lambda vals: seq(vals)
    tu = jax_tree_util()
    if tu is not None:
        leaves, treedef = tu.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
        if not (treedef.num_leaves == 1 and treedef.num_nodes == 1 and leaves and leaves[0][1] is x):
            items = []
            for kp, child in leaves:
                if len(kp) != 1:
                    raise PathError(f"unexpected key path {kp!r} under {prefix or '<root>'!r}")
                items.append((_jax_key_name(kp[0], prefix), child))
            return items, lambda vals, _td=treedef: tu.tree_unflatten(_td, vals)
    if _is_plain_dataclass(x):
        fields = [f for f in dataclasses.fields(x)]
        names = [f.name for f in fields]

        def rebuild_dc(vals, _x=x, _fields=fields):
            init_kwargs = {f.name: v for f, v in zip(_fields, vals) if f.init}
            new = dataclasses.replace(_x, **init_kwargs)
            for f, v in zip(_fields, vals):
                if not f.init:
                    object.__setattr__(new, f.name, v)
            return new

        return [(n, getattr(x, n)) for n in names], rebuild_dc
    return None


def _walk(x: Any, prefix: str, is_leaf, out: dict, rebuild_mode: bool, source=None):
    """Flatten into ``out``; when ``rebuild_mode``, return ``x`` rebuilt with leaves from ``source``."""
    # is_leaf first, as in JAX: ``is_leaf=lambda x: x is None`` makes None a leaf
    if is_leaf is not None and is_leaf(x):
        if rebuild_mode:
            return source(prefix)
        _add(out, prefix, x)
        return x
    if x is None:
        return None
    ch = _children(x, prefix)
    if ch is None:
        if rebuild_mode:
            return source(prefix)
        _add(out, prefix, x)
        return x
    items, rebuild = ch
    seen: set[str] = set()
    new_vals = []
    for comp, child in items:
        if comp in seen:
            raise PathError(
                f"two keys under {prefix or '<root>'!r} render as the same path component {comp!r} "
                "(for example 1 and '1'); make the keys distinct as text"
            )
        seen.add(comp)
        new_vals.append(_walk(child, _join(prefix, comp), is_leaf, out, rebuild_mode, source))
    return rebuild(new_vals) if rebuild_mode else x


def _add(out: dict, path: str, leaf: Any) -> None:
    if path in out:
        raise PathError(f"path {path!r} occurs twice in the tree")
    out[path] = leaf


def flatten_with_paths(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> dict[str, Any]:
    """Flatten ``tree`` into an ordered ``{path: leaf}`` dict.

    Args:
      tree: any pytree (dict, list, tuple, namedtuple, dataclass, registered JAX pytree).
      is_leaf: optional predicate; a node it returns ``True`` for is kept as one leaf.

    >>> flatten_with_paths({"layers": [{"w": 1, "b": 2}], "head": (3, None)})
    {'head/0': 3, 'layers/0/b': 2, 'layers/0/w': 1}

    A leaf that is the whole tree has the empty path ``""``.
    """
    out: dict[str, Any] = {}
    _walk(tree, "", is_leaf, out, False)
    return out


def tree_paths(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[str]:
    """The paths of ``tree``'s leaves, in flatten order.

    Args:
      tree: any pytree.
      is_leaf: optional predicate; a node it returns ``True`` for is kept as one leaf.
    """
    return list(flatten_with_paths(tree, is_leaf=is_leaf))


def _difference_message(expected: Iterable[str], got: Iterable[str], what: str) -> str | None:
    expected = list(expected)
    got = list(got)
    exp_set, got_set = set(expected), set(got)
    missing = [p for p in expected if p not in got_set]
    extra = [p for p in got if p not in exp_set]
    if not missing and not extra:
        return None
    parts = [f"{what}: paths differ"]
    if missing:
        parts.append(f"missing {len(missing)}: {', '.join(repr(p) for p in missing[:20])}" + (" ..." if len(missing) > 20 else ""))
    if extra:
        parts.append(f"unexpected {len(extra)}: {', '.join(repr(p) for p in extra[:20])}" + (" ..." if len(extra) > 20 else ""))
    return "; ".join(parts)


class _NoLike:
    def __repr__(self) -> str:
        return "<no template>"


_NO_LIKE: Any = _NoLike()


def unflatten(flat: Mapping[str, Any], like: Any = _NO_LIKE, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """Rebuild a tree from ``{path: leaf}``.

    With ``like``, the result has exactly ``like``'s structure (containers, namedtuples,
    dataclasses, registered pytrees) and every path of ``like`` must be present in
    ``flat`` and nothing else; otherwise :class:`PathError` lists every difference.
    ``like=None`` is the empty tree (``None`` has no leaves), so ``flat`` must be empty.
    Without ``like``, the result is nested dicts keyed by the path components; every
    path must then be a string of non-empty components.

    Args:
      flat: ``{path: leaf}``, as :func:`flatten_with_paths` gives.
      like: an optional tree whose structure the result takes.
      is_leaf: the same predicate that flattened ``like`` (its leaves' boundaries).

    >>> unflatten({"a/0": 1, "a/1": 2}, like={"a": [0, 0]})
    {'a': [1, 2]}
    >>> unflatten({"a/x": 1, "b": 2})
    {'a': {'x': 1}, 'b': 2}
    """
    if not isinstance(flat, Mapping):
        raise PathError(f"unflatten expects a mapping of path -> leaf, got {type(flat).__name__}")
    if like is not _NO_LIKE:
        template = flatten_with_paths(like, is_leaf=is_leaf)
        msg = _difference_message(template.keys(), flat.keys(), "unflatten")
        if msg:
            raise PathError(msg)
        return _walk(like, "", is_leaf, {}, True, source=lambda p: flat[p])
    if "" in flat:
        if len(flat) != 1:
            raise PathError("the root path '' cannot be combined with other paths")
        return flat[""]
    root: dict = {}
    for path, leaf in flat.items():
        if not isinstance(path, str):
            raise PathError(f"unflatten: path {path!r} is a {type(path).__name__}, expected a str like 'a/0/b'")
        parts = path.split(SEPARATOR)
        if "" in parts:
            raise PathError(f"unflatten: path {path!r} has an empty component (leading, trailing or doubled {SEPARATOR!r})")
        node = root
        for i, part in enumerate(parts[:-1]):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise PathError(f"path {path!r} goes below leaf {SEPARATOR.join(parts[: i + 1])!r}")
            node = nxt
        if parts[-1] in node:
            raise PathError(f"path {path!r} is both a leaf and a subtree")
        node[parts[-1]] = leaf
    return root


def map_with_path(
    fn: Callable[..., Any], tree: Any, *rest: Any, is_leaf: Callable[[Any], bool] | None = None
) -> Any:
    """Apply ``fn(path, leaf, *other_leaves)`` to every leaf; same structure out.

    Args:
      fn: called as ``fn(path, leaf, *other_leaves)`` for each leaf.
      tree: the tree whose structure the result takes.
      *rest: more trees with the same paths; their leaves are passed after ``tree``'s.
      is_leaf: optional predicate; a node it returns ``True`` for is kept as one leaf.

    >>> map_with_path(lambda p, x: f"{p}={x}", {"a": 1, "b": [2]})
    {'a': 'a=1', 'b': ['b/0=2']}
    """
    flat = flatten_with_paths(tree, is_leaf=is_leaf)
    others = []
    for i, other in enumerate(rest):
        of = flatten_with_paths(other, is_leaf=is_leaf)
        msg = _difference_message(flat.keys(), of.keys(), f"map_with_path (tree 0 vs tree {i + 1})")
        if msg:
            raise PathError(msg)
        others.append(of)
    out = {p: fn(p, leaf, *(o[p] for o in others)) for p, leaf in flat.items()}
    return _walk(tree, "", is_leaf, {}, True, source=lambda p: out[p])


@functools.lru_cache(maxsize=1024)
def compile_pattern(pattern: str | re.Pattern) -> re.Pattern:
    """``pattern`` compiled for whole-path matching (``rx.fullmatch(path)``), cached.

    Every package matches paths through this one function, so a rule, filter or
    selector pattern means the same thing everywhere.

    Args:
      pattern: a regular expression (text or compiled), matched against whole paths.

    >>> compile_pattern(r"layers/\\d+/kernel").fullmatch("layers/3/kernel") is not None
    True
    >>> compile_pattern("(")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ...
    PathError: invalid path pattern '(': missing ), unterminated subpattern at position 0

    Raises:
      PathError: ``pattern`` is not a valid regular expression (or not a string).
    """
    if isinstance(pattern, re.Pattern):
        return pattern
    if not isinstance(pattern, str):
        raise PathError(f"a path pattern must be a str regular expression, got {type(pattern).__name__}")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise PathError(f"invalid path pattern {pattern!r}: {e}") from None


def path_matches(pattern: str | re.Pattern, path: str) -> bool:
    """Whether ``pattern`` (a regular expression) matches the *whole* ``path``.

    Args:
      pattern: a regular expression (text or compiled).
      path: the path string to test.

    >>> path_matches(r"layers/\\d+/kernel", "layers/3/kernel")
    True
    >>> path_matches("kernel", "layers/3/kernel")
    False
    """
    rx = compile_pattern(pattern)
    return rx.fullmatch(path) is not None


def match_paths(tree_or_paths: Any, pattern: str | re.Pattern) -> list[str]:
    """The paths (of a tree's leaves, or of an iterable of path strings) that ``pattern`` fully matches.

    Args:
      tree_or_paths: a pytree (its leaves' paths are tested) or an iterable of path strings.
      pattern: a regular expression, matched against whole paths.

    >>> match_paths({"embed": 1, "layers": [2, 3]}, r"layers/.*")
    ['layers/0', 'layers/1']
    """
    if isinstance(tree_or_paths, (list, tuple, set, frozenset)) and all(isinstance(p, str) for p in tree_or_paths) and tree_or_paths:
        paths = list(tree_or_paths)
    elif isinstance(tree_or_paths, (type({}.keys()),)):
        paths = list(tree_or_paths)
    else:
        paths = tree_paths(tree_or_paths)
    rx = compile_pattern(pattern)
    return [p for p in paths if rx.fullmatch(p) is not None]
