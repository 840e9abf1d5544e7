"""How a gradient transformation prints: the factory calls that built it, with the arguments
that differ from the defaults, and no function addresses (plain text and notebook HTML).

A transformation is a pair of closures, so its description is read back from them: the
factory's name (``scale_by_adam``, ``chain``, ``masked``...) from the update's name or the
closures' qualified names, its arguments from the closure variables named like the
factory's parameters, and the transformations it wraps (chain members, ``masked``'s inner)
from the closure variables that are transformations themselves. An argument a factory does
not keep under its own name (``scale_by_learning_rate``'s ``flip_sign`` becomes a sign) is
not shown when it has a default, and shows as ``...`` when it is required.
"""

from __future__ import annotations

import functools
import html
import inspect
import sys
from collections.abc import Callable
from typing import Any

_MAX_DEPTH = 6  # closures followed below a factory's own functions
_NAMESPACES = ("cairn.optim", "cairn.optim.contrib", "cairn.optim.schedules", "cairn.optim.transforms")
_UNSET = object()


def _is_tx(x: Any) -> bool:
    return (
        not isinstance(x, type)
        and callable(getattr(x, "init", None))
        and callable(getattr(x, "update", None))
    )


def _factory_name(fn: Any) -> str:
    """``scale_by_adam`` for ``scale_by_adam.<locals>.init``; a PackedUpdate's own name."""
    if hasattr(fn, "fn") and isinstance(getattr(fn, "__name__", None), str):  # PackedUpdate
        return fn.__name__
    qual = getattr(fn, "__qualname__", None) or type(fn).__name__
    name = qual.split(".<locals>")[0].split(".")[0]
    # ``_schedule_free`` builds the closures of ``schedule_free`` once its arguments are checked
    public = name.lstrip("_")
    return public if public != name and _factory(public) is not None else name


def _factory(name: str) -> Callable[..., Any] | None:
    for ns in _NAMESPACES:
        mod = sys.modules.get(ns)
        f = getattr(mod, name, None) if mod is not None else None
        if callable(f):
            return f
    return None


def _closure_values(roots: list[Any]) -> dict[str, Any]:
    """Closure variables of ``roots`` and of the functions they close over (nearest first);
    transformations are not entered (they are described on their own)."""
    found: dict[str, Any] = {}
    seen: set[int] = set()
    level = list(roots)
    for _ in range(_MAX_DEPTH):
        nxt: list[Any] = []
        for f in level:
            if id(f) in seen:
                continue
            seen.add(id(f))
            if isinstance(f, functools.partial):
                nxt.append(f.func)
                continue
            if hasattr(f, "fn") and hasattr(f, "init_fn"):  # PackedUpdate
                nxt += [f.fn, f.init_fn]
                continue
            code, cells = getattr(f, "__code__", None), getattr(f, "__closure__", None)
            if code is None or not cells:
                continue
            for name, cell in zip(code.co_freevars, cells):
                try:
                    v = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                found.setdefault(name, v)
                if inspect.isfunction(v) or isinstance(v, functools.partial) or hasattr(v, "init_fn"):
                    nxt.append(v)
        level = nxt
    return found


def _equal(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # arrays and other values without a plain truth value
        return False


def _value(v: Any) -> str | Node:
    if _is_tx(v):
        return describe(v)
    if isinstance(v, (bool, int, float, complex, str, bytes)) or v is None:
        return repr(v)
    if isinstance(v, type):
        return v.__name__
    if isinstance(v, (tuple, list)):
        items = [_value(x) for x in v]
        text = ", ".join(x.text() if isinstance(x, Node) else x for x in items)
        return f"({text}{',' if len(items) == 1 else ''})" if isinstance(v, tuple) else f"[{text}]"
    if hasattr(v, "dtype") and hasattr(v, "shape"):
        if v.shape == ():
            try:
                return repr(v.item())
            except Exception:  # a tracer
                pass
        return f"{getattr(v.dtype, 'name', v.dtype)}{list(v.shape)}"
    if hasattr(v, "name") and type(v).__name__ == "dtype":
        return str(v.name)
    if callable(v):
        return _describe_function(v)
    return type(v).__name__


class Node:
    """One factory call: its name, its non-default arguments, the transformations it wraps.

    A node without a name is a transformation no cairn.optim factory made: its ``init=`` and
    ``update=`` arguments name the functions.
    """

    def __init__(self, name: str | None, args: list[tuple[str, str | Node]], children: list[Node],
                 partial: bool = False) -> None:
        self.name, self.args, self.children = name, args, children
        self.partial = partial  # some arguments could not be read back: shown as "..."

    def inner_text(self) -> str:
        parts = [c.text() for c in self.children]
        parts += [f"{k}={v.text() if isinstance(v, Node) else v}" for k, v in self.args]
        return ", ".join(parts + ["..."] * self.partial)

    def text(self) -> str:
        return f"{self.name or 'GradientTransformation'}({self.inner_text()})"

    def html(self) -> str:
        args = "".join(
            f"<li><code>{html.escape(k)}</code> = "
            f"{v.html() if isinstance(v, Node) else '<code>' + html.escape(v) + '</code>'}</li>"
            for k, v in self.args
        ) + "<li>...</li>" * self.partial
        children = "".join(f"<li>{c.html()}</li>" for c in self.children)
        name = html.escape(self.name or "GradientTransformation")
        if not args and not children:
            return f"<code>{name}()</code>"
        return (
            f"<details open><summary><code>{name}</code></summary>"
            f"<ul style='margin:0;list-style:none'>{children}{args}</ul></details>"
        )


def _describe_parts(name: str, roots: list[Any], skip: tuple[Any, ...] = ()) -> Node:
    values = _closure_values(roots)
    children = [v for v in values.values() if _is_tx(v) and not any(v is s for s in skip)]
    factory = _factory(name)
    args: list[tuple[str, str | Node]] = []
    try:
        params = inspect.signature(factory).parameters if factory is not None else {}
    except (TypeError, ValueError):
        params = {}
    partial = False
    for pname, p in params.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if pname not in values:  # not kept under its own name: a required one shows as "..."
            partial = partial or p.default is p.empty
            continue
        v = values[pname]
        if _is_tx(v) or (p.default is not p.empty and _equal(v, p.default)):
            continue
        args.append((pname, _value(v)))
    return Node(name, args, [describe(c) for c in children], partial)


def _maker(update: Any, init: Any) -> str | None:
    """The public factory whose closures these are: the update's first (an init may be a
    shared helper such as ``init_empty_state``), looking through internal wrappers."""
    level, seen = [update, init], set()
    for _ in range(_MAX_DEPTH):
        nxt = []
        for f in level:
            if id(f) in seen:
                continue
            seen.add(id(f))
            made = hasattr(f, "init_fn") or "<locals>" in str(getattr(f, "__qualname__", ""))
            if made and _factory(_factory_name(f)) is not None:
                return _factory_name(f)
            nxt += [v for v in _closure_values([f]).values()
                    if inspect.isfunction(v) or hasattr(v, "init_fn")]
        level = nxt
    return None


def _describe_function(fn: Any) -> str | Node:
    """A schedule or other callable: ``warmup_cosine_decay_schedule(peak_value=...)`` when a
    cairn.optim factory made it, else its name (never its address)."""
    name = _factory_name(fn)
    if _factory(name) is fn:  # the factory itself (inject_hyperparams's inner_factory)
        return name
    if _factory(name) is None:
        return getattr(fn, "__qualname__", type(fn).__name__).replace(".<locals>", "")
    return _describe_parts(name, [fn])


def _multi_steps(tx: Any) -> Node:
    k = _closure_values([tx._k]).get("k", tx._k)
    node = _describe_parts("MultiSteps", [])
    args: list[tuple[str, str | Node]] = [("every_k_schedule", _value(k))]
    defaults = inspect.signature(type(tx)).parameters
    for pname, v in (("use_grad_mean", tx._mean), ("should_skip_update_fn", tx._skip),
                     ("accumulator_dtype", tx._acc_dtype)):
        if not _equal(v, defaults[pname].default):
            args.append((pname, _value(v)))
    return Node(node.name, args, [describe(tx.inner_opt)])


def _injected(values: dict[str, Any]) -> Node:
    """``inject_hyperparams(adamw)(learning_rate=0.001)``: the inner factory and the
    arguments it was given (numeric, scheduled and static alike) that differ from its defaults."""
    inner = values.get("inner_factory")
    given = {**values.get("other", {}), **values.get("numeric", {}), **values.get("scheds", {})}
    try:
        params = inspect.signature(inner).parameters if inner is not None else {}
    except (TypeError, ValueError):
        params = {}
    args: list[tuple[str, str | Node]] = [
        (k, _value(v)) for k, v in given.items()
        if not (k in params and params[k].default is not params[k].empty and _equal(v, params[k].default))
    ]
    return Node(f"inject_hyperparams({_factory_name(inner) if inner is not None else '?'})", args, [])


def describe(tx: Any) -> Node:
    """The factory-call tree of a transformation (see the module docstring)."""
    if type(tx).__name__ == "MultiSteps" and hasattr(tx, "inner_opt"):
        return _multi_steps(tx)
    init, update = tx.init, tx.update
    members = getattr(update, "txs", None)
    if isinstance(members, tuple) and all(_is_tx(m) for m in members):  # chain
        return Node(_factory_name(update), [], [describe(m) for m in members])
    name = _maker(update, init)
    if name == "inject_hyperparams":
        return _injected(_closure_values([init, update]))
    if name is None:  # the user's own: name its functions
        return Node(None, [("init", _function_name(init)), ("update", _function_name(update))], [])
    return _describe_parts(name, [update, init])


def _function_name(fn: Any) -> str:
    if hasattr(fn, "fn") and hasattr(fn, "init_fn"):  # PackedUpdate
        return str(fn.__name__)
    if inspect.ismethod(fn):
        return f"{type(fn.__self__).__name__}.{fn.__func__.__name__}"
    return str(getattr(fn, "__qualname__", type(fn).__name__)).replace(".<locals>", "")


def text_repr(tx: Any) -> str:
    """``GradientTransformation(chain(scale_by_adam(), scale_by_learning_rate(...)))``."""
    node = describe(tx)
    if node.name is None or node.name == type(tx).__name__:
        return f"{type(tx).__name__}({node.inner_text()})"
    return f"{type(tx).__name__}({node.text()})"


def html_repr(tx: Any) -> str:
    """The notebook form of :func:`text_repr`: a collapsible tree of the factory calls."""
    node = describe(tx)
    if node.name == type(tx).__name__:
        return f"<div>{node.html()}</div>"
    return (
        f"<div><code>{html.escape(type(tx).__name__)}</code>"
        f"<div style='margin-left:1em'>{node.html()}</div></div>"
    )
