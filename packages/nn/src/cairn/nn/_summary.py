"""``tabulate``: a table of a model's modules, output shapes and parameter counts.

(The reprs of modules and states live beside their classes, in ``_module`` and
``_state``.)
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from cairn.nn._graph import flat, iter_modules
from cairn.nn._jit import eval_shape
from cairn.nn._module import Module
from cairn.nn._variables import Param, Variable


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


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if b < 1024 or unit == "GB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return f"{b} B"  # pragma: no cover


def tabulate(model: Module, *inputs: Any, method: str = "__call__", **kwargs: Any) -> str:
    """A table of every module in ``model``: path, class, output shapes of its call on
    ``inputs`` (computed abstractly with ``jax.eval_shape``: nothing runs), parameter
    counts and bytes of its own variables, plus totals.

    ``inputs`` may be arrays or ``jax.ShapeDtypeStruct``. Modules that are not called
    show an empty output column.

    Args:
      model: the module.
      inputs: the call's positional inputs (arrays or ``jax.ShapeDtypeStruct``).
      method: the method to call.
      kwargs: the call's keyword arguments.

    Raises:
      TypeError: ``model`` is not a Module.
    """
    if not isinstance(model, Module):
        raise TypeError(f"tabulate: expected a Module, got {type(model).__name__}")
    outputs = _record_outputs(model, inputs, method, kwargs)
    rows: list[tuple[str, ...]] = [("path", "module", "outputs", "params", "other vars", "bytes")]
    for path, m in iter_modules(model):
        own = [v for _, v in m._graph_items() if isinstance(v, Variable)]
        out = outputs.get(path)
        rows.append(
            (
                path or "<root>",
                type(m).__name__,
                _shape_str(out) if out is not None else "",
                *_counts(own, total=False),
            )
        )
    rows.append(("total", "", "", *_counts(flat(model).variables, total=True)))
    return _format_table(rows)


def _record_outputs(model: Module, inputs: tuple, method: str, kwargs: dict) -> dict:
    """``{path: output}`` of every module called when ``model.<method>(*inputs)`` runs
    under ``jax.eval_shape`` (nothing when there are no inputs)."""
    outputs: dict[Any, Any] = {}
    classes = {type(m) for _, m in iter_modules(model)}
    originals = {}

    def wrap(orig):
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
            cls.__call__ = wrap(originals[cls])  # type: ignore[method-assign]
    try:
        if inputs or kwargs:
            eval_shape(run, model, *inputs, **kwargs)
    finally:
        for cls, orig in originals.items():
            cls.__call__ = orig  # type: ignore[method-assign]
    return outputs


def _shape_str(out: Any) -> str:
    leaves = jax.tree_util.tree_leaves(out)
    parts = [
        f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}"
        for x in leaves[:4]
    ]
    if len(leaves) > 4:
        parts.append("...")
    return ", ".join(parts)


def _counts(variables: list, total: bool) -> tuple[str, str, str]:
    """The params, other-variables and bytes columns for ``variables`` (a total row
    shows zeros; a module row leaves them empty)."""
    p_n, p_b = _count_bytes([v for v in variables if isinstance(v, Param)])
    o_n, o_b = _count_bytes([v for v in variables if not isinstance(v, Param)])
    if total:
        return f"{p_n:,}", f"{o_n:,}", _fmt_bytes(p_b + o_b)
    return (
        f"{p_n:,}" if p_n else "",
        f"{o_n:,}" if o_n else "",
        _fmt_bytes(p_b + o_b) if p_b + o_b else "",
    )


def _format_table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    sep = "+".join("-" * (w + 2) for w in widths)
    out_lines = []
    for i, r in enumerate(rows):
        out_lines.append("|".join(f" {c:<{w}} " for c, w in zip(r, widths)))
        if i == 0 or i == len(rows) - 2:
            out_lines.append(sep)
    return "\n".join(out_lines)
