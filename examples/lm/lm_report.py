"""Progress bar, peak-FLOP/s probe and the end-of-run report (JSON + loss-curve PNG)."""

from __future__ import annotations

import json
import pathlib
import sys
import time
from typing import TextIO

import jax
import jax.numpy as jnp
import numpy as np


def measure_peak_flops(seconds: float = 1.0, n: int = 1024) -> float:
    """Measured float32 matmul FLOP/s of this machine (one device, all its threads)."""
    dev = jax.devices()[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), dev)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    reps, t0 = 0, time.perf_counter()
    while True:
        f(a).block_until_ready()
        reps += 1
        el = time.perf_counter() - t0
        if el > seconds and reps >= 3:
            break
    return 2.0 * n**3 * reps / el


class Progress:
    """A one-line progress bar on a terminal, periodic plain lines otherwise."""

    def __init__(self, total: int, start: int, every: int, enabled: bool = True, stream: TextIO = sys.stderr) -> None:
        self.total, self.step, self.every, self.stream = total, start, every, stream
        self.enabled = enabled
        self.tty = enabled and stream.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, loss: float, tokens_per_s: float, lr: float) -> None:
        self.step = step
        if not self.enabled:
            return
        if self.tty:
            width = 28
            done = int(width * step / self.total)
            bar = "#" * done + "." * (width - done)
            self.stream.write(
                f"\r[{bar}] {step}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s lr {lr:.2e}"
            )
            self.stream.flush()
        elif step % self.every == 0 or step == self.total:
            el = time.perf_counter() - self.t0
            self.stream.write(
                f"step {step}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s lr {lr:.2e} ({el:.0f}s)\n"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def write_report(run_dir: pathlib.Path, report: dict, curve: list[tuple[int, float]]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.array([s for s, _ in curve])
    losses = np.array([v for _, v in curve])
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, losses, lw=1, alpha=0.4, label="loss (per step)")
    if len(losses) >= 20:
        k = max(5, len(losses) // 50)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1 :], smooth, lw=2, label=f"moving average ({k})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy on answer tokens")
    ax.set_yscale("log")
    ax.set_title(f"loss: final {report['final_loss']:.4f}, held-out exact match {report['heldout_exact_match']:.1%}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "loss_curve.png")
    plt.close(fig)


def format_report(r: dict) -> str:
    lines = [
        "",
        "=== report ===",
        f"steps                  {r['steps']} (resumed from {r['resumed_from']})" if r.get("resumed_from") is not None else f"steps                  {r['steps']}",
        f"final loss             {r['final_loss']:.4f}",
        f"held-out exact match   {r['heldout_exact_match']:.2%} of {r['heldout_examples']} problems (chance ~{r['chance_exact_match']:.0e})",
        f"tokens/s               {r['tokens_per_s']:,.0f}",
        f"model FLOPs util.      {r['mfu']:.1%} of a measured {r['peak_flops'] / 1e9:,.1f} GFLOP/s",
        f"blocked on checkpoints {r['checkpoint_blocked_s']:.2f} s ({r['checkpoints_saved']} saved)",
        f"blocked on data        {r['data_blocked_s']:.2f} s",
        f"wall time              {r['wall_s']:.1f} s (compile {r['compile_s']:.1f} s)",
        f"mesh                   {r['mesh']}  devices {r['devices']}  processes {r['processes']}",
        f"run directory          {r['run_dir']}",
    ]
    if "per_device_param_bytes" in r:
        lines.insert(-1, f"per-device memory      params {r['per_device_param_bytes'] / 2**20:,.2f} "
                         f"MiB, optimizer {r['per_device_optimizer_bytes'] / 2**20:,.2f} MiB")
    if isinstance(r.get("kernels"), dict):
        lines.insert(-1, "kernels                " + "; ".join(f"{k} {_short(v)}" for k, v in r["kernels"].items()))
    return "\n".join(lines + format_production(r))


def _short(v: object) -> str:
    """``cairn.kernels[xla] (auto: kernels 8.8 ms, xla 10.4 ms)`` or ``plain XLA (config)`` from lm_train's entry."""
    if not isinstance(v, dict):
        return str(v)
    what = f"cairn.kernels[{v.get('kernels_implementation', '?')}]" if v.get("implementation") == "kernels" else "plain XLA"
    ms = ", ".join(f"{k} {t:.1f} ms" for k, t in v.get("candidates_ms", {}).items())
    why = str(v.get("chosen_by", "")) + (f": {ms}" if ms else "") + (f"; from {v['provenance']}" if v.get("provenance") else "")
    return what + (f" ({why})" if why else "")


def format_production(r: dict) -> list[str]:
    """The report lines of the steps after training (quantize, generate, export, serve)."""
    if r.get("stopped_early"):
        return ["production steps       skipped: the run stopped before train.steps"]
    if "production_skipped" in r:
        return [f"production steps       skipped: {r['production_skipped']}"]
    failed = [f"production steps       FAILED: {r['production_error']}"] if "production_error" in r else []
    if "generation" not in r:
        return failed
    g = r["generation"]
    lines = ["", f"=== after training: greedy generation on {g['examples']} held-out problems (KV cache, "
                 f"up to {g['max_new_tokens']} new tokens) ==="]
    for name, v in g["variants"].items():
        lines.append(f"{name:22s} exact match {v['exact_match']:.2%}   params {v['param_bytes'] / 2**10:,.0f} KiB"
                     + (f"   quantized in {v['quantize_s']:.1f} s" if name != "float" else ""))
    srv = r.get("serving")
    if srv:
        lines += ["", f"=== served by cairn-serve from {srv['repository']} (start-up {srv.get('startup_s', float('nan')):.1f} s, "
                      f"export {srv['export_s']:.1f} s) ==="]
        for m in srv["models"].values():
            if "levels" not in m:
                continue
            lines.append(f"{m['generator']:22s} served exact match {m['served_exact_match']:.2%} vs in-process "
                         f"{m['inprocess_exact_match']:.2%} ({m['differing_answers']} answers differ); "
                         f"/infer ({m.get('infer_client', '?')}) next token {'matches' if m['infer_next_token_matches'] else 'DIFFERS'}")
            for lv in m["levels"]:
                lines.append(f"  concurrency {lv['concurrency']:<3d}      {lv['tokens_per_s']:8,.0f} tok/s   "
                             f"TTFT p50 {lv['ttft_p50_ms']:6.1f} ms   latency p50 {lv['latency_p50_ms']:6.1f} / "
                             f"p99 {lv['latency_p99_ms']:6.1f} ms   exact match {lv['exact_match']:.2%}")
    if "end_to_end_s" in r:
        lines.append(f"end to end             {r['end_to_end_s']:.1f} s (training {r['wall_s']:.1f} s, "
                     f"after training {r['production_s']:.1f} s)")
    return lines + failed
