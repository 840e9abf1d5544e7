"""Progress bar, peak-FLOP/s probe and the end-of-run report (JSON, loss-curve and
serving-latency PNGs, and how to try the served model)."""

from __future__ import annotations

import json
import pathlib
import shlex
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


def format_eta(seconds: float) -> str:
    """``"1h02m"``, ``"3m07s"``, ``"42s"``; ``"?"`` when unknown."""
    if not seconds >= 0 or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """A one-line progress bar on a terminal, periodic plain lines otherwise; both end with
    the estimated time left (ETA), from the pace since the first update (the first steps
    compile, so they are left out once there is a later pace to go by)."""

    def __init__(self, total: int, start: int, every: int, enabled: bool = True, stream: TextIO = sys.stderr) -> None:
        self.total, self.step, self.every, self.stream = total, start, every, stream
        self.enabled = enabled
        self.tty = enabled and stream.isatty()
        self.t0 = time.perf_counter()
        self._start = start
        self._mark: tuple[float, int] | None = None  # (time, step) of the first update

    def eta_s(self, step: int, now: float) -> float:
        """Seconds left to ``total`` at the pace since the first update (before it: since the start)."""
        t, s = self._mark if self._mark is not None and step > self._mark[1] else (self.t0, self._start)
        return (now - t) / (step - s) * (self.total - step) if step > s else float("nan")

    def update(self, step: int, loss: float, tokens_per_s: float, lr: float) -> None:
        self.step = step
        if not self.enabled:
            return
        now = time.perf_counter()
        eta = format_eta(self.eta_s(step, now))
        if self._mark is None:
            self._mark = (now, step)
        if self.tty:
            width = 28
            done = int(width * step / self.total)
            bar = "#" * done + "." * (width - done)
            self.stream.write(
                f"\r[{bar}] {step}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s lr {lr:.2e} ETA {eta}  "
            )
            self.stream.flush()
        elif step % self.every == 0 or step == self.total:
            el = time.perf_counter() - self.t0
            self.stream.write(
                f"step {step}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s lr {lr:.2e} ({el:.0f}s, ETA {eta})\n"
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
    if report.get("serving"):
        write_latency_plot(run_dir / "serving_latency.png", report["serving"])
    if report.get("posttrain"):
        report["loss_curves"] = str(run_dir / "loss_curves.png")
        write_stage_curves(run_dir / "loss_curves.png", curve, report["posttrain"])
        (run_dir / "metrics.json").write_text(json.dumps(report, indent=2, sort_keys=True))


def write_stage_curves(path: pathlib.Path, curve: list[tuple[int, float]], posttrain: dict) -> None:
    """The loss of every stage side by side: pretraining, SFT, GRPO (with its mean reward)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), dpi=110)
    panels = [("pretraining", curve, "cross-entropy on answer tokens")]
    for stage, label in (("sft", "SFT with LoRA (chat)"), ("grpo", "GRPO with LoRA")):
        panels.append((label, [(s, v) for s, v in posttrain.get(stage, {}).get("curve", []) if v is not None],
                       "loss"))
    for ax, (title, pts, ylabel) in zip(axes, panels, strict=True):
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.5)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    rewards = posttrain.get("grpo", {}).get("rewards", [])
    if rewards:
        twin = axes[2].twinx()
        twin.plot([r[0] for r in rewards], [r[1] for r in rewards], color="tab:green", lw=1, label="mean reward")
        twin.set_ylabel("mean reward (exact answer)")
        twin.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_latency_plot(path: pathlib.Path, serving: dict) -> bool:
    """The served models' request latency per concurrency level (the load test's): one
    cumulative distribution per level (p50 and p99 marked), beside it the time to first
    token. Returns False (nothing written) when there was no load test."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [(name, lv) for name, m in serving.get("models", {}).items() for lv in m.get("levels", [])
              if lv.get("latencies_ms")]
    if not series:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    for name, lv in series:
        for ax, key in zip(axes, ("latencies_ms", "ttfts_ms"), strict=True):
            xs = np.sort(np.asarray(lv.get(key) or [np.nan], float))
            label = f"{name} c={lv['concurrency']}" + (f" ({lv['tokens_per_s']:,.0f} tok/s)" if key == "latencies_ms" else "")
            line, = ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), lw=1.5, label=label)
            if key == "latencies_ms":
                for q, mark in ((50, "o"), (99, "^")):
                    ax.plot(np.percentile(xs, q), q / 100, mark, color=line.get_color())
    axes[0].set_title("request latency (o p50, ^ p99)")
    axes[1].set_title("time to first token")
    for ax in axes:
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    load = series[0][1].get("loadavg")
    fig.suptitle("served by cairn-serve, per concurrency level" + (f" (load {load[0]:.1f})" if load else ""))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def format_load(r: dict) -> str:
    """``load 3.2 / 2.9 / 2.5 (1, 5, 15 min) on 2 CPUs`` from a report's ``loadavg``, or ``""``."""
    la = r.get("loadavg")
    if not la:
        return ""
    return f"load {la[0]:.1f} / {la[1]:.1f} / {la[2]:.1f} (1, 5, 15 min) on {r.get('cpu_count', '?')} CPUs"


def format_goodput(g: dict) -> str:
    """The report's goodput line: the fraction, then where the rest of the time went."""
    parts = [f"{k[:-2].replace('_', ' ')} {v:.1f}" for k, v in g.items()
             if k.endswith("_s") and k not in ("productive_s", "total_s") and v >= 0.05]
    return (f"{g['goodput']:.1%} (productive {g['productive_s']:.1f} s of {g['total_s']:.1f} s; "
            + ", ".join(parts) + f" s; {g['runs']} run(s), {g['steps_redone']} step(s) redone)")


def format_try_it(serving: dict, port: int = 8000) -> str:
    """How to serve what the run exported and a request to try, with curl and with the
    official ``openai`` client: the OpenAI chat route (``/v1/chat/completions``) for a
    post-trained model (``try`` has ``messages``), else ``/v1/completions``."""
    t = serving["try"]
    url = f"http://127.0.0.1:{port}/v1"
    client = f"from openai import OpenAI; c = OpenAI(base_url={url!r}, api_key='none'); "
    if t.get("messages"):
        route, asked = "chat/completions", t["messages"][-1]["content"]
        body = json.dumps({"model": t["model"], "messages": t["messages"], "max_tokens": t["max_tokens"], "temperature": 0})
        py = client + (f"print(c.chat.completions.create(model={t['model']!r}, messages={t['messages']!r}, "
                       f"max_tokens={t['max_tokens']}, temperature=0).choices[0].message.content)")
    else:
        route, asked = "completions", t["prompt"]
        body = json.dumps({"model": t["model"], "prompt": t["prompt"], "max_tokens": t["max_tokens"], "temperature": 0})
        py = client + (f"print(c.completions.create(model={t['model']!r}, prompt={t['prompt']!r}, "
                       f"max_tokens={t['max_tokens']}, temperature=0).choices[0].text)")
    return "\n".join([
        "",
        "=== try it ===",
        "the server is stopped; start it again on what this run exported (Ctrl-C stops it):",
        f"  cairn-serve --model-repository {shlex.quote(serving['repository'])} --port {port}",
        f"then ask it {asked!r} (right: {t['expected']!r}; this run's {t['model']} answered "
        f"{t['answer']!r} in process), with curl:",
        f"  curl -s {url}/{route} -H 'Content-Type: application/json' -d {shlex.quote(body)}",
        "or with the openai client (pip install openai):",
        f"  python -c {shlex.quote(py)}",
    ])


def format_report(r: dict) -> str:
    lines = [
        "",
        "=== report ===",
        f"steps                  {r['steps']} (resumed from {r['resumed_from']})" if r.get("resumed_from") is not None else f"steps                  {r['steps']}",
        f"final loss             {r['final_loss']:.4f}",
        f"held-out exact match   {r['heldout_exact_match']:.2%} of {r['heldout_examples']} problems (chance ~{r['chance_exact_match']:.0e})",
        f"tokens/s               {r['tokens_per_s']:,.0f}",
        f"model FLOPs util.      {r['mfu']:.1%} of a measured {r['peak_flops'] / 1e9:,.1f} GFLOP/s",
        f"machine load           {format_load(r)}" if r.get("loadavg") else "",  # next to MFU and tokens/s
        f"blocked on checkpoints {r['checkpoint_blocked_s']:.2f} s ({r['checkpoints_saved']} saved)",
        f"blocked on data        {r['data_blocked_s']:.2f} s",
        f"wall time              {r['wall_s']:.1f} s (compile {r['compile_s']:.1f} s)",
        f"mesh                   {r['mesh']}  devices {r['devices']}  processes {r['processes']}",
        f"run directory          {r['run_dir']}",
    ]
    if not r.get("loadavg"):
        lines.remove("")  # the machine-load line
    if r.get("goodput"):
        lines.insert(-1, f"goodput                {format_goodput(r['goodput'])}")
    if r.get("preemptions"):
        lines.insert(-1, "preempted              " + ", ".join(
            f"at step {p['step']} (resumed from {p['resumed_from']})" for p in r["preemptions"]))
    if r.get("profile"):
        p = r["profile"]
        lines.insert(-1, "profile                " + (f"skipped: {p['skipped']}" if "skipped" in p else
                         f"steps {p['steps'][0]}..{p['steps'][-1]}, {p['step_time_ms']:.2f} ms/step traced; "
                         f"{p['summary']}, trace {p['trace_dir']}"))
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


def format_posttrain(r: dict) -> list[str]:
    """The report lines of the tokenizer and the post-training stages."""
    p, t = r.get("posttrain"), r.get("tokenizer") or {}
    if not p:
        return []
    lines = ["", "=== post-training: each stage starts from from_pretrained of the one before ==="]
    if t.get("kind") == "bpe":
        lines.append(f"tokenizer              byte-level BPE trained on the corpus: {t['vocab_size']} ids, {t['merges']} merges; "
                     f"{t['sample']!r} -> {' '.join(t['sample_tokens'])}")
    h = p["handover"]
    lines.append(f"hand-over              save_pretrained -> {h['path']} ({h['shards']} safetensors shards + tokenizer)")
    for stage, name in (("sft", "SFT (LoRA, chat)"), ("grpo", "GRPO (LoRA, exact answer)")):
        st = p.get(stage)
        if not st:
            continue
        before = f"{st['heldout_exact_match_before']:.2%} -> " if "heldout_exact_match_before" in st else ""
        last = st.get("last") or {}
        extra = f", last mean reward {last['reward']:.2f}" if "reward" in last else ""
        spread = [v for _, v in st.get("groups_nonzero_std") or []]
        if spread:
            extra += f", groups with a reward spread {sum(spread) / len(spread):.0%}"
        lines.append(f"{name:22s} held-out exact match {before}{st['heldout_exact_match']:.2%} on {p['examples']} chat "
                     f"prompts after {st['steps']} steps ({st['seconds']:.1f} s{extra}); -> {st['hf_dir']}"
                     + (f" [{st['skipped']}]" if st.get("skipped") else ""))
    return lines


def format_production(r: dict) -> list[str]:
    """The report lines of the steps after training (quantize, generate, export, serve)."""
    if r.get("stopped_early"):
        return ["production steps       skipped: the run stopped before train.steps"]
    if "production_skipped" in r:
        return [f"production steps       skipped: {r['production_skipped']}"]
    failed = [f"production steps       FAILED: {r['production_error']}"] if "production_error" in r else []
    pre = format_posttrain(r)
    if "generation" not in r:
        return pre + failed
    g = r["generation"]
    lines = pre + ["", f"=== after training: greedy generation on {g['examples']} held-out problems (KV cache, "
                 f"up to {g['max_new_tokens']} new tokens) ==="]
    for name, v in g["variants"].items():
        lines.append(f"{name:22s} exact match {v['exact_match']:.2%}   params {v['param_bytes'] / 2**10:,.0f} KiB"
                     + (f"   quantized in {v['quantize_s']:.1f} s" if name != "float" else ""))
    srv = r.get("serving")
    if srv:
        lines += ["", f"=== served by cairn-serve from {srv['repository']} (start-up {srv.get('startup_s', float('nan')):.1f} s, "
                      f"export {srv['export_s']:.1f} s) ==="]
        if srv.get("latency_plot"):
            lines.append(f"latency per concurrency level: {srv['latency_plot']}")
        for m in srv["models"].values():
            if "levels" not in m:
                continue
            lines.append(f"{m['generator']:22s} served exact match {m['served_exact_match']:.2%} vs in-process "
                         f"{m['inprocess_exact_match']:.2%} ({m['differing_answers']} answers differ); "
                         f"/infer ({m.get('infer_client', '?')}) next token {'matches' if m['infer_next_token_matches'] else 'DIFFERS'}")
            for lv in m["levels"]:
                lines.append(f"  concurrency {lv['concurrency']:<3d}      {lv['tokens_per_s']:8,.0f} tok/s   "
                             f"TTFT p50 {lv['ttft_p50_ms']:6.1f} ms   latency p50 {lv['latency_p50_ms']:6.1f} / "
                             f"p99 {lv['latency_p99_ms']:6.1f} ms   exact match {lv['exact_match']:.2%}"
                             + (f"   load {lv['loadavg'][0]:.1f}" if lv.get("loadavg") else ""))
    if "end_to_end_s" in r:
        lines.append(f"end to end             {r['end_to_end_s']:.1f} s (training {r['wall_s']:.1f} s, "
                     f"after training {r['production_s']:.1f} s)")
    return lines + failed
