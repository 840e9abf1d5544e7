"""Views of a module tree with other static settings (Flax NNX's ``nnx.view`` /
``nnx.with_attributes``): a new tree of new module objects holding the *same*
Variables, with some static attributes changed. Training and evaluation copies of one
model share their parameters: ``eval_model = nn.view(model, deterministic=True,
use_running_average=True)``; an update to ``model``'s weights is seen by
``eval_model``.
"""

from __future__ import annotations

from typing import Any

from cairn.nn._graph import flat, iter_modules
from cairn.nn._nodes import Node
from cairn.nn._variables import Variable


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


def with_attributes(
    node: Node, /, *, only: Any = ..., raise_if_not_found: bool = True, **attributes: Any
) -> Node:
    """A new tree sharing ``node``'s Variables in which every module selected by
    ``only`` (a Module type, a tuple of them, or ``(path, module) -> bool``) that has
    one of ``attributes`` gets the new value. ``node`` itself is unchanged.

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
        for name, value in attributes.items():
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


def recursive_map(f: Any, node: Node, /) -> Any:
    """Apply ``f(path, x)`` to every module and Variable of ``node``, children before
    parents, on a new tree sharing ``node``'s Variables: what ``f`` returns replaces
    ``x`` (return ``x`` to keep it). Returns ``f((), new_root)``.

    >>> from cairn import nn
    >>> m = nn.Sequential(nn.Linear(2, 2, rngs=nn.Rngs(0)), nn.Linear(2, 2, rngs=nn.Rngs(1)))
    >>> names = []
    >>> _ = nn.recursive_map(lambda p, x: names.append("/".join(map(str, p))) or x, m)
    >>> names[:3]
    ['layers/0/kernel', 'layers/0/bias', 'layers/0']

    Raises:
      TypeError: ``node`` is not a module.
    """
    if not isinstance(node, Node):
        raise TypeError(f"recursive_map: expected a module, got {type(node).__name__}")
    c = flat(node)
    root = c.graphdef.build_from_variables(c.variables)

    def rec(x: Any, path: tuple) -> Any:
        if isinstance(x, Node):
            for k, v in list(x._graph_items()):
                if isinstance(v, Node | Variable):
                    new = rec(v, (*path, k))
                    if new is not v:
                        x._graph_set(k, new)
        return f(path, x)

    return rec(root, ())
