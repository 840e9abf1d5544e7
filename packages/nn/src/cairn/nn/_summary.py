"""Display: readable reprs of modules and states, and ``tabulate``."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from cairn.nn._variables import Variable

_MAX_DEPTH = 12


def _count_bytes(variables) -> tuple[int, int]:
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
            except TypeError:  # PRNG key dtypes
                b += size * 8
    return n, b


def _fmt_bytes(b: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if b < 1024 or unit == "GB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return f"{b} B"  # pragma: no cover


def module_repr(m, indent: int = 0, depth: int = 0) -> str:
    from cairn.nn._module import List, Module

    pad = "  " * (indent + 1)
    name = type(m).__name__
    if depth > _MAX_DEPTH:
        return f"{name}(...)"
    state_lines, config_lines = [], []
    for k, v in m._graph_items():
        key = f"{k}: " if isinstance(m, List) else f"{k}="
        if isinstance(v, Module):
            state_lines.append(f"{pad}{key}{module_repr(v, indent + 1, depth + 1)},")
        elif isinstance(v, Variable):
            state_lines.append(f"{pad}{key}{v!r},")
        else:
            r = _static_repr(v)
            if len(r) > 80:
                r = r[:77] + "..."
            config_lines.append(f"{pad}{key}{r},")
    lines = state_lines + config_lines
    if not lines:
        return f"{name}()"
    return f"{name}(\n" + "\n".join(lines) + "\n" + "  " * indent + ")"


def _static_repr(v) -> str:
    if isinstance(v, type):
        return v.__name__
    if callable(v) and hasattr(v, "__qualname__"):
        mod = getattr(v, "__module__", "") or ""
        name = v.__qualname__.replace(".<locals>", "")
        return f"{mod.split('.')[0]}.{name}" if mod.startswith(("jax", "numpy")) else name
    return repr(v)


def state_repr(s) -> str:
    from cairn.nn._filters import path_str

    if not s._flat:
        return "State({})"
    lines = [f"  {path_str(p)!r}: {v!r}," for p, v in s._flat.items()]
    return "State({\n" + "\n".join(lines) + "\n})"


def tabulate(model, *inputs: Any, method: str = "__call__", **kwargs: Any) -> str:
    """A table of every module in ``model``: path, class, output shapes of its call on
    ``inputs`` (computed abstractly with ``jax.eval_shape``: nothing runs), parameter
    counts and bytes of its own variables, plus totals.

    ``inputs`` may be arrays or ``jax.ShapeDtypeStruct``. Modules that are not called
    show an empty output column.
    """
    from cairn.nn._graph import flat, iter_modules
    from cairn.nn._module import Module
    from cairn.nn._transforms import eval_shape

    if not isinstance(model, Module):
        raise TypeError(f"tabulate: expected a Module, got {type(model).__name__}")
    outputs: dict[int, Any] = {}
    classes = {type(m) for _, m in iter_modules(model)}
    originals = {}

    def wrap(cls, orig):
        def recorded(self, *a, **kw):
            out = orig(self, *a, **kw)
            outputs.setdefault(self.__dict__.get("_cairn_tab_id", id(self)), out)
            return out

        return recorded

    def run(m, *a, **kw):
        for path, sub in iter_modules(m):
            object.__setattr__(sub, "_cairn_tab_id", path)
        return getattr(m, method)(*a, **kw)

    for cls in classes:
        if "__call__" in cls.__dict__:
            originals[cls] = cls.__dict__["__call__"]
            cls.__call__ = wrap(cls, originals[cls])
    try:
        if inputs or kwargs:
            eval_shape(run, model, *inputs, **kwargs)
    finally:
        for cls, orig in originals.items():
            cls.__call__ = orig

    def shape_str(out) -> str:
        leaves = jax.tree_util.tree_leaves(out)
        parts = [
            f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}"
            for x in leaves[:4]
        ]
        if len(leaves) > 4:
            parts.append("...")
        return ", ".join(parts)

    rows = [("path", "module", "outputs", "params", "other vars", "bytes")]
    from cairn.nn._variables import Param

    for path, m in iter_modules(model):
        own = [v for _, v in m._graph_items() if isinstance(v, Variable)]
        p_n, p_b = _count_bytes([v for v in own if isinstance(v, Param)])
        o_n, o_b = _count_bytes([v for v in own if not isinstance(v, Param)])
        out = outputs.get(path)
        rows.append(
            (
                path or "<root>",
                type(m).__name__,
                shape_str(out) if out is not None else "",
                f"{p_n:,}" if p_n else "",
                f"{o_n:,}" if o_n else "",
                _fmt_bytes(p_b + o_b) if p_b + o_b else "",
            )
        )
    allvars = flat(model).variables
    tp_n, tp_b = _count_bytes([v for v in allvars if isinstance(v, Param)])
    to_n, to_b = _count_bytes([v for v in allvars if not isinstance(v, Param)])
    rows.append(("total", "", "", f"{tp_n:,}", f"{to_n:,}", _fmt_bytes(tp_b + to_b)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    sep = "+".join("-" * (w + 2) for w in widths)
    out_lines = []
    for i, r in enumerate(rows):
        out_lines.append("|".join(f" {c:<{w}} " for c, w in zip(r, widths)))
        if i == 0 or i == len(rows) - 2:
            out_lines.append(sep)
    return "\n".join(out_lines)
