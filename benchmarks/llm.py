"""cairn.llm against a raw read, transformers (torch, CPU) and raw JAX, on one generated Qwen2 checkpoint.

The script writes a Qwen2-shaped checkpoint of random bfloat16 weights itself (safetensors
shards, ``model.safetensors.index.json``, ``config.json``) into a temp dir: the shape of
Qwen2.5-0.5B at ``--full`` (0.92 GiB, tied embeddings), a 4-layer one of ~55 MiB at
``--quick``. Then, on that checkpoint:

1. **load**: ``cairn.llm.from_pretrained`` (bfloat16, the file's dtype) against a raw read of
   every byte of the shards into memory (``np.fromfile``), and transformers'
   ``from_pretrained`` when torch is installed. Each load runs in a fresh child process
   (imports done first), the files dropped from the page cache before it (``posix_fadvise
   DONTNEED`` per file, and ``/proc/sys/vm/drop_caches`` when writable), so reads are cold;
   the variants alternate order between repeats. Peak resident memory is the child's
   VmHWM (reset through ``/proc/self/clear_refs``) above its RSS after the imports, also
   sampled as anonymous memory alone (RssAnon: file pages mapped while reading are page
   cache the kernel can drop), each divided by the checkpoint's size.
2. **tokens/s on CPU** against transformers on the same weights, dtype, ids and work: greedy
   decoding with a KV cache on both sides (ours: a jitted ``model(ids, cache=cache)`` step with
   the cache donated; transformers: ``model(ids, past_key_values=..., use_cache=True)`` under
   ``torch.inference_mode``). Prefill is one call on the whole prompt (both sides compute the
   logits of every position, then take the last one's argmax); decode is ``--new`` one-token
   steps. Batches 1 and 8, float32 and bfloat16. For bfloat16, ours runs as
   ``cairn.llm.generate`` does on CPU: on a float32 copy of the loaded weights made once
   (``CausalLM.astype``, timed apart), since XLA:CPU has no bfloat16 matrix product and
   converts every weight on every call; the step on the bfloat16 weights themselves is
   measured too ("16-bit step"). Compile time is ours' first call minus a
   timed one, reported apart. Greedy tokens are compared. torch runs with the faster of one
   thread and every core (measured per row): on a loaded machine its OpenMP threads spin at
   barriers and run several times slower than one thread.
3. **jitted forward vs raw JAX**: the full-sequence logits of ``nn.jit(model)`` against the
   same math written here as one plain function over the same parameter arrays (einsums,
   RMSNorm, rotary, grouped-query attention, SwiGLU) under ``jax.jit``; logits checked equal.

Timings interleave the contenders and report medians; the load average is printed because
the machines these run on are shared. The last line is one JSON object with the ratios.

Usage: python benchmarks/llm.py [--quick | --full] [--repeats N] [--skip-load] [--skip-speed]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

MiB = 1024 * 1024
# Qwen2.5-0.5B's shape (--full) and a small one of the same family (--quick)
SHAPES = {
    "full": {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "shard_mib": 256, "prompt": 128, "new": 32,
             "forward_repeats": 3},
    "quick": {"vocab_size": 32768, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 2, "shard_mib": 16, "prompt": 64, "new": 16,
              "forward_repeats": 11},
}


# --- the checkpoint (written here with safetensors, not with cairn.llm) ---


def hf_config(shape: dict) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "bfloat16",
        "vocab_size": shape["vocab_size"], "hidden_size": shape["hidden_size"],
        "intermediate_size": shape["intermediate_size"], "num_hidden_layers": shape["num_hidden_layers"],
        "num_attention_heads": shape["num_attention_heads"], "num_key_value_heads": shape["num_key_value_heads"],
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
        "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": shape["num_hidden_layers"], "attention_dropout": 0.0, "initializer_range": 0.02,
        "bos_token_id": 0, "eos_token_id": 1, "use_cache": True,
    }


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    d, i, h = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * h, c["num_key_value_heads"] * h
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], d)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (q, d), p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.weight": (kv, d), p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (d, q), p + "mlp.gate_proj.weight": (i, d),
                p + "mlp.up_proj.weight": (i, d), p + "mlp.down_proj.weight": (d, i)}
    out["model.norm.weight"] = (d,)
    return out


def write_checkpoint(directory: str, shape: dict) -> int:
    """Random bfloat16 weights (normal, std 0.02; norms 1 + small noise) as safetensors
    shards of about ``shard_mib`` plus the index and config.json; returns the bytes written."""
    import ml_dtypes
    from safetensors.numpy import save_file

    cfg = hf_config(shape)
    rng = np.random.default_rng(0)
    limit, shards, current, used = shape["shard_mib"] * MiB, [], {}, 0
    for name, shp in tensor_shapes(cfg).items():
        if name.endswith("norm.weight"):
            arr = 1.0 + 0.1 * rng.standard_normal(shp, dtype=np.float32)
        else:
            arr = 0.02 * rng.standard_normal(shp, dtype=np.float32)
        arr = arr.astype(ml_dtypes.bfloat16)
        if current and used + arr.nbytes > limit:
            shards.append(current)
            current, used = {}, 0
        current[name] = arr
        used += arr.nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for k, tensors in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
        for name, arr in tensors.items():
            weight_map[name] = file
            total += arr.nbytes
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return sum(os.path.getsize(os.path.join(directory, f)) for f in set(weight_map.values()))


# --- 1. load time and peak memory, one fresh child process per measurement ---


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


class PeakRSS:
    """Peak resident memory (MiB) above the RSS at entry: VmHWM after a reset, and a sampler
    of VmRSS and RssAnon (anonymous memory alone)."""

    def __enter__(self) -> PeakRSS:
        with contextlib.suppress(OSError):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        self.base, self.base_anon = _status("VmRSS"), _status("RssAnon")
        self.rss, self.anon, self._stop = self.base, self.base_anon, False
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop:
            self.rss, self.anon = max(self.rss, _status("VmRSS")), max(self.anon, _status("RssAnon"))
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()
        self.extra = max(self.rss, _status("VmHWM")) - self.base
        self.extra_anon = self.anon - self.base_anon


def drop_cache(directory: str) -> bool:
    """Evicts the checkpoint's files from the page cache; True when the global drop worked too."""
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def _load_raw(directory: str) -> Any:
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    return [np.fromfile(os.path.join(directory, f), np.uint8) for f in files]


def _load_ours(directory: str) -> Any:
    import jax

    from cairn import llm, nn

    model = llm.from_pretrained(directory)
    jax.block_until_ready(nn.state(model))
    return model


def _load_hf(directory: str) -> Any:
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)


LOADERS: dict[str, Callable[[str], Any]] = {"raw": _load_raw, "ours": _load_ours, "transformers": _load_hf}


def load_child(which: str, directory: str) -> dict:
    """One cold load in this fresh process: seconds, MiB above the post-import RSS."""
    import jax

    import cairn.llm  # noqa: F401  (every variant starts from the same imports)

    if which == "transformers":
        import torch  # noqa: F401
        import transformers  # noqa: F401
    jax.devices()
    cold = drop_cache(directory)
    with PeakRSS() as m:
        t0 = time.perf_counter()
        result = LOADERS[which](directory)
        seconds = time.perf_counter() - t0
    del result
    return {"s": seconds, "extra_mib": m.extra, "extra_anon_mib": m.extra_anon, "drop_caches": cold}


def run_load_child(which: str, directory: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--load-child", which, "--dir", directory]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"load child {which} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def bench_load(directory: str, size_mib: float, repeats: int, have_torch: bool) -> dict:
    who = ["raw", "ours"] + (["transformers"] if have_torch else [])
    res: dict[str, list[dict]] = {w: [] for w in who}
    for r in range(repeats):
        for w in who if r % 2 == 0 else who[::-1]:
            res[w].append(run_load_child(w, directory))
    out = {}
    for w, rows in res.items():
        out[w] = {k: statistics.median(x[k] for x in rows) for k in ("s", "extra_mib", "extra_anon_mib")}
        out[w]["mem_frac"] = out[w]["extra_mib"] / size_mib
        out[w]["anon_frac"] = out[w]["extra_anon_mib"] / size_mib
    out["drop_caches"] = all(x["drop_caches"] for rows in res.values() for x in rows)
    return out


# --- 2. prefill and decode tokens/s: ours and transformers, same weights, ids and work ---


class Ours:
    """Greedy decoding with a jitted step over the KV cache (donated).

    ``compute``: the dtype the steps run in, from a copy of the loaded weights made once
    (``CausalLM.astype``; its time is ``copy_s``), as ``cairn.llm.generate`` does on CPU for
    a 16-bit model; None runs the loaded weights as they are."""

    def __init__(self, directory: str, dtype: str, compute: str | None = None) -> None:
        import jax
        import jax.numpy as jnp

        from cairn import llm, nn

        self.jnp, self.model, self.copy_s = jnp, llm.from_pretrained(directory, dtype=dtype), 0.0
        if compute is not None:
            t0 = time.perf_counter()
            self.loaded, self.model = self.model, self.model.astype(compute)
            jax.block_until_ready(jax.tree_util.tree_leaves(self.model))
            self.copy_s = time.perf_counter() - t0

        def step(m: Any, ids: Any, cache: Any) -> Any:
            logits, cache = m(ids, cache=cache)
            return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

        def next_token(m: Any, tok: Any, cache: Any) -> Any:
            return step(m, tok[:, None], cache)

        self.step = nn.jit(step, donate_argnums=2)
        self.next_token = nn.jit(next_token, donate_argnums=2)

    def prefill(self, ids: np.ndarray, room: int) -> tuple[Any, Any]:
        cache = self.model.init_cache(ids.shape[0], ids.shape[1] + room)
        tok, cache = self.step(self.model, self.jnp.asarray(ids), cache)
        return tok.block_until_ready(), cache

    def decode(self, tok: Any, cache: Any, steps: int) -> np.ndarray:
        out = []
        for _ in range(steps):
            tok, cache = self.next_token(self.model, tok, cache)
            out.append(tok)
        return np.stack([np.asarray(t) for t in out], axis=1)


class Torch:
    """The same with transformers: a manual greedy loop over ``past_key_values``."""

    def __init__(self, directory: str, dtype: str) -> None:
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=getattr(torch, dtype), attn_implementation="sdpa").eval()

    def pick_threads(self, ids: np.ndarray, new: int) -> int:
        """Keeps the faster of one thread and every core: on a loaded machine torch's
        OpenMP threads spin at barriers and run several times slower than one thread."""
        best = (float("inf"), 1)
        for n in sorted({1, os.cpu_count() or 1}):
            self.torch.set_num_threads(n)
            t0 = time.perf_counter()
            tok, cache = self.prefill(ids, new)
            self.decode(tok, cache, 4)
            best = min(best, (time.perf_counter() - t0, n))
        self.torch.set_num_threads(best[1])
        return best[1]

    def prefill(self, ids: np.ndarray, room: int) -> tuple[Any, Any]:
        with self.torch.inference_mode():
            out = self.model(self.torch.from_numpy(ids.astype(np.int64)), use_cache=True)
            return out.logits[:, -1].argmax(-1), out.past_key_values

    def decode(self, tok: Any, cache: Any, steps: int) -> np.ndarray:
        out = []
        with self.torch.inference_mode():
            for _ in range(steps):
                o = self.model(tok[:, None], past_key_values=cache, use_cache=True)
                cache, tok = o.past_key_values, o.logits[:, -1].argmax(-1)
                out.append(tok)
        return self.torch.stack(out, 1).numpy()


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


def bench_speed(directory: str, shape: dict, dtype: str, batches: tuple[int, ...], repeats: int,
                have_torch: bool) -> dict:
    """``{batch: {side: {prefill_tps, decode_tps, compile_s}}, tokens_agree}`` (medians)."""
    rng = np.random.default_rng(1)
    ids_all = rng.integers(2, shape["vocab_size"], (max(batches), shape["prompt"]), dtype=np.int32)
    new = shape["new"]
    half = dtype in ("bfloat16", "float16")
    # ours as generate runs it on CPU (a float32 copy of 16-bit weights), and for 16-bit
    # weights also the step on the loaded weights themselves (XLA:CPU converts them per call)
    sides: dict[str, Any] = {"ours": Ours(directory, dtype, "float32" if half else None)}
    if half:
        sides["ours_16bit_step"] = Ours(directory, dtype)
    if have_torch:
        sides["transformers"] = Torch(directory, dtype)
    out: dict = {"rows": {}}
    for b in batches:
        ids = ids_all[:b]
        times: dict[str, dict[str, list[float]]] = {s: {"prefill": [], "decode": []} for s in sides}
        tokens: dict[str, np.ndarray] = {}
        first: dict[str, float] = {}
        for s, side in sides.items():  # warm-up (ours: compiles prefill and decode shapes)
            t_p, (tok, cache) = _timed(lambda side=side, ids=ids: side.prefill(ids, new))
            t_d, tokens[s] = _timed(lambda side=side, tok=tok, cache=cache: side.decode(tok, cache, 2))
            first[s] = t_p + t_d
        if "transformers" in sides:
            out.setdefault("torch_threads", {})[b] = sides["transformers"].pick_threads(ids, new)
        for r in range(repeats):
            for s in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                side = sides[s]
                t_p, (tok, cache) = _timed(lambda side=side, ids=ids: side.prefill(ids, new))
                t_d, toks = _timed(lambda side=side, tok=tok, cache=cache: side.decode(tok, cache, new))
                times[s]["prefill"].append(t_p)
                times[s]["decode"].append(t_d)
                tokens[s] = toks
        row: dict = {}
        out["rows"][b] = row
        for s in sides:
            p, d = statistics.median(times[s]["prefill"]), statistics.median(times[s]["decode"])
            compile_s = first[s] - p - d * 2 / new
            row[s] = {"prefill_tps": b * shape["prompt"] / p, "decode_tps": b * new / d,
                      "compile_s": compile_s if s.startswith("ours") else 0.0,
                      "copy_s": getattr(sides[s], "copy_s", 0.0)}
        if have_torch:
            row["tokens_agree"] = float(np.mean(tokens["ours"] == tokens["transformers"]))
    return out


# --- 3. the jitted forward against the same math as one raw JAX function ---


def raw_parts(cfg: Any, t: int) -> tuple[Callable[[Any, Any], Any], Callable[[Any], Any], Any]:
    """The raw forwards' shared pieces for ``t`` positions: RMSNorm (statistics in float32),
    rotary embedding (half-split, ``rope_theta``) and the causal mask."""
    import jax
    import jax.numpy as jnp

    def norm(x: Any, w: Any) -> Any:
        h = x.astype(jnp.float32)
        return w * (h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + cfg.rms_norm_eps)).astype(x.dtype)

    hd = cfg.head_dim
    inv = 1.0 / (dict(cfg.rope)["rope_theta"] ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv
    ang = jnp.concatenate([ang, ang], -1)
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]

    def rope(x: Any) -> Any:
        rot = jnp.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * cos.astype(x.dtype) + rot * sin.astype(x.dtype)

    return norm, rope, jnp.tril(jnp.ones((t, t), bool))


def raw_forward(p: dict, ids: Any, cfg: Any) -> Any:
    """Qwen2's forward over ``p`` (our parameter arrays by path): embed, per layer RMSNorm ->
    q/k/v einsums with biases -> rotary -> causal grouped-query attention -> output einsum ->
    residual -> RMSNorm -> SwiGLU -> residual; final RMSNorm, logits against the embeddings."""
    import jax
    import jax.numpy as jnp

    b, t = ids.shape
    hd, kv, groups = cfg.head_dim, cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    norm, rope, causal = raw_parts(cfg, t)
    x = p["embed/embedding"][ids]
    for i in range(cfg.num_hidden_layers):
        a = f"layers/{i}/attn/"
        h = norm(x, p[f"layers/{i}/input_norm/scale"])
        q = rope(jnp.einsum("btd,dnh->btnh", h, p[a + "q/kernel"]) + p[a + "q/bias"])
        k = rope(jnp.einsum("btd,dnh->btnh", h, p[a + "k/kernel"]) + p[a + "k/bias"])
        v = jnp.einsum("btd,dnh->btnh", h, p[a + "v/kernel"]) + p[a + "v/bias"]
        q = q.reshape(b, t, kv, groups, hd)
        s = jnp.einsum("btkgh,bskh->bkgts", q, k).astype(jnp.float32) * hd ** -0.5
        w = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1).astype(v.dtype)
        o = jnp.einsum("bkgts,bskh->btkgh", w, v).reshape(b, t, cfg.num_attention_heads, hd)
        x = x + jnp.einsum("btnh,nhd->btd", o, p[a + "o/kernel"])
        h = norm(x, p[f"layers/{i}/mlp_norm/scale"])
        m = f"layers/{i}/mlp/"
        x = x + (jax.nn.silu(h @ p[m + "gate/kernel"]) * (h @ p[m + "up/kernel"])) @ p[m + "down/kernel"]
    x = norm(x, p["norm/scale"])
    return (x @ p["embed/embedding"].T).astype(jnp.float32)


def bench_forward(directory: str, shape: dict, dtype: str, batches: tuple[int, ...], repeats: int) -> dict:
    import jax

    from cairn import llm, nn

    model = llm.from_pretrained(directory, dtype=dtype)
    params = {"/".join(map(str, k)): v[...] for k, v in nn.state(model).flat_state().items()}
    ours = nn.jit(lambda m, ids: m(ids))
    raw = jax.jit(lambda p, ids: raw_forward(p, ids, model.config))
    rng = np.random.default_rng(2)
    out = {}
    for b in batches:
        ids = jax.numpy.asarray(rng.integers(2, shape["vocab_size"], (b, shape["prompt"]), dtype=np.int32))
        c_ours, lo = _timed(lambda ids=ids: ours(model, ids).block_until_ready())
        c_raw, lr = _timed(lambda ids=ids: raw(params, ids).block_until_ready())
        tol = 1e-4 if dtype == "float32" else 5e-2
        err = float(np.max(np.abs(np.asarray(lo) - np.asarray(lr))) / (np.max(np.abs(np.asarray(lr))) + 1e-30))
        if err > tol:
            raise AssertionError(f"raw JAX forward differs from ours by {err:.2e} (relative to max |logit|)")
        t_ours, t_raw = [], []
        for r in range(repeats):
            pair = [(t_ours, lambda ids=ids: ours(model, ids).block_until_ready()),
                    (t_raw, lambda ids=ids: raw(params, ids).block_until_ready())]
            for dst, fn in pair if r % 2 == 0 else pair[::-1]:
                dst.append(_timed(fn)[0])
        o, rw = statistics.median(t_ours), statistics.median(t_raw)
        out[b] = {"ours_ms": o * 1e3, "raw_ms": rw * 1e3, "ratio": o / rw, "rel_err": err,
                  "ours_compile_s": c_ours - o, "raw_compile_s": c_raw - rw}
    return out


# --- main: the table and the JSON line ---


def _have_torch() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def print_load(load: dict, size_mib: float) -> None:
    cache = "cold: fadvise DONTNEED" + (" + drop_caches" if load["drop_caches"] else " per file")
    print(f"\n1. load: {size_mib:.0f} MiB bf16 checkpoint, medians of fresh processes ({cache})")
    print(f"{'contender':34s} {'s':>7s} {'vs raw':>7s} {'+RSS MiB':>9s} {'x ckpt':>7s} {'+anon MiB':>10s} {'x ckpt':>7s}")
    for w, label in (("raw", "raw read (np.fromfile)"), ("ours", "cairn.llm.from_pretrained"),
                     ("transformers", "transformers from_pretrained")):
        if w not in load:
            print(f"{label:34s} not measured (torch not installed)")
            continue
        r = load[w]
        print(f"{label:34s} {r['s']:7.2f} {r['s'] / load['raw']['s']:7.2f} {r['extra_mib']:9.0f} "
              f"{r['mem_frac']:7.2f} {r['extra_anon_mib']:10.0f} {r['anon_frac']:7.2f}")


def print_speed(speed: dict, shape: dict) -> None:
    print(f"\n2. CPU tokens/s: prompt {shape['prompt']}, {shape['new']} greedy decode steps, KV cache both sides")
    print(f"{'dtype':9s} {'batch':>5s} {'side':13s} {'prefill t/s':>11s} {'decode t/s':>11s} {'compile s':>9s} {'agree':>6s}")
    print("  (agree: ours' greedy tokens equal to transformers'; thr: the torch thread count kept, the faster;\n"
          "   16-bit dtypes: ours = the steps on a float32 copy made once (copy s), as cairn.llm.generate runs on\n"
          "   CPU; ours 16-bit step = the loaded 16-bit weights in the step)")
    for dtype, per_b in speed.items():
        for b, row in per_b["rows"].items():
            for s in ("ours", "ours_16bit_step", "transformers"):
                if s == "ours_16bit_step" and s not in row:
                    continue
                if s not in row:
                    print(f"{dtype:9s} {b:5d} {s:13s} not measured (torch not installed)")
                    continue
                r, agree = row[s], row.get("tokens_agree")
                a = f"{agree:6.2f}" if agree is not None and s == "ours" else ""
                if s == "transformers":
                    a = f"{per_b['torch_threads'][b]} thr"
                label = {"ours_16bit_step": "ours 16b step"}.get(s, s)
                copy = f" copy {r['copy_s']:.2f} s" if r.get("copy_s") else ""
                print(f"{dtype:9s} {b:5d} {label:13s} {r['prefill_tps']:11.1f} {r['decode_tps']:11.1f} "
                      f"{r['compile_s']:9.2f} {a:>6s}{copy}")


def print_forward(fwd: dict, shape: dict) -> None:
    print(f"\n3. jitted full-sequence forward (length {shape['prompt']}) vs the same math as raw JAX")
    print(f"{'dtype':9s} {'batch':>5s} {'ours ms':>9s} {'raw ms':>9s} {'ratio':>6s} {'ours cmp s':>10s} {'raw cmp s':>9s}")
    for dtype, per_b in fwd.items():
        for b, r in per_b.items():
            print(f"{dtype:9s} {b:5d} {r['ours_ms']:9.1f} {r['raw_ms']:9.1f} {r['ratio']:6.3f} "
                  f"{r['ours_compile_s']:10.2f} {r['raw_compile_s']:9.2f}")


def summary(size_mib: float, load: dict | None, speed: dict | None, fwd: dict | None, loads: list) -> dict:
    out: dict = {"bench": "llm", "checkpoint_mib": round(size_mib, 1),
                 "loadavg_start_end": [round(loads[0], 2), round(loads[-1], 2)]}
    if load:
        out["load_vs_raw_cold"] = round(load["ours"]["s"] / load["raw"]["s"], 3)
        out["load_peak_rss_frac"] = round(load["ours"]["mem_frac"], 3)
        out["load_peak_anon_frac"] = round(load["ours"]["anon_frac"], 3)
        if "transformers" in load:
            out["load_vs_transformers"] = round(load["ours"]["s"] / load["transformers"]["s"], 3)
    for dtype, per_b in (speed or {}).items():
        for b, row in per_b["rows"].items():
            if "transformers" in row:
                for k in ("prefill", "decode"):
                    ratio = row["ours"][f"{k}_tps"] / row["transformers"][f"{k}_tps"]
                    out[f"{k}_vs_transformers_{dtype}_b{b}"] = round(ratio, 3)
                if "ours_16bit_step" in row:
                    for k in ("prefill", "decode"):
                        ratio = row["ours_16bit_step"][f"{k}_tps"] / row["transformers"][f"{k}_tps"]
                        out[f"{k}_16bit_step_vs_transformers_{dtype}_b{b}"] = round(ratio, 3)
                out[f"tokens_agree_{dtype}_b{b}"] = row["tokens_agree"]
                out[f"torch_threads_{dtype}_b{b}"] = per_b["torch_threads"][b]
            out[f"compile_s_{dtype}_b{b}"] = round(row["ours"]["compile_s"], 2)
    for dtype, per_b in (fwd or {}).items():
        for b, r in per_b.items():
            out[f"forward_vs_raw_jax_{dtype}_b{b}"] = round(r["ratio"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a ~55 MiB model (the default of nox -s bench)")
    ap.add_argument("--full", action="store_true", help="the issue's size: Qwen2.5-0.5B's shape, 0.92 GiB")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--skip-load", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--load-child", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help="parent directory for the checkpoint (default: a temp dir)")
    a = ap.parse_args()
    if a.load_child:
        print(json.dumps(load_child(a.load_child, a.dir)))
        return
    import jax

    shape = SHAPES["full" if a.full else "quick"]
    repeats = a.repeats or (3 if a.full else 5)
    have_torch = _have_torch()
    loads = [os.getloadavg()[0]]
    base = tempfile.mkdtemp(prefix="cairn-llm-bench-", dir=a.dir)
    try:
        size_mib = write_checkpoint(base, shape) / MiB
        load = None if a.skip_load else bench_load(base, size_mib, repeats, have_torch)
        loads.append(os.getloadavg()[0])
        speed, fwd = {}, {}
        if not a.skip_speed:
            for dtype in a.dtypes.split(","):
                speed[dtype] = bench_speed(base, shape, dtype, (1, 8), repeats, have_torch)
                loads.append(os.getloadavg()[0])
                fwd[dtype] = bench_forward(base, shape, dtype, (1, 8), max(repeats, shape["forward_repeats"]))
                loads.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    versions = f"jax {jax.__version__}"
    if have_torch:
        import torch
        import transformers

        versions += f", torch {torch.__version__}, transformers {transformers.__version__}"
    print(f"\ncairn.llm, Qwen2 shape {shape}, {versions}, {os.cpu_count()} CPUs, "
          f"load average {', '.join(f'{x:.1f}' for x in loads)} (start .. end)")
    if load:
        print_load(load, size_mib)
    if speed:
        print_speed(speed, shape)
        print_forward(fwd, shape)
    print(json.dumps(summary(size_mib, load, speed, fwd, loads)))


if __name__ == "__main__":
    main()
