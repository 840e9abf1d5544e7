"""cairn.checkpoint vs Orbax vs the raw disk limit, on the same tree.

Tree: 100 float32 leaves, 1,000 MiB in all (``--quick``: 100 MiB). Every measurement runs in
a fresh child process (same seeded data), so each one's peak RSS (VmHWM, reset through
/proc/self/clear_refs) is its own; reads are cold: every file of the contender is dropped
from the page cache with posix_fadvise(DONTNEED) first. Reported: medians over repeats.

  raw    write: ndarray.tofile + fsync per leaf (the issue's disk limit);  read: np.fromfile
         per leaf (cold). Also one file holding every leaf with a single fsync (the stricter
         limit when per-file fsync latency dominates).
  cairn  AsyncCheckpointer.save -> wait_until_finished;  restore to ShapeDtypeStruct targets
  orbax  ocp.AsyncCheckpointer(StandardCheckpointHandler) with defaults; StandardRestore

The last line is one JSON object with the ratios.
"""

from __future__ import annotations

import argparse
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

MiB = 1024 * 1024


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


class PeakRSS:
    """Peak resident memory above a baseline: VmHWM after a reset, plus a sampling thread."""

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError:
            pass
        self.base = _status("VmRSS")
        self.sampled = self.base
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop:
            self.sampled = max(self.sampled, _status("VmRSS"))
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop = True
        self._t.join()
        self.peak = max(self.sampled, _status("VmHWM"))
        self.extra_mib = self.peak - self.base


def _drop_cache(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _fsync_dir(path: str) -> None:
    """Make the directory's entries durable (the last step of a raw fsync'd write)."""
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _data(n_leaves: int, leaf_mib: float, as_jax: bool):
    import numpy as np

    cols = 1024
    rows = int(leaf_mib * MiB / 4 / cols)
    rng = np.random.default_rng(0)
    leaves = {f"layer_{i:03d}": {"w": rng.standard_normal((rows, cols), dtype=np.float32)} for i in range(n_leaves)}
    if as_jax:
        import jax

        leaves = jax.tree_util.tree_map(jax.device_put, leaves)
        jax.block_until_ready(leaves)
    return leaves


def _raw_write(workdir: str, n: int, leaf_mib: float) -> dict:
    out: dict = {}
    tree = _data(n, leaf_mib, False)
    os.makedirs(workdir)
    with PeakRSS() as m:
        t0 = time.perf_counter()
        for name, leaf in tree.items():
            with open(os.path.join(workdir, name), "wb") as f:
                leaf["w"].tofile(f)
                f.flush()
                os.fsync(f.fileno())
        _fsync_dir(workdir)
        out["total_s"] = time.perf_counter() - t0
    out["extra_mib"] = m.extra_mib
    return out


def _raw_write_1file(workdir: str, n: int, leaf_mib: float) -> dict:
    # the stricter limit: every leaf appended to one file, a single fsync at the end
    out: dict = {}
    tree = _data(n, leaf_mib, False)
    os.makedirs(workdir)
    with PeakRSS() as m:
        t0 = time.perf_counter()
        with open(os.path.join(workdir, "all"), "wb") as f:
            for leaf in tree.values():
                leaf["w"].tofile(f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(workdir)
        out["total_s"] = time.perf_counter() - t0
    out["extra_mib"] = m.extra_mib
    return out


def _raw_read(workdir: str, n: int, leaf_mib: float) -> dict:
    import numpy as np

    out: dict = {}
    nbytes = n * leaf_mib * MiB
    _drop_cache(workdir)
    shape = (int(leaf_mib * MiB / 4 / 1024), 1024)
    with PeakRSS() as m:
        t0 = time.perf_counter()
        res = {name: np.fromfile(os.path.join(workdir, name), np.float32).reshape(shape) for name in sorted(os.listdir(workdir))}
        out["total_s"] = time.perf_counter() - t0
    out["extra_mib"] = m.extra_mib - nbytes / MiB
    assert len(res) == n
    return out


def _cairn_save(workdir: str, n: int, leaf_mib: float) -> dict:
    import cairn.checkpoint as cc

    out: dict = {}
    tree = _data(n, leaf_mib, True)
    ck = cc.AsyncCheckpointer()
    with PeakRSS() as m:
        t0 = time.perf_counter()
        ck.save(workdir, tree)
        out["blocked_s"] = time.perf_counter() - t0
        ck.wait_until_finished()
        out["total_s"] = time.perf_counter() - t0
    out["extra_mib"] = m.extra_mib
    return out


def _cairn_restore(workdir: str, n: int, leaf_mib: float) -> dict:
    import jax
    import numpy as np

    import cairn.checkpoint as cc

    out: dict = {}
    nbytes = n * leaf_mib * MiB
    _drop_cache(workdir)
    meta = cc.metadata(workdir)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target: dict = {}
    for path, lm in meta.items():
        top, leaf = path.split("/")
        target.setdefault(top, {})[leaf] = jax.ShapeDtypeStruct(lm.shape, np.dtype(lm.dtype), sharding=dev)
    with PeakRSS() as m:
        t0 = time.perf_counter()
        res = cc.restore(workdir, target)
        jax.block_until_ready(res)
        out["total_s"] = time.perf_counter() - t0
    out["extra_mib"] = m.extra_mib - nbytes / MiB
    _check(res, n, leaf_mib)
    return out


def _orbax_save(workdir: str, n: int, leaf_mib: float) -> dict:
    import orbax.checkpoint as ocp

    out: dict = {}
    tree = _data(n, leaf_mib, True)
    ck = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())
    with PeakRSS() as m:
        t0 = time.perf_counter()
        ck.save(workdir, args=ocp.args.StandardSave(tree))
        out["blocked_s"] = time.perf_counter() - t0
        ck.wait_until_finished()
        out["total_s"] = time.perf_counter() - t0
    out["extra_mib"] = m.extra_mib
    ck.close()
    return out


def _orbax_restore(workdir: str, n: int, leaf_mib: float) -> dict:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    out: dict = {}
    nbytes = n * leaf_mib * MiB
    _drop_cache(workdir)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shape = (int(leaf_mib * MiB / 4 / 1024), 1024)
    target = {f"layer_{i:03d}": {"w": jax.ShapeDtypeStruct(shape, np.float32, sharding=dev)} for i in range(n)}
    ck = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    with PeakRSS() as m:
        t0 = time.perf_counter()
        res = ck.restore(workdir, args=ocp.args.StandardRestore(target))
        jax.block_until_ready(res)
        out["total_s"] = time.perf_counter() - t0
    out["extra_mib"] = m.extra_mib - nbytes / MiB
    _check(res, n, leaf_mib)
    return out


_TASKS: dict[str, Callable[[str, int, float], dict]] = {
    "raw_write": _raw_write,
    "raw_write_1file": _raw_write_1file,
    "raw_read": _raw_read,
    "cairn_save": _cairn_save,
    "cairn_restore": _cairn_restore,
    "orbax_save": _orbax_save,
    "orbax_restore": _orbax_restore,
}


def child(task: str, workdir: str, n: int, leaf_mib: float) -> dict:
    """One measurement, in this (fresh) process: ``{"total_s", "extra_mib"[, "blocked_s"]}``."""
    import jax  # noqa: F401  (every task starts from the same imports: JAX and NumPy loaded)
    import numpy  # noqa: F401

    task_fn = _TASKS.get(task)
    return {} if task_fn is None else task_fn(workdir, n, leaf_mib)


def _check(res: dict, n: int, leaf_mib: float) -> None:
    import numpy as np

    ref = _data(2, leaf_mib, False)
    for name in ("layer_000", "layer_001"):
        np.testing.assert_array_equal(np.asarray(res[name]["w"]), ref[name]["w"])
    assert len(res) == n


def run_child(task: str, workdir: str, n: int, leaf_mib: float) -> dict:
    cmd = [sys.executable, __file__, "--child", task, "--workdir", workdir, "--leaves", str(n), "--leaf-mib", str(leaf_mib)]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if p.returncode != 0:
        raise RuntimeError(f"{task} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--child")
    ap.add_argument("--workdir")
    ap.add_argument("--leaves", type=int, default=100)
    ap.add_argument("--leaf-mib", type=float, default=10.0)
    ap.add_argument("--dir", default=None, help="parent directory for the files (default: a temp dir)")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.workdir, a.leaves, a.leaf_mib)))
        return
    leaf_mib = 1.0 if a.quick else a.leaf_mib
    n = a.leaves
    repeats = a.repeats or (2 if a.quick else 3)
    total_mib = n * leaf_mib
    res: dict[str, list[dict]] = {}
    base = tempfile.mkdtemp(prefix="cairn-ckpt-bench-", dir=a.dir)
    try:
        for r in range(repeats):
            order = [("raw1", ["raw_write_1file"]), ("raw", ["raw_write", "raw_read"]), ("cairn", ["cairn_save", "cairn_restore"]), ("orbax", ["orbax_save", "orbax_restore"])]
            if r % 2:
                order.reverse()  # alternate who goes first: the disk is shared and noisy
            for who, tasks in order:
                d = os.path.join(base, f"{who}-{r}")
                for task in tasks:
                    res.setdefault(task, []).append(run_child(task, d, n, leaf_mib))
                shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    def med(task, key):
        return statistics.median(x[key] for x in res[task])

    rows = [
        ("raw tofile+fsync / fromfile (cold)", med("raw_write", "total_s"), None, med("raw_write", "extra_mib"), med("raw_read", "total_s"), med("raw_read", "extra_mib")),
        ("raw, one file, one fsync (no read)", med("raw_write_1file", "total_s"), None, med("raw_write_1file", "extra_mib"), float("nan"), float("nan")),
        ("cairn.checkpoint (async, zarr3+OCDBT)", med("cairn_save", "total_s"), med("cairn_save", "blocked_s"), med("cairn_save", "extra_mib"), med("cairn_restore", "total_s"), med("cairn_restore", "extra_mib")),
        ("orbax-checkpoint (async, defaults)", med("orbax_save", "total_s"), med("orbax_save", "blocked_s"), med("orbax_save", "extra_mib"), med("orbax_restore", "total_s"), med("orbax_restore", "extra_mib")),
    ]
    print(f"tree: {n} float32 leaves, {total_mib:.0f} MiB; medians of {repeats} repeats (each in a fresh process)")
    print(f"{'contender':40s} {'save s':>8s} {'blocked ms':>11s} {'save +MiB':>10s} {'restore s':>10s} {'restore +MiB':>13s}")
    for name, s, b, sm, rs, rm in rows:
        bs = "-" if b is None else f"{b * 1000:.1f}"
        print(f"{name:40s} {s:8.2f} {bs:>11s} {sm:10.0f} {rs:10.2f} {rm:13.0f}")
    out = {
        "bench": "checkpoint",
        "mib": total_mib,
        "repeats": repeats,
        "save_vs_raw": round(med("cairn_save", "total_s") / med("raw_write", "total_s"), 3),
        "save_vs_raw_one_file": round(med("cairn_save", "total_s") / med("raw_write_1file", "total_s"), 3),
        "save_vs_orbax": round(med("cairn_save", "total_s") / med("orbax_save", "total_s"), 3),
        "restore_vs_raw_cold": round(med("cairn_restore", "total_s") / med("raw_read", "total_s"), 3),
        "restore_vs_orbax": round(med("cairn_restore", "total_s") / med("orbax_restore", "total_s"), 3),
        "blocked_vs_orbax": round(med("cairn_save", "blocked_s") / med("orbax_save", "blocked_s"), 3),
        "save_extra_mem_frac": round(med("cairn_save", "extra_mib") / total_mib, 3),
        "restore_extra_mem_frac": round(med("cairn_restore", "extra_mib") / total_mib, 3),
        "orbax_save_extra_mem_frac": round(med("orbax_save", "extra_mib") / total_mib, 3),
        "orbax_restore_extra_mem_frac": round(med("orbax_restore", "extra_mib") / total_mib, 3),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
