"""The registry of kernel ops and their implementations, and the dispatch of one call.

An *op* (``"dot_product_attention"``) has several :class:`Implementation` s (``"xla"``,
``"pallas_triton"``, ``"pallas_mosaic_gpu"``). :func:`call` picks one per call:

1. the explicit ``implementation=`` argument (a name, or a sequence tried in order);
2. the innermost active :func:`cairn.kernels.override` block;
3. the autotune cache entry for (device kind, op, shape bucket);
4. the first implementation in the op's preference order that runs compiled on this
   backend and whose ``supports`` accepts the arguments, with its ``default_config``
   (a heuristic on shapes, dtype and backend: nothing is measured).

Each recorded :class:`cairn.kernels.KernelCall` names the rule that decided (``source``).

A Pallas implementation on a backend outside its ``platforms`` (the CPU) is used only when
asked for explicitly (rules 1-2), and then runs with ``interpret=True``.

GPU-only implementations are registered :func:`deferred`: the op module names the module
that holds the kernel, and that module (with Pallas Triton or Mosaic GPU behind it) is
imported the first time the implementation's code is needed. Dispatch on a CPU reads only
``platforms``, so ``import cairn.kernels`` and XLA-only use never import a GPU backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax

from cairn.kernels import _cache, _override, _trace


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One implementation of one op.

    Args:
      op: the op it implements (``"dot_product_attention"``, ``"ragged_dot"``, ...).
      name: ``"xla"``, ``"pallas_triton"`` or ``"pallas_mosaic_gpu"``.
      fn: ``fn(*args, config: Mapping[str, Any], interpret: bool, **kwargs) -> result``.
      platforms: the backends it runs compiled on: ``{"cpu", "gpu", "tpu"}`` for XLA,
        ``{"gpu"}`` for Pallas GPU kernels.
      configs: ``configs(*args, **kwargs)`` -> candidate configs for these arguments
        (looks at shapes and dtypes only); the autotuner measures each.
      default_config: ``default_config(*args, **kwargs)`` -> the config used without a
        tuned one; its keys (plus those of ``configs``) are the keys the implementation
        knows.
      supports: ``supports(*args, **kwargs)`` -> ``None``, or the reason it cannot take
        these arguments.
    """

    op: str
    name: str
    fn: Callable[..., Any]
    platforms: frozenset[str]
    configs: Callable[..., Sequence[Mapping[str, Any]]] = lambda *a, **k: ({},)
    default_config: Callable[..., Mapping[str, Any]] = lambda *a, **k: {}
    supports: Callable[..., str | None] = lambda *a, **k: None


class _Deferred:
    """Where a deferred implementation lives; imports it once, on first use, and checks it."""

    def __init__(self, op: str, name: str, module: str, attr: str, platforms: frozenset[str]) -> None:
        self.op, self.name, self.module, self.attr, self.platforms = op, name, module, attr, platforms
        self._impl: Implementation | None = None
        self._lock = threading.Lock()

    def load(self) -> Implementation:
        if self._impl is not None:
            return self._impl
        with self._lock:
            if self._impl is None:
                impl = getattr(importlib.import_module(self.module), self.attr, None)
                expected = (self.op, self.name, self.platforms)
                if not isinstance(impl, Implementation) or (impl.op, impl.name, impl.platforms) != expected:
                    raise TypeError(
                        f"{self.module}.{self.attr} must be the Implementation (op, name, platforms) = "
                        f"{expected} that was registered deferred, got {impl!r}"
                    )
                self._impl = impl
        return self._impl


class _Forward:
    """One field of a deferred implementation: calling it loads the module, then calls the real field."""

    def __init__(self, where: _Deferred, field: str) -> None:
        self.where, self.field = where, field

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.where.load(), self.field)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<deferred {self.where.module}.{self.where.attr}.{self.field}>"


def deferred(
    op: str, name: str, module: str, platforms: frozenset[str] | set[str], *, attr: str = "IMPLEMENTATION"
) -> Implementation:
    """An :class:`Implementation` whose code is imported from ``module`` on first use.

    Its ``fn``, ``configs``, ``default_config`` and ``supports`` import ``module`` when first
    called and forward to ``module.<attr>`` (an :class:`Implementation` with the same ``op``,
    ``name`` and ``platforms``). Only ``platforms`` is known without the import, which is
    all dispatch reads for an implementation that does not run compiled on this backend;
    so GPU kernels (Pallas Triton, Mosaic GPU) cost nothing to import on a CPU, and still
    run (interpreted) when asked for by name.

    Args:
      op: the op name.
      name: the implementation name (``"pallas_triton"``, ``"pallas_mosaic_gpu"``).
      module: the absolute module name holding the implementation.
      platforms: the backends it runs compiled on, as the real implementation says.
      attr: the module attribute that is the :class:`Implementation`.

    Returns:
      The implementation to pass to :func:`register`.

    Raises:
      TypeError: (on first use) ``module.<attr>`` is not an Implementation of this op,
        name and platforms.
    """
    where = _Deferred(op, name, module, attr, frozenset(platforms))
    return Implementation(
        op=op,
        name=name,
        fn=_Forward(where, "fn"),
        platforms=where.platforms,
        configs=_Forward(where, "configs"),
        default_config=_Forward(where, "default_config"),
        supports=_Forward(where, "supports"),
    )


@dataclasses.dataclass
class _Op:
    bucket: Callable[..., tuple[Any, ...]]
    preference: tuple[str, ...]
    impls: dict[str, Implementation] = dataclasses.field(default_factory=dict)
    example: Callable[..., tuple[Any, ...]] | None = None


_OPS: dict[str, _Op] = {}
_PENDING: dict[str, list[Implementation]] = {}


def register_op(
    op: str,
    *,
    bucket: Callable[..., tuple[Any, ...]],
    preference: Sequence[str] = ("pallas_mosaic_gpu", "pallas_triton", "xla"),
    example: Callable[..., tuple[Any, ...]] | None = None,
) -> None:
    """Declare ``op`` with its shape-bucket function and implementation preference.

    Args:
      op: the op name.
      bucket: ``bucket(*args, **kwargs)`` -> a JSON-able tuple (ints, strings, bools,
        ``None``) naming the shape bucket of a call: the autotune cache key. Shapes in
        one bucket (e.g. sequence lengths rounded up to a power of two) share a result.
      preference: implementation names in the order default dispatch tries them.
      example: ``example(*args, **kwargs)`` -> the positional arguments with every
        ``jax.ShapeDtypeStruct`` replaced by a representative value, for the autotuner
        (e.g. valid block tables and full lengths, where zeros would time an empty
        loop); ``None``: the generic values of ``cairn.kernels.autotune_op``.

    Raises:
      ValueError: if ``op`` is already declared.
    """
    if op in _OPS and not _same_source(_OPS[op].bucket, bucket):
        raise ValueError(f"op {op!r} is already registered")
    _OPS[op] = _Op(bucket, tuple(preference), _OPS[op].impls if op in _OPS else {}, example)
    for impl in _PENDING.pop(op, []):
        register(impl)


def register(impl: Implementation) -> None:
    """Add ``impl`` to its op (the op may be declared before or after).

    Args:
      impl: the :class:`Implementation` to add.

    Raises:
      ValueError: if ``(impl.op, impl.name)`` is already registered.
    """
    if impl.op not in _OPS:
        pending = _PENDING.setdefault(impl.op, [])
        if any(p.name == impl.name and not _same_source(p.fn, impl.fn) for p in pending):
            raise ValueError(
                f"implementation {impl.name!r} of op {impl.op!r} is already registered"
            )
        pending[:] = [p for p in pending if p.name != impl.name] + [impl]
        return
    impls = _OPS[impl.op].impls
    if impl.name in impls and not _same_source(impls[impl.name].fn, impl.fn):
        raise ValueError(f"implementation {impl.name!r} of op {impl.op!r} is already registered")
    impls[impl.name] = impl


def register_builtin(
    op: str,
    *,
    bucket: Callable[..., tuple[Any, ...]],
    xla: Callable[..., Any],
    gpu: Mapping[str, str],
    xla_configs: Callable[..., Sequence[Mapping[str, Any]]] | None = None,
    xla_default_config: Callable[..., Mapping[str, Any]] | None = None,
    **op_options: Any,
) -> None:
    """Declare one of cairn.kernels' own ops: the op, its XLA implementation (CPU, GPU, TPU)
    and its GPU implementations, each loaded on first use (:func:`deferred`), so importing
    cairn.kernels on a CPU loads no Triton or Mosaic GPU code.

    Registered once: a module imported a second time under another name (a doctest run)
    registers nothing again.

    Args:
      op: the op's name.
      bucket, op_options: as for :func:`register_op` (``preference``, ``example``).
      xla: the XLA implementation's function.
      gpu: ``{implementation name: module}`` of the GPU implementations
        (``{"pallas_triton": "cairn.kernels._glu.pallas_triton"}``).
      xla_configs, xla_default_config: the XLA implementation's configs, if it has any.
    """
    if op in _OPS:
        return
    register_op(op, bucket=bucket, **op_options)
    tuning: dict[str, Any] = {}
    if xla_configs is not None:
        tuning["configs"] = xla_configs
    if xla_default_config is not None:
        tuning["default_config"] = xla_default_config
    register(Implementation(op, "xla", xla, frozenset({"cpu", "gpu", "tpu"}), **tuning))
    for name, module in gpu.items():
        register(deferred(op, name, module, {"gpu"}))


def _same_source(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    """Whether two functions come from the same line of the same file.

    A module imported a second time under another name (pytest's doctest collection
    does this) re-registers its ops; that replaces the entry instead of raising. Two
    :func:`deferred` implementations are the same when they name the same module attribute.
    """
    if isinstance(a, _Forward) and isinstance(b, _Forward):
        return (a.where.module, a.where.attr, a.field) == (b.where.module, b.where.attr, b.field)
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if ca is None or cb is None:
        return False
    return (ca.co_filename, ca.co_firstlineno) == (cb.co_filename, cb.co_firstlineno)


def ops() -> list[str]:
    """The registered op names, sorted."""
    return sorted(_OPS)


def implementations(op: str) -> dict[str, Implementation]:
    """The implementations of ``op`` by name.

    Args:
      op: the op name.

    Raises:
      ValueError: if ``op`` is not registered.
    """
    return dict(_get_op(op).impls)


def example_args(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """``args`` with abstract values made concrete by the op's ``example`` hook (unchanged without one)."""
    hook = _get_op(op).example
    if hook is None or not any(isinstance(a, jax.ShapeDtypeStruct) for a in args):
        return args
    return tuple(hook(*args, **kwargs))


def _get_op(op: str) -> _Op:
    if op not in _OPS:
        raise ValueError(f"unknown kernel op {op!r}; registered ops: {sorted(_OPS)}")
    return _OPS[op]


_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "cairn_kernels_target", default=None
)


@contextlib.contextmanager
def cross_compile(platform: str) -> Iterator[None]:
    """Dispatch as if the backend were ``platform`` (``"gpu"``, ``"tpu"``, ``"cpu"``).

    For lowering on a machine without that device, e.g. ``jax.export(...,
    platforms=["cuda"])`` on a CPU host: inside the block Pallas GPU kernels are used
    compiled (``interpret=False``) and chosen by the usual rules for ``platform``.

    Args:
      platform: ``"gpu"``, ``"tpu"`` or ``"cpu"``.

    Raises:
      ValueError: an unknown platform.
    """
    if platform not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"cross_compile platform must be 'cpu', 'gpu' or 'tpu', got {platform!r}")
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


def backend() -> str:
    """The backend kernels are chosen for: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (see :func:`cross_compile`)."""
    target = _TARGET.get()
    if target is not None:
        return target
    name = jax.default_backend()
    return "gpu" if name in ("gpu", "cuda", "rocm") else name


def bucket_key(op: str, *args: Any, **kwargs: Any) -> str:
    """The autotune-cache key (JSON text) of a call's shape bucket."""
    return json.dumps(list(_get_op(op).bucket(*args, **kwargs)), separators=(",", ":"))


def _lookup(op: str, name: str) -> Implementation:
    impls = _get_op(op).impls
    if name not in impls:
        raise ValueError(
            f"unknown implementation {name!r} for op {op!r}: implementation= must be one of {sorted(impls)}"
        )
    return impls[name]


def _explicit(op: str, requested: str | Sequence[str], args: Any, kwargs: Any) -> Implementation:
    names = [requested] if isinstance(requested, str) else list(requested)
    if not names:
        raise ValueError(f"implementation= for op {op!r} is an empty sequence")
    impls = [_lookup(op, n) for n in names]
    reasons = [(i, i.supports(*args, **kwargs)) for i in impls]
    # in a sequence, an implementation that runs compiled here beats an interpreted one
    for impl, reason in reasons:
        if reason is None and backend() in impl.platforms:
            return impl
    for impl, reason in reasons:
        if reason is None:
            return impl
    why = "; ".join(f"{i.name}: {r}" for i, r in reasons)
    raise ValueError(
        f"implementation={requested!r} cannot run op {op!r} on these arguments ({why})"
    )


def _default(op: str, args: Any, kwargs: Any) -> Implementation:
    entry = _get_op(op)
    for name in entry.preference:
        impl = entry.impls.get(name)
        if (
            impl is not None
            and backend() in impl.platforms
            and impl.supports(*args, **kwargs) is None
        ):
            return impl
    raise ValueError(
        f"no implementation of op {op!r} runs on backend {backend()!r} with these arguments; "
        f"reasons: { {n: i.supports(*args, **kwargs) for n, i in entry.impls.items()} }"
    )


def resolve(
    op: str,
    *args: Any,
    implementation: str | Sequence[str] | None = None,
    config: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Implementation, dict[str, Any]]:
    """The implementation and full config :func:`call` would use (see the module docstring).

    Raises:
      ValueError: unknown op or implementation name; an explicitly requested
        implementation that cannot take the arguments (the reason is named); a config
        key the implementation does not know.
    """
    impl, cfg, _, _ = _resolve(op, args, kwargs, implementation, config)
    return impl, cfg


def _resolve(
    op: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    implementation: str | Sequence[str] | None,
    config: Mapping[str, Any] | None,
) -> tuple[Implementation, dict[str, Any], str, dict[str, Any]]:
    """:func:`resolve`, plus the rule that decided (``KernelCall.source``) and the cache record."""
    over_impl, over_config = _override.active_override(op)
    requested = implementation if implementation is not None else over_impl
    tuned: Mapping[str, Any] | None = None
    measured: dict[str, Any] = {}
    if requested is not None:
        impl = _explicit(op, requested, args, kwargs)
        impl_source = "argument" if implementation is not None else "override"
    else:
        found, tuned, measured = _cached(op, args, kwargs)
        impl = found if found is not None else _default(op, args, kwargs)
        impl_source = ("cache" if "file" in measured else "autotune") if found is not None else "default"
    chosen = config if config is not None else over_config if over_config is not None else tuned
    config_source = "argument" if config is not None else "override" if over_config is not None else impl_source
    # the first rule (in dispatch order) that gave the implementation or the config
    source = min(impl_source, config_source, key=_SOURCE_ORDER.index)
    if source not in ("cache", "autotune"):
        measured = {}
    return impl, full_config(impl, chosen, *args, **kwargs), source, measured


_SOURCE_ORDER = ("argument", "override", "cache", "autotune", "default")


def _cached(
    op: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Implementation | None, Mapping[str, Any] | None, dict[str, Any]]:
    """The autotune cache's implementation and config for this call, if usable here, and its record."""
    hit = _cache.lookup_entry(_cache.device_kind(), op, bucket_key(op, *args, **kwargs))
    if hit is None:
        return None, None, {}
    entry, origin = hit
    cand = _get_op(op).impls.get(entry["implementation"])
    if cand is None or backend() not in cand.platforms or cand.supports(*args, **kwargs) is not None:
        return None, None, {}
    measured = dict(entry.get("measured", {}), time_ms=entry["time_ms"])
    if origin is not None:
        measured["file"] = origin
    return cand, dict(entry["config"]), measured


def full_config(
    impl: Implementation, config: Mapping[str, Any] | None, *args: Any, **kwargs: Any
) -> dict[str, Any]:
    """``impl``'s default config for these arguments updated by ``config``.

    Raises:
      ValueError: if ``config`` has a key the implementation does not know.
    """
    base = dict(impl.default_config(*args, **kwargs))
    if not config:
        return base
    known = set(base)
    for cand in impl.configs(*args, **kwargs):
        known.update(cand)
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(
            f"config key(s) {unknown} unknown to implementation {impl.name!r} of op {impl.op!r}; "
            f"known keys: {sorted(known)}"
        )
    base.update(config)
    return base


def call(
    op: str,
    *args: Any,
    implementation: str | Sequence[str] | None = None,
    config: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``op`` on ``args`` with the implementation and config :func:`resolve` picks.

    The call runs inside ``jax.named_scope(f"cairn_kernels.{op}.{implementation}")`` and is
    reported to :func:`cairn.kernels.recording` blocks (op, argument shapes and dtypes,
    implementation, config, and where the choice came from: ``KernelCall.source``).

    Args:
      op: the op name (``"dot_product_attention"``, ``"ragged_dot"``...).
      args: the op's positional arguments.
      implementation: an implementation name, or names to choose from in order; None lets
        :func:`resolve` pick.
      config: the config to run with; None uses the override, the cache or the default.
      kwargs: the op's keyword arguments.

    Raises:
      ValueError: as :func:`resolve`.
    """
    impl, cfg, source, measured = _resolve(op, args, kwargs, implementation, config)
    interpret = backend() not in impl.platforms
    _trace.record(
        _trace.KernelCall(
            op=op,
            implementation=impl.name,
            config=cfg,
            args=tuple(_trace.abstract(a) for a in args),
            kwargs={k: _trace.abstract(v) for k, v in kwargs.items()},
            interpret=interpret,
            source=source,
            measured=measured,
        )
    )
    with jax.named_scope(f"{_trace.SCOPE_PREFIX}{op}.{impl.name}"):
        return impl.fn(*args, config=cfg, interpret=interpret, **kwargs)
