"""cairn.kernels on a GPU: every implementation of each op at LLM shapes, compiled (not
interpreted), against what a user would call instead on the same device.

Per op and implementation (``xla``, ``pallas_triton``, ``pallas_mosaic_gpu`` where the op
has one): the output is first checked against the reference's (max error / max(1, |ref|),
bf16 tolerance 2e-2; a mismatch is reported, never timed), then forward (and forward +
backward where both sides have a gradient) are timed: jitted, medians of ``reps`` runs each
ended by ``block_until_ready``, the two sides in turns. ``ratio`` = reference ms / ours
(> 1: ours is faster). The references:

- attention: ``jax.nn.dot_product_attention(implementation="cudnn")`` (XLA's when cuDNN
  refuses the shape), bf16 ``[4, 4096, 32/8 heads, 128]`` causal grouped-query;
- ragged_dot: ``jax.lax.ragged_dot`` (a Mixtral-sized MoE layer);
- gated_linear_unit, layer_norm, rms_norm, the fused linear + cross-entropy loss and the
  weight-only int8 matmul: the plain ``jax.numpy`` composition;
- paged_attention (one decode step over a shuffled page pool): ``jax.nn`` attention over
  a contiguous ``[batch, max_length]`` cache with ``key_value_seq_lengths``.

An implementation that fails to compile or run is a row with the error in its note (so one
broken kernel does not hide the others' figures). Without a GPU every row reads
"not measured (no GPU)". Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import cairn.kernels as ck
from cairn.core_array import QArray, QuantLayout

BF16 = jnp.bfloat16
TOL = 2e-2


def _median_ms(fns: list[Callable[[], Any]], reps: int) -> list[float]:
    """Median ms of each thunk, run in turns after two warm-up calls each."""
    for fn in fns:
        for _ in range(2):
            jax.block_until_ready(fn())
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[i].append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def _error(got: Any, want: Any) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want))) / max(1.0, float(np.max(np.abs(want))))


def _grad_fn(fn: Callable[..., Any], argnums: tuple[int, ...]) -> Callable[..., Any]:
    return jax.jit(jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums))


def _attention_case() -> dict[str, Any]:
    b, t, n, kh, h = 4, 4096, 32, 8, 128
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, t, n, h), BF16)
    k = jax.random.normal(keys[1], (b, t, kh, h), BF16)
    v = jax.random.normal(keys[2], (b, t, kh, h), BF16)

    def ref(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    try:
        jax.block_until_ready(jax.jit(ref)(q, k, v))
        ref_name = "jax.nn cuDNN"
    except Exception:  # noqa: BLE001 - cuDNN refusing the shape is a fact to report, not a failure
        def ref(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        ref_name = "jax.nn XLA (cuDNN refused)"
    return {
        "op": "dot_product_attention", "shape": f"bf16[{b},{t},{n}/{kh},{h}] causal GQA", "args": (q, k, v),
        "ours": lambda impl: lambda q, k, v: ck.dot_product_attention(q, k, v, is_causal=True, implementation=impl),
        "ref": ref, "ref_name": ref_name, "grad": (0, 1, 2),
        "op_args": (q, k, v), "op_fn": lambda q, k, v: ck.dot_product_attention(q, k, v, is_causal=True),
    }


def _ragged_case() -> dict[str, Any]:
    m, k, n, g = 16384, 4096, 14336, 8
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.normal(size=(m, k)), BF16)
    rhs = jnp.asarray(rng.normal(size=(g, k, n)) * 0.02, BF16)
    sizes = jnp.asarray(rng.multinomial(m, [1 / g] * g), jnp.int32)
    return {
        "op": "ragged_dot", "shape": f"bf16 MoE m={m} k={k} n={n} groups={g}", "args": (lhs, rhs),
        "ours": lambda impl: lambda a, b: ck.ragged_dot(a, b, sizes, implementation=impl),
        "ref": lambda a, b: jax.lax.ragged_dot(a, b, sizes), "ref_name": "jax.lax.ragged_dot", "grad": (0, 1),
    }


def _glu_case() -> dict[str, Any]:
    m, k, n = 8192, 4096, 14336
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(m, k)), BF16)
    w = jnp.asarray(rng.normal(size=(k, 2, n)) * 0.02, BF16)
    return {
        "op": "gated_linear_unit", "shape": f"bf16 x[{m},{k}] w[{k},2,{n}] swish", "args": (x, w),
        "ours": lambda impl: lambda x, w: ck.gated_linear_unit(x, w, activation=jax.nn.swish, implementation=impl),
        "ref": lambda x, w: jax.nn.swish(x @ w[:, 0]) * (x @ w[:, 1]), "ref_name": "swish(x@w0)*(x@w1)",
        "grad": (0, 1),
    }


def _norm_cases() -> list[dict[str, Any]]:
    rows, d = 16384, 4096
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(rows, d)), BF16)
    s = jnp.asarray(rng.normal(size=(d,)), BF16)
    o = jnp.asarray(rng.normal(size=(d,)), BF16)

    def plain_ln(x, s, o):
        xf = x.astype(jnp.float32)
        mean = xf.mean(-1, keepdims=True)
        var = ((xf - mean) ** 2).mean(-1, keepdims=True)
        return ((xf - mean) * jax.lax.rsqrt(var + 1e-6) * s + o).astype(x.dtype)

    def plain_rms(x, s):
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + 1e-6) * s).astype(x.dtype)

    shape = f"bf16 [{rows},{d}]"
    return [
        {"op": "layer_norm", "shape": shape, "args": (x, s, o), "ref": plain_ln, "ref_name": "plain jnp (f32 math)",
         "ours": lambda impl: lambda x, s, o: ck.layer_norm(x, s, o, implementation=impl), "grad": (0, 1, 2)},
        {"op": "layer_norm", "shape": shape + " rms", "args": (x, s), "ref": plain_rms,
         "ref_name": "plain jnp (f32 math)", "grad": (0, 1),
         "ours": lambda impl: lambda x, s: ck.rms_norm(x, s, implementation=impl)},
    ]


def _ce_case() -> dict[str, Any]:
    b, h, v = 8192, 4096, 128256
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(b, h)), BF16)
    w = jnp.asarray(rng.normal(size=(h, v)) * 0.02, BF16)
    labels = jnp.asarray(rng.integers(0, v, size=b), jnp.int32)

    def naive(x, w):
        logits = jnp.dot(x, w, preferred_element_type=jnp.float32)
        return (jax.nn.logsumexp(logits, axis=1) - jnp.take_along_axis(logits, labels[:, None], 1)[:, 0]).sum()

    return {
        "op": "linear_softmax_cross_entropy_loss", "shape": f"bf16 tokens={b} hidden={h} vocab={v}", "args": (x, w),
        "ours": lambda impl: lambda x, w: ck.linear_softmax_cross_entropy_loss(x, labels, w, implementation=impl),
        "ref": naive, "ref_name": "naive logits composition", "grad": (0, 1), "scale_error": b,
        "op_args": (x, labels, w), "op_fn": ck.linear_softmax_cross_entropy_loss,
    }


def _quantized_case() -> dict[str, Any]:
    m, k, n = 4096, 4096, 4096
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(m, k)), BF16)
    q = jnp.asarray(rng.integers(-127, 128, size=(k, n)), jnp.int8)
    s = jnp.asarray(rng.uniform(0.001, 0.01, size=(1, n)), jnp.float32)
    dn = (((1,), (0,)), ((), ()))

    def ours(impl):
        return lambda x, q, s: ck.quantized_dot_general(x, QArray(q, s, layout=QuantLayout.per_channel(1)), dn,
                                                        implementation=impl)

    def ref(x, q, s):
        return x @ QArray(q, s, layout=QuantLayout.per_channel(1)).dequantize().astype(x.dtype)

    return {"op": "quantized_dot_general", "shape": f"w8 bf16 x[{m},{k}] q[{k},{n}]", "args": (x, q, s),
            "ours": ours, "ref": ref, "ref_name": "x @ dequantize(q)", "grad": None}


def _paged_cases() -> list[dict[str, Any]]:
    """A full decode batch (64 rows), and 4 rows of long context, where few programs would
    walk many pages each (the case split pages are for)."""
    return [_paged_case(64, 4096), _paged_case(4, 32768)]


def _paged_case(batch: int, max_length: int) -> dict[str, Any]:
    heads, kv_heads, dim, block = 32, 8, 128, 16
    rng = np.random.default_rng(5)
    lengths = jnp.asarray(rng.integers(max_length // 8, max_length, size=batch), jnp.int32)
    keys = jax.random.split(jax.random.key(5), 3)
    k = jax.random.normal(keys[0], (batch, max_length, kv_heads, dim), BF16)
    v = jax.random.normal(keys[1], (batch, max_length, kv_heads, dim), BF16)
    q = jax.random.normal(keys[2], (batch, 1, heads, dim), BF16)
    width = max_length // block
    tables = rng.permutation(batch * width).reshape(batch, width).astype(np.int32)
    flat = jnp.asarray(tables.reshape(-1))
    kp = jnp.zeros((batch * width, block, kv_heads, dim), BF16).at[flat].set(k.reshape(-1, block, kv_heads, dim))
    vp = jnp.zeros_like(kp).at[flat].set(v.reshape(-1, block, kv_heads, dim))
    tables = jnp.asarray(tables)

    def ref(q, kp, vp, k=k, v=v):
        del kp, vp
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths)

    return {
        "op": "paged_attention", "shape": f"bf16 decode batch={batch} max_len={max_length} {heads}/{kv_heads}x{dim} "
                                          f"page={block}",
        "args": (q, kp, vp),
        "ours": lambda impl: lambda q, kp, vp: ck.paged_attention(q, kp, vp, tables, lengths, implementation=impl),
        "ref": ref, "ref_name": "jax.nn over a contiguous cache", "grad": None,
        "op_args": (q, kp, vp), "op_fn": lambda q, kp, vp: ck.paged_attention(q, kp, vp, tables, lengths),
    }


def _measure(case: dict[str, Any], impl: str, mode: str, reps: int) -> dict[str, Any]:
    row = {"op": case["op"], "impl": impl, "shape": f"{case['shape']} {mode}", "ours_ms": None,
           "ref_name": case["ref_name"], "ref_ms": None, "ratio": None, "note": ""}
    args = case["args"]
    try:
        if mode == "fwd":
            ours, ref = jax.jit(case["ours"](impl)), jax.jit(case["ref"])
        else:
            ours, ref = _grad_fn(case["ours"](impl), case["grad"]), _grad_fn(case["ref"], case["grad"])
        got, want = ours(*args), ref(*args)
        scale = case.get("scale_error", 1) if mode == "fwd" else 1
        errs = [_error(g, w) / scale for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)]
        row["max_error"] = max(errs)
        if max(errs) > TOL:
            row["note"] = f"MISMATCH: error {max(errs):.2e} > {TOL}"
            return row
        t_ours, t_ref = _median_ms([lambda: ours(*args), lambda: ref(*args)], reps)
        row.update(ours_ms=round(t_ours, 3), ref_ms=round(t_ref, 3), ratio=round(t_ref / t_ours, 3),
                   note=f"error {max(errs):.1e}")
    except Exception as exc:  # noqa: BLE001 - a broken kernel is a row, so the others still get measured
        traceback.print_exc()  # the whole story goes to stderr; the row keeps the first lines
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        row["note"] = f"FAILED: {message[:300]}"
    return row


CASES: list[Callable[[], Any]] = [_attention_case, _ragged_case, _glu_case, _norm_cases, _ce_case, _quantized_case,
                                  _paged_cases]


def _sweep(case: dict[str, Any], impl: str, mode: str, reps: int) -> list[dict[str, Any]]:
    """Every config of one implementation, timed by ``ck.autotune_op`` (best of ``reps``) on
    the op call ``op_fn`` makes (``ck.ops_in``), fastest first; a config that fails to
    compile is a row with its error."""
    try:
        call = ck.ops_in(case["op_fn"], *case["op_args"])[0]
        entry = ck.autotune_op(call.op, *call.args, implementations=[impl], iterations=reps,
                               mode="fwd" if mode == "fwd" else "fwd_bwd", store=False, **call.kwargs)
    except Exception as exc:  # noqa: BLE001 - an implementation that takes none of these is a row
        return [{"op": case["op"], "impl": impl, "mode": mode, "config": {}, "ms": None, "error": str(exc)[:300]}]
    rows = [{"op": case["op"], "impl": impl, "mode": mode, "config": dict(m.config),
             "ms": None if m.time_ms is None else round(m.time_ms, 3), "error": (m.error or "")[:200]}
            for m in entry.candidates]
    return sorted(rows, key=lambda r: float("inf") if r["ms"] is None else r["ms"])


def _not_measured() -> list[dict[str, Any]]:
    names = {"dot_product_attention": "bf16[4,4096,32/8,128] causal GQA", "ragged_dot": "bf16 MoE",
             "gated_linear_unit": "bf16 x[8192,4096] w[4096,2,14336]", "layer_norm": "bf16 [16384,4096]",
             "linear_softmax_cross_entropy_loss": "bf16 tokens=8192 hidden=4096 vocab=128256",
             "quantized_dot_general": "w8 bf16 x[4096,4096]", "paged_attention": "bf16 decode batch=64 max_len=4096"}
    return [{"op": op, "impl": impl, "shape": shape, "ours_ms": None, "ref_name": "", "ref_ms": None, "ratio": None,
             "note": "not measured (no GPU)"} for op, shape in names.items() for impl in ck.implementations(op)]


def main() -> None:
    """Run every case on the default backend's GPU; print the table and one JSON line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--ops", default="", help="comma-separated op names to run (default: all)")
    parser.add_argument("--sweep", default="", help="comma-separated implementations whose every config is "
                        "timed (ck.autotune_op) instead of the table, for the ops whose case has an op_fn")
    parser.add_argument("--sweep-modes", default="fwd", help="comma-separated: fwd, fwd+bwd")
    args = parser.parse_args()
    reps = 10 if args.quick else 30
    wanted = {o for o in args.ops.split(",") if o}
    rows: list[dict[str, Any]] = []
    if jax.default_backend() != "gpu":
        rows = _not_measured()
    elif not args.sweep:
        for make in CASES:
            made = make()
            for case in made if isinstance(made, list) else [made]:
                if wanted and case["op"] not in wanted:
                    continue
                for impl in ck.implementations(case["op"]):
                    for mode in ("fwd",) + (("fwd+bwd",) if case["grad"] else ()):
                        rows.append(_measure(case, impl, mode, reps))
                        r = rows[-1]
                        print(f"# {r['op']} {r['impl']} {r['shape']}: {r['ours_ms']} vs {r['ref_ms']} {r['note']}",
                              flush=True)
    sweep: list[dict[str, Any]] = []
    if args.sweep and jax.default_backend() == "gpu":
        for make in CASES:
            made = make()
            for case in made if isinstance(made, list) else [made]:
                if (wanted and case["op"] not in wanted) or "op_fn" not in case:
                    continue
                for impl in (i for i in args.sweep.split(",") if i in ck.implementations(case["op"])):
                    for mode in args.sweep_modes.split(","):
                        sweep += _sweep(case, impl, mode, reps)
        for r in sweep:
            print(f"# sweep {r['op']} {r['impl']} {r['mode']} {r['config']}: {r['ms']} {r['error']}", flush=True)
    print(f"{'op':34} {'impl':18} {'shape':58} {'ours ms':>9} {'ref ms':>9} {'ratio':>6}  reference / note")
    for r in rows:
        ours = "" if r["ours_ms"] is None else f"{r['ours_ms']:.3f}"
        ref = "" if r["ref_ms"] is None else f"{r['ref_ms']:.3f}"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"{r['op']:34} {r['impl']:18} {r['shape'][:58]:58} {ours:>9} {ref:>9} {ratio:>6}  {r['ref_name']}; "
              f"{r['note']}")
    device = jax.devices()[0].device_kind if jax.default_backend() == "gpu" else "none"
    print(json.dumps({"bench": "kernels_gpu", "device": device, "jax": jax.__version__,
                      "load": round(os.getloadavg()[0], 2),
                      "failed": [f"{r['op']}/{r['impl']}/{r['shape']}" for r in rows
                                 if r["note"].startswith(("FAILED", "MISMATCH"))],
                      "rows": [{k: r[k] for k in ("op", "impl", "shape", "ours_ms", "ref_ms", "ratio")}
                               for r in rows],
                      "sweep": sweep}))


if __name__ == "__main__":
    main()
