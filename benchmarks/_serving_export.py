"""Export and cold-start figures for cairn.serving (imported by benchmarks/serving.py).

For an MLP in float32 and with int8 weights (QArray per channel): the export time, the
StableHLO artifact's size with the weights as arguments (what export does) and closed
over as constants (what a naive ``jax.export`` of a closure gives), the weights on disk,
and a cold start in a fresh process (``load`` with every bucket compiled, then one
request) without and with JAX's persistent compilation cache.

``rows(quick)`` returns one dict per model; ``python benchmarks/_serving_export.py
[--quick]`` prints them as a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

COLD = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
from cairn.serving import load
t1 = time.perf_counter()
m = load(sys.argv[1], compilation_cache_dir=sys.argv[2] if sys.argv[2] != "-" else None)
t2 = time.perf_counter()
m({"x": np.zeros((1, m.inputs["x"].shape[1]), np.float32)})
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_request_s": t3 - t2}))
"""


def _mlp_params(d: int, h: int, layers: int, int8: bool) -> dict:
    from cairn.core_array import QArray, QuantLayout

    rng = np.random.default_rng(0)
    params = {}
    for i in range(layers):
        w = (rng.normal(size=(d if i == 0 else h, h)) / np.sqrt(h)).astype(np.float32)
        if int8:
            scale = np.abs(w).max(axis=0, keepdims=True) / 127
            q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
            params[f"l{i}"] = QArray(q, scale.astype(np.float32), qtype="int8", layout=QuantLayout.per_channel(1))
        else:
            params[f"l{i}"] = w
    return params


def _forward(params: dict, inputs: dict):
    import jax

    h = inputs["x"]
    for i in range(len(params)):
        w = params[f"l{i}"]
        h = jax.nn.relu(h @ (w.dequantize() if hasattr(w, "dequantize") else w))
    return {"y": h}


def _cold(path: str, cache: str | None) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", COLD, path, cache or "-"], capture_output=True, text=True,
                         env=env, timeout=600, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["process_s"] = time.perf_counter() - t
    return res


def _dir_bytes(path: str, sub: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(path, sub)) for f in fs)


def _one(name: str, d: int, h: int, layers: int, int8: bool, buckets: tuple[int, ...], work: str) -> dict:
    import jax
    from jax import export as jexport

    from cairn.core_array import ArraySpec, shape_dtype_structs
    from cairn.serving import export

    params = _mlp_params(d, h, layers, int8)
    specs = {"x": ArraySpec(("b", d), "float32")}
    t = time.perf_counter()
    path = export(_forward, params, specs, os.path.join(work, name), batch_buckets=buckets, max_batch_size=buckets[-1])
    export_s = time.perf_counter() - t
    closed = jexport.export(jax.jit(lambda inp: _forward(params, inp)))(shape_dtype_structs(specs)).serialize()
    cache = os.path.join(work, f"{name}_cache")
    no_cache = _cold(path, None)
    _cold(path, cache)  # fills the cache
    cached = _cold(path, cache)
    return {
        "model": name,
        "weights_disk_bytes": _dir_bytes(path, "weights"),
        "export_s": round(export_s, 3),
        "artifact_bytes_weights_as_args": _dir_bytes(path, "signatures"),
        "artifact_bytes_closed_over": len(closed),
        "buckets": len(buckets),
        "cold_load_s_no_cache": round(no_cache["load_s"], 3),
        "cold_load_s_cache": round(cached["load_s"], 3),
        "cold_process_s_no_cache": round(no_cache["process_s"], 2),
        "cold_process_s_cache": round(cached["process_s"], 2),
        "first_request_ms_cache": round(cached["first_request_s"] * 1e3, 2),
    }


def rows(quick: bool) -> list[dict]:
    """One row per model (float32 MLP, int8 MLP): export time, sizes and cold starts.

    Quick: 2 layers of 256, buckets (1, 8, 32); full: 4 layers of 1024, buckets up to 64.
    """
    d, h, layers = (256, 256, 2) if quick else (1024, 1024, 4)
    buckets = (1, 8, 32) if quick else (1, 2, 4, 8, 16, 32, 64)
    with tempfile.TemporaryDirectory() as work:
        return [
            _one(f"mlp_f32_{layers}x{h}", d, h, layers, False, buckets, work),
            _one(f"mlp_int8_{layers}x{h}", d, h, layers, True, buckets, work),
        ]


def _table(rs: list[dict]) -> str:
    cols = list(rs[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rs)) for c in cols]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths)) for r in rs]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    rs = rows(ap.parse_args().quick)
    print(_table(rs))
    summary = {r["model"]: {"artifact_ratio_closed_over_vs_args": round(r["artifact_bytes_closed_over"] / r["artifact_bytes_weights_as_args"], 1),
                            "cold_load_speedup_with_cache": round(r["cold_load_s_no_cache"] / max(r["cold_load_s_cache"], 1e-9), 2)}
               for r in rs}
    print(json.dumps({"benchmark": "serving_export", "rows": rs, "ratios": summary}))


if __name__ == "__main__":
    main()
