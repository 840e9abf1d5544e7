"""``quantize``, ``quantize_params`` and ``calibrate``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from cairn.core_array import QArray, path_of
from cairn.quant._providers import QuantizationProvider
from cairn.quant._qtypes import required
from cairn.quant._replay import Trace, TraceCache, compiled_replay, concrete
from cairn.quant._rewrite import Interpreter, WeightRef, materialize
from cairn.quant._weights import WeightFilter, leaf_names, weight_leaves

__all__ = ["quantize", "quantize_params", "calibrate"]


def _is_q(x: Any) -> bool:
    return isinstance(x, QArray)


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _abstract(x: Any) -> Any:
    """The float shape and dtype ``fn`` is traced with (a ``QArray``'s logical ones)."""
    import jax

    return jax.ShapeDtypeStruct(x.shape, x.dtype)


class _Flat:
    """The call's leaves: weights (with their paths) first, then the other array leaves;
    non-array leaves are static and part of the trace key."""

    def __init__(self, args: tuple, kwargs: dict, weight_argnums: Sequence[int], weight_filter: WeightFilter | None = None) -> None:
        import jax

        self.treedef_args = []
        self.weight_paths: list[str] = []
        self.weight_modules: list[str] = []
        self.weight_names: list[str] = []
        leaves: list[Any] = []
        kinds: list[str] = []
        for i, a in enumerate(args):
            with_path, td = jax.tree_util.tree_flatten_with_path(a, is_leaf=_is_q)
            self.treedef_args.append(td)
            chosen = None
            if i in weight_argnums:  # per leaf: (path, module path) when it is a weight
                chosen = weight_leaves(a, with_path, td, weight_filter, i if len(weight_argnums) > 1 else None)
            for n, (_, leaf) in enumerate(with_path):
                picked = None if chosen is None else chosen[n]
                if picked is not None and (_is_array(leaf) or _is_q(leaf)):
                    self.weight_paths.append(picked[0])
                    self.weight_modules.append(picked[1])
                    self.weight_names.append(picked[2])
                    kinds.append("w")
                else:
                    kinds.append("a" if _is_array(leaf) else "s")
                leaves.append(leaf)
        kw_leaves, self.treedef_kw = jax.tree_util.tree_flatten(kwargs)
        leaves += kw_leaves
        kinds += ["a" if _is_array(x) else "s" for x in kw_leaves]
        self.leaves, self.kinds = leaves, kinds
        self.sizes = [len(jax.tree_util.tree_leaves(a, is_leaf=_is_q)) for a in args]

    def key(self) -> tuple:
        parts: list[tuple] = []
        for leaf, kind in zip(self.leaves, self.kinds):
            if kind == "s":
                parts.append(("s", leaf if _hashable(leaf) else id(leaf)))
            else:
                a = _abstract(leaf)
                parts.append((kind, a.shape, str(a.dtype)))
        return (tuple(self.treedef_args), self.treedef_kw, tuple(parts))

    def dynamic(self) -> list[Any]:
        return [x for x, k in zip(self.leaves, self.kinds) if k != "s"]

    def rebuild(self, dynamic: Sequence[Any]) -> tuple[tuple, dict]:
        import jax

        it = iter(dynamic)
        leaves = [next(it) if k != "s" else x for x, k in zip(self.leaves, self.kinds)]
        args, pos = [], 0
        for td, n in zip(self.treedef_args, self.sizes):
            args.append(jax.tree_util.tree_unflatten(td, leaves[pos : pos + n]))
            pos += n
        return tuple(args), jax.tree_util.tree_unflatten(self.treedef_kw, leaves[pos:])


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _trace(fn: Callable, flat: _Flat) -> Trace:
    import jax

    out_tree: list[Any] = []

    def flat_fn(*dynamic: Any) -> list:
        args, kwargs = flat.rebuild(dynamic)
        out = fn(*args, **kwargs)
        leaves, td = jax.tree_util.tree_flatten(out)
        out_tree.append(td)
        return leaves

    closed = jax.make_jaxpr(flat_fn)(*[_abstract(x) for x in flat.dynamic()])
    statics = [x for x, k in zip(flat.leaves, flat.kinds) if k == "s"]
    return Trace(closed, out_tree[0], flat.kinds, flat.weight_paths, flat.weight_modules, statics, flat.weight_names)


def _inputs(entry: Trace, dynamic: Sequence[Any]) -> list[Any]:
    """The program's inputs: a weight as a :class:`WeightRef` (with its module path and
    name), a ``QArray`` that is not a weight dequantized, any other leaf as itself."""
    paths, modules, names = iter(entry.weight_paths), iter(entry.weight_modules), iter(entry.weight_names)
    kinds = [k for k in entry.kinds if k != "s"]
    return [
        WeightRef(next(paths), x, module=next(modules), variable_path=next(names)) if k == "w" else x.dequantize() if _is_q(x) else x
        for x, k in zip(dynamic, kinds)
    ]


def _run(provider: QuantizationProvider, entry: Trace, dynamic: Sequence[Any], what: str) -> list:
    inputs = _inputs(entry, dynamic)
    provider._begin_trace({r.name: r.value for r in inputs if isinstance(r, WeightRef)})
    interp = Interpreter(provider._handle, activation_dots=True, on_opaque=provider._not_entered)
    # An output that is an input unchanged is that input's leaf (a stored QArray stays one).
    unchanged = {id(x): leaf for x, leaf in zip(inputs, dynamic)}
    outs = [unchanged[id(o)] if id(o) in unchanged else materialize(o) for o in interp.run_closed(entry.closed, inputs)]
    if entry.unchecked:
        provider._end_trace(what)
        entry.unchecked = False
    return outs


def quantize(fn: Callable, provider: QuantizationProvider, *, weight_argnums: int | Sequence[int] = 0) -> Callable:
    """``fn`` with every dot its rules select quantized; same signature, same outputs' structure.

    The weights are the parameters among the leaves of the arguments in ``weight_argnums``
    (every leaf of a plain pytree; in a module, the leaves of ``Param`` variables, not
    caches or statistics: see ``weight_filter`` of the provider); a weight's path is its
    core_array path inside its argument (``layers/0/kernel``; with several weight
    arguments, prefixed by the argument's index) and its module path that of the module
    holding it (``layers/0``). An output that is an input leaf unchanged is returned as
    that leaf (a ``QArray`` weight stays one). When ``fn`` is called, it is traced
    once per argument structure and shape, and its program is re-evaluated with each dot
    whose operand flows from a weight (through casts, transposes, reshapes, slices,
    broadcasts, and into jit, scan, remat, cond, while, shard_map and custom-derivative calls)
    handed to ``provider``. Works eagerly, under ``jax.jit``, ``jax.grad`` and ``vmap``;
    an eager call runs a compiled replay of the rewritten program, built once per
    signature (the last 32 signatures are kept; weights are its arguments, never its
    constants). A weight may also be a ``QArray`` (see :func:`quantize_params`).

    Args:
      fn: the function to quantize (its weights among its arguments).
      provider: the provider whose rules select and quantize the dots.
      weight_argnums: the index (or indices) of the arguments holding the weights.

    Raises:
      ValueError: (with ``strict=True``, the default) a rule selected no op.
    """
    argnums = (weight_argnums,) if isinstance(weight_argnums, int) else tuple(weight_argnums)
    cache = TraceCache()
    name = getattr(fn, "__qualname__", repr(fn))

    def run(entry: Trace, dynamic: list[Any]) -> list:
        return _run(provider, entry, dynamic, name)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        import jax

        flat = _Flat(args, kwargs, argnums, provider.weight_filter)
        entry = cache.get(flat.key(), lambda: _trace(fn, flat))
        dynamic = flat.dynamic()
        compiled = compiled_replay(entry, provider, run) if concrete(dynamic) else None
        if compiled is None:
            outs = run(entry, dynamic)
        else:  # outputs that are inputs or constants come back as the run op by op gives them
            computed = iter(compiled[0](dynamic, compiled[1]))
            outs = [
                dynamic[entry.forwarded[i]] if i in entry.forwarded
                else entry.literals[i] if i in entry.literals else next(computed)
                for i in range(entry.n_out)
            ]
        return jax.tree_util.tree_unflatten(entry.out_tree, outs)

    wrapped._traces = cache  # type: ignore[attr-defined]  # for tests: the signatures held
    return wrapped


def quantize_params(
    params: Any, provider: QuantizationProvider, fn: Callable | None = None, *args: Any, pack: bool = False, **kwargs: Any
) -> Any:
    """``params`` with every weight the rules select replaced by a ``QArray``, leaf by leaf.

    Which axes share a scale comes from the program: pass ``fn`` and example arguments
    (``fn(params, *args, **kwargs)``; only shapes are traced, nothing runs), or call the
    quantized function once before. A weight whose path to its dot is more than
    transposes and casts (e.g. a reshape) stays float; the quantized function still
    quantizes it on the fly, with the same numerics.

    With ``pack=True`` sub-byte values (int4, nf4, fp4, int2) are stored two or four to a
    byte (``QArray.pack``): half the memory for 4-bit weights; the dots unpack them.

    Args:
      params: the parameter pytree; not changed.
      provider: the provider whose rules select the weights (its weight plan comes from a trace).
      fn: ``fn(params, *args, **kwargs)`` to trace for the plan; None uses the plan of an earlier
        call.
      args: example positional arguments of ``fn`` after ``params``.
      pack: store sub-byte values two or four to a byte.
      kwargs: example keyword arguments of ``fn``.

    Returns:
      A tree of ``params``' structure; selected leaves are ``QArray``s whose
      ``dequantize()`` has the leaf's dtype.

    Raises:
      ValueError: no ``fn`` and no earlier call, so no weight plan.
    """
    import jax

    if fn is not None:
        jax.eval_shape(quantize(fn, provider), params, *args, **kwargs)
    if not provider._plan:
        raise ValueError(
            "quantize_params: no weight plan yet; pass fn and example arguments "
            "(quantize_params(params, provider, fn, *args)) or call the quantized function once first"
        )
    from cairn.quant._numerics import quantize_array

    with_path, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_q)
    out = []
    # the plan is keyed by weight names (variable paths), so a plan made on a module applies
    # to its state or its pure dict as well
    for (kp, leaf), name in zip(with_path, leaf_names(params, [kp for kp, _ in with_path])):
        path = path_of(kp)
        plan = provider._plan.get(name)
        if plan is None or isinstance(leaf, QArray):
            out.append(leaf)
            continue
        rule, axes, tile = plan
        q = quantize_array(leaf, required(rule.weight_qtype, f"{rule._describe()}.weight_qtype"), reduce_axes=axes, tile=tile, method=rule.weight_calibration_method, where=path)
        out.append(jax.block_until_ready(q.pack() if pack else q))
    return jax.tree_util.tree_unflatten(treedef, out)


def calibrate(fn: Callable, provider: QuantizationProvider, batches: Iterable[Sequence[Any]]) -> dict:
    """Static activation ranges for the rules with ``act_static_scale=True``.

    Runs ``fn(*batch)`` for every batch (float numerics, nothing quantized), records the
    per-tensor range of each selected dot's activation operand by the rule's
    ``act_calibration_method``, and stores the mean over batches in ``provider``.

    Args:
      fn: the model function, called as ``fn(*batch)``.
      provider: the provider whose rules (with ``act_static_scale=True``) are calibrated; the ranges
        are stored in it.
      batches: calibration batches, each a sequence of ``fn``'s arguments.

    Returns:
      ``{(module_path, op_kind, op_index, operand): (lo, hi)}``.

    Raises:
      ValueError: no batch was given, or no rule selected a dot with an activation operand.
    """
    import jax.numpy as jnp

    recorder: dict = {}
    provider._recording = recorder
    try:
        run = quantize(fn, _FloatOnly(provider))
        for batch in batches:
            run(*batch)
    finally:
        provider._recording = None
    if not recorder:
        raise ValueError("calibrate: no batch was given, or no rule selected a dot with an activation operand")
    for key, values in recorder.items():
        lo = jnp.mean(jnp.stack([v[0] for v in values]))
        hi = jnp.mean(jnp.stack([v[1] for v in values]))
        provider._static[key] = (lo, hi)
    return dict(provider._static)


class _FloatOnly(QuantizationProvider):
    """Matches like ``inner`` and records activation ranges into it, quantizing nothing."""

    def __init__(self, inner: QuantizationProvider) -> None:
        super().__init__(inner.rules, strict=inner.strict, weight_filter=inner.weight_filter)
        self._recording = inner._recording
        self.rule_type = inner.rule_type

    def _operand(self, site: Any, rule: Any, x: Any, side: int) -> Any:
        if isinstance(x, WeightRef):
            return x.materialize()
        if self._recording is not None and rule.act_qtype:
            key = (site.module_path, site.kind, site.index, side)
            self._recording.setdefault(key, []).append(self._act_bounds(rule, x))
        return x

    def _compute(self, site: Any, rule: Any, ops: list, rest: list) -> list:
        from cairn.quant._dots import bind_dequantized

        return bind_dequantized(site.eqn, ops, [materialize(r) for r in rest])
