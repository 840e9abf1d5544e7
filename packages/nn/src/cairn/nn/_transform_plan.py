"""What every lifted transform shares: an argument plan and the write-back.

How the transforms work: each module argument is replaced by the flat list of its
variables' values (cached per module while its structure is unchanged), the pure
function rebuilds fresh module objects from those values inside the transform, calls the
user function, and returns the new values. Outside, only the values are swapped into the
original Variable objects; if the function changed the structure (added a variable,
...), the original objects are updated in place to the new structure.

A :class:`Plan` is that decomposition for any pytree of arguments: per leaf (modules and
variables are leaves here) a kind from ``cairn.nn._nodes`` (``MOD``, ``VAR`` or
``LEAF`` for a plain pytree leaf), its structure (a GraphDef, a variable template, or
None) and its dynamic value (the module's value list, the variable's value, the leaf).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax

from cairn.nn._data import DataSlot
from cairn.nn._filters import path_str
from cairn.nn._graph import GraphDef, check_tree, flat, fresh_flat, sync, tree_mode
from cairn.nn._module import Module, annotate_exception
from cairn.nn._nodes import LEAF, MOD, PREFIX_TREES, VAR, SharedReferenceError, is_node, key_of
from cairn.nn._state import GraphState, State
from cairn.nn._variables import EPOCH, Variable, rebuild_variable, template_of

set_raw = Variable.__dict__["raw_value"].__set__


def set_raw_data(v: Variable, x: Any) -> None:
    """``set_raw`` for a variable list that may hold data slots (a plain data
    attribute's value lives in its module: ``cairn.nn._data``)."""
    if type(v) is DataSlot:
        object.__setattr__(v, "raw_value", x)
    else:
        set_raw(v, x)


class Plan:
    """A pytree split into a static description and flat dynamic values.

    Per pytree leaf (modules and variables are leaves here): ``kinds`` (``MOD``,
    ``VAR``, ``LEAF``), ``descs`` (GraphDef, variable template, None), ``objs`` (the
    caller's module or variable), ``varlists`` (a module's variables) and ``dyn`` (a
    module's list of variable values, a variable's value, else the leaf itself).
    """

    __slots__ = ("treedef", "kinds", "descs", "objs", "varlists", "dyn", "links", "_linking")

    def __init__(self, tree: Any, link: bool = False) -> None:
        leaves, treedef = jax.tree_util.tree_flatten(expose_states(tree), is_leaf=is_node)
        self.treedef: Any = treedef
        self.kinds: list[int] = []
        self.descs: list[Any] = []
        self.objs: list[Any] = []
        self.varlists: list[Any] = []  # a module's variables, else None
        self.dyn: list[Any] = []
        # ``link`` (graph mode): a module or Variable shared by two leaves is one object
        # inside the transform; links[(leaf, index)] = (first leaf, index) of each
        # repeat. Without ``link`` a repeat raises SharedReferenceError.
        self.links: dict[tuple[int, int], tuple[int, int]] | None = None
        self._linking = link
        seen: dict[int, tuple[int, int]] = {}
        for li, x in enumerate(leaves):
            if isinstance(x, Module):
                c = flat(x)
                self._add(MOD, c.graphdef, x, c.variables, [v.raw_value for v in c.variables])
                first = seen.get(id(x))
                if first is not None:
                    self._link((li, -1), first)
                    continue
                seen[id(x)] = (li, -1)
                for j, v in enumerate(c.variables):
                    first = seen.get(id(v))
                    if first is not None:
                        self._link((li, j), first)
                    else:
                        seen[id(v)] = (li, j)
            elif isinstance(x, Variable):
                self._add(VAR, template_of(x), x, None, x.raw_value)
                first = seen.get(id(x))
                if first is not None:
                    self._link((li, -1), first)
                else:
                    seen[id(x)] = (li, -1)
            else:
                self._add(LEAF, None, None, None, x)

    def _link(self, at: tuple[int, int], first: tuple[int, int]) -> None:
        if not self._linking:
            fl, fj = first
            owner = self.objs[at[0]]
            v = self.objs[fl] if fj < 0 else self.varlists[fl][fj]
            if isinstance(v, Module):  # a module passed twice: named by its first variable
                if not self.varlists[fl]:
                    return  # nothing to alias
                v = self.varlists[fl][0]
            if owner is self.objs[fl]:
                raise SharedReferenceError(
                    f"Inconsistent aliasing detected: the same {type(owner).__name__} object "
                    f"is passed twice to a transform (Duplicate {type(v).__name__}); pass "
                    f"it once"
                )
            raise SharedReferenceError(
                f"Inconsistent aliasing detected: the same {type(v).__name__} object is "
                f"reachable from two arguments ({type(owner).__name__} and another; "
                f"Duplicate {type(v).__name__}); transform arguments must not share "
                f"variables"
            )
        if self.links is None:
            self.links = {}
        self.links[at] = first

    def shared(self) -> list[tuple[Any, list[tuple[int, int]]]]:
        """Each module / Variable found at more than one leaf (or inside two leaves):
        ``(object, [(leaf, index), ...])``, index -1 for the leaf itself, else the
        variable index in the leaf module's variables."""
        groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for at, first in (self.links or {}).items():
            groups.setdefault(first, [first]).append(at)
        out = []
        for (li, j), places in groups.items():
            obj = self.objs[li] if j < 0 else self.varlists[li][j]
            out.append((obj, places))
        return out

    def _add(self, kind, desc, obj, varlist, dyn) -> None:
        self.kinds.append(kind)
        self.descs.append(desc)
        self.objs.append(obj)
        self.varlists.append(varlist)
        self.dyn.append(dyn)

    @property
    def has_data(self) -> bool:
        """Whether a module of the plan has plain data attributes."""
        return any(k == MOD and d.has_data for k, d in zip(self.kinds, self.descs))

    def key(self) -> tuple:
        """The plan's structure, hashable (a compilation cache key)."""
        links = None if self.links is None else tuple(sorted(self.links.items()))
        return (self.treedef, tuple(self.kinds), tuple(self.descs), links)

    def extend_flat(self, values: list, targets: list, ids: list) -> None:
        """Append every dynamic value to ``values``, the variable it belongs to (None
        for a plain leaf) to ``targets``, and the id of each module / variable to
        ``ids``."""
        for kind, obj, d, vl in zip(self.kinds, self.objs, self.dyn, self.varlists):
            if kind == MOD:
                values.extend(d)
                targets.extend(vl)
                ids.append(id(obj))
            elif kind == VAR:
                values.append(d)
                targets.append(obj)
                ids.append(id(obj))
            else:
                values.append(d)
                targets.append(None)

    def take(self, it: Any) -> tuple[list, int]:
        """Dynamic values shaped like ``dyn`` taken from the flat iterator ``it``, and
        how many were taken."""
        dyn = []
        n = 0
        for kind, d in zip(self.kinds, self.dyn):
            if kind == MOD:
                k = len(d)
                dyn.append([next(it) for _ in range(k)])
                n += k
            else:
                dyn.append(next(it))
                n += 1
        return dyn, n

    def rebuild(self, dyn: Sequence) -> tuple[Any, list]:
        """Fresh objects from dynamic values: (tree, list of rebuilt leaves)."""
        if self.links is not None:
            return self._rebuild_linked(dyn)
        out = []
        for kind, desc, d in zip(self.kinds, self.descs, dyn):
            if kind == MOD:
                out.append(desc.build_from_values(d))
            elif kind == VAR:
                out.append(rebuild_variable(desc, d))
            else:
                out.append(d)
        return self.treedef.unflatten(out), out

    def _rebuild_linked(self, dyn: Sequence) -> tuple[Any, list]:
        """:meth:`rebuild` when leaves share modules or Variables: each shared one is
        rebuilt once (from its first place's value) and found at every place."""
        links = self.links or {}
        out: list[Any] = []
        for li, (kind, desc, d) in enumerate(zip(self.kinds, self.descs, dyn)):
            first = links.get((li, -1))
            if first is not None:
                fl, fj = first
                out.append(out[fl] if fj < 0 else _cache_vars(out[fl])[fj])
            elif kind == MOD:
                reuse = {}
                for j in range(len(d)):
                    f = links.get((li, j))
                    if f is not None:
                        fl, fj = f
                        reuse[j] = out[fl] if fj < 0 else _cache_vars(out[fl])[fj]
                out.append(desc.build_from_values(d, reuse or None))
            elif kind == VAR:
                out.append(rebuild_variable(desc, d))
            else:
                out.append(d)
        return self.treedef.unflatten(out), out

    def collect(self, rebuilt: list) -> tuple[list, list]:
        """New dynamic values and structure descriptors of rebuilt leaves after a call."""
        dyn: list[Any] = []
        descs: list[Any] = []
        for kind, obj in zip(self.kinds, rebuilt):
            if kind == MOD:
                c = fresh_flat(obj)
                dyn.append([v.raw_value for v in c.variables])
                descs.append(c.graphdef)
            elif kind == VAR:
                dyn.append(obj.raw_value)
                descs.append(template_of(obj))
            else:
                dyn.append(None)
                descs.append(None)
        return dyn, descs

    def static_descs(self) -> list:
        """``descs`` with None for plain leaves (what :meth:`collect` returns when the
        call kept every structure)."""
        return [d if k != LEAF else None for k, d in zip(self.kinds, self.descs)]

    def fill(self, new_dyn: Sequence) -> list:
        """``new_dyn`` with the plan's own values at plain leaves."""
        return [nd if k != LEAF else d for k, nd, d in zip(self.kinds, new_dyn, self.dyn)]

    def write_back(self, dyn: Sequence, descs: Sequence) -> None:
        """Give the caller's objects the new values (and structures) ``dyn`` /
        ``descs``."""
        for i, kind in enumerate(self.kinds):
            if kind == MOD:
                write_module(self.objs[i], self.descs[i], self.varlists[i], descs[i], dyn[i])
            elif kind == VAR:
                var = self.objs[i]
                set_raw(var, dyn[i])
                if descs[i] != self.descs[i]:
                    object.__setattr__(var, "_meta", dict(descs[i][1].meta))
                    EPOCH[0] += 1

    def originals(self, dyn: Sequence | None = None) -> Any:
        """The tree with the caller's own objects (after write_back); plain leaves from
        ``dyn`` (default: the plan's)."""
        dyn = self.dyn if dyn is None else dyn
        leaves = [o if k != LEAF else d for k, o, d in zip(self.kinds, self.objs, dyn)]
        return self.treedef.unflatten(leaves)


class _StateVars:
    """A :class:`State` as a transform sees it: its Variables are the children (so they
    are plan leaves, and the changes a function makes to them are written back, as Flax
    NNX's transforms do for a State argument), in the order of the State's own pytree
    leaves; it unflattens to a State (or GraphState) again."""

    __slots__ = ("aux", "variables")

    def __init__(self, state: State) -> None:
        flat_state = state._flat
        paths = _grouped_paths(list(flat_state))
        gd = state._graphdef if isinstance(state, GraphState) else None
        self.aux = (type(state) is GraphState, gd, tuple(paths))
        self.variables = [flat_state[p] for p in paths]


def _grouped_paths(paths: list) -> list:
    """``paths`` in the order a State flattens them: grouped by first key (in order of
    first appearance), recursively."""
    groups: dict = {}
    for p in paths:
        groups.setdefault(p[0], []).append(p)
    out: list = []
    for head, ps in groups.items():
        leaf = [p for p in ps if len(p) == 1]
        rest = [p[1:] for p in ps if len(p) > 1]
        if leaf and not rest:
            out.extend(leaf)
        else:
            out.extend(leaf + [(head, *q) for q in _grouped_paths(rest)])
    return out


def _state_vars_unflatten(aux: tuple, children: Any) -> Any:
    is_graph, gd, paths = aux
    st = State.from_flat(dict(zip(paths, children)))
    return GraphState.wrap(gd, st) if is_graph else st


jax.tree_util.register_pytree_node(
    _StateVars, lambda sv: (sv.variables, sv.aux), _state_vars_unflatten
)


def _is_state_or_node(x: Any) -> bool:
    return isinstance(x, State) or is_node(x)


def expose_states(tree: Any) -> Any:
    """``tree`` with each :class:`State` in it as :class:`_StateVars` (its Variables
    become plan leaves); the tree itself when it holds no State."""
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=_is_state_or_node)
    if not any(isinstance(x, State) for x in leaves):
        return tree
    return jax.tree_util.tree_map(
        lambda x: _StateVars(x) if isinstance(x, State) else x, tree, is_leaf=_is_state_or_node
    )


def check_output_aliasing(fn: str, inputs: Any, out: Any) -> None:
    """Flax NNX's rule for a transform without graph updates (``graph=False`` or
    ``graph_updates=False``): the output must not hold a Variable of the (rebuilt)
    inputs, as the caller could not tell the returned object from its own argument.

    Args:
      fn: the transform's name, for the message.
      inputs: the rebuilt arguments (a pytree of modules, Variables and values).
      out: what the function returned.

    Raises:
      ValueError: naming the Variable and its input and output paths.
    """
    seen: dict[int, str] = {}
    for where, v in _variables_with_paths(inputs):
        seen.setdefault(id(v), where)
    for where, v in _variables_with_paths(out):
        if id(v) in seen:
            raise ValueError(
                f"Duplicate {type(v).__name__} found at paths: input {seen[id(v)]!r} and "
                f"output {where!r}. nn.{fn} with graph_updates=False does not support "
                f"Variable aliasing (duplicate inputs, duplicate outputs, or input "
                f"Variables returned as outputs): return the value, a new Variable "
                f"(nn.clone), or pass graph=True, graph_updates=True"
            )


def _variables_with_paths(tree: Any) -> list[tuple[str, Variable]]:
    out = []
    for kp, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_node)[0]:
        where = jax.tree_util.keystr(kp)
        if isinstance(x, Variable):
            out.append((where, x))
        elif isinstance(x, Module):
            c = fresh_flat(x)
            out.extend((f"{where}/{path_str(p)}", v) for p, v in zip(c.graphdef.paths, c.variables))
    return out


def check_carry_disjoint(carry: Plan, xs: Plan) -> None:
    """``nn.scan``: a Variable both in the carry and in the scanned inputs would get two
    prefixes (``Carry`` and an axis).

    Raises:
      SharedReferenceError: Flax's "Inconsistent aliasing detected", naming the type.
    """
    ids = {id(v) for vl, o in zip(carry.varlists, carry.objs)
           for v in (vl if vl is not None else [o]) if v is not None}
    for vl, o in zip(xs.varlists, xs.objs):
        for v in vl if vl is not None else [o]:
            if v is not None and id(v) in ids:
                raise SharedReferenceError(
                    f"Inconsistent aliasing detected. The following nodes have different "
                    f"prefixes:\nNode: {type(v).__name__}\n  carry: Carry\n  xs: 0"
                )


def check_consistent_prefixes(plan: Plan, leaf_prefixes: Sequence) -> None:
    """A module or Variable shared by two arguments of a graph-mode transform must get
    the same prefix (``in_axes``, ``in_specs``...) at each place.

    Args:
      plan: the linked plan of the arguments.
      leaf_prefixes: per plan leaf, its prefix (for a module: one per variable).

    Raises:
      ValueError: Flax's "Inconsistent aliasing detected" listing, per node, each place
        and its prefix.
    """
    if plan.links is None:
        return
    msgs = []
    for _obj, places in plan.shared():
        per_var: dict[int, list[tuple[tuple, Any]]] = {}
        for li, j in places:
            pre = leaf_prefixes[li]
            if j >= 0:
                per_var.setdefault(0, []).append(((li, j), pre[j]))
            elif plan.kinds[li] == MOD:
                for jj, p in enumerate(pre):
                    per_var.setdefault(jj, []).append(((li, jj), p))
            else:
                per_var.setdefault(0, []).append(((li, -1), pre))
        for entries in per_var.values():
            if any(not _same_prefix(entries[0][1], p) for _, p in entries[1:]):
                msgs.append(_aliasing_lines(plan, entries))
    if msgs:
        raise SharedReferenceError(
            "Inconsistent aliasing detected. The following nodes have different prefixes:\n"
            + "\n".join(msgs)
        )


def _same_prefix(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001  (arrays and other values without a plain ==)
        return False


def _aliasing_lines(plan: Plan, entries: list) -> str:
    """``Node: <type>`` and one ``  <path>: <prefix>`` line per place."""
    where = [_arg_path(kp) for kp, _ in
             jax.tree_util.tree_flatten_with_path(plan.originals(), is_leaf=is_node)[0]]
    lines = []
    v = None
    for (li, j), p in entries:
        if j >= 0:
            v = plan.varlists[li][j]
            path = f"{where[li]}/{path_str(plan.descs[li].paths[j])}"
        else:
            v = plan.objs[li]
            path = where[li]
        lines.append(f"  {path.lstrip('/') or '<root>'}: {p}")
    return f"Node: {type(v).__name__}\n" + "\n".join(lines)


def _arg_path(kp: tuple) -> str:
    """The path of a plan leaf in ``(args, kwargs)`` as ``0/1`` (argument, position)."""
    try:
        return path_str(tuple(key_of(e) for e in kp[1:]))
    except Exception:  # noqa: BLE001  (a key with no path name: jax's own spelling)
        return jax.tree_util.keystr(kp)


def _cache_vars(module: Module) -> list:
    """The variables of a module just rebuilt (from its build cache)."""
    return module.__dict__["_cairn_cache"].variables


def check_tree_args(fn: str, tree: Any, graph: bool | None) -> None:
    """In tree mode (``graph=False``, or ``nn.set_graph_mode(False)``), raise
    :class:`SharedReferenceError` (a ``ValueError``) naming the paths when the arguments
    ``tree`` of ``nn.<fn>`` hold a module or Variable at two places (inside one module
    or across arguments); graph mode allows it. Nothing is walked in graph mode."""
    if not tree_mode(graph):
        return
    seen: dict[int, str] = {}
    for kp, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_node)[0]:
        if isinstance(x, Module):
            c = flat(x)
            check_tree(x, c, False)
            pairs = [(f"{jax.tree_util.keystr(kp)}/{path_str(p)}", v)
                     for p, v in zip(c.graphdef.paths, c.variables)]
        elif isinstance(x, Variable):
            pairs = [(jax.tree_util.keystr(kp), x)]
        else:
            continue
        for where, v in pairs:
            if id(v) in seen:
                raise SharedReferenceError(
                    f"Duplicate {type(v).__name__}: the same object is found at paths "
                    f"{seen[id(v)]!r} and {where!r} of the arguments of nn.{fn}; tree mode "
                    f"(graph=False) does not support shared references (pass graph=True, "
                    f"or nn.clone one of them)"
                )
            seen[id(v)] = where


def write_module(
    obj: Module, old_gd: GraphDef, old_vars: list, new_gd: GraphDef, values: list
) -> None:
    """Give module ``obj`` (encoded as ``old_gd`` with ``old_vars``) the ``values`` of
    structure ``new_gd``: in place value by value when the structure is unchanged."""
    if new_gd is old_gd or new_gd == old_gd:
        sr = set_raw_data if old_gd.has_data else set_raw
        for v, x in zip(old_vars, values):
            sr(v, x)
    else:
        sync(obj, new_gd.build_from_values(values))


def call_annotated(fun: Callable, args: Sequence, kwargs: dict) -> Any:
    """``fun(*args, **kwargs)``; an exception gets a note naming the module that raised
    it (by argument and path)."""
    try:
        return fun(*args, **kwargs)
    except Exception as e:
        roots = [(str(i), a) for i, a in enumerate(args)]
        roots += [(repr(k), v) for k, v in kwargs.items()]
        annotate_exception(e, roots)
        raise


class Box:
    """A side channel out of a traced function (the new structures of its arguments)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Any = None


def argnums_tuple(argnums: int | Sequence[int]) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def run_pure(f: Callable, plan: Plan, box: Box, no_alias: str | None = None) -> Callable:
    """A pure function of the plan's dynamic values, ``(out, new_dyn)``; the new
    structures go to ``box``. The plan's tree must be ``(args, kwargs)``. ``no_alias``
    (a transform's name) refuses an output holding an input Variable
    (:func:`check_output_aliasing`)."""

    def pure(dyn):
        (a, kw), rebuilt = plan.rebuild(dyn)
        out = call_annotated(f, a, kw)
        if no_alias is not None:
            check_output_aliasing(no_alias, rebuilt, out)
        new_dyn, new_descs = plan.collect(rebuilt)
        box.value = new_descs
        return out, new_dyn

    return pure


def check_same_structure(old_descs: Sequence, new_descs: Sequence, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` when a loop body changed a module's
    structure."""
    if list(old_descs) != list(new_descs):
        raise ValueError(
            f"{what}: the function changed the structure of a module in its carry (added or "
            f"removed variables or changed static attributes); create new state before "
            f"the loop"
        )


def _carry_identity_error(what: str, tree: Any, i: int, x: Any, kind: str) -> None:
    """Raise the loop-carry identity error for leaf ``i`` of the returned carry ``tree``."""
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_node)[0]]
    where = paths[i] if i < len(paths) else f"leaf {i}"
    raise ValueError(
        f"{what}: the returned carry holds a new {type(x).__name__} ({kind}) at "
        f"{where or 'the root'} instead of the object the step was given. Carry references "
        f"must be the same between iterations (scan Variable identity must be preserved "
        f"across iterations): change the carry's modules / Variables in place and return "
        f"them; state written to a new object would be lost"
    )


class Carry:
    """A loop carry that may contain modules (``scan``, ``fori_loop``, ``while_loop``):
    its values go through the loop, the caller's objects get the final ones."""

    def __init__(self, tree: Any, link: bool = False) -> None:
        self.plan = Plan(tree, link)

    @property
    def dyn(self) -> list:
        return self.plan.dyn

    def rebuild(self, dyn: Sequence) -> Any:
        """The carry for one step: fresh objects holding ``dyn`` (remembered, with their
        variables, for the identity check of :meth:`extract`)."""
        tree, rebuilt = self.plan.rebuild(dyn)
        self._given = rebuilt
        self._given_vars = [fresh_flat(o).variables if k == MOD else None
                            for k, o in zip(self.plan.kinds, rebuilt)]
        return tree

    def extract(self, tree: Any, what: str) -> list:
        """The dynamic values of the carry ``tree`` a loop body returned.

        Raises:
          ValueError: naming ``what``, when the structure differs from the initial one.
        """
        leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_node)
        if treedef != self.plan.treedef:
            raise ValueError(
                f"{what}: the returned carry has structure {treedef}, expected "
                f"{self.plan.treedef}"
            )
        given = getattr(self, "_given", None)
        dyn = []
        for i, (kind, desc, x) in enumerate(zip(self.plan.kinds, self.plan.descs, leaves)):
            if kind == MOD:
                if given is not None and x is not given[i]:
                    _carry_identity_error(what, tree, i, x, "module")
                c = fresh_flat(x)
                check_same_structure([desc], [c.graphdef], what)
                if given is not None:
                    # a module's entry of _given_vars is its variable list, never None
                    for v, w in zip(c.variables, cast(list, self._given_vars[i])):
                        if v is not w and type(v) is not DataSlot:  # data is a value: no identity
                            _carry_identity_error(what, tree, i, v, "variable of the module")
                dyn.append([v.raw_value for v in c.variables])
            elif kind == VAR:
                if given is not None and x is not given[i]:
                    _carry_identity_error(what, tree, i, x, "Variable")
                dyn.append(x.raw_value)
            else:
                dyn.append(x)
        return dyn

    def finish(self, dyn: Sequence) -> Any:
        """Write the final values back; the carry with the caller's objects."""
        plan = self.plan
        plan.write_back(
            [d if k != LEAF else None for k, d in zip(plan.kinds, dyn)], plan.static_descs()
        )
        return plan.originals(dyn)


def reject_bound_method(f: Any, what: str) -> None:
    """Raise ``ValueError`` when ``f`` is a bound method of a module: the module would
    be closed over (its values baked in as constants, its changes lost or leaked as
    tracers) instead of passed through the transform.

    Args:
      f: the function given to the transform.
      what: the transform's name, for the message.
    """
    owner = getattr(f, "__self__", None)
    if inspect.ismethod(f) and isinstance(owner, Module):
        name = getattr(f, "__name__", "method")
        raise ValueError(
            f"nn.{what} does not take bound methods of a module ({type(owner).__name__}."
            f"{name}): the module would be closed over instead of passed through the "
            f"transform; pass it as an argument, e.g. nn.{what}({type(owner).__name__}."
            f"{name})(module, ...)"
        )


def check_prefix(prefix: Any, name: str, fn: str, graph: Any, graph_updates: Any) -> None:
    """Flax NNX's checks of a transform's prefix argument (``in_axes``, ``in_shardings``,
    ``argnums``...) where the caller asked for a mode by keyword: a lone Variable is
    never a prefix (give the axis of the whole Variable); a ``StateAxes`` /
    ``StateSharding`` / ``DiffState`` needs ``graph=True`` and ``graph_updates=True``
    (tree mode takes ``nn.prefix`` trees instead); a module is no prefix under
    ``graph=True`` (graph mode takes ``StateAxes``).

    Raises:
      ValueError: naming the offending entry and what to pass instead.
    """

    def walk(x: Any, where: str) -> None:
        if isinstance(x, Variable):
            if graph is False:
                raise ValueError(
                    f"Found Variable of type {type(x).__name__} at {where} in `{name}` for "
                    f"nn.{fn}. Variables prefixes are not supported: pass a prefix for the "
                    "entire Variable instead of a Variable holding a prefix for its value."
                )
            return
        if getattr(type(x), "_cairn_prefix_mapping", False):
            if graph is False or graph_updates is False:
                kind = type(x).__name__
                raise ValueError(
                    f"`{name}` cannot contain `{kind}` objects when `graph=False` or "
                    f"`graph_updates=False` (found at {where} for nn.{fn}); give a tree from "
                    f"nn.prefix(...) instead, or leave graph / graph_updates at their defaults"
                )
            return
        if is_node(x):
            if graph is True and x not in PREFIX_TREES:
                raise ValueError(
                    f"Found graph node of type {type(x).__name__} at {where} in `{name}` for "
                    f"nn.{fn}. Graph nodes are not allowed as prefixes when graph=True: use "
                    f"a StateAxes / StateSharding, or pass graph=False with an nn.prefix tree"
                )
            return
        if isinstance(x, (tuple, list)):
            for i, y in enumerate(x):
                walk(y, f"{where}[{i}]")
        elif isinstance(x, dict):
            for k, y in x.items():
                walk(y, f"{where}[{k!r}]")

    if graph is not None or graph_updates is not None:
        walk(prefix, name)
