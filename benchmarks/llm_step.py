"""cairn.llm's Llama forward and train step against the same math as raw JAX (plain jax.numpy).

Issue 26 asks that cairn.llm's jitted forward (and training step) stay within 1.05x of the
same model written as raw JAX. ``benchmarks/llm.py`` times the forward of a Qwen2 checkpoint;
this script times a randomly initialised **Llama** (no biases, untied ``lm_head``, SwiGLU,
grouped-query attention, rotary) in one process:

- **forward**: ``nn.jit(lambda m, ids: m(ids))`` against ``jax.jit(raw_forward)`` over the very
  same parameter arrays (``nn.state(model)`` read out by path), full-sequence logits, float32.
- **train step**: next-token cross-entropy, its gradient and an AdamW update.
  Ours: ``nn.value_and_grad`` through the ``CausalLM`` and ``nn.Optimizer.update`` under
  ``nn.jit`` with the model and optimizer donated (as ``cairn.llm``'s trainers run it).
  Raw: ``jax.value_and_grad`` of ``raw_forward``'s loss and the same ``cairn.optim.adamw``
  transformation applied to the parameter dict under ``jax.jit`` with params and state donated.

Both sides compute the same logits (checked to 1e-4 relative) and the same first-step loss.
Timings interleave ours and raw (the order alternating per repeat), take medians, and print
the load average before and after, since the machines these run on are shared. The last
line is one JSON object with the ratios (ours / raw: below 1.05 is the issue's bar).

Usage: python benchmarks/llm_step.py [--quick | --full] [--repeats N]  (no flag: the --full model)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from llm import raw_parts  # benchmarks/llm.py: the raw forwards' shared pieces

from cairn import llm, nn, optim

SHAPES = {
    "default": {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
                "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "batch": 4, "length": 128},
    "quick": {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "batch": 2, "length": 64},
}


def _by_path(tree: dict, prefix: str = "") -> dict:
    """A nested dict's arrays by ``"a/b/c"`` path (at trace time: no cost in the program)."""
    out = {}
    for k, v in tree.items():
        out.update(_by_path(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def raw_forward(params: dict, ids: Any, cfg: Any) -> Any:
    """Llama's forward over ``params`` (nested dicts of arrays): embed; per layer RMSNorm -> q/k/v einsums ->
    rotary -> causal grouped-query attention -> output projection -> residual -> RMSNorm ->
    SwiGLU -> residual; final RMSNorm; ``lm_head``. Norm statistics and softmax in float32."""

    p = _by_path(params)

    b, t = ids.shape
    hd, kv, n = cfg.head_dim, cfg.num_key_value_heads, cfg.num_attention_heads
    norm, rope, causal = raw_parts(cfg, t)
    x = p["embed/embedding"][ids]
    for i in range(cfg.num_hidden_layers):
        a = f"layers/{i}/attn/"
        h = norm(x, p[f"layers/{i}/input_norm/scale"])
        q = rope(jnp.einsum("btd,dnh->btnh", h, p[a + "q/kernel"])).reshape(b, t, kv, n // kv, hd)
        k = rope(jnp.einsum("btd,dnh->btnh", h, p[a + "k/kernel"]))
        v = jnp.einsum("btd,dnh->btnh", h, p[a + "v/kernel"])
        s = jnp.einsum("btkgh,bskh->bkgts", q, k).astype(jnp.float32) * hd ** -0.5
        w = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1).astype(v.dtype)
        o = jnp.einsum("bkgts,bskh->btkgh", w, v).reshape(b, t, n * hd)
        x = x + o @ p[a + "o/kernel"].reshape(n * hd, -1)
        h = norm(x, p[f"layers/{i}/mlp_norm/scale"])
        m = f"layers/{i}/mlp/"
        x = x + (jax.nn.silu(h @ p[m + "gate/kernel"]) * (h @ p[m + "up/kernel"])) @ p[m + "down/kernel"]
    return (norm(x, p["norm/scale"]) @ p["lm_head/kernel"]).astype(jnp.float32)


def xent(logits: Any, ids: Any) -> Any:
    """Mean next-token cross-entropy of ``logits [B, T, V]`` against ``ids`` shifted by one."""
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def interleaved(ours: Callable[[], Any], raw: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Median seconds of ``ours`` and ``raw``, called alternately (order swapped every repeat)."""
    t_ours, t_raw = [], []
    for r in range(repeats):
        pair = [(t_ours, ours), (t_raw, raw)]
        for dst, fn in pair if r % 2 == 0 else pair[::-1]:
            dst.append(_timed(fn))
    return statistics.median(t_ours), statistics.median(t_raw)


def build(shape: dict) -> tuple[llm.CausalLM, dict, Any]:
    cfg = llm.LlmConfig("llama", **{k: v for k, v in shape.items() if k not in ("batch", "length")},
                        max_position_embeddings=max(2048, shape["length"]))
    model = llm.CausalLM(cfg, rngs=nn.Rngs(0))
    params = jax.tree.map(jnp.array, nn.state(model).to_pure_dict())  # nested dicts, a copy
    ids = jnp.asarray(np.random.default_rng(1).integers(0, shape["vocab_size"], (shape["batch"], shape["length"]),
                                                         dtype=np.int32))
    return model, params, ids


def bench_forward(model: llm.CausalLM, params: dict, ids: Any, repeats: int) -> dict:
    ours = nn.jit(lambda m, x: m(x))
    raw = jax.jit(lambda p, x: raw_forward(p, x, model.config))
    lo, lr = np.asarray(ours(model, ids)), np.asarray(raw(params, ids))
    err = float(np.max(np.abs(lo - lr)) / np.max(np.abs(lr)))
    if err > 1e-4:
        raise AssertionError(f"raw JAX logits differ from cairn.llm's by {err:.2e} (relative to max |logit|)")
    o, r = interleaved(lambda: ours(model, ids), lambda: raw(params, ids), repeats)
    return {"ours_ms": o * 1e3, "raw_ms": r * 1e3, "ratio": o / r, "rel_err": err}


def bench_train(model: llm.CausalLM, params: dict, ids: Any, repeats: int) -> dict:
    tx = optim.adamw(1e-4, weight_decay=0.01)
    opt = nn.Optimizer(model, tx, wrt=nn.Param)

    def ours_step(m: llm.CausalLM, o: nn.Optimizer, x: Any) -> Any:
        loss, grads = nn.value_and_grad(lambda mm: xent(mm(x), x))(m)
        o.update(m, grads)
        return loss

    def raw_step(p: dict, s: Any, x: Any) -> tuple:
        loss, g = jax.value_and_grad(lambda pp: xent(raw_forward(pp, x, model.config), x))(p)
        updates, s = tx.update(g, s, p)
        return optim.apply_updates(p, updates), s, loss

    ours = nn.jit(ours_step, donate_argnums=(0, 1))
    raw = jax.jit(raw_step, donate_argnums=(0, 1))
    box = {"p": params, "s": tx.init(params)}

    def run_raw() -> Any:
        box["p"], box["s"], loss = raw(box["p"], box["s"], ids)
        return loss

    l_ours, l_raw = float(ours(model, opt, ids)), float(run_raw())
    if abs(l_ours - l_raw) > 1e-4 * abs(l_raw):
        raise AssertionError(f"first-step losses differ: cairn.llm {l_ours} raw JAX {l_raw}")
    o, r = interleaved(lambda: ours(model, opt, ids), run_raw, repeats)
    return {"ours_ms": o * 1e3, "raw_ms": r * 1e3, "ratio": o / r, "loss": l_raw}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a smaller model (seconds; what nox -s bench runs)")
    ap.add_argument("--full", action="store_true", help="the default model (nox -s bench -- --full)")
    ap.add_argument("--repeats", type=int, default=21)
    a = ap.parse_args()
    shape = SHAPES["quick" if a.quick else "default"]
    loads = [os.getloadavg()[0]]
    model, params, ids = build(shape)
    fwd = bench_forward(model, params, ids, a.repeats)
    loads.append(os.getloadavg()[0])
    train = bench_train(model, params, ids, a.repeats)
    loads.append(os.getloadavg()[0])
    print(f"cairn.llm Llama {shape}, float32, jax {jax.__version__} on {jax.devices()[0].platform}, "
          f"{os.cpu_count()} CPUs, load average {', '.join(f'{x:.1f}' for x in loads)} (start, after fwd, end), "
          f"{a.repeats} interleaved repeats, medians")
    print(f"{'step':12s} {'cairn.llm ms':>13s} {'raw JAX ms':>11s} {'ratio':>6s}")
    for name, r in (("forward", fwd), ("train step", train)):
        print(f"{name:12s} {r['ours_ms']:13.2f} {r['raw_ms']:11.2f} {r['ratio']:6.3f}")
    print(json.dumps({"bench": "llm_step", "forward_vs_raw_jax": round(fwd["ratio"], 3),
                      "train_step_vs_raw_jax": round(train["ratio"], 3), "forward_rel_err": fwd["rel_err"],
                      "loadavg": [round(x, 2) for x in loads], "platform": jax.devices()[0].platform}))


if __name__ == "__main__":
    main()
