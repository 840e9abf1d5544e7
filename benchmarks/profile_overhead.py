"""What cairn.nn.Profiler costs a training step, in one process.

Work: a cairn.nn model of ``--layers`` residual MLP blocks (width ``--width``, batch
``--batch``) trained with cairn.optim's AdamW, one jitted step that blocks on its loss.

Variants (milliseconds per step, the best and the median over rounds; the rounds interleave
the variants so that load changes on a shared machine hit every variant alike; the ratios
use the best, which load can only make worse):
  plain      the loop with no profiler at all (the floor)
  off        every step inside ``Profiler(enabled=False).step(step)`` (must equal plain)
  on         every step inside the traced window of ``Profiler(...).step(step)``: a
             ``jax.profiler`` trace with step annotations (what the issue's 3% is about)
  jax        the peer: the same window traced with ``jax.profiler.trace`` + ``StepTraceAnnotation``
             directly, without cairn's helper
Also the one-off cost of ``Profiler.summary()`` (reading the trace back, the per-module
table, the roofline and memory analysis; paid once after the window, not per step).

Prints a table, then ONE JSON line of ratios (on/plain, off/plain, on/jax).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

from cairn import nn, optim


class Block(nn.Module):
    def __init__(self, width: int, rngs: nn.Rngs) -> None:
        self.up = nn.Linear(width, 4 * width, rngs=rngs)
        self.down = nn.Linear(4 * width, width, rngs=rngs)
        self.norm = nn.LayerNorm(width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, layers: int, width: int, rngs: nn.Rngs) -> None:
        self.blocks = nn.List([Block(width, rngs) for _ in range(layers)])
        self.head = nn.Linear(width, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@nn.jit
def train_step(model: Model, opt: nn.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    loss, grads = nn.value_and_grad(lambda m: jnp.mean((m(x)[:, 0] - y) ** 2))(model)
    opt.update(model, grads)
    return loss


def run_window(kind: str, model: Model, opt: nn.Optimizer, x: jax.Array, y: jax.Array, steps: int,
               log_dir: str) -> float:
    """Seconds per step of ``steps`` steps run the ``kind`` way. Starting and stopping a
    trace (once per window, writing the files) is outside the timed steps for both tracers:
    step 0 starts it untimed, the profiler's window extends past the timed steps."""
    prof = None
    if kind in ("off", "on"):
        prof = nn.Profiler(log_dir, start_step=0, num_steps=steps + 2, enabled=kind == "on", peak={})
    ctx = jax.profiler.trace(log_dir) if kind == "jax" else None
    if ctx is not None:
        ctx.__enter__()

    def one(s: int) -> None:
        if prof is not None:
            with prof.step(s):
                float(train_step(model, opt, x, y))
        elif kind == "jax":
            with jax.profiler.StepTraceAnnotation("train", step_num=s):
                float(train_step(model, opt, x, y))
        else:
            float(train_step(model, opt, x, y))

    one(0)
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        one(s)
    per_step = (time.perf_counter() - t0) / steps
    if ctx is not None:
        ctx.__exit__(None, None, None)
    if prof is not None:
        prof.close()
    return per_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20, help="steps per window")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="a small model, 3 rounds of 8 steps")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.width, args.batch, args.steps, args.rounds = 4, 128, 64, 8, 3
    model = Model(args.layers, args.width, nn.Rngs(0))
    opt = nn.Optimizer(model, optim.adamw(1e-3), wrt=nn.Param)
    x = jax.random.normal(jax.random.key(0), (args.batch, args.width))
    y = jnp.sin(x).sum(1)
    compiled = train_step.lower(model, opt, x, y).compile()
    for _ in range(3):  # warm up (and compile the jitted call path)
        float(train_step(model, opt, x, y))
    kinds = ["plain", "off", "on", "jax"]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for k in kinds[r % 4:] + kinds[: r % 4]:  # rotate the order every round
                times[k].append(run_window(k, model, opt, x, y, args.steps, os.path.join(tmp, f"{k}{r}")))
        prof = nn.Profiler(os.path.join(tmp, "summary"), start_step=0, num_steps=args.steps)
        prof.add_compiled("train_step", compiled)
        run_steps = [run_window("plain", model, opt, x, y, 1, tmp)]  # keep the step warm
        for s in range(args.steps):
            with prof.step(s):
                float(train_step(model, opt, x, y))
        t0 = time.perf_counter()
        summary = prof.summary(print_fn=None)
        summary_s = time.perf_counter() - t0
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"device: {jax.devices()[0].device_kind}; model: {args.layers} blocks, width {args.width}, "
          f"batch {args.batch}; {args.rounds} rounds of {args.steps} steps")
    print(f"{'variant':<8} {'best ms':>9} {'median':>9} {'max':>9} {'best vs plain':>14}")
    for k in kinds:
        print(f"{k:<8} {min(times[k]) * 1e3:9.3f} {med[k] * 1e3:9.3f} {max(times[k]) * 1e3:9.3f} "
              f"{min(times[k]) / min(times['plain']):14.3f}")
    rows = len(summary["functions"]["train_step"]["modules"])
    print(f"summary(): {summary_s * 1e3:.0f} ms once per window ({rows} module rows, peak measured);"
          f" {len(run_steps)} warm-up step")
    best = {k: min(v) for k, v in times.items()}
    print(json.dumps({
        "benchmark": "profile_overhead", "device": jax.devices()[0].device_kind,
        "on_vs_plain": best["on"] / best["plain"], "off_vs_plain": best["off"] / best["plain"],
        "on_vs_jax_profiler": best["on"] / best["jax"], "jax_profiler_vs_plain": best["jax"] / best["plain"],
        "median_on_vs_plain": med["on"] / med["plain"], "step_ms_plain": best["plain"] * 1e3,
        "summary_ms": summary_s * 1e3,
    }))


if __name__ == "__main__":
    sys.exit(main())
