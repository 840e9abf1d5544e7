"""Logical axis names -> mesh axes -> ``PartitionSpec`` / ``NamedSharding``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cairn.core_array._jax_compat import require_jax

if TYPE_CHECKING:
    import jax

__all__ = ["LogicalAxisRules", "logical_to_partition_spec", "named_sharding"]

MeshAxes = str | tuple[str, ...] | None


def _norm_target(target: Any, logical: str) -> MeshAxes:
    if target is None or isinstance(target, str):
        return target
    if isinstance(target, (list, tuple)) and all(isinstance(t, str) for t in target):
        return tuple(target)
    raise ValueError(
        f"rule for logical axis {logical!r}: target {target!r} must be None, a mesh axis name or a tuple of names"
    )


class LogicalAxisRules:
    """An ordered list of ``(logical_axis, mesh_axes)`` rules.

    For each array dim, the first rule naming its logical axis whose mesh axes are all
    present in the mesh (when one is given) and not yet used by an earlier dim of the
    same array wins; with none, the dim is replicated. ``mesh_axes`` may be ``None``
    (replicate), one mesh axis name, or a tuple of them (the dim is split over their
    product).

    Args:
      rules: ``(logical_axis, mesh_axes)`` pairs in priority order, or a mapping of them.

    >>> rules = LogicalAxisRules([("batch", "data"), ("embed", "model"), ("mlp", "model")])
    >>> rules.mesh_axes(("batch", "embed", "mlp"))
    ('data', 'model', None)
    """

    def __init__(self, rules: Iterable[tuple[str, Any]] | Mapping[str, Any] = ()) -> None:
        items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
        norm = []
        for i, rule in enumerate(items):
            if not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str):
                raise ValueError(f"rule {i} {rule!r} must be a (logical_axis_name, mesh_axes) pair")
            norm.append((rule[0], _norm_target(rule[1], rule[0])))
        self.rules: tuple[tuple[str, MeshAxes], ...] = tuple(norm)

    def __iter__(self):
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def __repr__(self) -> str:
        return f"LogicalAxisRules({list(self.rules)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LogicalAxisRules) and self.rules == other.rules

    def __hash__(self) -> int:
        return hash(self.rules)

    def to_json(self) -> list:
        return [[k, list(v) if isinstance(v, tuple) else v] for k, v in self.rules]

    @classmethod
    def from_json(cls, data: Sequence) -> LogicalAxisRules:
        """Inverse of :meth:`to_json`.

        Args:
          data: ``[[logical_axis, mesh_axes], ...]`` as :meth:`to_json` writes it.
        """
        return cls([(k, v) for k, v in data])

    def mesh_axes(
        self, logical_axes: Sequence[str | None], mesh_axis_names: Iterable[str] | None = None
    ) -> tuple[MeshAxes, ...]:
        """The mesh axes for each logical axis (``None`` = replicated).

        Args:
          logical_axes: one logical axis name (or ``None``) per array dim.
          mesh_axis_names: the mesh's axis names; rules naming others are skipped (``None``: none skipped).
        """
        available = None if mesh_axis_names is None else set(mesh_axis_names)
        used: set[str] = set()
        out: list[MeshAxes] = []
        for logical in logical_axes:
            if logical is None:
                out.append(None)
                continue
            if not isinstance(logical, str):
                raise ValueError(f"logical axis {logical!r} must be a string or None")
            chosen: MeshAxes = None
            for name, target in self.rules:
                if name != logical:
                    continue
                if target is None:
                    break
                names = (target,) if isinstance(target, str) else target
                if available is not None and not all(n in available for n in names):
                    continue
                if any(n in used for n in names):
                    continue
                chosen = target
                used.update(names)
                break
            out.append(chosen)
        return tuple(out)


def _rules(rules: Any) -> LogicalAxisRules:
    return rules if isinstance(rules, LogicalAxisRules) else LogicalAxisRules(rules)


def logical_to_partition_spec(
    logical_axes: Sequence[str | None], rules: Any, mesh: Any = None
) -> jax.sharding.PartitionSpec:
    """The ``jax.sharding.PartitionSpec`` for an array with the given logical axes.

    With ``mesh``, rules whose mesh axes the mesh lacks are skipped.

    Args:
      logical_axes: one logical axis name (or ``None``) per array dim.
      rules: a :class:`LogicalAxisRules` or anything its constructor accepts.
      mesh: an optional ``jax.sharding.Mesh``; rules naming axes it lacks are skipped.
    """
    jax = require_jax("logical_to_partition_spec")
    names = None if mesh is None else tuple(mesh.axis_names)
    return jax.sharding.PartitionSpec(*_rules(rules).mesh_axes(tuple(logical_axes), names))


def named_sharding(mesh: Any, logical_axes: Sequence[str | None], rules: Any) -> jax.sharding.NamedSharding:
    """``NamedSharding(mesh, logical_to_partition_spec(logical_axes, rules, mesh))``.

    Args:
      mesh: the ``jax.sharding.Mesh``.
      logical_axes: one logical axis name (or ``None``) per array dim.
      rules: a :class:`LogicalAxisRules` or anything its constructor accepts.
    """
    jax = require_jax("named_sharding")
    return jax.sharding.NamedSharding(mesh, logical_to_partition_spec(logical_axes, rules, mesh))
