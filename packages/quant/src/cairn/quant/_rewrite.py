"""Re-evaluate a traced program, handing every dot whose operand is a weight to a handler.

The program (a jaxpr) is evaluated equation by equation inside the caller's trace. An
input leaf that is a weight enters as a :class:`WeightRef` (its path and value); view
operations on it (convert, transpose, reshape, broadcast, slicing, copies) are recorded
on the reference instead of being run, so that when the reference reaches a
``dot_general``, ``conv_general_dilated`` or ``ragged_dot_general`` the handler knows
exactly which weight the operand is, and in which layout. Any other use materializes
the weight (``value`` with the views applied) and runs the equation as traced.
Sub-programs of ``jit``, ``remat``, ``cond``, ``while``, ``scan``, ``shard_map`` and
``custom_jvp``/``custom_vjp`` calls are descended into and rebuilt around the rewritten
body. A custom derivative rule keeps its meaning: a ``custom_vjp`` call is rebuilt as a
``custom_vjp`` whose forward is the user's ``fwd`` rewritten like the body (so its primal
output is the quantized one and its residuals are what the quantized forward computed)
and whose backward is the user's ``bwd`` as written, on those residuals; a ``custom_jvp``
call is rebuilt as a ``custom_jvp`` whose primal is the rewritten body and whose tangent
is the user's ``jvp`` rule as written, on the call's inputs. A weight's cotangent or
tangent is carried through its recorded views (the chain rule of ``materialize``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from cairn.core_array import QArray, QuantLayout

__all__ = ["WeightRef", "DotSite", "Interpreter", "materialize", "bind_as_traced"]

VIEW_PRIMITIVES = frozenset(
    {
        "convert_element_type",
        "transpose",
        "reshape",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "slice",
        "dynamic_slice",
        "rev",
        "copy",
        "copy_p",
        "pvary",
    }
)
# views that keep every element where it is (a block of the view is the same block of the input)
_ELEMENTWISE_VIEWS = frozenset({"convert_element_type", "copy", "copy_p", "pvary"})
DOT_KINDS = {
    "dot_general": "dot_general",
    "conv_general_dilated": "conv_general_dilated",
    "ragged_dot_general": "ragged_dot",
    "ragged_dot": "ragged_dot",
}
_TRANSFORM_SCOPE = re.compile(r"^[\w.]+\(.*\)$")


@dataclasses.dataclass(frozen=True)
class WeightRef:
    """A weight flowing through the program: its leaf ``path``, ``value`` (an array or a
    ``QArray``), the view operations applied so far (``(primitive, params, extra_args)``),
    the path of the ``module`` it belongs to (``None``: the path minus its last component)
    and the path of the variable holding it (``None``: the leaf path; see :attr:`name`)."""

    path: str
    value: Any
    views: tuple[tuple[Any, dict, tuple], ...] = ()
    module: str | None = None
    variable_path: str | None = None

    @property
    def name(self) -> str:
        """The weight's name: its variable's path (``a/kernel`` for NNX's leaf ``a/kernel/value``).
        The weight plan, LoRA adapters and input scales are keyed by it."""
        return self.path if self.variable_path is None else self.variable_path

    @property
    def module_path(self) -> str:
        """The path of the module holding the weight (Qwix's meaning of a module path)."""
        return self.path.rpartition("/")[0] if self.module is None else self.module

    def materialize(self) -> Any:
        """The float operand the program would have computed (a ``QArray`` is dequantized)."""
        x = self.value.dequantize() if isinstance(self.value, QArray) else self.value
        for prim, params, extra in self.views:
            x = prim.bind(x, *extra, **params)
        return x

    def with_view(self, prim: Any, params: dict, extra: tuple) -> WeightRef:
        return dataclasses.replace(self, views=(*self.views, (prim, dict(params), tuple(extra))))


def materialize(x: Any) -> Any:
    """``x`` itself, or a :class:`WeightRef`'s materialized value."""
    return x.materialize() if isinstance(x, WeightRef) else x


@dataclasses.dataclass(frozen=True)
class DotSite:
    """One dot as the handler sees it.

    ``kind`` is ``dot_general``, ``einsum``, ``conv_general_dilated`` or ``ragged_dot``;
    ``module_path`` is the first weight operand's module path, or, for a dot between
    activations, the ``jax.named_scope`` path it was traced under; ``index`` counts the
    ops of this kind in that module in program order; ``eqn`` is the traced equation;
    ``weight_sides`` the operand positions (0, 1) that are weights.
    """

    kind: str
    module_path: str
    index: int
    eqn: Any
    weight_sides: tuple[int, ...] = ()

    @property
    def params(self) -> dict:
        return self.eqn.params


Handler = Callable[[DotSite, list], "list | None"]


def _scope(eqn: Any) -> tuple[str, bool]:
    """(module scope, is_einsum) from the equation's name stack."""
    parts = [p for p in str(eqn.source_info.name_stack).split("/") if p and not _TRANSFORM_SCOPE.match(p)]
    einsum = bool(parts) and "->" in parts[-1]
    if einsum:
        parts = parts[:-1]
    return "/".join(parts), einsum


@contextlib.contextmanager
def _eqn_context(eqn: Any) -> Iterator[None]:
    """Keep the traced equation's source location and name scope on what we emit."""
    ctx: Any
    try:
        from jax._src import source_info_util as siu

        stack = siu.current_name_stack() + eqn.source_info.name_stack
        ctx = siu.user_context(eqn.source_info.traceback, name_stack=stack)
    except Exception:  # pragma: no cover - a JAX without these internals still works
        ctx = contextlib.nullcontext()
    with ctx, eqn.ctx.manager:
        yield


def bind_as_traced(eqn: Any, invals: Sequence[Any]) -> list:
    """Run ``eqn``'s primitive with its traced parameters on ``invals`` (always a list out)."""
    got = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = got if isinstance(got, tuple) else ((), got)  # JAX < 0.7 returned a pair
    out = eqn.primitive.bind(*subfuns, *[materialize(x) for x in invals], **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _split_refs(values: Sequence[Any]) -> tuple[list[Any], Callable[[Sequence[Any]], list[Any]]]:
    """(the non-weight values, merge(arrays) -> values with the weights put back)."""
    is_ref = [isinstance(v, WeightRef) for v in values]
    arrays = [v for v, r in zip(values, is_ref) if not r]

    def merge(new_arrays: Sequence[Any]) -> list[Any]:
        it = iter(new_arrays)
        return [v if r else next(it) for v, r in zip(values, is_ref)]

    return arrays, merge


class Interpreter:
    """Evaluates jaxprs, routing dots to ``handler(site, invals)`` (``None``: run as traced).

    With ``activation_dots=True`` the handler also sees dots with no weight operand.
    ``on_opaque(eqn, refs)`` is told of every primitive that carries a sub-program this
    interpreter does not enter (``pmap``, ``pallas_call``, ...) and receives weights ``refs``
    (which it then gets materialized).
    """

    def __init__(self, handler: Handler, *, activation_dots: bool = False, on_opaque: Callable[[Any, list], None] | None = None) -> None:
        self.handler = handler
        self.activation_dots = activation_dots
        self.on_opaque = on_opaque
        self._counters: dict[tuple[str, str], int] = {}

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list:
        """Evaluate ``jaxpr`` on ``consts`` and ``args``; returns its outputs (weights materialized
        only where a consumer needs them, so an output may be a :class:`WeightRef`)."""
        from jax.extend.core import Literal

        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, Literal) else env[v]

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            with _eqn_context(eqn):
                outvals = self._eqn(eqn, invals)
            for v, x in zip(eqn.outvars, outvals):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def run_closed(self, closed: Any, args: Sequence[Any]) -> list:
        return self.run(closed.jaxpr, closed.consts, args)

    def _eqn(self, eqn: Any, invals: list) -> list:
        name = eqn.primitive.name
        has_ref = any(isinstance(x, WeightRef) for x in invals)
        if name in DOT_KINDS and (has_ref or self.activation_dots):
            out = self.handler(self._site(eqn, invals), invals)
            if out is not None:
                return out
            return bind_as_traced(eqn, invals)
        if not has_ref:
            return bind_as_traced(eqn, invals)
        if name in VIEW_PRIMITIVES and isinstance(invals[0], WeightRef):
            extra = [materialize(x) for x in invals[1:]]
            return [invals[0].with_view(eqn.primitive, eqn.params, tuple(extra))]
        rebuild = _SUBPROGRAMS.get(name)
        if rebuild is not None:
            return rebuild(self, eqn, invals)
        if self.on_opaque is not None and _has_subprogram(eqn):
            self.on_opaque(eqn, [x for x in invals if isinstance(x, WeightRef)])
        return bind_as_traced(eqn, invals)

    def _site(self, eqn: Any, invals: list) -> DotSite:
        scope, einsum = _scope(eqn)
        refs = [x for x in invals[:2] if isinstance(x, WeightRef)]
        module = refs[0].module_path if refs else scope
        kind = "einsum" if einsum and eqn.primitive.name == "dot_general" else DOT_KINDS[eqn.primitive.name]
        counter_kind = "dot_general" if kind == "einsum" else kind
        index = self._counters.get((module, counter_kind), 0)
        self._counters[(module, counter_kind)] = index + 1
        sides = tuple(i for i, x in enumerate(invals[:2]) if isinstance(x, WeightRef))
        return DotSite(kind, module, index, eqn, sides)


def _has_subprogram(eqn: Any) -> bool:
    from jax.extend.core import jaxprs_in_params

    return any(True for _ in jaxprs_in_params(eqn.params))


# --- sub-programs ---


def _inline(interp: Interpreter, eqn: Any, invals: list) -> list:
    closed = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
    if hasattr(closed, "consts"):
        return interp.run_closed(closed, invals)
    return interp.run(closed, (), invals)


def _remat(interp: Interpreter, eqn: Any, invals: list) -> list:
    import jax

    arrays, merge = _split_refs(invals)
    jaxpr = eqn.params["jaxpr"]

    def body(*new_arrays: Any) -> list:
        return [materialize(o) for o in interp.run(jaxpr, (), merge(new_arrays))]

    policy = eqn.params.get("policy")
    return list(jax.checkpoint(body, prevent_cse=eqn.params.get("prevent_cse", True), policy=policy)(*arrays))


def _cond(interp: Interpreter, eqn: Any, invals: list) -> list:
    import jax

    index, operands = materialize(invals[0]), invals[1:]
    arrays, merge = _split_refs(operands)

    def branch(closed: Any) -> Callable[..., list]:
        def run(*new_arrays: Any) -> list:
            return [materialize(o) for o in interp.run_closed(closed, merge(new_arrays))]

        return run

    return list(jax.lax.switch(index, [branch(b) for b in eqn.params["branches"]], *arrays))


def _while(interp: Interpreter, eqn: Any, invals: list) -> list:
    import jax

    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, carry = invals[:nc], invals[nc : nc + nb], [materialize(x) for x in invals[nc + nb :]]

    def cond_fn(c: Any) -> Any:
        return materialize(interp.run_closed(p["cond_jaxpr"], [*cconsts, *c])[0])

    def body_fn(c: Any) -> Any:
        return tuple(materialize(o) for o in interp.run_closed(p["body_jaxpr"], [*bconsts, *c]))

    return list(jax.lax.while_loop(cond_fn, body_fn, tuple(carry)))


def _pack(values: Sequence[Any]) -> tuple[list[Any], Callable[[Sequence[Any]], list[Any]], list[tuple[int, int]]]:
    """Every array ``values`` hold (a weight: its value's leaves and its views' extra operands),
    ``unpack(arrays)`` -> the values rebuilt from such arrays, and each value's span in them.

    A transformation that must see every array as an argument (``custom_vjp``,
    ``custom_jvp``, ``shard_map``) passes the arrays and rebuilds the weights inside."""
    import jax

    leaves: list[Any] = []
    specs: list[tuple[WeightRef | None, Any, int]] = []
    spans: list[tuple[int, int]] = []
    for v in values:
        if isinstance(v, WeightRef):
            parts, td = jax.tree_util.tree_flatten([v.value, [list(extra) for _, _, extra in v.views]])
        else:
            parts, td = [v], None
        spans.append((len(leaves), len(leaves) + len(parts)))
        specs.append((v if td is not None else None, td, len(parts)))
        leaves += parts

    def unpack(arrays: Sequence[Any]) -> list[Any]:
        it, out = iter(arrays), []
        for ref, td, n in specs:
            chunk = [next(it) for _ in range(n)]
            if ref is None:
                out.append(chunk[0])
                continue
            value, extras = jax.tree_util.tree_unflatten(td, chunk)
            views = tuple((prim, params, tuple(e)) for (prim, params, _), e in zip(ref.views, extras))
            out.append(dataclasses.replace(ref, value=value, views=views))
        return out

    return leaves, unpack, spans


class _SubRuns:
    """Runs of one equation's sub-programs that may happen later than the equation (JAX calls a
    ``custom_vjp``'s forward when it differentiates, possibly after the whole program was
    interpreted): each starts from the op counters as they were at the equation, so a dot
    keeps its index (and its rule) whichever run sees it; the first run's counters continue."""

    def __init__(self, interp: Interpreter) -> None:
        self.interp = interp
        self.start = dict(interp._counters)
        self.after: dict | None = None

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list:
        interp = self.interp
        outer, interp._counters = interp._counters, dict(self.start)
        try:
            outs = [materialize(o) for o in interp.run(jaxpr, consts, args)]
        finally:
            ran, interp._counters = interp._counters, outer
        if self.after is None:
            self.after = ran
        return outs

    def finish(self) -> None:
        if self.after is not None:
            self.interp._counters = self.after


def _zero_tangent(x: Any) -> Any:
    import jax
    import numpy as np

    dtype = jax.dtypes.result_type(x)
    if jax.dtypes.issubdtype(dtype, np.inexact):
        return jax.numpy.zeros(np.shape(x), dtype)
    return np.zeros(np.shape(x), jax.dtypes.float0)


def _view_fn(unpack: Callable, spans: list[tuple[int, int]], arrays: list[Any], k: int) -> Callable[..., Any]:
    """``f(*arrays of value k) -> value k materialized`` (the others fixed): the chain rule of a
    weight's views."""
    lo, hi = spans[k]

    def f(*parts: Any) -> Any:
        full = list(arrays)
        full[lo:hi] = parts
        return materialize(unpack(full)[k])

    return f


def _custom_vjp(interp: Interpreter, eqn: Any, invals: list) -> list:
    """A ``custom_vjp`` call that receives a weight: the user's rule around the rewritten forward."""
    import jax

    p = eqn.params
    nconst = p["num_consts"]
    leaves, unpack, spans = _pack(invals)
    runs = _SubRuns(interp)
    closed = p["call_jaxpr"]

    def primal(*arrays: Any) -> list:
        return runs.run(closed.jaxpr, closed.consts, unpack(arrays))

    def fwd(*arrays: Any) -> tuple[list, tuple]:
        vals = unpack(arrays)
        prims = vals[nconst:]
        try:
            fwd_jaxpr, fwd_consts = p["fwd_jaxpr_thunk"].call_wrapped(*[True] * len(prims))
            outs = runs.run(fwd_jaxpr, fwd_consts, prims)
        except jax.errors.UnexpectedTracerError as e:
            name = getattr(closed.jaxpr.debug_info, "func_name", "?")
            raise ValueError(
                f"quantize: the custom_vjp function {name!r} closes over a traced array (a weight or a value "
                "computed from the arguments), so its fwd rule cannot be run again on the rewritten program "
                "(JAX cannot either, once the function is staged); pass that array as an argument of the "
                "function, or wrap it with jax.closure_convert"
            ) from e
        _, res_tree, forwarded = p["out_trees"]()
        n_res = res_tree.num_leaves - sum(f is not None for f in forwarded)
        it = iter(outs[:n_res])
        res = [next(it) if f is None else materialize(prims[f]) for f in forwarded]
        return outs[n_res:], (res, list(arrays))

    def bwd(saved: tuple, cts: list) -> tuple:
        res, arrays = saved
        cts_in = [None] * nconst + list(p["bwd"].call_wrapped(*res, *cts))
        return tuple(_pull_back(unpack, spans, arrays, cts_in))

    fn = jax.custom_vjp(primal)
    fn.defvjp(fwd, bwd)
    out = fn(*leaves)
    runs.finish()
    return list(out)


def _pull_back(unpack: Callable, spans: list[tuple[int, int]], arrays: list[Any], cts: list[Any]) -> list[Any]:
    """Cotangents of the packed arrays from the cotangents of the values they rebuild
    (``None``: zero; a weight's through the vjp of its materialization)."""
    import jax

    out: list[Any] = [None] * len(arrays)
    values = unpack(arrays)
    for k, ((lo, hi), value, ct) in enumerate(zip(spans, values, cts)):
        if ct is None or type(ct).__name__ in ("Zero", "SymbolicZero"):
            continue
        if not isinstance(value, WeightRef):
            out[lo] = ct
            continue
        _, vjp = jax.vjp(_view_fn(unpack, spans, arrays, k), *arrays[lo:hi])
        for i, g in enumerate(vjp(ct)):
            out[lo + i] = None if jax.dtypes.result_type(g) == jax.dtypes.float0 else g
    return out


def _custom_jvp(interp: Interpreter, eqn: Any, invals: list) -> list:
    """A ``custom_jvp`` call that receives a weight: the rewritten body, the user's tangent rule."""
    import jax
    from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

    p = eqn.params
    nconst = p["num_consts"]
    leaves, unpack, spans = _pack(invals)
    runs = _SubRuns(interp)
    closed = p["call_jaxpr"]

    @jax.custom_jvp
    def fn(*arrays: Any) -> list:
        return runs.run(closed.jaxpr, closed.consts, unpack(arrays))

    def fn_jvp(primals: tuple, tangents: tuple) -> tuple[list, list]:
        out = fn(*primals)
        mats, dots = _tangents_of_values(unpack, spans, list(primals), list(tangents))
        n_in = len(mats) - nconst
        jvp_jaxpr, jvp_consts, out_zeros = p["jvp_jaxpr_fun"].call_wrapped(*[False] * n_in)
        got = jaxpr_as_fun(ClosedJaxpr(jvp_jaxpr, jvp_consts))(*mats[nconst:], *dots[nconst:])
        it = iter(got[len(out_zeros) :])
        return out, [_zero_tangent(o) if z else next(it) for o, z in zip(out, out_zeros)]

    fn.defjvp(fn_jvp)
    out = fn(*leaves)
    runs.finish()
    return list(out)


def _tangents_of_values(unpack: Callable, spans: list[tuple[int, int]], arrays: list[Any], tangents: list[Any]) -> tuple[list, list]:
    """(the materialized values, their tangents): a weight's through the jvp of its materialization."""
    import jax

    values, dots = [], []
    for k, ((lo, hi), value) in enumerate(zip(spans, unpack(arrays))):
        if not isinstance(value, WeightRef):
            values.append(value)
            dots.append(tangents[lo])
            continue
        v, t = jax.jvp(_view_fn(unpack, spans, arrays, k), tuple(arrays[lo:hi]), tuple(tangents[lo:hi]))
        values.append(v)
        dots.append(t)
    return values, dots


class _Block:
    """A view marker: the weight is a device's block of a view the program does not keep
    (inside ``shard_map``, after a reshape or slice), so no leaf axes can be read from it."""

    name = "shard_map_block"

    @staticmethod
    def bind(x: Any) -> Any:
        return x


def _mesh_size(mesh: Any, entry: Any) -> int:
    names = entry if isinstance(entry, tuple) else (entry,)
    size = 1
    for n in names:
        size *= int(mesh.shape[n])
    return size


def _value_spec(ref: WeightRef, entries: list[Any]) -> list[Any] | None:
    """The partition of ``ref.value`` whose views give ``entries`` (``None``: not a block)."""
    entries = list(entries)
    for prim, params, _ in reversed(ref.views):
        if prim.name == "transpose":
            before: list[Any] = [None] * len(entries)
            for i, a in enumerate(params["permutation"]):
                before[a] = entries[i]
            entries = before
        elif prim.name not in _ELEMENTWISE_VIEWS:
            return None
    return entries


def _part_spec(shape: tuple[int, ...], logical: tuple[int, ...], entries: list[Any], mesh: Any) -> list[Any] | None:
    """The partition of one part of a weight (values, or scales with size 1 or a tile count
    on an axis) that gives each device the part of its own block (``None``: none does)."""
    if not shape:
        return []
    if len(shape) != len(logical):
        return None
    out = []
    for n, full, e in zip(shape, logical, entries):
        if e is None or n == full:
            out.append(e)
        elif n == 1:
            out.append(None)
        elif n % _mesh_size(mesh, e) == 0 and full % n == 0:
            out.append(e)  # a whole number of tiles per device
        else:
            return None
    return out


def _shard_input(v: Any, spec: Any, mesh: Any, shape: tuple[int, ...]) -> tuple[list[Any], list[Any], Callable[[list[Any]], Any]]:
    """(arrays, their partition specs, rebuild(blocks) -> the value inside the body) for one
    ``shard_map`` operand: a weight is passed as its value's parts, split like the operand."""
    import jax
    from jax.sharding import PartitionSpec

    if not isinstance(v, WeightRef):
        return [v], [spec], lambda parts: parts[0]
    entries = list(spec) + [None] * (len(shape) - len(spec))
    value = v.value.unpack() if isinstance(v.value, QArray) else v.value
    value_entries = _value_spec(v, entries)
    ref = dataclasses.replace(v, value=value)
    leaves, unpack, _ = _pack([ref])
    n_value = len(jax.tree_util.tree_leaves(value))
    specs: list[Any] = []
    if value_entries is not None:
        for leaf in leaves[:n_value]:
            part = _part_spec(tuple(leaf.shape), tuple(value.shape), value_entries, mesh)
            if part is None:
                break
            specs.append(PartitionSpec(*part))
    if value_entries is None or len(specs) < n_value:
        # not a block of the leaf: the device's block of the materialized weight, quantized on the fly
        return [v.materialize()], [spec], lambda parts: dataclasses.replace(v, value=parts[0], views=((_Block(), {}, ()),))
    specs += [PartitionSpec()] * (len(leaves) - n_value)
    return leaves, specs, lambda parts: unpack(parts)[0]


def _shard_map(interp: Interpreter, eqn: Any, invals: list) -> list:
    """A ``shard_map`` whose body receives a weight: the body rewritten, the weight split like
    the operand it was (its value, or a stored ``QArray``'s values and scales)."""
    import jax

    p = eqn.params
    arrays: list[Any] = []
    specs: list[Any] = []
    rebuilds: list[tuple[int, Callable[[list[Any]], Any]]] = []
    for v, spec, var in zip(invals, p["in_specs"], eqn.invars):
        parts, part_specs, rebuild = _shard_input(v, spec, p["mesh"], tuple(var.aval.shape))
        arrays += parts
        specs += part_specs
        rebuilds.append((len(parts), rebuild))

    def body(*blocks: Any) -> tuple:
        it = iter(blocks)
        vals = [rebuild([next(it) for _ in range(n)]) for n, rebuild in rebuilds]
        return tuple(materialize(o) for o in interp.run(p["jaxpr"], (), vals))

    run = jax.shard_map(
        body, mesh=p["mesh"], in_specs=tuple(specs), out_specs=tuple(p["out_specs"]),
        axis_names=frozenset(p["newly_manual_axes"]), check_vma=p["check_vma"],
    )
    return list(run(*arrays))


def _sliced_layout(layout: QuantLayout) -> QuantLayout | None:
    """The layout of one slice along axis 0 (``None`` when axis 0 is a tiled axis)."""
    if layout.kind == "per_tensor":
        return layout
    if layout.kind == "per_tile":
        return None if 0 in layout.axes else QuantLayout.per_tile(tuple(a - 1 for a in layout.axes), layout.tile_sizes)
    axes = [a - 1 for a in layout.axes if a != 0]
    return QuantLayout.per_channel(*axes) if axes else QuantLayout.per_tensor()


def _scan_input(x: Any, length: int) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """Arrays to scan over for one ``xs`` entry, and how to rebuild the entry per step."""
    if not isinstance(x, WeightRef) or x.views:
        return [materialize(x)], lambda parts: parts[0]
    v = x.value
    if not isinstance(v, QArray):
        return [v], lambda parts, _x=x: dataclasses.replace(_x, value=parts[0])
    v = v.unpack()
    layout = _sliced_layout(v.layout)
    if layout is None:
        return [x.materialize()], lambda parts: parts[0]
    import jax.numpy as jnp

    children = [v.qvalue, v.scale] + ([] if v.zero_point is None else [v.zero_point])
    children = [c if c.shape[:1] == (length,) else jnp.broadcast_to(c, (length, *c.shape[1:])) for c in children]

    def rebuild(parts: list[Any], _x: WeightRef = x, _v: QArray = v) -> WeightRef:
        zp = parts[2] if len(parts) > 2 else None
        q = QArray(parts[0], parts[1], zp, qtype=_v.qtype, layout=layout, dtype=_v.dtype)
        return dataclasses.replace(_x, value=q)

    return children, rebuild


def _scan(interp: Interpreter, eqn: Any, invals: list) -> list:
    import jax

    p = eqn.params
    nconst, ncarry = p["num_consts"], p["num_carry"]
    consts = invals[:nconst]
    carry = [materialize(x) for x in invals[nconst : nconst + ncarry]]
    parts = [_scan_input(x, p["length"]) for x in invals[nconst + ncarry :]]
    sizes = [len(arrays) for arrays, _ in parts]
    xs = [a for arrays, _ in parts for a in arrays]

    def body(c: tuple, x: tuple) -> tuple[tuple, tuple]:
        it, per_step = iter(x), []
        for size, (_, rebuild) in zip(sizes, parts):
            per_step.append(rebuild([next(it) for _ in range(size)]))
        outs = [materialize(o) for o in interp.run_closed(p["jaxpr"], [*consts, *c, *per_step])]
        return tuple(outs[:ncarry]), tuple(outs[ncarry:])

    carry_out, ys = jax.lax.scan(
        body, tuple(carry), tuple(xs), length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
    )
    return [*carry_out, *ys]


_SUBPROGRAMS: dict[str, Callable[[Interpreter, Any, list], list]] = {
    "jit": _inline,
    "pjit": _inline,
    "closed_call": _inline,
    "core_call": _inline,
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
    "shard_map": _shard_map,
    "remat2": _remat,
    "checkpoint": _remat,
    "cond": _cond,
    "while": _while,
    "scan": _scan,
}
