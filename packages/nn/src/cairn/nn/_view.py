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
    node: Node, /, *, only: Any = ..., raise_if_not_found: bool = True, **attributes: Any
) -> Node:
    """A new tree sharing ``node``'s Variables in which every module selected by
    ``only`` (a Module type, a tuple of them, or ``(path, module) -> bool``) that has
    one of ``attributes`` gets the new value (a module with Flax's ``set_view(**modes)``
    hook gets the keywords it names through it). ``node`` itself is unchanged.

    >>> from cairn import nn
    >>> drop = nn.Dropout(0.5, rngs=nn.Rngs(0))
    >>> nn.with_attributes(drop, deterministic=True).deterministic, drop.deterministic
    (True, False)

    Raises:
      ValueError: ``raise_if_not_found`` and no selected module has one of the
        attributes (the message lists them).
      TypeError: ``node`` is not a module.
    """
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
        raise ValueError(
            f"view: no selected module of {type(node).__name__} has the attribute(s) "
            f"{missing}; pass raise_if_not_found=False to ignore them"
        )
    return out


def view(
    node: Node, /, *, only: Any = ..., raise_if_not_found: bool = True, **kwargs: Any
) -> Node:
    """A view of ``node`` with static settings changed, sharing its Variables:
    ``nn.view(model, deterministic=True, use_running_average=True)`` is an evaluation
    copy of a training model (see :func:`with_attributes` for ``only`` and the errors).

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
    return with_attributes(node, only=only, raise_if_not_found=raise_if_not_found, **kwargs)

