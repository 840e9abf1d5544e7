"""``tabulate``: a table of the method calls a model makes on given inputs, with their
inputs, outputs, optional FLOPs and the variables of the module called, by type.

The model is cloned and its modules' public methods (and ``__call__``) are wrapped for
the run, so a method body is traced once: its inputs and outputs are recorded, its FLOPs
read from XLA's cost analysis of that one trace. The whole run is abstract
(``jax.eval_shape``): nothing is computed and the caller's model is not changed. The
table is plain text drawn with box characters (the layout of Flax NNX's rich table:
title, header, one block per call, a ``Total`` footer and a ``Total Parameters`` caption).

(The reprs of modules and states live beside their classes, in ``_module`` and
``_state``.)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, cast

import jax
import numpy as np

from cairn.nn._capture import wrapped_methods
from cairn.nn._graph import clone, flat, iter_modules
from cairn.nn._module import Module, public_methods
from cairn.nn._nodes import Node
from cairn.nn._rngs import Rngs, RngStream
from cairn.nn._variables import RngState, Variable


@dataclasses.dataclass
class CallInfo:
    """One recorded method call (a row of the table; what ``row_filter`` is given).

    Attributes:
      call_order: the call's position in the run (rows are listed in this order).
      type: the class of the module called.
      path: the module's path parts, plus the method name unless it is ``__call__``.
      inputs_repr: the rendered inputs.
      outputs: the outputs, arrays replaced by their ``dtype[shape]``.
      flops: XLA's FLOP estimate of the call (None unless asked for).
      vjp_flops: XLA's FLOP estimate of the call's VJP (None unless asked for).
    """

    call_order: int
    type: type
    path: tuple[str, ...]
    module_path: str
    inputs_repr: str
    outputs: Any
    flops: int | None
    vjp_flops: int | None


def filter_rng_streams(row: CallInfo) -> bool:
    """The default ``row_filter``: every row but the calls of an ``RngStream``.

    Args:
      row: the recorded call.
    """
    return not issubclass(row.type, RngStream)


# --- sizes ---


def _size_bytes(variables: list) -> tuple[int, int]:
    n = b = 0
    for v in variables:
        for leaf in jax.tree_util.tree_leaves(v.raw_value):
            shape = getattr(leaf, "shape", None)
            dtype = getattr(leaf, "dtype", None)
            if shape is None or dtype is None:
                continue
            size = int(np.prod(shape))
            n += size
            try:
                b += size * np.dtype(dtype).itemsize
            except TypeError:  # PRNG key dtypes: the two uint32 words of a threefry key
                b += size * 8
    return n, b


def _bytes_repr(num_bytes: int) -> str:
    """Decimal units, one decimal (``1.1 KB`` is 1,100 bytes)."""
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if num_bytes > scale:
            return f"{num_bytes / scale:,.1f} {unit}"
    return f"{num_bytes:,} B"


def _size_repr(size_bytes: tuple[int, int]) -> str:
    return f"{size_bytes[0]:,} ({_bytes_repr(size_bytes[1])})"


def _type_key(v: Variable) -> type:
    """The column a variable counts in: its type, with every random-stream type as
    ``RngState``."""
    return RngState if isinstance(v, RngState) else type(v)


# --- rendering values (a small YAML-like form) ---


def _leaf_repr(x: Any) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{x.dtype}[{','.join(str(d) for d in x.shape)}]"
    if isinstance(x, Node):
        return f"{type(x).__name__}(...)"
    if isinstance(x, type):
        return f"type[{x.__name__}]"
    if isinstance(x, str):
        return x
    return repr(x)


def _render(value: Any, indent: int = 0) -> list[str]:
    """The lines of ``value``: a dict as ``key: value`` lines, a list or tuple as ``- item``
    lines (nested containers indented by two), a leaf by :func:`_leaf_repr`."""
    pad = " " * indent
    if isinstance(value, Mapping) and value:
        lines = []
        for k, v in value.items():
            if isinstance(v, (Mapping, list, tuple)) and v:
                lines += [f"{pad}{k}:", *_render(v, indent + 2)]
            else:
                lines.append(f"{pad}{k}: {_empty_or_leaf(v)}")
        return lines
    if isinstance(value, (list, tuple)) and value:
        lines = []
        for v in value:
            if isinstance(v, (Mapping, list, tuple)) and v:
                sub = _render(v, indent + 2)
                lines.append(f"{pad}- {sub[0].lstrip()}")
                lines += sub[1:]
            else:
                lines.append(f"{pad}- {_empty_or_leaf(v)}")
        return lines
    return [pad + _empty_or_leaf(value)]


def _empty_or_leaf(v: Any) -> str:
    if isinstance(v, Mapping):
        return "{}"
    if isinstance(v, (list, tuple)):
        return "[]"
    return _leaf_repr(v)


def _cell(value: Any) -> str:
    """A table cell: empty for None or an empty container, else the rendered lines."""
    if value is None or (isinstance(value, (Mapping, list, tuple)) and not value):
        return ""
    return "\n".join(_render(value))


def _inputs_repr(args: tuple, kwargs: dict) -> str:
    """One argument alone is rendered as itself, several as a list; keywords follow."""
    parts = []
    if args:
        parts.append(_cell(args[0] if len(args) == 1 and not kwargs else list(args)))
    if kwargs:
        parts.append(_cell(kwargs))
    return "\n".join(p for p in parts if p)


# --- recording the calls ---


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct, np.generic))


def _join(prefix: str, path: str) -> str:
    return "/".join(p for p in (prefix, path) if p)


def _flops(lowered: Any) -> int:
    cost = lowered.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per computation
        cost = cost[0] if cost else None
    return 0 if not cost or "flops" not in cost else int(cost["flops"])


def _cotangent(x: Any) -> Any:
    if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):
        return x
    return np.zeros(x.shape, jax.dtypes.float0)


class _Recorder:
    """Wraps module methods so every call on a module of the cloned model is traced once
    under ``jax.jit`` and recorded as a :class:`CallInfo`."""

    def __init__(self, compute_flops: bool, compute_vjp_flops: bool):
        self.compute_flops = compute_flops
        self.compute_vjp_flops = compute_vjp_flops
        self.paths: dict[int, str] = {}
        self.keep: list = []  # the modules whose ids are in `paths` stay alive (no id reuse)
        self.rows: list[CallInfo] = []
        self.seen: set = set()
        self.counter = itertools.count()

    def register(self, obj: Any, prefix: str) -> None:
        """Record the path of ``obj`` and of every module under it."""
        if isinstance(obj, Module):
            for path, m in iter_modules(obj):
                self.paths[id(m)] = _join(prefix, path)
                self.keep.append(m)

    def register_copy(self, copy: Module, obj: Module, prefix: str) -> None:
        """Record the modules of ``copy`` (a rebuild of ``obj``) at the paths already
        recorded for their counterparts in ``obj`` (a shared module keeps its first
        path), else under ``prefix``."""
        for (path, m), (_, o) in zip(iter_modules(copy), iter_modules(obj)):
            self.paths[id(m)] = self.paths.get(id(o), _join(prefix, path))
            self.keep.append(m)

    def wrap(self, name: str, orig: Callable) -> Callable:
        rec = self

        def recorded(obj, *args, **kwargs):
            path = rec.paths.get(id(obj))
            if path is None:  # a module the run did not reach through the model
                return orig(obj, *args, **kwargs)
            order = next(rec.counter)
            inputs = _inputs_repr(args, kwargs)
            # the module travels as its graph (a shared submodule or Variable stays one
            # object inside the trace), the arguments as a pytree
            c = flat(obj)
            gd, nv = c.graphdef, c.graphdef.num_variables
            leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
            leaves = [v.raw_value for v in c.variables] + leaves
            dyn_at = [i for i, x in enumerate(leaves) if _is_array(x)]

            def body(*dyn):
                full = list(leaves)
                for i, x in zip(dyn_at, dyn):
                    full[i] = x
                o = gd.build_from_values(full[:nv])
                a, kw = jax.tree_util.tree_unflatten(treedef, full[nv:])
                rec.register_copy(o, obj, path)
                return orig(o, *a, **kw)

            dyn = [leaves[i] for i in dyn_at]
            jitted = jax.jit(body)
            traced = jitted.trace(*dyn)
            flops = _flops(traced.lower()) if rec.compute_flops else None
            key = (path, name, inputs)
            if key not in rec.seen:
                rec.seen.add(key)
                vjp = _vjp_flops(body, dyn) if rec.compute_vjp_flops else None
                parts = tuple(p for p in path.split("/") if p)
                if name != "__call__":
                    parts += (name,)
                rec.rows.append(
                    CallInfo(order, type(obj), parts, path, inputs, traced.out_info, flops, vjp)
                )
            return jitted(*dyn)

        recorded.__name__ = getattr(orig, "__name__", name)
        recorded.__doc__ = getattr(orig, "__doc__", None)
        return recorded


def _vjp_flops(body: Callable, dyn: list) -> int:
    """FLOPs of ``body``'s VJP with respect to its floating-point inputs, pulled back
    from its own outputs."""
    diff_at = [
        i for i, x in enumerate(dyn) if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)
    ]

    def f(*d):
        full = list(dyn)
        for i, x in zip(diff_at, d):
            full[i] = x
        return body(*full)

    def run(*d):
        out, pullback = jax.vjp(f, *d)
        return pullback(jax.tree_util.tree_map(_cotangent, out))

    return _flops(jax.jit(run).trace(*[dyn[i] for i in diff_at]).lower())


_NOT_WRAPPED = (Rngs, RngStream)


def _record(model: Module, method: str, args: tuple, kwargs: dict, rec: _Recorder) -> None:
    """Run ``model.<method>(*args, **kwargs)`` abstractly with every module class's
    methods wrapped by ``rec``; the classes are restored afterwards."""
    classes = {type(m) for _, m in iter_modules(model)}
    classes = {c for c in classes if not issubclass(c, _NOT_WRAPPED)}
    with wrapped_methods(classes, rec.wrap):
        top = getattr(type(model), method, None)
        if top is None or not callable(top):
            raise AttributeError(f"tabulate: {type(model).__name__} has no method {method!r}")
        if type(model) in classes and method not in public_methods(type(model)):
            top = rec.wrap(method, top)
        rec.register(model, "")
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dyn_at = [i for i, x in enumerate(leaves) if _is_array(x)]

        def run(*dyn):
            full = list(leaves)
            for i, x in zip(dyn_at, dyn):
                full[i] = x
            a, kw = jax.tree_util.tree_unflatten(treedef, full)
            return top(model, *a, **kw)

        jax.eval_shape(run, *[leaves[i] for i in dyn_at])


# --- the table ---

_TABLE_KEYS = frozenset({"title", "caption", "show_header", "show_lines", "show_footer"})
_COLUMN_KEYS = frozenset({"justify", "min_width"})
# rich.console.Console options that only concern a terminal (colour, markup, wrapping
# width): the table here is plain text, never coloured and never wrapped
_CONSOLE_KEYS = frozenset({
    "force_terminal", "force_jupyter", "force_interactive", "no_color", "width", "height",
    "color_system", "soft_wrap", "highlight", "markup", "emoji", "record", "legacy_windows",
    "tab_size", "safe_box",
})


def _check_keys(what: str, given: Mapping[str, Any], allowed: frozenset) -> None:
    bad = sorted(set(given) - allowed)
    if bad:
        raise ValueError(
            f"tabulate: {what} {bad} not supported; the plain-text table takes {sorted(allowed)}"
        )


def _draw(
    headers: list[str],
    rows: list[list[str]],
    footer: list[str] | None,
    *,
    title: str | None,
    caption: str | None,
    show_header: bool,
    show_lines: bool,
    justify: list[str],
    footer_justify: list[str],
    min_width: int,
) -> str:
    """Box-drawn table: title, header, rows (multi-line cells), footer, caption."""
    cells = [[c.split("\n") for c in r] for r in rows]
    everything = [[h.split("\n") for h in headers], *cells] + (
        [[f.split("\n") for f in footer]] if footer else []
    )
    widths = [
        max([min_width, 1] + [len(line) for r in everything for line in r[i]])
        for i in range(len(headers))
    ]
    total = sum(widths) + 3 * len(widths) + 1

    def rule(left: str, fill: str, mid: str, right: str) -> str:
        return left + mid.join(fill * (w + 2) for w in widths) + right

    def block(row: list[list[str]], edge: str, justify: list[str] = justify) -> list[str]:
        height = max(len(c) for c in row)
        out = []
        for k in range(height):
            parts = []
            for c, w, j in zip(row, widths, justify):
                text = c[k] if k < len(c) else ""
                text = {"right": text.rjust, "center": text.center}.get(j, text.ljust)(w)
                parts.append(f" {text} ")
            out.append(edge + edge.join(parts) + edge)
        return out

    lines = [title.center(total).rstrip()] if title else []
    if show_header:
        lines += [rule("┏", "━", "┳", "┓"), *block(everything[0], "┃")]
        lines.append(rule("┡", "━", "╇", "┩"))
    else:
        lines.append(rule("┌", "─", "┬", "┐"))
    for i, row in enumerate(cells):
        if i and show_lines:
            lines.append(rule("├", "─", "┼", "┤"))
        lines += block(row, "│")
    if footer:
        lines.append(rule("├", "─", "┼", "┤"))
        lines += block(everything[-1], "│", footer_justify)
    lines.append(rule("└", "─", "┴", "┘"))
    if caption:
        for part in caption.split("\n"):
            lines.append(part.center(total).rstrip())
    return "\n".join(lines)


def _variable_cell(m: Module, var_type: type, stats: dict) -> str:
    """The cell of module ``m`` in a variable type's column: its own variables of that
    type (``name: dtype[shape]``, or the value and metadata when it has any), then the
    count and bytes of all such variables under ``m``."""
    attrs: dict[str, Any] = {}
    for name, v in m._graph_items():
        if not isinstance(v, Variable) or _type_key(v) is not var_type:
            continue
        value = v.raw_value
        value_repr = _leaf_repr(value) if hasattr(value, "shape") and hasattr(value, "dtype") else ""
        meta = v.get_metadata()
        if isinstance(v, RngState):
            meta.pop("tag", None)  # every random-stream variable has one
        if meta:
            attrs[str(name)] = {"value": value_repr, **{k: _leaf_repr(x) for k, x in meta.items()}}
        elif value_repr:
            attrs[str(name)] = value_repr
    cell = _cell(attrs) + "\n\n" if attrs else ""
    if var_type in stats:
        cell += _size_repr(stats[var_type])
    return cell


def _stats(m: Module) -> dict[type, tuple[int, int]]:
    """``{column type: (count, bytes)}`` of every variable under ``m``."""
    groups: dict[type, list] = {}
    for v in flat(m).variables:
        groups.setdefault(_type_key(v), []).append(v)
    return {t: _size_bytes(vs) for t, vs in groups.items()}


def tabulate(
    obj: Module,
    *input_args: Any,
    depth: int | None = None,
    method: str = "__call__",
    row_filter: Callable[[CallInfo], bool] = filter_rng_streams,
    table_kwargs: Mapping[str, Any] = MappingProxyType({}),
    column_kwargs: Mapping[str, Any] = MappingProxyType({}),
    console_kwargs: Mapping[str, Any] = MappingProxyType({}),
    compute_flops: bool = False,
    compute_vjp_flops: bool = False,
    **input_kwargs: Any,
) -> str:
    """A table of the calls ``obj.<method>(*input_args, **input_kwargs)`` makes.

    One row per call of a module's method (``__call__`` and public methods; a method
    called twice with the same input shapes is listed once), in call order: the module's
    path (plus the method name unless it is ``__call__``), its class, the inputs and
    outputs as ``dtype[shape]``, optionally XLA's FLOP estimates, and one column per
    variable type (random-stream variables together as ``RngState``): the module's own
    variables and the count and bytes of all such variables under it. A footer gives the
    model's totals per type and a caption the grand total (bytes in decimal units).

    The run is abstract (``jax.eval_shape`` on a clone): nothing is computed and ``obj``
    is not changed; each method body is traced once.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> print(nn.tabulate(nn.Linear(2, 3, rngs=nn.Rngs(0)), jnp.ones((1, 2))))
                                Linear Summary
    ┏━━━━━━┳━━━━━━━━┳━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━┓
    ┃ path ┃ type   ┃ inputs       ┃ outputs      ┃ Param                ┃
    ┡━━━━━━╇━━━━━━━━╇━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━┩
    │      │ Linear │ float32[1,2] │ float32[1,3] │ kernel: float32[2,3] │
    │      │        │              │              │ bias: float32[3]     │
    │      │        │              │              │                      │
    │      │        │              │              │ 9 (36 B)             │
    ├──────┼────────┼──────────────┼──────────────┼──────────────────────┤
    │      │        │              │        Total │ 9 (36 B)             │
    └──────┴────────┴──────────────┴──────────────┴──────────────────────┘
    <BLANKLINE>
                          Total Parameters: 9 (36 B)

    Args:
      obj: the model (a Module).
      input_args: the call's positional inputs (arrays or ``jax.ShapeDtypeStruct``).
      depth: list only calls at most this many path parts deep (None: all).
      method: the method of ``obj`` to call.
      row_filter: keeps a row when it returns True (default: all but ``RngStream`` calls).
      table_kwargs: ``title``, ``caption``, ``show_header``, ``show_lines``, ``show_footer``.
      column_kwargs: ``justify`` (``"left"``, ``"right"``, ``"center"``) and ``min_width``
        of every column.
      console_kwargs: Flax's ``rich`` console options (``width``, ``no_color``,
        ``force_terminal``...), accepted and without effect: the table is plain text,
        never coloured nor wrapped.
      compute_flops: add a ``flops`` column (XLA's cost analysis of each call).
      compute_vjp_flops: add a ``vjp_flops`` column (the same for each call's VJP).
      input_kwargs: the call's keyword arguments.

    Raises:
      TypeError: ``obj`` is not a Module.
      AttributeError: ``obj`` has no method ``method``.
      ValueError: an option this table does not support.
    """
    if not isinstance(obj, Module):
        raise TypeError(f"tabulate: expected a Module, got {type(obj).__name__}")
    _check_keys("table_kwargs", table_kwargs, _TABLE_KEYS)
    _check_keys("column_kwargs", column_kwargs, _COLUMN_KEYS)
    _check_keys("console_kwargs", console_kwargs, _CONSOLE_KEYS)
    model = cast(Module, clone(obj))
    rec = _Recorder(compute_flops, compute_vjp_flops)
    _record(model, method, input_args, input_kwargs, rec)
    rows = sorted(rec.rows, key=lambda r: r.call_order)
    rows = [r for r in rows if (depth is None or len(r.path) <= depth) and row_filter(r)]
    return _table(model, rows, compute_flops, compute_vjp_flops, table_kwargs, column_kwargs)


def _table(model: Module, rows: list[CallInfo], flops: bool, vjp_flops: bool,
           table_kwargs: Mapping[str, Any], column_kwargs: Mapping[str, Any]) -> str:
    modules = dict(iter_modules(model))
    totals = _stats(model)
    var_types = sorted(totals, key=lambda t: t.__name__)
    headers = ["path", "type", "inputs", "outputs"]
    headers += ["flops"] * flops + ["vjp_flops"] * vjp_flops
    headers += [t.__name__ for t in var_types]
    body = []
    for r in rows:
        m = cast(Module, modules[r.module_path])
        stats = _stats(m)
        cells = ["/".join(r.path), r.type.__name__, r.inputs_repr, _cell(r.outputs)]
        cells += [str(r.flops)] * flops + [str(r.vjp_flops)] * vjp_flops
        cells += [_variable_cell(m, t, stats) for t in var_types]
        body.append(cells)
    n_info = 4 + flops + vjp_flops
    footer = [""] * (n_info - 1) + ["Total"] + [_size_repr(totals[t]) for t in var_types]
    count, size = map(sum, zip((0, 0), *totals.values()))
    grand = (count, size)
    justify = [column_kwargs.get("justify", "left")] * len(headers)
    return _draw(
        headers, body, footer if table_kwargs.get("show_footer", True) else None,
        title=table_kwargs.get("title", f"{type(model).__name__} Summary"),
        caption=table_kwargs.get("caption", f"\nTotal Parameters: {_size_repr(grand)}"),
        show_header=table_kwargs.get("show_header", True),
        show_lines=table_kwargs.get("show_lines", True),
        justify=justify,
        footer_justify=[j if i != n_info - 1 else "right" for i, j in enumerate(justify)],
        min_width=int(column_kwargs.get("min_width", 0)),
    )
