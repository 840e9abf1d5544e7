"""Views of a module tree with other static settings (Flax NNX's ``nnx.view`` /
``nnx.with_attributes``): a new tree of new module objects holding the *same*
Variables, with some static attributes changed. Training and evaluation copies of one
model share their parameters: ``eval_model = nn.view(model, deterministic=True,
use_running_average=True)``; an update to ``model``'s weights is seen by
``eval_model``.
"""

from __future__ import annotations

import inspect
from typing import Any

from cairn.nn._graph import flat, iter_modules
from cairn.nn._graph_mode import check_mode
from cairn.nn._module import AttributesNotFoundError
from cairn.nn._nodes import Node

_POS_OR_KW = inspect.Parameter.POSITIONAL_OR_KEYWORD


def _module_predicate(only: Any):
    if only is Ellipsis or only is True:
        return lambda path, m: True
    if isinstance(only, type):
        return lambda path, m: isinstance(m, only)
    if isinstance(only, tuple | list):
        preds = [_module_predicate(o) for o in only]
        return lambda path, m: any(p(path, m) for p in preds)
    if callable(only):
        return only
    raise TypeError(
        f"view: `only` must be ..., a Module type, a tuple of them or a predicate "
        f"(path, module) -> bool, got {only!r}"
    )


def _call_set_view(mod: Node, attributes: dict) -> set[str]:
    """Flax's ``set_view`` hook: a module defining ``set_view(**modes)`` gets the
    keywords its signature names (all of them if it takes ``**kwargs``)."""
    set_view = getattr(mod, "set_view", None)
    if not callable(set_view):
        return set()
    params = inspect.signature(set_view).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        set_view(**attributes)
        return set(attributes)
    named = {p.name for p in params if p.kind in (_POS_OR_KW, inspect.Parameter.KEYWORD_ONLY)}
    given = {k: v for k, v in attributes.items() if k in named}
    set_view(**given)
    return set(given)


def with_attributes(
    node: Node,
    /,
    *,
    only: Any = ...,
    raise_if_not_found: bool = True,
    graph: bool | None = None,
    **attributes: Any,
) -> Node:
    """A new tree sharing ``node``'s Variables in which every module selected by
    ``only`` (a Module type, a tuple of them, or ``(path, module) -> bool``) that has
    one of ``attributes`` gets the new value (a module with Flax's ``set_view(**modes)``
    hook gets the keywords it names through it). ``node`` itself is unchanged.

    Args:
      node: the module tree.
      only: the modules to change: a Module type, a tuple of them or ``(path, module) -> bool``.
      raise_if_not_found: raise when no selected module has one of the attributes.
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).
      attributes: the attributes and their new values.

    >>> from cairn import nn
    >>> drop = nn.Dropout(0.5, rngs=nn.Rngs(0))
    >>> nn.with_attributes(drop, deterministic=True).deterministic, drop.deterministic
    (True, False)

    Raises:
      ValueError: ``raise_if_not_found`` and no selected module has one of the
        attributes (the message lists them).
      TypeError: ``node`` is not a module.
    """
    check_mode("with_attributes", graph)
    return _with_attributes(node, only, raise_if_not_found, attributes, "with_attributes")


def _with_attributes(
    node: Node, only: Any, raise_if_not_found: bool, attributes: dict, caller: str
) -> Node:
    """The body of :func:`with_attributes` and :func:`view` (``caller`` words the
    error as Flax does for each)."""
    if not isinstance(node, Node):
        raise TypeError(f"view: expected a module, got {type(node).__name__}")
    c = flat(node)
    out = c.graphdef.build_from_variables(c.variables)
    pred = _module_predicate(only)
    found: set[str] = set()
    for path, mod in iter_modules(out):
        if not pred(path, mod):
            continue
        via_hook = _call_set_view(mod, attributes)
        found |= via_hook
        for name, value in attributes.items():
            if name in via_hook:
                continue
            if name in mod.__dict__ and not isinstance(mod.__dict__[name], Node):
                setattr(mod, name, value)
                found.add(name)
    missing = sorted(set(attributes) - found)
    if raise_if_not_found and missing:
        head = (
            f"Unused keys found in nnx.view: {missing}"
            if caller == "view"
            else f"Could not find at least one instance of the following attributes: {missing}"
        )
        raise AttributesNotFoundError(
            f"{head} (no selected module of {type(node).__name__} has them); pass "
            f"raise_if_not_found=False to ignore them"
        )
    return out


def view(
    node: Node,
    /,
    *,
    only: Any = ...,
    raise_if_not_found: bool = True,
    graph: bool | None = None,
    **kwargs: Any,
) -> Node:
    """A view of ``node`` with static settings changed, sharing its Variables:
    ``nn.view(model, deterministic=True, use_running_average=True)`` is an evaluation
    copy of a training model (see :func:`with_attributes` for ``only`` and the errors).

    Args:
      node: the module tree.
      only: the modules to change: a Module type, a tuple of them or ``(path, module) -> bool``.
      raise_if_not_found: raise when no selected module has one of the settings.
      graph: Flax NNX's graph-mode keyword, accepted for compatibility (one behaviour here).
      kwargs: the settings and their new values.

    >>> from cairn import nn
    >>> class Block(nn.Module):
    ...     def __init__(self, rngs):
    ...         self.linear = nn.Linear(2, 4, rngs=rngs)
    ...         self.drop = nn.Dropout(0.5, rngs=rngs)
    ...         self.bn = nn.BatchNorm(4, rngs=rngs)
    >>> block = Block(nn.Rngs(0))
    >>> ev = nn.view(block, deterministic=True, use_running_average=True)
    >>> ev.drop.deterministic, ev.bn.use_running_average, block.drop.deterministic
    (True, True, False)
    >>> ev.linear.kernel is block.linear.kernel
    True
    """
    check_mode("view", graph)
    return _with_attributes(node, only, raise_if_not_found, kwargs, "view")


def view_info(node: Node, /, *, only: Any = ..., graph: bool | None = None) -> str:
    """What ``nn.view`` can set on ``node``: for each module type under it (selected by
    ``only``) that has a ``set_view`` hook, the hook's keywords with their types,
    defaults and the docstring lines that describe them, one block per type (headed by
    its qualified name) sorted by name. Modules without a hook take any of their
    existing attributes.

    Args:
      node: a module.
      only: a Module type, a tuple of them or ``(path, module) -> bool``.
      graph: Flax NNX's mode keyword (one behaviour here).

    >>> from cairn import nn
    >>> print(nn.view_info(nn.Dropout(0.5, rngs=nn.Rngs(0))))
    Dropout:
      deterministic: bool | None = None
        if True, disables dropout masking.
    """
    check_mode("view_info", graph)
    if not isinstance(node, Node):
        raise TypeError(f"view_info: expected a module, got {type(node).__name__}")
    pred = _module_predicate(only)
    blocks: dict[str, str] = {}
    for path, mod in iter_modules(node):
        name = type(mod).__qualname__  # as Flax NNX: a class defined in a function says where
        hook = getattr(mod, "set_view", None)
        if name in blocks or not callable(hook) or not pred(path, mod):
            continue
        blocks[name] = _hook_block(name, hook)
    return "\n".join(blocks[k] for k in sorted(blocks))


def _hook_block(name: str, hook: Any) -> str:
    docs = _arg_docs(inspect.getdoc(hook) or "")
    lines = [f"{name}:"]
    for p in inspect.signature(hook).parameters.values():
        if p.kind not in (_POS_OR_KW, inspect.Parameter.KEYWORD_ONLY):
            continue
        ann = p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(
            p.annotation
        )
        head = f"  {p.name}"
        if p.annotation is not inspect.Parameter.empty:
            head += f": {ann}"
        if p.default is not inspect.Parameter.empty:
            head += f" = {p.default!r}"
        lines.append(head)
        lines.extend(f"    {d}" for d in docs.get(p.name, []))
    return "\n".join(lines)


def _arg_docs(doc: str) -> dict[str, list[str]]:
    """``{arg: description lines}`` from the ``Args:`` section of a docstring."""
    out: dict[str, list[str]] = {}
    cur = None
    in_args = False
    for line in doc.splitlines():
        if line.strip() == "Args:":
            in_args = True
            continue
        if not in_args:
            continue
        if line and not line.startswith(" "):
            break
        stripped = line.strip()
        if line.startswith("  ") and not line.startswith("    ") and ":" in stripped:
            cur, _, rest = stripped.partition(":")
            out[cur] = [rest.strip()] if rest.strip() else []
        elif cur is not None and stripped:
            out[cur].append(stripped)
    return out
