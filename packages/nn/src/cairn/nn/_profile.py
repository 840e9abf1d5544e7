"""Profiles without a UI: a jax.profiler trace of a window of steps, read back into a
per-module time table (from the named scopes module calls add), a roofline line and the
memory footprint of each compiled step."""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

#: The file :meth:`Profiler.summary` writes into the log directory.
SUMMARY_FILE = "profile_summary.json"
_TOP = "(no module)"
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations)=\{?([^,}]*(?:, %[\w.\-]+)*)\}?")
_WRAPPED = re.compile(r"^[A-Za-z_][\w]*\((.*)\)$")


def scope_of(op_name: str) -> tuple[str, bool]:
    """``(module path, backward)`` of an XLA op from its ``op_name`` metadata.

    ``jit(step)/transpose(jvp(blocks/0))/l1/dot_general`` is op ``dot_general`` of
    ``blocks/0/l1`` in the backward pass: ``jit``/``pjit`` frames are dropped, transform
    frames (``jvp(...)``, ``transpose(...)``, ``vmap(...)``, ``remat(...)``) are unwrapped
    to the scopes they hold, and the last component (the primitive) is dropped. An op
    outside every module has the path ``""``.

    Args:
      op_name: an XLA op's ``op_name`` metadata.

    >>> scope_of("jit(pure)/transpose(jvp(blocks/0))/l1/dot_general")
    ('blocks/0/l1', True)
    >>> scope_of("jit(pure)/jvp(norm)/rsqrt"), scope_of("jit(pure)/mul")
    (('norm', False), ('', False))
    """
    name = op_name.split(";")[0]
    parts: list[str] = []
    depth, cur = 0, ""
    for ch in name:  # split on "/" outside parentheses
        if ch == "/" and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += (ch == "(") - (ch == ")")
        cur += ch
    parts.append(cur)
    out: list[str] = []
    backward = False
    for part in parts[:-1]:
        if re.match(r"^p?jit\(", part):
            continue
        while (m := _WRAPPED.match(part)) is not None:
            backward |= part.startswith("transpose(")
            part = m.group(1)
        out += [p for p in scope_of(part + "/x")[0].split("/") if p] if "(" in part else [p for p in part.split("/") if p]
    return "/".join(out), backward


def parse_hlo(text: str) -> tuple[str, dict[str, list[str]]]:
    """``(module name, {instruction: op_names})`` of an HLO module's text; a fusion or a
    call lists the op names of every instruction of the computations it calls."""
    module = text.split("\n", 1)[0].split()[1].rstrip(",") if text.startswith("HloModule") else ""
    comps: dict[str, list[tuple[str, list[str], list[str]]]] = {}
    current: list[tuple[str, list[str], list[str]]] | None = None
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h is not None:
            current = comps.setdefault(h.group(1), [])
            continue
        m = _INSTR.match(line)
        if m is None or current is None:
            continue
        called = [c.strip().lstrip("%") for cs in _CALLS.findall(line) for c in cs.split(",") if c.strip()]
        current.append((m.group(1), _OP_NAME.findall(line)[:1], called))

    def names_in(comp: str, seen: set[str]) -> list[str]:
        if comp in seen:
            return []
        seen.add(comp)
        out: list[str] = []
        for _, ops, called in comps.get(comp, []):
            out += ops
            for c in called:
                out += names_in(c, seen)
        return out

    table: dict[str, list[str]] = {}
    for instrs in comps.values():
        for name, ops, called in instrs:
            inner = [n for c in called for n in names_in(c, set())]
            table[name] = inner or ops
    return module, table


def _common_scope(op_names: list[str]) -> tuple[str, bool]:
    scopes = [scope_of(n) for n in op_names if not n.startswith("keep[")]
    if not scopes:
        return "", False
    paths = [s.split("/") if s else [] for s, _ in scopes]
    common: list[str] = []
    for parts in zip(*paths, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return "/".join(common), any(b for _, b in scopes)


def measure_peak(device: Any = None, *, repeats: int = 3) -> dict[str, Any]:
    """Measured peak of ``device`` (default: the first device): matmul FLOP/s (float32
    1024x1024 on CPU, bfloat16 8192x8192 on accelerators) and memory bandwidth (``x + 1``
    over 64 MiB on CPU, 512 MiB elsewhere: well past the caches; read plus write), the best
    of ``repeats``.

    Args:
      device: the device to measure; None uses the first.
      repeats: runs per measurement; the best is kept.
    """
    device = device or jax.devices()[0]
    cpu = device.platform == "cpu"
    n, dtype = (1024, jnp.float32) if cpu else (8192, jnp.bfloat16)
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    mm = jax.jit(lambda x: x @ x)
    m = (64 if cpu else 512) * 2**20 // 4
    v = jax.device_put(jnp.ones((m,), jnp.float32), device)
    add = jax.jit(lambda x: x + 1.0)

    def best(fn: Callable, x: Any) -> float:
        jax.block_until_ready(fn(x))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - t0)
        return min(times)

    return {
        "device": str(device.device_kind),
        "platform": device.platform,
        "flops_per_s": 2 * n**3 / best(mm, a),
        "bytes_per_s": 2 * 4 * m / best(add, v),
        "matmul": f"{jnp.dtype(dtype).name}[{n},{n}] @ [{n},{n}]",
    }


def _cost(compiled: Any) -> dict[str, float]:
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older JAX: one dict per computation
        cost = cost[0] if cost else {}
    cost = cost or {}
    return {
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "transcendentals": float(cost.get("transcendentals", 0.0)),
    }


def _memory(compiled: Any) -> dict[str, int]:
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    fields = ("argument", "output", "alias", "temp", "generated_code")
    out = {f"{f}_bytes": int(getattr(stats, f"{f}_size_in_bytes", 0)) for f in fields}
    out["total_bytes"] = out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
    return out


def roofline(cost: dict[str, float], seconds: float, peak: dict[str, Any]) -> dict[str, Any]:
    """One roofline line: achieved FLOP/s and bytes/s of a step that took ``seconds``, its
    arithmetic intensity against the machine's ridge point, and the time the roofline
    allows (``max(flops / peak FLOP/s, bytes / peak bytes/s)``) as a fraction of ``seconds``.

    Args:
      cost: ``{"flops": ..., "bytes_accessed": ...}`` of one step (XLA's cost analysis).
      seconds: the step's measured time.
      peak: ``{"flops_per_s": ..., "bytes_per_s": ...}``, e.g. from :func:`measure_peak`.

    >>> r = roofline({"flops": 4e9, "bytes_accessed": 1e9}, 0.5, {"flops_per_s": 1e10, "bytes_per_s": 1e10})
    >>> r["intensity"], r["ridge"], r["bound"], r["roofline_s"], r["efficiency"]
    (4.0, 1.0, 'compute', 0.4, 0.8)
    """
    flops, nbytes = cost["flops"], cost["bytes_accessed"]
    pf, pb = float(peak["flops_per_s"]), float(peak["bytes_per_s"])
    intensity = flops / nbytes if nbytes else float("inf")
    bound_s = max(flops / pf, nbytes / pb)
    return {
        "seconds": seconds,
        "flops_per_s": flops / seconds if seconds else 0.0,
        "bytes_per_s": nbytes / seconds if seconds else 0.0,
        "intensity": intensity,
        "ridge": pf / pb,
        "bound": "compute" if intensity >= pf / pb else "memory",
        "roofline_s": bound_s,
        "efficiency": bound_s / seconds if seconds else 0.0,
    }


@dataclass
class _Fn:
    compiled: Any
    module: str
    ops: dict[str, list[str]]


class Profiler:
    """Traces steps ``start_step .. start_step + num_steps - 1`` with ``jax.profiler`` and
    summarizes them without a UI.

    Wrap each training step in :meth:`step`; inside the window each step runs under
    ``jax.profiler.StepTraceAnnotation`` and the trace (``log_dir/plugins/profile/<run>/``:
    ``*.xplane.pb`` for XProf / TensorBoard's profile plugin, ``*.trace.json.gz``) is written
    when the window ends. Register the compiled step functions with :meth:`add_compiled`
    (``fn.lower(*args).compile()``); :meth:`summary` then reads the trace back and gives,
    per function:

    - a per-module time table: each XLA op event of the function (``hlo_module`` and
      ``hlo_op`` in the trace) is charged to the module path of its op (the
      ``jax.named_scope`` that module calls add while tracing, read from the op's
      ``op_name`` metadata in the compiled HLO; a fusion of ops from several modules goes
      to their common parent), split into forward and backward (ops under ``transpose``);
    - a roofline line: FLOPs and bytes from ``compiled.cost_analysis()`` against
      :func:`measure_peak` of the device, at the function's measured time per step;
    - the compiled memory footprint (``compiled.memory_analysis()``).

    It prints them and saves them as ``log_dir/profile_summary.json``. With
    ``enabled=False`` :meth:`step` returns a shared ``contextlib.nullcontext`` and nothing
    else happens.

    Args:
      log_dir: where the trace and the summary go.
      start_step: the first step traced (skip compilation and warm-up).
      num_steps: how many steps are traced.
      enabled: ``False`` turns everything off.
      name: the step annotation's name (XProf's step marker).
      peak: a :func:`measure_peak` result to use (measured at :meth:`summary` if ``None``).
      python_tracer: also record every Python function call (``jax.profiler``'s default;
        off here: the tables do not need it and on a Python-heavy step it costs the most).

    >>> import tempfile, jax.numpy as jnp
    >>> from cairn import nn
    >>> model = nn.Linear(64, 64, rngs=nn.Rngs(0))
    >>> step_fn = nn.jit(lambda m, x: jnp.sum(m(x)))
    >>> x = jnp.ones((8, 64))
    >>> prof = Profiler(tempfile.mkdtemp(), start_step=1, num_steps=2,
    ...                 peak={"flops_per_s": 1e11, "bytes_per_s": 1e10})
    >>> prof.add_compiled("step", step_fn.lower(model, x).compile())
    >>> for step in range(4):
    ...     with prof.step(step):
    ...         _ = step_fn(model, x).block_until_ready()
    >>> s = prof.summary(print_fn=None)
    >>> s["steps"], sorted(s["functions"]["step"]) == ["cost", "memory", "module", "modules", "roofline"]
    ([1, 2], True)
    """

    def __init__(
        self,
        log_dir: str | os.PathLike,
        *,
        start_step: int,
        num_steps: int,
        enabled: bool = True,
        name: str = "train",
        peak: dict[str, Any] | None = None,
        python_tracer: bool = False,
    ) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.log_dir = os.path.abspath(os.fspath(log_dir))
        self.start_step, self.num_steps = int(start_step), int(num_steps)
        self.enabled = bool(enabled)
        self._name = name
        self._peak = peak
        self._fns: dict[str, _Fn] = {}
        self._active = False
        self._done = False
        self._step_s: dict[int, float] = {}
        self._null = contextlib.nullcontext()
        self._python_tracer = python_tracer

    @property
    def done(self) -> bool:
        """Whether the window has been traced."""
        return self._done

    def add_compiled(self, name: str, compiled: Any) -> None:
        """Register a compiled function (``jax.stages.Compiled``) under ``name``.

        Args:
          name: the name the summary uses.
          compiled: a ``jax.stages.Compiled``.
        """
        if not hasattr(compiled, "as_text") or not hasattr(compiled, "cost_analysis"):
            raise TypeError(f"add_compiled({name!r}, ...) needs a jax.stages.Compiled "
                            f"(fn.lower(*args).compile()), got {type(compiled).__name__}")
        if self.enabled:
            module, ops = parse_hlo(compiled.as_text())
            self._fns[name] = _Fn(compiled, module, ops)

    def step(self, step: int) -> contextlib.AbstractContextManager:
        """The context for one training step (a no-op outside the window or when off).

        Args:
          step: the training step number.
        """
        if not self.enabled or self._done or not self.start_step <= step < self.start_step + self.num_steps:
            if self._active and step >= self.start_step + self.num_steps:
                self._stop()
            return self._null
        return self._traced(step)

    @contextlib.contextmanager
    def _traced(self, step: int) -> Iterator[None]:
        if not self._active:
            os.makedirs(self.log_dir, exist_ok=True)
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 1 if self._python_tracer else 0
            jax.profiler.start_trace(self.log_dir, profiler_options=options)
            self._active = True
        t0 = time.perf_counter()
        try:
            with jax.profiler.StepTraceAnnotation(self._name, step_num=step):
                yield
        finally:
            self._step_s[step] = time.perf_counter() - t0
            if step == self.start_step + self.num_steps - 1:
                self._stop()

    def _stop(self) -> None:
        if self._active:
            jax.profiler.stop_trace()
            self._active = False
            self._done = True

    def close(self) -> None:
        """Stop a trace still running (a loop that ended inside the window)."""
        self._stop()

    def summary(self, print_fn: Callable[[str], Any] | None = print) -> dict[str, Any]:
        """Read the trace back; print the tables with ``print_fn`` (``None``: silent) and
        write ``log_dir/profile_summary.json``. Returns what it wrote.

        The summary holds ``steps``, ``step_time_s`` (host wall time of each traced step:
        block on the step's result inside :meth:`step` to include the device),
        ``trace_dir``, ``peak`` and, per registered function, ``module`` (the HLO module
        name), ``cost``, ``memory``, ``roofline`` and ``modules``: rows of ``path``,
        ``forward_ms``, ``backward_ms`` (the ops charged to exactly that module, per step),
        ``total_ms`` (that module and everything below it, per step), ``percent`` (of the
        function's op time) and ``ops`` (op events per step).

        Args:
          print_fn: prints the tables; None is silent.
        """
        if not self.enabled:
            raise RuntimeError("this Profiler is disabled (enabled=False): there is nothing to summarize")
        self._stop()
        if not self._done:
            raise RuntimeError(
                f"the profiled window (steps {self.start_step}..{self.start_step + self.num_steps - 1}) "
                f"was not reached: steps traced {sorted(self._step_s)}"
            )
        run_dir, events = _read_trace(self.log_dir)
        peak = self._peak or measure_peak()
        n = len(self._step_s)
        times = [self._step_s[s] for s in sorted(self._step_s)]
        out: dict[str, Any] = {
            "steps": sorted(self._step_s),
            "step_time_s": {"mean": sum(times) / n, "min": min(times), "max": max(times)},
            "trace_dir": run_dir,
            "peak": peak,
            "functions": {},
        }
        ops = _op_events(events)
        claimed: set[int] = set()  # an event counts for the first registered function holding its op
        for name, fn in self._fns.items():
            rows, op_s = _module_table(fn, ops, n, claimed)
            seconds = op_s if op_s > 0 else out["step_time_s"]["mean"]
            out["functions"][name] = {
                "module": fn.module,
                "cost": _cost(fn.compiled),
                "memory": _memory(fn.compiled),
                "roofline": roofline(_cost(fn.compiled), seconds, peak) | {"time_from": "trace" if op_s > 0 else "step"},
                "modules": rows,
            }
        with open(os.path.join(self.log_dir, SUMMARY_FILE), "w") as f:
            json.dump(out, f, indent=1)
        if print_fn is not None:
            print_fn(format_summary(out))
        return out


def _read_trace(log_dir: str) -> tuple[str, list[dict]]:
    runs = sorted(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "")), key=os.path.getmtime)
    files = glob.glob(os.path.join(runs[-1], "*.trace.json.gz")) if runs else []
    if not files:
        raise FileNotFoundError(
            f"no jax.profiler trace (*.trace.json.gz) under {log_dir}/plugins/profile/; "
            f"was the trace written? (runs found: {runs})"
        )
    events: list[dict] = []
    for f in files:  # one per host
        with gzip.open(f, "rt") as fh:
            data = json.load(fh)
        events += data.get("traceEvents", []) if isinstance(data, dict) else data
    return runs[-1], events


def _op_events(events: list[dict]) -> list[dict]:
    """The XLA op events; on an accelerator only the device's (the host's thunk launches of
    the same ops are left out)."""
    ops = [e for e in events if e.get("ph") == "X" and "hlo_op" in (e.get("args") or {})]
    names = {e.get("pid"): str((e.get("args") or {}).get("name", "")) for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {p for p, nm in names.items() if "/device:" in nm and "CPU" not in nm.upper()}
    on_device = [e for e in ops if e.get("pid") in device]
    return on_device or ops


def _module_table(fn: _Fn, ops: list[dict], steps: int, claimed: set[int]) -> tuple[list[dict], float]:
    """Rows of the per-module table of ``fn`` and its op time per step (seconds), from the
    op events not ``claimed`` by an earlier function (which this one adds to)."""
    self_t: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    total = 0.0
    scope_cache: dict[str, tuple[str, bool]] = {}
    for i, e in enumerate(ops):
        args = e["args"]
        op = args["hlo_op"]
        if i in claimed or args.get("hlo_module", fn.module) != fn.module or op not in fn.ops:
            continue
        claimed.add(i)
        if op not in scope_cache:
            scope_cache[op] = _common_scope(fn.ops[op])
        path, backward = scope_cache[op]
        ms = float(e.get("dur", 0.0)) / 1000.0
        total += ms
        t = self_t.setdefault(path, [0.0, 0.0])
        t[1 if backward else 0] += ms
        counts[path] = counts.get(path, 0) + 1
    paths = set(self_t)
    for p in list(paths):
        parts = p.split("/") if p else []
        paths.update("/".join(parts[:i]) for i in range(1, len(parts)))
    rows = []
    for p in sorted(paths, key=lambda q: (q != "", q)):
        incl = sum(sum(v) for q, v in self_t.items() if q == p or (p and q.startswith(p + "/")) or p == "")
        f, b = self_t.get(p, [0.0, 0.0])
        rows.append({
            "path": p or _TOP, "forward_ms": f / steps, "backward_ms": b / steps, "total_ms": incl / steps,
            "percent": 100.0 * incl / total if total else 0.0, "ops": counts.get(p, 0) / steps,
        })
    return rows, total / 1000.0 / steps


def format_summary(summary: dict[str, Any]) -> str:
    """The text :meth:`Profiler.summary` prints: per function, the module table, the
    roofline line and the memory footprint."""
    st = summary["step_time_s"]
    peak = summary["peak"]
    lines = [
        f"profile of steps {summary['steps'][0]}..{summary['steps'][-1]}: step time mean "
        f"{st['mean'] * 1e3:.2f} ms (min {st['min'] * 1e3:.2f}, max {st['max'] * 1e3:.2f}); peak "
        f"{peak['flops_per_s'] / 1e12:.3g} TFLOP/s, {peak['bytes_per_s'] / 1e9:.3g} GB/s ({peak.get('device', '?')})",
        f"trace: {summary['trace_dir']}",
    ]
    for name, fn in summary["functions"].items():
        r, c, m = fn["roofline"], fn["cost"], fn["memory"]
        labels = []
        for row in fn["modules"]:
            depth = 0 if row["path"] == _TOP else row["path"].count("/") + 1
            labels.append(("  " * depth + row["path"].split("/")[-1]) if depth else row["path"])
        w = max([24, *map(len, labels)])
        lines.append(f"\n{name} ({fn['module']})")
        lines.append(f"  {'module':<{w}} {'fwd ms':>9} {'bwd ms':>9} {'total ms':>9} {'%':>6}")
        for label, row in zip(labels, fn["modules"], strict=True):
            lines.append(f"  {label:<{w}} {row['forward_ms']:9.3f} "
                         f"{row['backward_ms']:9.3f} {row['total_ms']:9.3f} {row['percent']:6.1f}")
        lines.append(
            f"  roofline: {c['flops'] / 1e9:.3g} GFLOP, {c['bytes_accessed'] / 1e6:.3g} MB in {r['seconds'] * 1e3:.2f} ms"
            f" ({r['time_from']}): {r['flops_per_s'] / 1e12:.3g} TFLOP/s, {r['bytes_per_s'] / 1e9:.3g} GB/s,"
            f" intensity {r['intensity']:.3g} vs ridge {r['ridge']:.3g} ({r['bound']}-bound),"
            f" roofline time {r['roofline_s'] * 1e3:.3g} ms = {100 * r['efficiency']:.1f}% of measured"
        )
        if m:
            lines.append(
                "  memory: " + ", ".join(f"{k[:-6]} {v / 2**20:.2f} MiB" for k, v in m.items() if k.endswith("_bytes"))
            )
    return "\n".join(lines)
