"""``nn.capture``: run a function and return the values its modules ``sow`` /
``perturb`` (Flax NNX's way of reading intermediates without keeping them)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from cairn.nn._graph import iter_modules, pop
from cairn.nn._module import Module, public_methods
from cairn.nn._state import State
from cairn.nn._variables import Variable


def _set_path(module: Module, path: tuple, var: Variable) -> None:
    owner: Any = module
    for k in path[:-1]:
        owner = owner[k] if isinstance(owner, list | tuple | dict) else getattr(owner, k)
    if not isinstance(owner, Module):
        raise ValueError(
            f"nn.capture: init has a value at {'/'.join(map(str, path))!r} whose parent is "
            f"not a module"
        )
    setattr(owner, path[-1], var)


def _put_back(module: Module, *states: State) -> None:
    for s in states:
        for path, var in s._flat.items():
            _set_path(module, path, var)


def capture(
    fn: Any,
    *var_types: type[Variable],
    init: State | None = None,
    method_outputs: type[Variable] | None = None,
) -> Callable:
    """Wrap ``fn`` so that it returns ``(result, captured)``: the variables of types
    ``var_types`` (``nn.Intermediate`` from ``sow``, ``nn.Perturbation`` from
    ``perturb``) that the call created, as one State per type (``(result, *states)``
    for several types; only ``result`` for none). Each call starts from no such
    variables (or from ``init``'s, e.g. perturbations whose gradient you want), and the
    module is left as it was.

    ``fn`` is a module (its ``__call__``), a bound method of a module, or a function
    whose first argument is the module; ``nn.capture(nn.Intermediate)`` is a decorator.

    Args:
      fn: what to run.
      *var_types: the variable types to capture.
      init: a State of starting values (paths relative to the module).
      method_outputs: a Variable type: every call of a public method (or ``__call__``)
        of a module under the root also sows its output in that type, named by the
        method (``captured["__call__"]``, ``captured["block"]["helper"]``); list the type
        in ``var_types`` to get it back.

    Raises:
      TypeError: ``method_outputs`` is not a Variable type, or the first argument is no
        module.

    >>> import jax.numpy as jnp
    >>> from cairn import nn
    >>> class Foo(nn.Module):
    ...     def __call__(self, x):
    ...         self.sow(nn.Intermediate, "h", 2 * x)
    ...         return x + 1
    >>> y, inter = nn.capture(Foo(), nn.Intermediate)(jnp.ones(2))
    >>> inter["h"].value[0].tolist()
    [2.0, 2.0]
    """
    if isinstance(fn, type) and issubclass(fn, Variable):
        return functools.partial(
            _capture_deferred, var_types=(fn, *var_types), init=init,
            method_outputs=method_outputs,
        )
    if method_outputs is not None and not (
        isinstance(method_outputs, type) and issubclass(method_outputs, Variable)
    ):
        raise TypeError(
            f"nn.capture: method_outputs must be a Variable type (e.g. nn.Intermediate), "
            f"got {method_outputs!r}"
        )
    bound = fn.__self__ if inspect.ismethod(fn) and isinstance(fn.__self__, Module) else None
    if isinstance(fn, Module):
        bound = fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        module = bound if bound is not None else args[0]
        if not isinstance(module, Module):
            raise TypeError(
                f"nn.capture: the first argument must be a module, got {type(module).__name__}"
            )
        types = tuple(var_types)
        before = _pop_all(module, types)
        if init is not None:
            _put_back(module, init)
        try:
            if method_outputs is None:
                result = fn(*args, **kwargs)
            else:
                with _sowing_methods(module, method_outputs):
                    result = fn(*args, **kwargs)
        finally:
            captured = _pop_all(module, types)
            _put_back(module, *before)
        if not types:
            return result
        return (result, *captured)

    return wrapper


def _pop_all(module: Module, types: tuple) -> tuple[State, ...]:
    if not types:
        return ()
    out = pop(module, *types)
    return out if isinstance(out, tuple) else (out,)


def _capture_deferred(fn: Any, *, var_types: tuple, init: Any, method_outputs: Any) -> Any:
    return capture(fn, *var_types, init=init, method_outputs=method_outputs)


@contextlib.contextmanager
def _sowing_methods(root: Module, var_type: type[Variable]) -> Iterator[None]:
    """Within the context, each public method of the module classes under ``root``
    sows its output as ``var_type`` named by the method; the classes are restored."""
    classes = {type(m) for _, m in iter_modules(root)}

    def sowing(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def method(self, *args, **kwargs):
            out = fn(self, *args, **kwargs)
            self.sow(var_type, name, out)
            return out

        return method

    with wrapped_methods(classes, sowing):
        yield


@contextlib.contextmanager
def wrapped_methods(classes: set[type], wrap: Callable[[str, Callable], Callable]) -> Iterator[None]:
    """Within the context, each public method ``name`` of each class in ``classes`` is
    ``wrap(name, method)``; afterwards every class has its own methods back."""
    saved: list[tuple[type, str, Any]] = []
    try:
        for cls in classes:
            for name, fn in public_methods(cls).items():
                saved.append((cls, name, cls.__dict__.get(name, _MISSING)))
                setattr(cls, name, wrap(name, fn))
        yield
    finally:
        for cls, name, orig in reversed(saved):
            if orig is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, orig)


_MISSING = object()
