"""Autotuning by measurement across every implementation and config available on the device.

:func:`autotune_op` times each (implementation, config) pair that runs compiled on the
current backend and accepts the arguments, and stores the fastest in the autotune cache
under (device kind, op, shape bucket); later calls in the same bucket use it.
:func:`autotune` does this for every kernel op a function calls (found by tracing it
once), which is what ``cairn-autotune`` runs offline.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn.core_array import QArray
from cairn.kernels import _cache, _registry, _trace

_LOG = logging.getLogger("cairn.kernels")


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One timed candidate: ``time_ms`` (best of the runs) or the ``error`` that ruled it out.

    Args:
      implementation: the candidate implementation's name.
      config: the candidate config.
      time_ms: its time in milliseconds (best of the runs), or None when it failed.
      error: why the candidate was ruled out, or None.
    """

    implementation: str
    config: Mapping[str, Any]
    time_ms: float | None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class AutotuneEntry:
    """The result for one (op, bucket): the winner and every candidate measured.

    ``measured`` records when, where and under what load it was measured
    (:func:`cairn.kernels.measurement_context`; empty for a schema-1 cache entry);
    ``origin`` is the cache file it was taken from when :func:`autotune` reused a cached
    entry (``force=False``), ``None`` when it was measured now.

    Args:
      op: the op name (``"dot_product_attention"``...).
      bucket: the shape bucket the entry is for (a string key built from the arguments' shapes and
        dtypes).
      implementation: the winning implementation's name.
      config: the winning config.
      time_ms: the winner's time in milliseconds (best of the runs).
      candidates: every candidate measured, winners and losers, as :class:`Measurement` s.
      measured: the measurement record (:func:`measurement_context`); empty for a schema-1 entry.
      origin: the cache file the entry was read from; None when measured in this process.
    """

    op: str
    bucket: str
    implementation: str
    config: Mapping[str, Any]
    time_ms: float
    candidates: tuple[Measurement, ...]
    measured: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    origin: str | None = None

    @classmethod
    def from_json(cls, op: str, bucket: str, doc: Mapping[str, Any], origin: str | None = None) -> AutotuneEntry:
        """An entry from its cache-file form (see ``cache_schema.json``).

        Args:
          op: the op name.
          bucket: the shape bucket.
          doc: the entry's JSON object from the cache file.
          origin: the path of the file it came from, or None.
        """
        cands = tuple(
            Measurement(c["implementation"], dict(c["config"]), c.get("time_ms"), c.get("error"))
            for c in doc.get("candidates", ())
        )
        return cls(op, bucket, str(doc["implementation"]), dict(doc["config"]), float(doc["time_ms"]),
                   cands, dict(doc.get("measured", {})), origin)

    def to_json(self) -> dict[str, Any]:
        """The cache-file form of this entry (see ``cache_schema.json``)."""
        cands = []
        for m in self.candidates:
            item: dict[str, Any] = {
                "implementation": m.implementation,
                "config": dict(m.config),
                "time_ms": m.time_ms,
            }
            if m.error is not None:
                item["error"] = m.error
            cands.append(item)
        doc = {
            "implementation": self.implementation,
            "config": dict(self.config),
            "time_ms": self.time_ms,
            "candidates": cands,
        }
        if self.measured:
            doc["measured"] = dict(self.measured)
        return doc


@dataclasses.dataclass(frozen=True)
class AutotuneResult:
    """What :func:`autotune` measured: one :class:`AutotuneEntry` per (op, bucket).

    Args:
      device_kind: the device kind measured on (``jax.devices()[0].device_kind``).
      entries: one :class:`AutotuneEntry` per (op, bucket).
    """

    device_kind: str
    entries: tuple[AutotuneEntry, ...]

    def save(self, path: str | pathlib.Path | None = None) -> pathlib.Path:
        """Write the device kind's cache file (default: the user cache directory), atomically.

        Args:
          path: the cache file to write; None uses ``cache_dir() / "<device kind>.json"``.

        Returns:
          the path written.
        """
        return _cache.save(self.device_kind, path)

    def table(self) -> str:
        """A text table: op, implementation, time, config, bucket, and where each came from."""
        lines = [f"{'op':28} {'implementation':18} {'time ms':>9}  config / bucket / source"]
        for e in self.entries:
            source = "cache" if e.origin is not None else "autotune"
            lines.append(
                f"{e.op:28} {e.implementation:18} {e.time_ms:9.3f}  {dict(e.config)} {e.bucket}"
                f"  [{_trace.describe_source(source, {**e.measured, 'file': e.origin})}]"
            )
        return "\n".join(lines)


def example_value(spec: Any, seed: int = 0) -> Any:
    """A concrete argument for a ``jax.ShapeDtypeStruct`` (other values pass through).

    Floats are standard normal, integers zero (one segment), booleans ``True``, PRNG keys
    ``jax.random.key(seed)``. An op may supply its own (``register_op(..., example=)``,
    e.g. ``paged_attention``'s valid block tables and full lengths); those come first.
    """
    if not isinstance(spec, jax.ShapeDtypeStruct):
        return spec
    dtype = spec.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return jax.random.split(jax.random.key(seed), int(np.prod(spec.shape))).reshape(spec.shape)
    if jnp.issubdtype(dtype, jnp.floating):
        return jax.random.normal(jax.random.key(seed), spec.shape, jnp.float32).astype(dtype)
    if dtype == jnp.bool_:
        return jnp.ones(spec.shape, bool)
    return jnp.zeros(spec.shape, dtype)


def _round_robin(
    candidates: list[tuple[str, dict[str, Any], Any]], flat: tuple[Any, ...], iterations: int
) -> list[Measurement]:
    """Best-of-``iterations`` ms per candidate, timed in turns (candidate 1, 2, ..., 1, 2, ...).

    Taking turns spreads other load on a shared machine over all candidates alike, and
    the minimum is the run least disturbed, so the ranking is the most repeatable.
    """
    best = [float("inf")] * len(candidates)
    for _ in range(max(1, iterations)):
        for i, (_, _, fn) in enumerate(candidates):
            start = time.perf_counter()
            jax.block_until_ready(fn(*flat))
            best[i] = min(best[i], (time.perf_counter() - start) * 1e3)
    return [Measurement(name, cfg, ms) for (name, cfg, _), ms in zip(candidates, best, strict=True)]


def _compile_candidates(
    op: str,
    impls: Mapping[str, _registry.Implementation],
    names: list[str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mode: str,
    interpret: bool,
) -> tuple[list[tuple[str, dict[str, Any], Any]], list[Measurement]]:
    """Every (implementation, config) that runs here, compiled and run once; failures recorded."""
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    statics = {k: v for k, v in kwargs.items() if k not in arrays}
    flat = (*args, *arrays.values())
    ok: list[tuple[str, dict[str, Any], Any]] = []
    failed: list[Measurement] = []
    for name in names:
        if name not in impls:
            raise ValueError(
                f"unknown implementation {name!r} for op {op!r}; valid: {sorted(impls)}"
            )
        impl = impls[name]
        on_device = _registry.backend() in impl.platforms
        if (not on_device and not interpret) or impl.supports(*args, **kwargs) is not None:
            continue
        for cfg in impl.configs(*args, **kwargs):
            full = _registry.full_config(impl, cfg, *args, **kwargs)
            fn = _runner(impl, full, statics, list(arrays), len(args), not on_device, mode)
            try:
                jax.block_until_ready(fn(*flat))  # compile and warm up
                ok.append((name, full, fn))
            except Exception as e:  # a config that does not fit (resources, shapes) is skipped
                failed.append(Measurement(name, full, None, f"{type(e).__name__}: {e}"[:300]))
    return ok, failed


def _runner(
    impl: _registry.Implementation,
    cfg: Mapping[str, Any],
    statics: Mapping[str, Any],
    names: list[str],
    n_args: int,
    interpret: bool,
    mode: str,
) -> Callable[..., Any]:
    def forward(*flat: Any) -> Any:
        kw = dict(statics, **dict(zip(names, flat[n_args:], strict=True)))
        return impl.fn(*flat[:n_args], config=cfg, interpret=interpret, **kw)

    if mode == "fwd":
        return jax.jit(forward)
    if mode != "fwd_bwd":
        raise ValueError(f"mode must be 'fwd' or 'fwd_bwd', got {mode!r}")

    def loss(*flat: Any) -> Any:
        out = forward(*flat)
        return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(out))

    def value_and_grad(*flat: Any) -> Any:
        # only float arrays are differentiated (not group sizes, segment ids or QArrays)
        floats = tuple(i for i in range(n_args) if _differentiable(flat[i]))
        if not floats:
            return loss(*flat), ()
        return jax.value_and_grad(loss, argnums=floats)(*flat)

    return jax.jit(value_and_grad)


def _differentiable(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return (
        not isinstance(x, QArray) and dtype is not None and bool(jnp.issubdtype(jnp.dtype(dtype), jnp.inexact))
    )


def autotune_op(
    op: str,
    *args: Any,
    implementations: Sequence[str] | None = None,
    iterations: int = 5,
    mode: str = "fwd",
    interpret: bool = False,
    store: bool = True,
    **kwargs: Any,
) -> AutotuneEntry:
    """Time every (implementation, config) of ``op`` on these arguments; cache the fastest.

    Args:
      op: the op name (``"dot_product_attention"``).
      *args: the op's positional arguments (arrays or ``jax.ShapeDtypeStruct``).
      implementations: restrict the candidates (default: every implementation that runs
        compiled on this backend).
      iterations: timed runs per candidate, in turns with the others (the best is kept), after a compile + warm-up run.
      mode: ``"fwd"`` times the forward, ``"fwd_bwd"`` forward plus gradient.
      interpret: also time Pallas implementations in interpret mode (for testing the
        machinery on a CPU; interpreter timings say nothing about a GPU).
      store: put the winner into the in-process autotune cache.
      **kwargs: the op's keyword arguments as :func:`cairn.kernels.call` gets them.

    Returns:
      The winner and every measurement.

    Raises:
      ValueError: unknown op or implementation, or no candidate ran.
    """
    impls = _registry.implementations(op)
    names = list(impls) if implementations is None else list(implementations)
    args = _registry.example_args(op, tuple(args), kwargs)
    args = tuple(example_value(a, i) for i, a in enumerate(args))
    kwargs = {k: example_value(v, 100 + i) for i, (k, v) in enumerate(kwargs.items())}
    candidates, failed = _compile_candidates(op, impls, names, args, kwargs, mode, interpret)
    flat = (*args, *(v for v in kwargs.values() if isinstance(v, jax.Array)))
    results = _round_robin(candidates, flat, iterations) + failed
    timed = [m for m in results if m.time_ms is not None]
    if not timed:
        raise ValueError(
            f"autotune: no implementation of op {op!r} ran on these arguments: {results}"
        )
    best = min(timed, key=lambda m: m.time_ms or 0.0)
    key = _registry.bucket_key(op, *args, **kwargs)
    context = _cache.measurement_context(mode=mode, iterations=max(1, iterations))
    entry = AutotuneEntry(
        op, key, best.implementation, dict(best.config), float(best.time_ms or 0.0), tuple(results),
        context,
    )
    if store:
        _cache.put(_cache.device_kind(), op, key, entry.to_json())
    _LOG.info(
        "cairn.kernels: autotuned %s %s -> %s %s (%.3f ms, load %s on %d CPUs)",
        op,
        key,
        best.implementation,
        best.config,
        entry.time_ms,
        context["loadavg"],
        context["cpu_count"],
    )
    return entry


def autotune(
    fn: Callable[..., Any],
    *args: Any,
    iterations: int = 5,
    mode: str = "fwd",
    save: bool = False,
    force: bool = True,
    **kwargs: Any,
) -> AutotuneResult:
    """Autotune every kernel op ``fn(*args, **kwargs)`` calls (Tokamax's ``autotune``).

    ``fn`` is traced once (:func:`cairn.kernels.ops_in`); each distinct (op, shape bucket)
    is measured with :func:`autotune_op` across all implementations and configs, and
    the winners go to the in-process cache (and, with ``save=True``, to the user cache
    file). Later calls of ``fn`` dispatch to the winners.

    Args:
      fn: a JAX function calling kernel ops.
      *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).
      iterations: as :func:`autotune_op`.
      mode: as :func:`autotune_op`.
      save: also write the user cache file.
      force: measure every bucket (the default); ``False`` reuses an entry already read
        from a cache file and measured in the same ``mode`` (``cairn-kernels tune`` without
        ``--force``) and measures the rest.
      **kwargs: static keyword arguments of ``fn``.

    Returns:
      An :class:`AutotuneResult` (``.table()``, ``.save()``).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import cairn.kernels as ck
      >>> q = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32)
      >>> result = ck.autotune(lambda q: ck.dot_product_attention(q, q, q), q, iterations=1)
      >>> [e.op for e in result.entries]
      ['dot_product_attention']
    """
    seen: set[tuple[str, str]] = set()
    entries = []
    for call in _trace.ops_in(fn, *args, **kwargs):
        key = (call.op, _registry.bucket_key(call.op, *call.args, **call.kwargs))
        if key in seen:
            continue
        seen.add(key)
        cached = None if force else _cache.lookup_entry(_cache.device_kind(), *key)
        if cached is not None and cached[1] is not None and cached[0].get("measured", {}).get("mode", mode) == mode:
            entries.append(AutotuneEntry.from_json(*key, cached[0], origin=cached[1]))
            continue
        entries.append(
            autotune_op(call.op, *call.args, iterations=iterations, mode=mode, **call.kwargs)
        )
    result = AutotuneResult(_cache.device_kind(), tuple(entries))
    if save:
        result.save()
    return result
