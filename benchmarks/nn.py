"""cairn.nn against Flax NNX and raw jax.jit, in one process.

Work: a 32-layer, width-16 MLP (ReLU) trained with AdamW (optax as the transformation
for everyone), batch 8: compute is tiny, so the per-call Python overhead dominates.

Variants (microseconds per call, min over repeats of the mean of N calls):
  raw        jax.jit of the pure function on a params dict (the floor)
  cairn      cairn.nn.jit with the model and the Optimizer passed in, updated in place
  nnx        flax.nnx.jit default (graph mode)
  nnx_tree   flax.nnx.jit(graph=False)
  nnx_cached flax.nnx.cached_partial
  nnx_jpart  flax.nnx.jit_partial(graph=False)
for a train step and for an eval step (changes nothing). Also split + merge of a
1,000-module model, and first-call (trace + compile) time: the median over rounds that each
build a fresh model and jitted function, interleaved across variants.

Prints a table, then ONE JSON line of ratios. ``--quick`` runs small repeat counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import optax

from cairn import nn

DEPTH, WIDTH, BATCH = 32, 16, 8


def bench_many(fns: dict, calls: int, rounds: int) -> dict:
    """Seconds per call of several variants, interleaved round-robin (``rounds`` rounds
    of ``calls`` calls each) so that load changes on a shared machine hit every variant
    alike. Returns ``{name: [seconds per call in each round]}``."""
    for fn in fns.values():
        out = fn()
        for _ in range(min(calls, 10)):
            out = fn()
        jax.block_until_ready(out)
    times: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(calls):
                out = fn()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t) / calls)
    return times


def paired_ratio(times: dict, a: str, b: str) -> float:
    """Median over rounds of time(a) / time(b): robust to load that changes between
    rounds."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def bench_py(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Timing of pure-Python work (no device values to wait for)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def first_calls(factories: dict, rounds: int) -> dict:
    """Median seconds of a first call (trace + compile + run) per variant.

    Each factory builds a fresh model, optimizer and jitted function, so every round
    retraces and recompiles; rounds are interleaved with a rotating order (a single first
    call depends on what ran before it: warm allocator, LLVM and tracing caches).
    """
    names = list(factories)
    times: dict = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            fn = factories[n]()
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times[n].append(time.perf_counter() - t)
    return {n: statistics.median(v) for n, v in times.items()}


# --- cairn model ---
class CLinear(nn.Module):
    def __init__(self, din: int, dout: int, rngs: nn.Rngs) -> None:
        self.kernel = nn.Param(
            jax.nn.initializers.lecun_normal()(rngs.params(), (din, dout), jnp.float32)
        )
        self.bias = nn.Param(jnp.zeros((dout,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.kernel + self.bias


class CMLP(nn.Module):
    def __init__(self, depth: int, width: int, rngs: nn.Rngs) -> None:
        self.layers = nn.List([CLinear(width, width, rngs) for _ in range(depth)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x


def c_loss(model: CMLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


def c_train_step(model: CMLP, opt: nn.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    loss, grads = nn.value_and_grad(c_loss)(model, x, y)
    opt.update(model, grads)
    return loss


# --- raw jax ---
def raw_forward(params: dict, x: jax.Array) -> jax.Array:
    for layer in params["layers"].values():
        x = jax.nn.relu(x @ layer["kernel"] + layer["bias"])
    return x


def raw_loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((raw_forward(params, x) - y) ** 2)


def make_raw_step(tx: optax.GradientTransformation) -> Callable[..., tuple]:
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(raw_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


# --- flax nnx ---
def nnx_parts() -> tuple[Any, type, Callable[..., Any], Callable[..., Any]]:
    from flax import nnx

    class NMLP(nnx.Module):
        def __init__(self, depth, width, rngs):
            self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])

        def __call__(self, x):
            for layer in self.layers:
                x = jax.nn.relu(layer(x))
            return x

    def loss(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    def train_step(model, opt, x, y):
        value, grads = nnx.value_and_grad(loss)(model, x, y)
        opt.update(model, grads)
        return value

    return nnx, NMLP, loss, train_step


def first_call_factories(tx: optax.GradientTransformation, x: jax.Array, y: jax.Array, no_flax: bool) -> dict:
    """Per variant: build a fresh model + jitted train step, return the call to time."""

    def raw():
        params = nn.to_pure_dict(nn.state(CMLP(DEPTH, WIDTH, nn.Rngs(0)), nn.Param))
        state, step = tx.init(params), jax.jit(make_raw_step(tx))
        return lambda: step(params, state, x, y)[2]

    def cairn():
        model = CMLP(DEPTH, WIDTH, nn.Rngs(0))
        opt = nn.Optimizer(model, tx, wrt=nn.Param)
        step = nn.jit(lambda m, o, x, y: c_train_step(m, o, x, y))
        return lambda: step(model, opt, x, y)

    out = {"raw jax.jit": raw, "cairn nn.jit": cairn}
    if no_flax:
        return out
    try:
        nnx, NMLP, _, n_train = nnx_parts()
    except ImportError:  # pragma: no cover - flax not installed
        return out

    def nnx_variant(kind: str):
        def factory():
            m = NMLP(DEPTH, WIDTH, nnx.Rngs(0))
            o = nnx.Optimizer(m, tx, wrt=nnx.Param)

            def fresh(*a):  # a new function object: nothing cached from earlier rounds
                return n_train(*a)

            if kind == "graph":
                step = nnx.jit(fresh)
                return lambda: step(m, o, x, y)
            if kind == "tree":
                step = nnx.jit(fresh, graph=False)
                return lambda: step(m, o, x, y)
            if kind == "cached":
                step = nnx.cached_partial(nnx.jit(fresh), m, o)
            else:
                step = nnx.jit_partial(fresh, m, o, graph=False)
            return lambda: step(x, y)

        return factory

    out["nnx.jit (graph, default)"] = nnx_variant("graph")
    out["nnx.jit(graph=False)"] = nnx_variant("tree")
    if hasattr(nnx, "cached_partial"):
        out["nnx.cached_partial"] = nnx_variant("cached")
    if hasattr(nnx, "jit_partial"):
        out["nnx.jit_partial(graph=False)"] = nnx_variant("jit_partial")
    return out


def trace_compile(tx: optax.GradientTransformation, x: jax.Array, y: jax.Array, no_flax: bool, rounds: int) -> dict:
    """Median seconds of tracing (``.lower``) and of compiling (``.compile``) a fresh
    train step per variant, rounds interleaved: the first-call time split in two, so a
    difference is not hidden in the first execution's noise."""
    def raw():
        params = nn.to_pure_dict(nn.state(CMLP(DEPTH, WIDTH, nn.Rngs(0)), nn.Param))
        return jax.jit(make_raw_step(tx)).lower, (params, tx.init(params), x, y)

    def cairn():
        model = CMLP(DEPTH, WIDTH, nn.Rngs(0))
        opt = nn.Optimizer(model, tx, wrt=nn.Param)
        return nn.jit(lambda m, o, x, y: c_train_step(m, o, x, y)).lower, (model, opt, x, y)

    variants = {"raw jax.jit": raw, "cairn nn.jit": cairn}
    if not no_flax:
        try:
            nnx, NMLP, _, n_train = nnx_parts()

            def flax_default():
                m = NMLP(DEPTH, WIDTH, nnx.Rngs(0))
                o = nnx.Optimizer(m, tx, wrt=nnx.Param)
                return nnx.jit(lambda *a: n_train(*a)).lower, (m, o, x, y)

            variants["nnx.jit (graph, default)"] = flax_default
        except ImportError:  # pragma: no cover - flax not installed
            pass
    times: dict = {n: ([], []) for n in variants}
    for _ in range(rounds):
        for name, make in variants.items():
            lower, args = make()
            t0 = time.perf_counter()
            lowered = lower(*args)
            t1 = time.perf_counter()
            lowered.compile()
            times[name][0].append(t1 - t0)
            times[name][1].append(time.perf_counter() - t1)
    return {n: (statistics.median(a), statistics.median(b)) for n, (a, b) in times.items()}


def _setup_raw(tx: optax.GradientTransformation, x: jax.Array, y: jax.Array, train: dict, evals: dict) -> None:
    """The raw jax.jit train and eval steps on a params dict (the floor)."""
    model = CMLP(DEPTH, WIDTH, nn.Rngs(0))
    params = nn.to_pure_dict(nn.state(model, nn.Param))
    raw_state = {"p": params, "s": tx.init(params)}
    raw_step = jax.jit(make_raw_step(tx))
    raw_eval = jax.jit(raw_loss)

    def raw_train() -> jax.Array:
        raw_state["p"], raw_state["s"], loss = raw_step(raw_state["p"], raw_state["s"], x, y)
        return loss

    train["raw jax.jit"] = raw_train
    evals["raw jax.jit"] = lambda: raw_eval(raw_state["p"], x, y)


def _setup_cairn(
    tx: optax.GradientTransformation, x: jax.Array, y: jax.Array, train: dict, evals: dict, repeats: int
) -> tuple[float, int]:
    """cairn.nn.jit's train and eval steps; returns the Python work of one call (seconds)
    and the number of variables it writes back."""
    model = CMLP(DEPTH, WIDTH, nn.Rngs(0))
    opt = nn.Optimizer(model, tx, wrt=nn.Param)
    c_step = nn.jit(c_train_step)
    c_eval = nn.jit(c_loss)
    train["cairn nn.jit"] = lambda: c_step(model, opt, x, y)
    evals["cairn nn.jit"] = lambda: c_eval(model, x, y)

    # the Python work of one nn.jit call alone: the compiled call replaced by a stub that
    # returns every variable as changed (the worst case for the write-back)
    c_step(model, opt, x, y)
    entry = next(iter(c_step._cache.values()))
    real_jitted = entry.jitted
    all_vals = [v.raw_value for v in nn.state(model).flat_state().values()]
    all_vals += [v.raw_value for v in nn.state(opt).flat_state().values()]
    stub_out = (all_vals[0], {}, dict(enumerate(all_vals)), None)
    entry.jitted = lambda don, keep: stub_out
    c_wrapper = bench_py(lambda: c_step(model, opt, x, y), 200, repeats)
    entry.jitted = real_jitted
    return c_wrapper, len(all_vals)


def _split_merge_times(sm_repeats: int) -> tuple[float, float, float]:
    """cairn split + merge of 1,000 modules: warm, split alone, and cold (seconds)."""
    big = nn.List([CLinear(2, 2, nn.Rngs(i)) for i in range(1000)])

    def c_split_merge() -> nn.Module:
        gd, st = nn.split(big)
        return nn.merge(gd, st)

    c_sm = bench_py(c_split_merge, 10, sm_repeats)
    c_split = bench_py(lambda: nn.split(big), 10, sm_repeats)

    # cold: the structure cache invalidated before each split (what the first split of a
    # freshly built or restructured model costs)
    from cairn.nn._variables import bump_epoch

    def c_split_merge_cold() -> nn.Module:
        bump_epoch()
        return c_split_merge()

    c_sm_cold = bench_py(c_split_merge_cold, 10, sm_repeats)
    return c_sm, c_split, c_sm_cold


def _setup_nnx(
    tx: optax.GradientTransformation, x: jax.Array, y: jax.Array, train: dict, evals: dict, quick: bool
) -> float | None:
    """The Flax NNX variants' train and eval steps; returns NNX's split + merge of 1,000
    modules (seconds), or ``None`` without Flax."""
    try:
        nnx, NMLP, n_loss, n_train = nnx_parts()
    except ImportError:  # pragma: no cover - flax not installed
        return None
    variants = [
        ("nnx.jit (graph, default)", {}),
        ("nnx.jit(graph=False)", {"graph": False}),
    ]
    for name, kw in variants:
        m = NMLP(DEPTH, WIDTH, nnx.Rngs(0))
        o = nnx.Optimizer(m, tx, wrt=nnx.Param)
        step = nnx.jit(n_train, **kw)
        ev = nnx.jit(n_loss, **kw)
        train[name] = lambda step=step, m=m, o=o: step(m, o, x, y)
        evals[name] = lambda ev=ev, m=m: ev(m, x, y)
    if hasattr(nnx, "cached_partial"):
        m = NMLP(DEPTH, WIDTH, nnx.Rngs(0))
        o = nnx.Optimizer(m, tx, wrt=nnx.Param)
        cached = nnx.cached_partial(nnx.jit(n_train), m, o)
        cached_ev = nnx.cached_partial(nnx.jit(n_loss), m)
        train["nnx.cached_partial"] = lambda: cached(x, y)
        evals["nnx.cached_partial"] = lambda: cached_ev(x, y)
    if hasattr(nnx, "jit_partial"):
        m = NMLP(DEPTH, WIDTH, nnx.Rngs(0))
        o = nnx.Optimizer(m, tx, wrt=nnx.Param)
        jp = nnx.jit_partial(n_train, m, o, graph=False)
        jp_ev = nnx.jit_partial(n_loss, m, graph=False)
        name = "nnx.jit_partial(graph=False)"
        train[name] = lambda: jp(x, y)
        evals[name] = lambda: jp_ev(x, y)
    nbig = nnx.List([nnx.Linear(2, 2, rngs=nnx.Rngs(i)) for i in range(1000)])

    def n_split_merge() -> object:
        gd, st = nnx.split(nbig)
        return nnx.merge(gd, st)

    return bench_py(n_split_merge, 2 if quick else 5, 2 if quick else 5)


def _print_table(m: dict) -> None:
    """The human-readable report of the measurements ``m`` (see ``main``)."""
    rounds, rcalls = m["rounds"], m["rcalls"]
    print(
        f"MLP {DEPTH}x{WIDTH} + AdamW, batch {BATCH}; us per call, min over {rounds} "
        f"interleaved rounds of {rcalls} calls; ratios are medians of per-round ratios; "
        f"first call = median over fresh models and functions, interleaved"
    )
    print(f"{'variant':32s} {'train step':>12s} {'eval step':>12s} {'first call s':>13s}")
    for name, tr, ev, first in m["rows"]:
        print(f"{name:32s} {tr:12.1f} {ev:12.1f} {first:13.3f}")
    print(
        f"cairn nn.jit Python work per call ({m['n_vals']} variables written back): "
        f"{m['c_wrapper'] * 1e6:.1f} us"
    )
    nnx_sm = m["nnx_sm"]
    print(
        f"split+merge, 1,000 modules: cairn {m['c_sm'] * 1e3:.3f} ms (split alone {m['c_split'] * 1e3:.3f} ms; "
        f"cold, structure cache invalidated first: {m['c_sm_cold'] * 1e3:.3f} ms)"
        + (f", nnx {nnx_sm * 1e3:.3f} ms" if nnx_sm is not None else "")
    )
    for name, (tr, co) in m["tc"].items():
        print(f"trace / compile of a fresh train step, {name}: {tr:.3f} s / {co:.3f} s")


def _result(m: dict, quick: bool) -> dict:
    """The JSON line: ratios and figures from the measurements ``m`` (see ``main``)."""
    t_train, t_eval, firsts, tc = m["t_train"], m["t_eval"], m["firsts"], m["tc"]
    c_sm, c_sm_cold, nnx_sm = m["c_sm"], m["c_sm_cold"], m["nnx_sm"]
    c, r = "cairn nn.jit", "raw jax.jit"
    result = {
        "bench": "nn",
        "quick": bool(quick),
        "cairn_vs_raw_train": round(paired_ratio(t_train, c, r), 3),
        "cairn_vs_raw_eval": round(paired_ratio(t_eval, c, r), 3),
        "cairn_wrapper_us": round(m["c_wrapper"] * 1e6, 1),
        "split_merge_1000_ms": round(c_sm * 1e3, 3),
        "split_merge_1000_cold_ms": round(c_sm_cold * 1e3, 3),
        "first_call_cairn_s": round(firsts[c], 3),
        "first_call_raw_s": round(firsts[r], 3),
    }
    keys = {
        "nnx.jit (graph, default)": "nnx_default",
        "nnx.jit(graph=False)": "nnx_tree",
        "nnx.cached_partial": "nnx_cached",
        "nnx.jit_partial(graph=False)": "nnx_jit_partial",
    }
    for name, key in keys.items():
        if name in t_train:
            result[f"{key}_over_cairn_train"] = round(paired_ratio(t_train, name, c), 2)
            result[f"{key}_over_cairn_eval"] = round(paired_ratio(t_eval, name, c), 2)
    result["trace_compile_cairn_s"] = [round(v, 3) for v in tc[c]]
    if "nnx.jit (graph, default)" in tc:
        result["trace_compile_nnx_s"] = [round(v, 3) for v in tc["nnx.jit (graph, default)"]]
    if "nnx.jit (graph, default)" in firsts:
        result["first_call_nnx_s"] = round(firsts["nnx.jit (graph, default)"], 3)
    nnx_firsts = [v for k, v in firsts.items() if k.startswith("nnx")]
    if nnx_firsts:
        result["first_call_nnx_fastest_s"] = round(min(nnx_firsts), 3)
    if nnx_sm is not None:
        result["nnx_over_cairn_split_merge"] = round(nnx_sm / c_sm, 1)
        result["nnx_over_cairn_split_merge_cold"] = round(nnx_sm / c_sm_cold, 1)
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small repeat counts (< 60 s)")
    ap.add_argument("--no-flax", action="store_true", help="skip the Flax NNX variants")
    args = ap.parse_args(argv)
    repeats = 3 if args.quick else 9
    rounds, rcalls = (15, 10) if args.quick else (40, 25)
    sm_repeats = 5 if args.quick else 20

    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    y = jax.random.normal(jax.random.key(2), (BATCH, WIDTH))
    tx = optax.adamw(1e-3)

    train: dict = {}
    evals: dict = {}
    # setup order, and what runs in it, as it always was: raw, cairn (+ its wrapper
    # timing), split/merge, nnx; then the interleaved timings
    _setup_raw(tx, x, y, train, evals)
    c_wrapper, n_vals = _setup_cairn(tx, x, y, train, evals, repeats)
    c_sm, c_split, c_sm_cold = _split_merge_times(sm_repeats)
    nnx_sm = None if args.no_flax else _setup_nnx(tx, x, y, train, evals, args.quick)

    t_train = bench_many(train, rcalls, rounds)
    firsts = first_calls(first_call_factories(tx, x, y, args.no_flax), 3 if args.quick else 6)
    t_eval = bench_many(evals, rcalls, rounds)
    tc = trace_compile(tx, x, y, args.no_flax, 2 if args.quick else 5)
    rows = [(n, min(t_train[n]) * 1e6, min(t_eval[n]) * 1e6, firsts[n]) for n in train]

    measured = {
        "rounds": rounds, "rcalls": rcalls, "rows": rows, "n_vals": n_vals, "c_wrapper": c_wrapper,
        "c_sm": c_sm, "c_split": c_split, "c_sm_cold": c_sm_cold, "nnx_sm": nnx_sm,
        "t_train": t_train, "t_eval": t_eval, "firsts": firsts, "tc": tc,
    }
    _print_table(measured)
    result = _result(measured, args.quick)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
