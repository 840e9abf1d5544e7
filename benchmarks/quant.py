"""cairn.quant against Qwix: the same transformer, the same weights, the same rules.

Two pre-norm blocks (D=512, MLP 2048, 8 heads; input [4, 128, 512]) written once in
cairn.nn and once in Flax NNX with identical weights. For each config the table shows,
for cairn.quant and for Qwix: the time to quantize (first call included for Qwix, whose
PTQ converts weights on the first call), the output's relative L2 error against the
float model, the jitted inference time against float, and the bytes of the weights.

Then an eager call of ``quantize(fn)`` against the same function under ``jax.jit`` (a
24-layer toy, w8a8), the row that shows what a cached compiled replay saves.

Prints the table, then ONE JSON line. ``--quick`` uses a smaller model; ``--eager-only``
runs the eager row alone.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cairn import nn, quant
from cairn.core_array import QArray, flatten_with_paths

CONFIGS = {
    "w8": {"weight_qtype": "int8"},
    "w8a8": {"weight_qtype": "int8", "act_qtype": "int8"},
    "w8a8_static": {"weight_qtype": "int8", "act_qtype": "int8", "act_static_scale": True},
    "w4_tile128": {"weight_qtype": "int4", "tile_size": 128},
    "fp8": {"weight_qtype": "float8_e4m3fn", "act_qtype": "float8_e4m3fn"},
    "nf4": {"weight_qtype": "nf4"},
    # GPTQ / AWQ on the calibration input, ours and Qwix's contrib flows (qwix.contrib.gptq/awq)
    "gptq_w4_tile128": {"weight_qtype": "int4", "tile_size": 128, "gptq": True},
    "awq_w4_tile128": {"weight_qtype": "int4", "tile_size": 128, "awq": True},
}


def _attend(q, k, v, heads: int):
    b, t, d = q.shape
    split = lambda a: a.reshape(b, t, heads, d // heads)  # noqa: E731
    logits = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / np.sqrt(d // heads)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), split(v))
    return out.reshape(b, t, d)


class CairnBlock(nn.Module):
    def __init__(self, d: int, f: int, heads: int, rngs: nn.Rngs) -> None:
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d, rngs=rngs), nn.LayerNorm(d, rngs=rngs)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, rngs=rngs) for _ in range(4))
        self.up, self.down = nn.Linear(d, f, rngs=rngs), nn.Linear(f, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.ln1(x)
        x = x + self.o(_attend(self.q(h), self.k(h), self.v(h), self.heads))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class NnxBlock(nnx.Module):
    def __init__(self, d: int, f: int, heads: int, rngs: nnx.Rngs) -> None:
        self.heads = heads
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.q, self.k, self.v, self.o = (nnx.Linear(d, d, rngs=rngs) for _ in range(4))
        self.up, self.down = nnx.Linear(d, f, rngs=rngs), nnx.Linear(f, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.ln1(x)
        x = x + self.o(_attend(self.q(h), self.k(h), self.v(h), self.heads))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class CairnModel(nn.Module):
    def __init__(self, d: int, f: int, heads: int, rngs: nn.Rngs) -> None:
        self.blocks = [CairnBlock(d, f, heads, rngs), CairnBlock(d, f, heads, rngs)]

    def __call__(self, x: jax.Array) -> jax.Array:
        for b in self.blocks:
            x = b(x)
        return x


class NnxModel(nnx.Module):
    def __init__(self, d: int, f: int, heads: int, rngs: nnx.Rngs) -> None:
        self.blocks = nnx.List([NnxBlock(d, f, heads, rngs), NnxBlock(d, f, heads, rngs)]) if hasattr(nnx, "List") else [
            NnxBlock(d, f, heads, rngs), NnxBlock(d, f, heads, rngs)
        ]

    def __call__(self, x: jax.Array) -> jax.Array:
        for b in self.blocks:
            x = b(x)
        return x


def _copy_weights(src: CairnModel, dst: NnxModel) -> None:
    """Give the NNX model the cairn model's weights, path by path."""
    for path, value in flatten_with_paths(src).items():
        node = dst
        parts = path.split("/")
        for part in parts[:-1]:
            node = node[int(part)] if part.isdigit() else getattr(node, part)
        getattr(node, parts[-1]).value = jnp.asarray(value)


def _weight_bytes(tree) -> int:
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, QArray)):
        parts = [leaf.qvalue, leaf.scale, leaf.zero_point] if isinstance(leaf, QArray) else [leaf]
        for p in parts:
            if p is not None and hasattr(p, "dtype"):
                bits = jnp.iinfo(p.dtype).bits if jnp.issubdtype(p.dtype, jnp.integer) else jnp.finfo(p.dtype).bits
                total += (int(np.prod(p.shape)) * bits + 7) // 8
    return total


def _best_ms(fn, args, rounds: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def _rel(a, b) -> float:
    if a is None:  # the peer's flow failed
        return float("nan")
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _ours(model: CairnModel, x, cfg: dict, rounds: int) -> dict:
    call = lambda m, x: m(x)  # noqa: E731
    cfg = dict(cfg)
    gptq, awq = cfg.pop("gptq", False), cfg.pop("awq", False)
    rule_type = quant.GptqRule if gptq else quant.AwqRule if awq else quant.QuantizationRule
    provider = quant.PtqProvider([rule_type(**cfg)])
    t = time.perf_counter()
    if cfg.get("act_static_scale"):
        quant.calibrate(call, provider, [(model, x)])
    if gptq:
        qmodel = jax.block_until_ready(quant.gptq_quantize_params(model, provider, call, [(x,)]))
    elif awq:
        qmodel = jax.block_until_ready(quant.awq_quantize_params(model, provider, call, [(x,)]))
    else:
        qmodel = jax.block_until_ready(quant.quantize_params(model, provider, call, x))
    quantize_s = time.perf_counter() - t
    fn = jax.jit(quant.quantize(call, provider))
    return {"quantize_s": quantize_s, "out": fn(qmodel, x), "ms": _best_ms(fn, (qmodel, x), rounds), "bytes": _weight_bytes(qmodel)}


def _qwix_calibrated(model: NnxModel, x, cfg: dict, method: str):
    """Qwix's contrib GPTQ / AWQ flow for NNX: a calibration model collects the statistics,
    then the method's quantize_params fills the PTQ (GPTQ) or AWQ-inference model."""
    import qwix
    from qwix.contrib import awq, gptq

    contrib = gptq if method == "gptq" else awq
    rules = [(gptq.GptqRule if method == "gptq" else awq.AwqRule)(**cfg)]
    provider = gptq.GptqCalibrationProvider(rules) if method == "gptq" else awq.AwqCalibrationProvider(rules)
    cal = qwix.quantize_model(model, provider, x)
    cal(x)
    infer = qwix.PtqProvider(rules) if method == "gptq" else awq.AwqInferenceProvider(rules)
    qmodel = qwix.quantize_model(model, infer, x)
    params = nnx.to_pure_dict(nnx.state(cal, nnx.Param))
    stats = nnx.to_pure_dict(nnx.state(cal, qwix.QuantStat))
    nnx.update(qmodel, contrib.quantize_params(params, qmodel, stats))
    return qmodel


def _qwix(model: NnxModel, x, cfg: dict, rounds: int) -> dict:
    import qwix

    method = "gptq" if cfg.get("gptq") else "awq" if cfg.get("awq") else None
    cfg = {k: v for k, v in cfg.items() if k not in ("gptq", "awq")}
    t = time.perf_counter()
    if method is None:
        qmodel = qwix.quantize_model(model, qwix.PtqProvider([qwix.QuantizationRule(**cfg)]), x)
    else:
        try:
            qmodel = _qwix_calibrated(model, x, cfg, method)
        except (ValueError, TypeError) as e:  # Qwix 0.1.8: its documented NNX AWQ flow fails in nnx.update
            print(f"qwix {method} failed: {type(e).__name__}: {e}")
            return {"quantize_s": float("nan"), "out": None, "ms": float("nan"), "bytes": 0}
    fn = nnx.jit(lambda m, x: m(x))
    out = jax.block_until_ready(fn(qmodel, x))  # Qwix PTQ converts the weights on the first call
    quantize_s = time.perf_counter() - t
    state = nnx.state(qmodel, nnx.Param)
    return {"quantize_s": quantize_s, "out": out, "ms": _best_ms(fn, (qmodel, x), rounds), "bytes": _weight_bytes(state)}


def _row(name: str, ours: dict, peer: dict, ref_ours, ref_peer, float_ms: tuple[float, float]) -> dict:
    return {
        "config": name,
        "ours_quantize_s": round(ours["quantize_s"], 3),
        "qwix_quantize_s": round(peer["quantize_s"], 3),
        "ours_error": round(_rel(ours["out"], ref_ours), 5),
        "qwix_error": round(_rel(peer["out"], ref_peer), 5),
        "ours_speedup_vs_float": round(float_ms[0] / ours["ms"], 3),
        "qwix_speedup_vs_float": round(float_ms[1] / peer["ms"], 3),
        "ours_bytes": ours["bytes"],
        "qwix_bytes": peer["bytes"],
    }


def _print_table(rows: list[dict], float_ms: tuple[float, float], float_bytes: int) -> None:
    print(f"float: cairn.nn {float_ms[0]:.2f} ms, Flax NNX {float_ms[1]:.2f} ms, weights {float_bytes / 2**20:.2f} MiB")
    head = f"{'config':<13}{'quantize s (ours/qwix)':>24}{'rel. error (ours/qwix)':>26}{'x float (ours/qwix)':>22}{'MiB (ours/qwix)':>18}"
    print(head)
    for r in rows:
        print(
            f"{r['config']:<13}{r['ours_quantize_s']:>11.3f} / {r['qwix_quantize_s']:<10.3f}"
            f"{100 * r['ours_error']:>12.2f}% / {100 * r['qwix_error']:<9.2f}%"
            f"{r['ours_speedup_vs_float']:>10.2f} / {r['qwix_speedup_vs_float']:<9.2f}"
            f"{r['ours_bytes'] / 2**20:>8.2f} / {r['qwix_bytes'] / 2**20:<7.2f}"
        )


def eager_vs_jit(rounds: int = 20, layers: int = 24, d: int = 256, tokens: int = 64) -> dict:
    """Milliseconds per call of a quantized ``layers``-deep tanh MLP, eagerly and under ``jax.jit``."""
    keys = jax.random.split(jax.random.key(0), layers)
    params = {"layers": [{"kernel": jax.random.normal(k, (d, d)) / np.sqrt(d)} for k in keys]}
    x = jax.random.normal(jax.random.key(1), (tokens, d))

    def mlp(p, x):
        for layer in p["layers"]:
            x = jnp.tanh(x @ layer["kernel"])
        return x

    q = quant.quantize(mlp, quant.PtqProvider([quant.QuantizationRule(weight_qtype="int8", act_qtype="int8")]))
    jitted = jax.jit(q)
    eager_ms = jit_ms = float("inf")
    for _ in range(rounds):  # interleaved, so a change in the machine's load hits both alike
        eager_ms = min(eager_ms, _best_ms(q, (params, x), 1))
        jit_ms = min(jit_ms, _best_ms(jitted, (params, x), 1))
    np.testing.assert_allclose(np.asarray(q(params, x)), np.asarray(jax.jit(q)(params, x)), rtol=1e-5, atol=1e-5)
    row = {"layers": layers, "eager_ms": round(eager_ms, 3), "jit_ms": round(jit_ms, 3), "eager_over_jit": round(eager_ms / jit_ms, 3)}
    print(f"eager vs jit ({layers} layers, [{tokens}, {d}] x [{d}, {d}], w8a8): eager {eager_ms:.2f} ms, jit {jit_ms:.2f} ms, {eager_ms / jit_ms:.2f}x")
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--eager-only", action="store_true")
    args = parser.parse_args()
    if args.eager_only:
        print(json.dumps({"bench": "quant_eager", **eager_vs_jit(rounds=50)}))
        return
    d, f, heads, b, t = (128, 512, 4, 2, 32) if args.quick else (512, 2048, 8, 4, 128)
    rounds = 5 if args.quick else 20
    cairn_model = CairnModel(d, f, heads, nn.Rngs(0))
    nnx_model = NnxModel(d, f, heads, nnx.Rngs(0))
    _copy_weights(cairn_model, nnx_model)
    x = jax.random.normal(jax.random.key(1), (b, t, d))
    ref_ours = jax.jit(lambda m, x: m(x))(cairn_model, x)
    ref_peer = nnx.jit(lambda m, x: m(x))(nnx_model, x)
    float_ms = (_best_ms(jax.jit(lambda m, x: m(x)), (cairn_model, x), rounds), _best_ms(nnx.jit(lambda m, x: m(x)), (nnx_model, x), rounds))
    rows = []
    for name, cfg in CONFIGS.items():
        peer_model = NnxModel(d, f, heads, nnx.Rngs(0))
        _copy_weights(cairn_model, peer_model)
        rows.append(_row(name, _ours(cairn_model, x, cfg, rounds), _qwix(peer_model, x, cfg, rounds), ref_ours, ref_peer, float_ms))
    _print_table(rows, float_ms, _weight_bytes(cairn_model))
    eager = eager_vs_jit(rounds)
    summary = {"bench": "quant", "quick": args.quick, "float_ms_ours": round(float_ms[0], 3), "float_ms_nnx": round(float_ms[1], 3)}
    summary.update({f"eager_{k}" if not k.startswith("eager") else k: v for k, v in eager.items()})
    for r in rows:
        for k in ("ours_error", "qwix_error", "ours_speedup_vs_float", "qwix_speedup_vs_float", "ours_bytes", "qwix_bytes"):
            summary[f"{r['config']}_{k}"] = r[k]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
