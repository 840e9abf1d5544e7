"""cairn.optim against Optax: one optimizer step (update + apply_updates) under jit.

Runs both libraries in one process on the same work: AdamW and
clip_by_global_norm + AdamW, on 1 leaf of N*L values and on L leaves of N values.
The step is ``params, state, grads -> new params, new state`` jitted with params
and state donated. Reports the compile time (lower + compile) and the step time
(min over repeats of the mean of ``calls`` steps; ours and Optax's timing loops are
interleaved so machine load affects both alike), a table, then one JSON line.

Ours is the default per-parameter state (each moment a tree like the params, sharded like
them); ``optim.pack(tx)`` rows are the opt-in packed state (one flat buffer per dtype) on
the same pytree params. Also measures our "packed params" mode (params held as ``optim.Packed``), where
no per-leaf work is left in the optimizer step, and the *per-leaf floor*: a plain
jitted ``p + c * g`` over the same L leaves (params donated). Any optimizer that
takes and returns ordinary pytrees of L arrays pays at least this (one kernel per
output leaf, one runtime buffer per input and output leaf); ``*_vs_floor_many``
in the JSON line is our step time divided by it.

Sharded row: on an 8-device virtual CPU mesh (data=2, model=4; run in a subprocess, since
the device count must be set before JAX starts), two Linear(512, 1024) / (1024, 512)-shaped
kernels sharded P('data', 'model') / P('model', 'data'): per-device optimizer bytes right
after ``init`` and after jitted steps, and the step time, ours beside Optax.

Usage: python benchmarks/optim.py [--quick] [--sharded-only]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cairn import optim


def make_tree(n_leaves: int, size: int, seed: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {f"layer_{i:04d}": jnp.asarray(rng.normal(size=(size,)), jnp.float32)
            for i in range(n_leaves)}


def build(lib: ModuleType, case: str) -> Any:
    if case == "adamw":
        return lib.adamw(1e-3, weight_decay=1e-4)
    return lib.chain(lib.clip_by_global_norm(1.0), lib.adamw(1e-3, weight_decay=1e-4))


def compile_step(lib: ModuleType, tx: Any, params: dict, grads: dict) -> tuple[Callable[[int], float], float]:
    """Jit the full step with params and state donated; return (run, compile seconds)."""
    state = tx.init(params)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return lib.apply_updates(p, u), s

    f = jax.jit(step, donate_argnums=(0, 1))
    t0 = time.perf_counter()
    compiled = f.lower(params, state, grads).compile()
    compile_s = time.perf_counter() - t0
    carry = [jax.tree.map(jnp.copy, params), state]
    carry[0], carry[1] = compiled(carry[0], carry[1], grads)
    jax.block_until_ready(carry[0])

    def run(calls):
        t0 = time.perf_counter()
        for _ in range(calls):
            carry[0], carry[1] = compiled(carry[0], carry[1], grads)
        jax.block_until_ready(carry[0])
        return (time.perf_counter() - t0) / calls

    return run, compile_s


def compile_floor(params: dict, grads: dict) -> tuple[Callable[[int], float], float]:
    """The per-leaf floor: params + 1e-3 * grads, leaf by leaf, params donated."""
    f = jax.jit(lambda p, g: jax.tree.map(lambda a, b: a + 1e-3 * b, p, g), donate_argnums=0)
    t0 = time.perf_counter()
    compiled = f.lower(params, grads).compile()
    compile_s = time.perf_counter() - t0
    carry = [compiled(jax.tree.map(jnp.copy, params), grads)]
    jax.block_until_ready(carry[0])

    def run(calls):
        t0 = time.perf_counter()
        for _ in range(calls):
            carry[0] = compiled(carry[0], grads)
        jax.block_until_ready(carry[0])
        return (time.perf_counter() - t0) / calls

    return run, compile_s


def measure_pair(runs: list[Callable[[int], float]], repeats: int, calls: int) -> list[float]:
    """Interleave the timing loops of several steps (so machine load hits all alike);
    return the min over repeats of each step's mean time, in ms."""
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            best[i] = min(best[i], run(calls))
    return [b * 1e3 for b in best]


def per_device_bytes(tree: Any) -> int:
    """The most bytes any one device holds of ``tree``'s arrays."""
    per: dict = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values(), default=0)


def sharded_child(repeats: int, calls: int) -> None:
    """Runs with 8 virtual devices: per-device bytes and step time, ours and Optax's."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    rng = np.random.default_rng(0)

    def put(shape, spec):
        return jax.device_put(jnp.asarray(rng.normal(size=shape), jnp.float32),
                              NamedSharding(mesh, spec))

    params = {"l1": {"kernel": put((512, 1024), P("data", "model"))},
              "l2": {"kernel": put((1024, 512), P("model", "data"))}}
    grads = jax.tree.map(lambda x: x * 1e-2, params)
    # warm up the jit and the sharded runtime once, so neither side's compile time pays it
    jax.block_until_ready(jax.jit(lambda p: jax.tree.map(lambda x: x * 2, p))(params))
    out, runs = {"param_bytes_per_device": per_device_bytes(params)}, []
    for name, lib in (("ours", optim), ("optax", optax)):
        tx = lib.adamw(1e-3, weight_decay=1e-4)
        state = tx.init(params)
        moments = [x for x in jax.tree.leaves(state) if x.ndim > 0]
        out[f"{name}_opt_bytes_per_device_init"] = per_device_bytes(state)
        out[f"{name}_moment_bytes_per_device_init"] = per_device_bytes(moments)

        def step(p, s, g, tx=tx, lib=lib):
            u, s = tx.update(g, s, p)
            return lib.apply_updates(p, u), s

        f = jax.jit(step, donate_argnums=(0, 1))
        t0 = time.perf_counter()
        compiled = f.lower(params, state, grads).compile()
        out[f"{name}_compile_s"] = time.perf_counter() - t0
        carry = [jax.tree.map(jnp.copy, params), state]
        carry[0], carry[1] = compiled(carry[0], carry[1], grads)
        jax.block_until_ready(carry[0])

        def run(calls, carry=carry, compiled=compiled):
            t0 = time.perf_counter()
            for _ in range(calls):
                carry[0], carry[1] = compiled(carry[0], carry[1], grads)
            jax.block_until_ready(carry[0])
            return (time.perf_counter() - t0) / calls

        runs.append(run)
        out[f"{name}_moments_after_steps"] = carry  # filled below, after the timing
    ours_ms, ref_ms = measure_pair(runs, repeats, calls)
    out["ours_ms"], out["optax_ms"] = ours_ms, ref_ms
    for name in ("ours", "optax"):
        _, state = out.pop(f"{name}_moments_after_steps")
        out[f"{name}_opt_bytes_per_device_after_steps"] = per_device_bytes(state)
    print("SHARDED " + json.dumps(out))


def sharded_row(quick: bool) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    args = [sys.executable, os.path.abspath(__file__), "--sharded-child"]
    if quick:
        args.append("--quick")
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"sharded benchmark failed:\n{r.stderr[-3000:]}")
    line = [x for x in r.stdout.splitlines() if x.startswith("SHARDED ")][-1]
    return json.loads(line[len("SHARDED "):])


def print_sharded(sh: dict) -> None:
    kib = 1024
    print("\nsharded: 8 virtual CPU devices, mesh data=2 x model=4, kernels (512, 1024) "
          "P('data', 'model') and (1024, 512) P('model', 'data'), AdamW")
    print(f"  params per device               {sh['param_bytes_per_device'] / kib:8.0f} KiB")
    for name in ("ours", "optax"):
        print(f"  {name:5s} optimizer per device     init "
              f"{sh[f'{name}_opt_bytes_per_device_init'] / kib:8.0f} KiB, after steps "
              f"{sh[f'{name}_opt_bytes_per_device_after_steps'] / kib:8.0f} KiB; step "
              f"{sh[f'{name}_ms']:.3f} ms, compile {sh[f'{name}_compile_s']:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small sizes, < 60 s")
    ap.add_argument("--sharded-only", action="store_true", help="only the 8-device row")
    ap.add_argument("--sharded-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sharded_child:
        sharded_child(*((5, 10) if args.quick else (15, 20)))
        return
    if args.sharded_only:
        sh = sharded_row(args.quick)
        print_sharded(sh)
        print(json.dumps({"bench": "optim_sharded", **sh}))
        return
    if args.quick:
        n, leaves, repeats, calls = 1000, 200, 5, 10
    else:
        n, leaves, repeats, calls = 1000, 1000, 15, 20
    total = n * leaves
    results = {}
    rows = []
    for case in ("adamw", "clip+adamw"):
        for label, nl, sz in (("1 leaf", 1, total), (f"{leaves} leaves", leaves, n)):
            params = make_tree(nl, sz, 0)
            grads = make_tree(nl, sz, 1)
            ours, ours_c = compile_step(optim, build(optim, case), params, grads)
            ref, ref_c = compile_step(optax, build(optax, case), params, grads)
            floor, floor_c = compile_floor(params, grads)
            # the opt-in packed state (optim.pack(tx)) on the same pytree params
            pks, pks_c = compile_step(optim, optim.pack(build(optim, case)), params, grads)
            ours_ms, ref_ms, floor_ms, pks_ms = measure_pair([ours, ref, floor, pks],
                                                             repeats, calls)
            key = f"{case}/{'1' if nl == 1 else 'many'}"
            results[key] = dict(ours_ms=ours_ms, ours_compile_s=ours_c, optax_ms=ref_ms,
                                optax_compile_s=ref_c, floor_ms=floor_ms, floor_compile_s=floor_c,
                                packstate_ms=pks_ms, packstate_compile_s=pks_c)
            rows.append((case, label, ours_ms, ref_ms, ours_c, ref_c))
            rows.append((case, label + ", optim.pack(tx)", pks_ms, ref_ms, pks_c, ref_c))
            rows.append((case, label + ", floor p+c*g", floor_ms, ref_ms, floor_c, ref_c))
        # packed-params mode: the user keeps params and grads as flat buffers
        params = make_tree(leaves, n, 0)
        layout = optim.layout_of(params)
        pp = optim.pack(params, layout)
        gp = optim.pack(make_tree(leaves, n, 1), layout)
        run, c = compile_step(optim, build(optim, case), pp, gp)
        (ms,) = measure_pair([run], repeats, calls)
        results[f"{case}/many_packed"] = dict(ours_ms=ms, ours_compile_s=c)
        rows.append((case, f"{leaves} leaves, packed params", ms, float("nan"), c, float("nan")))

    print(f"\ncairn.optim vs optax {optax.__version__}, jax {jax.__version__}, "
          f"{jax.devices()[0].platform}, {total:,} values, load {os.getloadavg()[0]:.1f}")
    print(f"{'case':12s} {'layout':28s} {'ours ms':>9s} {'optax ms':>9s} {'x faster':>9s} "
          f"{'ours cmp s':>10s} {'optax cmp s':>11s}")
    for case, label, o, r, oc, rc in rows:
        print(f"{case:12s} {label:28s} {o:9.3f} {r:9.3f} {r / o:9.2f} {oc:10.3f} {rc:11.3f}")
    out = {"bench": "optim", "leaves": leaves, "values": total}
    for case in ("adamw", "clip+adamw"):
        one, many = results[f"{case}/1"], results[f"{case}/many"]
        packed = results[f"{case}/many_packed"]
        out[f"{case}_many_vs_one_leaf"] = round(many["ours_ms"] / one["ours_ms"], 3)
        out[f"{case}_speedup_vs_optax_many"] = round(many["optax_ms"] / many["ours_ms"], 3)
        out[f"{case}_speedup_vs_optax_one"] = round(one["optax_ms"] / one["ours_ms"], 3)
        out[f"{case}_vs_floor_many"] = round(many["ours_ms"] / many["floor_ms"], 3)
        out[f"{case}_compile_s_many"] = round(many["ours_compile_s"], 3)
        out[f"{case}_optax_compile_s_many"] = round(many["optax_compile_s"], 3)
        out[f"{case}_packed_many_vs_one_leaf"] = round(packed["ours_ms"] / one["ours_ms"], 3)
        out[f"{case}_packed_speedup_vs_optax_many"] = round(many["optax_ms"] / packed["ours_ms"], 3)
        out[f"{case}_packed_compile_s"] = round(packed["ours_compile_s"], 3)
        out[f"{case}_packstate_speedup_vs_optax_many"] = round(
            many["optax_ms"] / many["packstate_ms"], 3)
        out[f"{case}_packstate_compile_s_many"] = round(many["packstate_compile_s"], 3)
    out["floor_ms_many"] = round(results["adamw/many"]["floor_ms"], 3)
    out["floor_compile_s_many"] = round(results["adamw/many"]["floor_compile_s"], 3)
    sh = sharded_row(args.quick)
    print_sharded(sh)
    for k, v in sh.items():
        out[f"sharded_{k}"] = round(v, 4) if isinstance(v, float) else v
    print(json.dumps(out))


if __name__ == "__main__":
    main()
