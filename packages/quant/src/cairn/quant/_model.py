"""``quantize_model``: a callable pytree (a cairn.nn or Flax NNX module) run quantized.

The model is a pytree whose leaves are its weights and state. A call traces
``model(*args)`` on a copy rebuilt from the leaves, rewrites that program like
:func:`~cairn.quant.quantize` (weight paths are the model's own paths,
``layers/0/mlp/kernel``), and returns the output together with the copy's leaves after
the call (a leaf the call did not change is the original leaf, so a stored ``QArray``
weight stays that ``QArray``). Whatever the call changed (BatchNorm statistics, KV caches, Rngs counters) is
then written back into the *same* objects of the original model, attribute by
attribute, so references the user holds (and the module a ``nn.jit`` or ``nn.grad``
trace merged) see the change. No module library is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cairn.quant._api import quantize
from cairn.quant._providers import QuantizationProvider

__all__ = ["quantize_model", "QuantizedModel"]

_MISSING = object()


def _is_array_like(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not hasattr(x, "__dict__")


def _attribute_names(obj: Any) -> list[tuple[str, bool]]:
    """``(name, is_slot)`` of every attribute: ``__dict__`` entries, then ``__slots__``."""
    names: list[tuple[str, bool]] = [(n, False) for n in getattr(obj, "__dict__", {})]
    seen = {n for n, _ in names}
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if slot not in ("__dict__", "__weakref__") and slot not in seen:
                names.append((slot, True))
                seen.add(slot)
    return names


def _set(obj: Any, name: str, value: Any, is_slot: bool) -> None:
    """Set through the class's own ``__setattr__`` (so a module library notices structural
    changes), except for slots, which are storage the class manages itself."""
    if not is_slot:
        try:
            setattr(obj, name, value)
            return
        except (AttributeError, TypeError):
            pass
    object.__setattr__(obj, name, value)


def _descend(old: Any, new: Any) -> bool:
    """Whether ``old`` is updated in place from ``new`` rather than replaced by it."""
    if type(old) is not type(new) or _is_array_like(old) or isinstance(old, tuple | str | bytes):
        return False
    return isinstance(old, list | dict) or bool(_attribute_names(old))


def _sync(old: Any, new: Any, seen: set[int]) -> None:
    """Make ``old`` equal ``new`` in place, keeping the identity of every object in ``old``."""
    if old is new or id(old) in seen:
        return
    seen.add(id(old))
    if isinstance(old, list):
        if len(old) != len(new):
            old[:] = new
            return
        for i, (o, n) in enumerate(zip(old, new)):
            if _descend(o, n):
                _sync(o, n, seen)
            elif o is not n:
                old[i] = n
        return
    if isinstance(old, dict):
        for key in [k for k in old if k not in new]:
            del old[key]
        for key, n in new.items():
            o = old.get(key, _MISSING)
            if o is not _MISSING and _descend(o, n):
                _sync(o, n, seen)
            elif o is not n:
                old[key] = n
        return
    for name, is_slot in _attribute_names(new):
        n = getattr(new, name, _MISSING)
        o = getattr(old, name, _MISSING)
        if n is _MISSING:
            continue
        if o is not _MISSING and _descend(o, n):
            _sync(o, n, seen)
        elif o is not n:
            _set(old, name, n, is_slot)


class QuantizedModel:
    """``model`` called through the provider's rules; attribute access reaches ``model``.

    A JAX pytree whose one child is the model, so it passes through ``jax.jit``,
    ``nn.jit``, ``nn.grad`` and checkpointing like the model itself.

    Args:
      model: the wrapped callable pytree (a cairn.nn or Flax NNX module...).
      provider: the provider whose rules quantize its dots.
      method: the name of the model's method that calling the wrapper runs.
    """

    def __init__(self, model: Any, provider: QuantizationProvider, method: str = "__call__") -> None:
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "provider", provider)
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "_fn", _calls(provider, method))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out, after = self._fn(self.model, *args, **kwargs)
        _sync(self.model, after, set())
        return out

    def __getattr__(self, name: str) -> Any:
        if name in ("model", "provider", "method", "_fn"):
            raise AttributeError(name)
        return getattr(self.model, name)

    def __repr__(self) -> str:
        return f"QuantizedModel({type(self.model).__name__}, {type(self.provider).__name__}, method={self.method!r})"


_CALLS: dict[tuple[int, str], tuple[QuantizationProvider, Callable]] = {}


def _calls(provider: QuantizationProvider, method: str) -> Callable:
    """One quantized caller per (provider, method), so its trace cache outlives wrappers."""
    hit = _CALLS.get((id(provider), method))
    if hit is not None and hit[0] is provider:
        return hit[1]

    def call(model: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        out = getattr(model, method)(*args, **kwargs)
        return out, model

    call.__qualname__ = f"{method} of the model"
    fn = quantize(call, provider)
    _CALLS[(id(provider), method)] = (provider, fn)
    return fn


def _register() -> None:
    import jax

    jax.tree_util.register_pytree_with_keys(
        QuantizedModel,
        lambda q: (((jax.tree_util.GetAttrKey("model"), q.model),), (q.provider, q.method)),
        lambda aux, children: QuantizedModel(next(iter(children)), *aux),
    )


_register()


def quantize_model(model: Any, provider: QuantizationProvider, *model_inputs: Any, method: str = "__call__") -> QuantizedModel:
    """Wrap ``model`` so that calling it runs quantized by ``provider``'s rules.

    Args:
      model: a callable pytree (a cairn.nn ``Module``, a Flax NNX module, or any
        registered pytree with a ``method``); its parameters are the weights (unless the
        provider's ``weight_filter`` says otherwise), named by their paths in the model,
        and a rule's ``module_path`` names the module holding one (``blocks/0/mlp``).
      provider: a ``PtqProvider`` or ``QtProvider``.
      *model_inputs: optional example inputs: the model is traced on them at once (shapes
        only, nothing is run or changed), so an unmatched rule fails here.
      method: the model method that is called.

    Returns:
      A :class:`QuantizedModel`; ``qmodel(x)`` mutates ``model`` exactly as ``model(x)``
      would (BatchNorm statistics, caches, Rngs counters).
    """
    qmodel = QuantizedModel(model, provider, method)
    if model_inputs:
        import jax

        jax.eval_shape(lambda m, *a: qmodel._fn(m, *a)[0], model, *model_inputs)
    return qmodel
