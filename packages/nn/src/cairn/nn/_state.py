"""State: the variables of a module tree, keyed by path.

A :class:`State` is a nested mapping (``state["layers"][0]["kernel"]``, also
``state.layers[0].kernel``) whose leaves are :class:`~cairn.nn.Variable` objects. It is
stored flat (path tuple -> Variable) so that ``split`` / ``merge`` cost no per-node work.

As a pytree, a State flattens each variable **inline**: the variable's value is the leaf
and its path is the variable's path, with no ``value`` component. So
``cairn.core_array.flatten_with_paths(nn.state(model))`` gives keys such as
``"layers/0/kernel"``, the same strings checkpoint keys, optimizer masks and
quantization rules use. ``jax.tree.map(f, state)`` returns a State of new variables
(same types and metadata) holding ``f(value)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import jax
from jax.tree_util import DictKey

from cairn.nn._data import plain
from cairn.nn._filters import path_str, path_text, to_predicate
from cairn.nn._variables import Variable, rebuild_variable, template_of


class State(MutableMapping):
    """A mapping from path to :class:`~cairn.nn.Variable`, nested by path component.

    Build one from a nested mapping of Variables (``State({"w": nn.Param(x)})``) or get
    it from :func:`~cairn.nn.state` / :func:`~cairn.nn.split`.

    Args:
      mapping: a nested mapping of variables (keys are path components); None for an empty State.
    """

    # _parent: (State, key) for a nested view (``state["b"]``, ``state.b``): changes
    # made through the view are written to the State it came from
    __slots__ = ("_flat_d", "_hint", "_parent")

    def __init__(self, mapping: Mapping | None = None) -> None:
        # path -> a Variable, a plain leaf (a data attribute's value, an array, a
        # PartitionSpec...) or an empty State (a nested dict's empty entry)
        self._flat_d: dict[tuple, Any] | None = {}
        self._hint: tuple[Any, list[Variable]] | None = None
        self._parent: tuple[State, Any] | None = None
        if mapping is not None:
            if isinstance(mapping, State):
                self._flat_d = dict(mapping._flat)
            else:
                _flatten_mapping(mapping, (), self._flat_d)

    @classmethod
    def from_flat(cls, flat: Mapping[tuple, Variable] | Any) -> State:
        """A State from ``{path_tuple: Variable}`` (or an iterable of pairs).

        Args:
          flat: ``{path tuple: Variable}``, or an iterable of such pairs.
        """
        s = object.__new__(cls)
        s._flat_d = dict(flat)
        s._hint = None
        s._parent = None
        return s

    @classmethod
    def _from_cache(cls, graphdef: Any, variables: list[Variable]) -> State:
        """A State over a GraphDef's cached variable list (the dict built on first use)."""
        s = object.__new__(cls)
        s._flat_d = None  # built on first use
        s._hint = (graphdef, variables)
        s._parent = None
        return s

    @property
    def _flat(self) -> dict[tuple, Any]:
        d = self._flat_d
        if d is None:
            assert self._hint is not None  # set whenever _flat_d is None
            gd, variables = self._hint
            if gd.has_data:  # a data attribute's entry is its plain value
                variables = [plain(v) for v in variables]
            d = self._flat_d = dict(zip(gd.paths, variables))
        return d

    # --- flat views ---
    def flat_state(self) -> dict[tuple, Variable]:
        """``{path_tuple: Variable}`` (a new dict)."""
        return dict(self._flat)

    def flat_paths(self) -> list[str]:
        """The ``/``-joined paths of every variable, in order."""
        return [path_str(p) for p in self._flat]

    def flat_items(self) -> list[tuple[str, Variable]]:
        return [(path_str(p), v) for p, v in self._flat.items()]

    # --- mapping protocol ---
    def _sub(self, key) -> State | Variable:
        v = self._flat.get((key,))
        if v is not None:
            return v
        sub = {p[1:]: v for p, v in self._flat.items() if p[0] == key and len(p) > 1}
        if not sub:
            raise KeyError(key)
        view = State.from_flat(sub)
        view._parent = (self, key)
        return view

    def _changed(self) -> None:
        """After a change through a nested view: write the view back to its parent."""
        parent = getattr(self, "_parent", None)
        if parent is not None:
            owner, key = parent
            owner[key] = self

    def __getitem__(self, key):
        return self._sub(key)

    def __getattr__(self, name):
        if name.startswith("__") or name in State.__slots__ or name == "_flat":
            raise AttributeError(name)
        try:
            return self._sub(name)
        except KeyError:
            raise AttributeError(
                f"State has no key {name!r} (top-level keys: {list(self)})"
            ) from None

    def __setattr__(self, name, value):
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            self[name] = value

    def __delattr__(self, name):
        if name.startswith("_"):
            object.__delattr__(self, name)
        else:
            del self[name]

    def __setitem__(self, key, value):
        _ = self._flat
        self._hint = None
        for p in [p for p in self._flat if p[0] == key]:
            del self._flat[p]
        if isinstance(value, Mapping):
            sub = value._flat if isinstance(value, State) else _flatten_mapping(value, (), {})
            for p, v in sub.items():
                self._flat[(key, *p)] = v
            if not sub:  # an empty sub-state stays, as a nested dict's empty entry
                self._flat[(key,)] = State()
        else:  # a Variable, or a plain leaf (an array, a number, a PartitionSpec...)
            self._flat[(key,)] = value
        self._changed()

    def __delitem__(self, key):
        ps = [p for p in self._flat if p[0] == key]
        if not ps:
            raise KeyError(key)
        _ = self._flat
        self._hint = None
        for p in ps:
            del self._flat[p]
        self._changed()

    def __iter__(self) -> Iterator:
        seen: dict[Any, None] = {}
        for p in self._flat:
            seen.setdefault(p[0], None)
        return iter(seen)

    def __len__(self) -> int:
        return len({p[0] for p in self._flat})

    def __contains__(self, key) -> bool:
        return any(p[0] == key for p in self._flat)

    def __eq__(self, other):
        if isinstance(other, Mapping) and not isinstance(other, State):
            # a nested dict of Variables compares as the State it makes (``state == {}``)
            try:
                other = State(other)
            except (TypeError, ValueError):
                return False
        if not isinstance(other, State):
            return NotImplemented
        return self._flat == other._flat

    __hash__ = None  # type: ignore[assignment]  # a mutable mapping

    # --- functional helpers ---
    def filter(self, *filters: Any) -> State | tuple[State, ...]:
        """The variables matching each filter (a State, or a tuple for several).

        Args:
          filters: one or more filters (Variable types, path regexes, ``...``, predicates...).
        """
        return self._partition(filters, strict=False)

    def split(self, *filters: Any) -> State | tuple[State, ...]:
        """Partition by ``filters`` (each variable goes to the first that matches; every
        variable must match one, so end with ``...`` to collect the rest).

        Args:
          filters: the filters, in order; the last is often ``...``.
        """
        return self._partition(filters, strict=True)

    def _partition(self, filters, strict: bool) -> State | tuple[State, ...]:
        """One State per filter, each variable in the first that matches; with
        ``strict`` a variable no filter matches is an error (``split``), else dropped."""
        preds = [to_predicate(f) for f in filters]
        outs: list[dict] = [{} for _ in preds]
        for p, v in self._flat.items():
            for o, pred in zip(outs, preds):
                if pred(p, v):
                    o[p] = v
                    break
            else:
                if not strict:
                    continue
                raise ValueError(
                    f"State.split: variable at {path_text(p)!r} ({type(v).__name__}) "
                    f"matched none of the filters {filters!r}; add `...` as the last filter"
                )
        states = tuple(State.from_flat(o) for o in outs)
        return states[0] if len(states) == 1 else states

    @staticmethod
    def merge(*states: State) -> State:
        """One State holding the variables of all ``states`` (later ones win).

        Args:
          states: the States to combine.
        """
        flat = {}
        for s in states:
            flat.update(s._flat)
        return State.from_flat(flat)

    def to_pure_dict(self) -> dict:
        return to_pure_dict(self)

    def replace_by_pure_dict(self, pure: Mapping) -> None:
        """Set every variable to the value at its path in ``pure`` (see
        :func:`replace_by_pure_dict`).

        Args:
          pure: nested plain dicts of values, as :func:`to_pure_dict` makes.
        """
        replace_by_pure_dict(self, pure)

    def __repr__(self) -> str:
        if not self._flat:
            return "State({})"
        lines = [f"  {path_text(p)!r}: {v!r}," for p, v in self._flat.items()]
        return "State({\n" + "\n".join(lines) + "\n})"


def _flatten_mapping(mapping: Mapping, prefix: tuple, out: dict) -> dict:
    for k, v in mapping.items():
        if isinstance(v, Variable):
            out[(*prefix, k)] = v
        elif isinstance(v, State):
            for p, x in v._flat.items():
                out[(*prefix, k, *p)] = x
        elif isinstance(v, Mapping):
            _flatten_mapping(v, (*prefix, k), out)
        else:  # a plain leaf: an array, a number, a PartitionSpec...
            out[(*prefix, k)] = v
    return out


def to_pure_dict(state: State | Mapping) -> dict:
    """Nested plain dicts of the variables' values (list indices stay ints).

    Args:
      state: a State (or a nested mapping of variables).
    """
    flat = state._flat if isinstance(state, State) else _flatten_mapping(state, (), {})
    out: dict = {}
    for p, v in flat.items():
        d = out
        for k in p[:-1]:
            d = d.setdefault(k, {})
        d[p[-1]] = v.raw_value if isinstance(v, Variable) else v
    return out


def replace_by_pure_dict(state: State, pure: Mapping) -> None:
    """Set every variable of ``state`` (in place) to the value at its path in the nested
    mapping ``pure`` (as made by :func:`to_pure_dict`; string forms of integer keys are
    accepted). Raises ``KeyError`` naming a path that ``pure`` lacks.

    Args:
      state: the State to update in place.
      pure: nested plain dicts of values at the State's paths.
    """
    for p, v in list(state._flat.items()):
        d = pure
        for i, k in enumerate(p):
            if isinstance(d, Mapping) and k in d:
                d = d[k]
            elif isinstance(d, Mapping) and str(k) in d:
                d = d[str(k)]
            else:
                raise KeyError(
                    f"replace_by_pure_dict: no value for {path_text(p)!r} (missing key "
                    f"{k!r} at {path_text(p[:i]) or '<root>'!r})"
                )
        if isinstance(d, Mapping):
            raise TypeError(
                f"replace_by_pure_dict: expected an array at {path_text(p)!r}, got a mapping"
            )
        if isinstance(v, Variable):
            v.value = d
        else:
            state._flat[p] = d


# --- pytree registration: variables inline ---


def _state_children(s: State):
    groups: dict = {}
    for p, v in s._flat.items():
        head = p[0]
        if len(p) == 1:
            groups[head] = v
        else:
            g = groups.get(head)
            if not isinstance(g, dict):
                g = groups[head] = {}
            g[p[1:]] = v
    keys = []
    children = []
    tmpl: list[tuple | str | None] = []  # a Variable's template, None (a sub-State), _PLAIN
    for k, g in groups.items():
        keys.append(k)
        if isinstance(g, Variable):
            children.append(g.raw_value)
            tmpl.append(template_of(g))
        elif isinstance(g, dict):
            children.append(State.from_flat(g))
            tmpl.append(None)
        else:  # a plain leaf, as it is
            children.append(g)
            tmpl.append(_PLAIN)
    return keys, children, tuple(tmpl)


# the template of a plain (non-Variable) leaf in a State's pytree aux data
_PLAIN = "plain"


def _state_flatten_with_keys(s: State):
    keys, children, tmpl = _state_children(s)
    return [(DictKey(k), c) for k, c in zip(keys, children)], (tuple(keys), tmpl)


def _state_flatten(s: State):
    keys, children, tmpl = _state_children(s)
    return children, (tuple(keys), tmpl)


def _state_unflatten(aux, children):
    keys, tmpl = aux
    flat = {}
    for k, t, c in zip(keys, tmpl, children):
        if t is _PLAIN:
            flat[(k,)] = c
        elif t is None:
            if isinstance(c, State):
                for p, v in c._flat.items():
                    flat[(k, *p)] = v
            else:  # jax may rebuild with placeholder leaves
                flat[(k,)] = c
        else:
            flat[(k,)] = rebuild_variable(t, c)
    return State.from_flat(flat)


jax.tree_util.register_pytree_with_keys(
    State, _state_flatten_with_keys, _state_unflatten, flatten_func=_state_flatten
)


class GraphState(State):
    """A :class:`State` that carries the :class:`~cairn.nn.GraphDef` of the module it
    came from (``nn.unpack``), so ``nn.merge(*graph_states)`` needs no GraphDef. It is a
    pytree (the GraphDef is static), so it goes through ``nn.grad`` / ``jax.jit``.

    Args:
      mapping: a nested mapping of variables; None for an empty state.
    """

    __slots__ = ("_graphdef",)

    @classmethod
    def wrap(cls, graphdef: Any, state: State) -> GraphState:
        """``state``'s variables with ``graphdef`` attached.

        Args:
          graphdef: the :class:`GraphDef` to attach.
          state: the :class:`State` whose variables it holds.
        """
        g: Any = cls.from_flat(state._flat)
        g._graphdef = graphdef
        return g

    @property
    def graphdef(self) -> Any:
        return self._graphdef

    @property
    def _state(self) -> State:
        return State.from_flat(self._flat)

    def __repr__(self) -> str:
        return "Graph" + super().__repr__()


def _gstate_flatten_with_keys(s: GraphState):
    kids, aux = _state_flatten_with_keys(s)
    return kids, (s._graphdef, aux)


def _gstate_flatten(s: GraphState):
    kids, aux = _state_flatten(s)
    return kids, (s._graphdef, aux)


def _gstate_unflatten(aux, children):
    return GraphState.wrap(aux[0], _state_unflatten(aux[1], children))


jax.tree_util.register_pytree_with_keys(
    GraphState, _gstate_flatten_with_keys, _gstate_unflatten, flatten_func=_gstate_flatten
)
