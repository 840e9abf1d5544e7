"""Benchmark rows for ragged_dot, gated_linear_unit, layer_norm/rms_norm,
linear_softmax_cross_entropy_loss and quantized_dot_general (imported by benchmarks/kernels.py).

Each op's ``xla`` implementation against the plain-JAX composition a user would write
(``ratio`` = reference time / ours, > 1 means ours is faster), forward and forward+backward,
jitted, best of several alternating runs after a warm-up; the cross-entropy's compiled temporary
memory against the naive composition. GPU rows say "not measured (no GPU)" unless a GPU
is the default backend.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn import kernels
from cairn.core_array import QArray, QuantLayout


def _time_pair_ms(ours: Callable[..., Any], ref: Callable[..., Any], *args: Any, reps: int) -> tuple[float, float]:
    """Best-of-``reps`` wall times of two compiled functions, measured alternately (the
    minimum is the least disturbed by other work on a shared machine)."""
    jax.block_until_ready(ours(*args))
    jax.block_until_ready(ref(*args))
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(reps):
        for i, fn in enumerate((ours, ref)):
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[i].append((time.perf_counter() - t) * 1e3)
    return min(times[0]), min(times[1])


def _row(op: str, impl: str, shape: str, ours: float, ref_name: str, ref: float, note: str = "") -> dict:
    return {
        "op": op, "impl": impl, "shape": shape, "ours_ms": round(ours, 3), "ref_name": ref_name,
        "ref_ms": round(ref, 3), "ratio": round(ref / ours, 3) if ours > 0 else None, "note": note,
    }


def _pair(op, shape, ours, ref, ref_name, args, reps, note="", grad_argnums=None):
    """Forward rows, and forward+backward rows when ``grad_argnums`` is given."""
    t_ours, t_ref = _time_pair_ms(jax.jit(ours), jax.jit(ref), *args, reps=reps)
    rows = [_row(op, "xla", shape + " fwd", t_ours, ref_name, t_ref, note)]
    if grad_argnums is not None:
        def loss(f):
            return jax.jit(jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), grad_argnums))
        t_ours, t_ref = _time_pair_ms(loss(ours), loss(ref), *args, reps=reps)
        rows.append(_row(op, "xla", shape + " fwd+bwd", t_ours, ref_name, t_ref, note))
    return rows


def _ragged(quick: bool, reps: int) -> list[dict]:
    m, k, n, g = (1024, 256, 256, 8) if quick else (4096, 1024, 1024, 8)
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(g, k, n)) * 0.05, jnp.float32)
    gs = jnp.asarray(rng.multinomial(m, [1 / g] * g), jnp.int32)
    return _pair(
        "ragged_dot", f"f32 m={m} k={k} n={n} groups={g}",
        lambda a, b: kernels.ragged_dot(a, b, gs, implementation="xla"),
        lambda a, b: jax.lax.ragged_dot(a, b, gs), "jax.lax.ragged_dot", (lhs, rhs), reps,
        grad_argnums=(0, 1),
    )


def _glu(quick: bool, reps: int) -> list[dict]:
    m, k, n = (512, 512, 1024) if quick else (2048, 1024, 4096)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(k, 2, n)) * 0.03, jnp.float32)

    def plain(x, w):
        return jax.nn.swish(x @ w[:, 0]) * (x @ w[:, 1])

    return _pair(
        "gated_linear_unit", f"f32 x[{m},{k}] w[{k},2,{n}] swish",
        lambda x, w: kernels.gated_linear_unit(x, w, activation=jax.nn.swish, implementation="xla"),
        plain, "swish(x@w0)*(x@w1)", (x, w), reps, grad_argnums=(0, 1),
    )


def _norms(quick: bool, reps: int) -> list[dict]:
    rows, d = (4096, 1024) if quick else (16384, 4096)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(rows, d)), jnp.float32)
    s = jnp.asarray(rng.normal(size=(d,)), jnp.float32)
    o = jnp.asarray(rng.normal(size=(d,)), jnp.float32)

    def plain_ln(x, s, o):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(v + 1e-6) * s + o

    def plain_rms(x, s, o):
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * s

    shape = f"f32 [{rows},{d}]"
    out = _pair("layer_norm", shape, lambda x, s, o: kernels.layer_norm(x, s, o, implementation="xla"),
                plain_ln, "plain jnp layer norm", (x, s, o), reps, grad_argnums=(0, 1, 2))
    out += _pair("rms_norm", shape, lambda x, s, o: kernels.rms_norm(x, s, implementation="xla"),
                 plain_rms, "plain jnp rms norm", (x, s, o), reps, grad_argnums=(0, 1))
    return out


def _naive_ce(x, labels, w):
    logits = jnp.dot(x, w, preferred_element_type=jnp.float32)
    return (jax.nn.logsumexp(logits, axis=1) - jnp.take_along_axis(logits, labels[:, None], 1)[:, 0]).sum()


def _ce_memory(b: int, h: int, v: int) -> dict:
    args = (jax.ShapeDtypeStruct((b, h), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.int32),
            jax.ShapeDtypeStruct((h, v), jnp.float32))

    def temp(f):
        g = jax.jit(jax.value_and_grad(f, (0, 2)))
        return g.lower(*args).compile().memory_analysis().temp_size_in_bytes

    ours = temp(lambda x, lab, w: kernels.linear_softmax_cross_entropy_loss(x, lab, w, implementation="xla"))
    naive = temp(_naive_ce)
    mib = 1024 * 1024
    return {
        "op": "linear_softmax_cross_entropy_loss", "impl": "xla",
        "shape": f"f32 tokens={b} hidden={h} vocab={v} value+grad temp memory",
        "ours_ms": None, "ref_name": "naive logits composition", "ref_ms": None,
        "ratio": round(naive / max(ours, 1), 2),
        "note": f"compiled temp bytes: ours {ours / mib:.1f} MiB, naive {naive / mib:.1f} MiB (ratio = naive/ours)",
    }


def _ce(quick: bool, reps: int) -> list[dict]:
    b, h, v = (1024, 256, 8192) if quick else (2048, 512, 32768)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(b, h)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(h, v)) * 0.05, jnp.float32)
    lab = jnp.asarray(rng.integers(0, v, size=b), jnp.int32)
    rows = _pair(
        "linear_softmax_cross_entropy_loss", f"f32 tokens={b} hidden={h} vocab={v}",
        lambda x, w: kernels.linear_softmax_cross_entropy_loss(x, lab, w, implementation="xla"),
        lambda x, w: _naive_ce(x, lab, w), "naive logits composition", (x, w), reps, grad_argnums=(0, 1),
    )
    mem = (2048, 256, 32768) if quick else (8192, 512, 32768)
    return rows + [_ce_memory(*mem)]


def _quantized(quick: bool, reps: int) -> list[dict]:
    m, k, n = (256, 1024, 1024) if quick else (1024, 4096, 4096)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    q = jnp.asarray(rng.integers(-127, 128, size=(k, n)), jnp.int8)
    s = jnp.asarray(rng.uniform(0.001, 0.01, size=(1, n)), jnp.float32)
    w = QArray(q, s, layout=QuantLayout.per_channel(1))
    dn = (((1,), (0,)), ((), ()))

    def ours(x, q, s):
        return kernels.quantized_dot_general(x, QArray(q, s, layout=QuantLayout.per_channel(1)), dn,
                                             implementation="xla")

    def dequant(x, q, s):
        return x @ QArray(q, s, layout=QuantLayout.per_channel(1)).dequantize()

    del w
    rows = _pair("quantized_dot_general", f"w8 per-channel f32 x[{m},{k}] q[{k},{n}]", ours, dequant,
                 "x @ dequantize(q)", (x, q, s), reps,
                 note="weight-only f32: the int8->f32 convert with the scale folded in, as the reference does")
    xq = jnp.asarray(rng.integers(-127, 128, size=(m, k)), jnp.int8)
    xs = jnp.asarray(rng.uniform(0.001, 0.01, size=(m, 1)), jnp.float32)

    def ours8(xq, xs, q, s):
        lhs = QArray(xq, xs, layout=QuantLayout.per_channel(0))
        return kernels.quantized_dot_general(lhs, QArray(q, s, layout=QuantLayout.per_channel(1)), dn,
                                             implementation="xla")

    def dequant8(xq, xs, q, s):
        lhs = QArray(xq, xs, layout=QuantLayout.per_channel(0))
        return lhs.dequantize() @ QArray(q, s, layout=QuantLayout.per_channel(1)).dequantize()

    return rows + _pair("quantized_dot_general", f"w8a8 per-token x per-channel [{m},{k}] x [{k},{n}]", ours8,
                        dequant8, "dequantize both, f32 dot", (xq, xs, q, s), reps,
                        note="int8 x int8 -> int32 dot, scales after")


def _interpret_rows() -> list[dict]:
    """Every Pallas kernel run in interpret mode at a small ragged size: its max error
    against the op's ``xla`` implementation (forward), no timing (interpret mode is not a
    speed)."""
    rng = np.random.default_rng(5)
    bf = jnp.bfloat16
    x = jnp.asarray(rng.normal(size=(70, 64)), bf)
    cases = {
        "ragged_dot": (kernels.ragged_dot, (x, jnp.asarray(rng.normal(size=(3, 64, 64)) * 0.1, bf),
                                            jnp.array([20, 0, 33], jnp.int32)), {}),
        "gated_linear_unit": (kernels.gated_linear_unit, (x, jnp.asarray(rng.normal(size=(64, 2, 64)) * 0.1, bf)),
                              {"activation": jax.nn.swish}),
        "layer_norm": (kernels.layer_norm, (x, jnp.ones((64,), bf), jnp.zeros((64,), bf)), {}),
        "linear_softmax_cross_entropy_loss": (
            kernels.linear_softmax_cross_entropy_loss,
            (x, jnp.asarray(rng.integers(0, 128, size=70), jnp.int32), jnp.asarray(rng.normal(size=(64, 128)) * 0.1, bf)),
            {},
        ),
    }
    out = []
    for op, (fn, args, kw) in cases.items():
        ref = np.asarray(fn(*args, implementation="xla", **kw).astype(jnp.float32))
        for impl in ("pallas_triton", "pallas_mosaic_gpu"):
            if impl not in kernels.implementations(op):
                continue
            got = np.asarray(fn(*args, implementation=impl, **kw).astype(jnp.float32))
            err = float(np.max(np.abs(got - ref))) / max(1.0, float(np.max(np.abs(ref))))
            out.append({"op": op, "impl": impl, "shape": "bf16 small ragged, interpret mode (CPU)", "ours_ms": None,
                        "ref_name": "xla implementation", "ref_ms": None, "ratio": None,
                        "note": f"max error / max(1, |ref|) = {err:.2e} (bf16 tolerance 1.6e-2)"})
    return out


def _gpu_rows() -> list[dict]:
    note = "not measured (no GPU)"
    out = []
    for op, shape in (
        ("ragged_dot", "bf16 MoE m=16384 k=4096 n=14336 groups=8"),
        ("gated_linear_unit", "bf16 x[8192,4096] w[4096,2,14336]"),
        ("layer_norm", "bf16 [16384,4096]"),
        ("linear_softmax_cross_entropy_loss", "bf16 tokens=8192 hidden=4096 vocab=128256"),
        ("quantized_dot_general", "w8 x[4096,4096] q[4096,4096]"),
    ):
        for impl in ("pallas_triton", "pallas_mosaic_gpu"):
            if impl in kernels.implementations(op):
                out.append({"op": op, "impl": impl, "shape": shape, "ours_ms": None, "ref_name": "XLA composition",
                            "ref_ms": None, "ratio": None, "note": note})
    return out


def rows(quick: bool) -> list[dict]:
    """Benchmark rows of K2's ops (see the module docstring)."""
    reps = 25 if quick else 41
    out: list[dict] = []
    for part in (_ragged, _glu, _norms, _ce, _quantized):
        out += part(quick, reps)
    if jax.default_backend() != "gpu":
        out += _interpret_rows()
        out += _gpu_rows()
    return out


if __name__ == "__main__":
    import json
    import sys

    for r in rows("--quick" in sys.argv):
        print(json.dumps(r))
