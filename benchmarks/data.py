"""cairn.data against Grain: same files, same pipeline, one process.

Pipeline: global shuffle -> decode 1 KiB record (np.frombuffer float32) and x * 2 + 1 ->
batch 64, over N records (100k by default, 20k with --quick). Steady-state records/s
are measured over a fixed number of batches after the first batch. Also measured: time
to the first batch with 2 workers, get_state, and set_state + next batch.

Prints a table, then ONE JSON line with the ratios (cairn / grain; > 1 means cairn is
faster). Run: python benchmarks/data.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

RECORD_BYTES = 1024
BATCH = 64


def decode(record: bytes) -> np.ndarray:
    return np.frombuffer(record, np.float32) * 2 + 1


def decode_row(row: dict) -> np.ndarray:
    return np.frombuffer(row["data"], np.float32) * 2 + 1


# --- helpers ---


# Batches consumed before the steady-state window: more than Grain's threads (16, each
# with a 32-batch buffer per process) can have computed ahead while the first batch was
# awaited, so the window measures production, not a backlog.
WARMUP = 100
GRAIN_THREADS = 16
GRAIN_BUFFER = 32


def steady_rate(it: Iterator, batches: int) -> tuple[float, float]:
    """(seconds to first batch, records/s over `batches` batches after a warm-up)."""
    t0 = time.perf_counter()
    first = next(it)
    t_first = time.perf_counter() - t0
    for _ in range(WARMUP):
        next(it)
    n = 0
    t1 = time.perf_counter()
    for _ in range(batches):
        try:
            b = next(it)
        except StopIteration:
            break
        n += len(b)
    dt = time.perf_counter() - t1
    assert first.shape[1] == RECORD_BYTES // 4
    return t_first, n / max(dt, 1e-9)


def close(it: Iterator) -> None:
    c = getattr(it, "close", None)
    if c is not None:
        c()


def settle(baseline_threads: int) -> None:
    """Wait until the previous run's threads and worker processes are gone, so they do
    not compete with the next measurement (Grain's prefetch threads keep filling their
    buffers after the consumer stops, and its workers exit when collected)."""
    import gc
    import multiprocessing
    import threading

    gc.collect()
    deadline = time.monotonic() + 10
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = threading.active_count()
        if not multiprocessing.active_children():
            if n <= baseline_threads:
                return
            if n == last and time.monotonic() - since > 0.3:
                return  # long-lived helper threads (e.g. JAX's) that will not exit
        if n != last:
            last, since = n, time.monotonic()
        gc.collect()
        time.sleep(0.05)


def plain_loop(records: list, batches: int) -> float:
    """The no-framework baseline: permute, decode each record, stack 64 at a time."""
    perm = np.random.default_rng(0).permutation(len(records))
    t0 = time.perf_counter()
    n = 0
    for b in range(batches):
        idx = perm[b * BATCH : (b + 1) * BATCH]
        batch = np.stack([decode(records[i]) for i in idx.tolist()])
        n += len(batch)
    return n / (time.perf_counter() - t0)


# --- pipelines ---


def cairn_iter(source: Any, fn: Callable[[Any], np.ndarray], workers: int) -> Iterator:
    import cairn.data as cd

    ds = cd.MapDataset.source(source).shuffle(seed=0).map(fn).batch(BATCH)
    it_ds = ds.to_iter_dataset()
    if workers:
        it_ds = it_ds.mp_prefetch(cd.MultiprocessingOptions(num_workers=workers))
    return iter(it_ds)


def grain_iter(source: Any, fn: Callable[[Any], np.ndarray], workers: int, threads: int | None = 0) -> Iterator:
    import grain

    ds = grain.MapDataset.source(source).shuffle(seed=0).map(fn).batch(BATCH)
    opts = (
        grain.ReadOptions(num_threads=threads)
        if threads is not None
        else grain.ReadOptions(num_threads=GRAIN_THREADS, prefetch_buffer_size=GRAIN_BUFFER)
    )
    it_ds = ds.to_iter_dataset(opts) if opts is not None else ds.to_iter_dataset()
    if workers:
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return iter(it_ds)


def measure(make: Callable[[], Iterator], batches: int, repeats: int) -> tuple[float, float]:
    firsts, rates = [], []
    for _ in range(repeats):
        it = make()
        try:
            f, r = steady_rate(it, batches)
        finally:
            close(it)
        firsts.append(f)
        rates.append(r)
    return statistics.median(firsts), statistics.median(rates)


def state_times(make: Callable[[], Any], steps: int = 200) -> tuple[float, float, int]:
    """(get_state seconds, set_state + next seconds, state size in bytes), medians."""
    it = make()
    try:
        for _ in range(5):
            next(it)
        # timed in runs of 1,000 calls: one call (~0.1 us) is below the timer's own cost
        gets = []
        for _ in range(steps // 10):
            t0 = time.perf_counter()
            for _ in range(1000):
                st = it.get_state()
            gets.append((time.perf_counter() - t0) / 1000)
        size = len(json.dumps(st))
        sets = []
        for _ in range(5):
            target = json.loads(json.dumps(st))
            next(it)
            t0 = time.perf_counter()
            it.set_state(target)
            next(it)
            sets.append(time.perf_counter() - t0)
        return statistics.median(gets), statistics.median(sets), size
    finally:
        close(it)


PACK_FEATURES = ("inputs", "targets", "weights")
PACK_LEN = 64
PACK_BINS = 8
PACK_BATCH = 32
PACK_BATCHES = 200


def read_cost_us(reads: list[tuple], per_call: int, records: int = 20_000) -> list[float]:
    """Microseconds per record to read ``records`` records at uniformly random indices,
    ``per_call`` indices per ``read(indices)`` call, for each ``(read, length)`` in
    ``reads``. The sources are measured in alternating passes (7 each, after a warm-up
    pass) and each gets its fastest pass, so load from other processes on a shared
    machine does not fall on one source more than the other."""
    rng = np.random.default_rng(1)
    plans = [
        [rng.integers(0, length, per_call) for _ in range(max(1, records // per_call))]
        for _, length in reads
    ]
    best = [float("inf")] * len(reads)
    for rep in range(8):
        for k, ((read, _), calls) in enumerate(zip(reads, plans)):
            t0 = time.perf_counter()
            for idx in calls:
                read(idx)
            dt = (time.perf_counter() - t0) / (len(calls) * per_call) * 1e6
            if rep:  # pass 0 warms the readers and the page cache
                best[k] = min(best[k], dt)
    return best


def pack_inputs(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for length in rng.integers(5, 21, n).tolist():
        t = rng.integers(1, 1000, length).astype(np.int32)
        out.append({"inputs": t, "targets": t + 1, "weights": np.ones(length, np.int32)})
    return out


# Both sides get the same options: shuffle_bins=False (rows and their order are then
# identical; `check_same_packing` asserts it) and shuffle_bins=True with seed=0 (the
# default of both; the same rows per window in a different order, since each library
# draws its own permutation). Everything else at the defaults of both.


def cairn_pack(seqs: list[dict], shuffle: bool = False) -> Iterator:
    import cairn.data as cd

    ds = cd.FirstFitPackIterDataset(
        cd.MapDataset.source(seqs).to_iter_dataset(),
        length_struct=dict.fromkeys(PACK_FEATURES, PACK_LEN),
        num_packing_bins=PACK_BINS,
        seed=0,
        shuffle_bins=shuffle,
    )
    return iter(ds.batch(PACK_BATCH))


def grain_pack(seqs: list[dict], shuffle: bool = False) -> Iterator:
    import grain

    ds = grain.experimental.FirstFitPackIterDataset(
        grain.MapDataset.source(seqs).to_iter_dataset(grain.ReadOptions(num_threads=0)),
        length_struct=dict.fromkeys(PACK_FEATURES, PACK_LEN),
        num_packing_bins=PACK_BINS,
        seed=0,
        shuffle_bins=shuffle,
    )
    return iter(ds.batch(PACK_BATCH))


def check_same_packing(seqs: list[dict]) -> None:
    """Unshuffled: the same batches; shuffled: the same rows in the first batches."""
    c, g = next(cairn_pack(seqs)), next(grain_pack(seqs))
    for k in c:
        np.testing.assert_array_equal(c[k], g[k], err_msg=k)
    c_it, g_it = cairn_pack(seqs, True), grain_pack(seqs, True)
    c_rows, g_rows = [], []
    for _ in range(4):
        bc, bg = next(c_it), next(g_it)
        c_rows += [
            np.concatenate([bc[k][i] for k in sorted(bc)]).tobytes() for i in range(PACK_BATCH)
        ]
        g_rows += [
            np.concatenate([bg[k][i] for k in sorted(bg)]).tobytes() for i in range(PACK_BATCH)
        ]
    # 4 batches of 32 rows = 16 whole windows of 8 rows.
    assert sorted(c_rows) == sorted(g_rows), "shuffled packing: different rows"


def pack_time(make: Callable[[list[dict]], Iterator], seqs: list[dict], batches: int) -> float:
    """Seconds per packed batch (after the first)."""
    it = make(seqs)
    first = next(it)
    assert first["inputs"].shape == (PACK_BATCH, PACK_LEN)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    return (time.perf_counter() - t0) / batches


# --- liveness ---


def _slow_element(x):
    time.sleep(0.01)
    return x


def _stuck_on_7(x):
    while x == 7:
        time.sleep(0.01)
    return x


_PARENT_SCRIPT = """
import sys, threading, time, functools
import numpy as np
import cairn.data as cd

def spin(x):
    while int(np.asarray(x).ravel()[0]) != 0:
        pass
    return x

def main():
    how, src = sys.argv[1], sys.argv[2]
    base = cd.MapDataset.range(100) if src == "-" else cd.MapDataset.source(
        cd.ArrayRecordDataSource(src)).map(functools.partial(np.frombuffer, dtype=np.int32))
    it = iter(base.map(spin).to_iter_dataset(cd.ReadOptions(chunk_records=1)).mp_prefetch(2))
    if how == "thread":
        t = threading.Thread(target=next, args=(it,)); t.start(); t.join()
    else:
        next(it)
    print(" ".join(map(str, it.worker_pids)), flush=True)
    time.sleep(600)

if __name__ == "__main__":
    main()
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _parent_death_s(how: str, src: str, tmp: str) -> float:
    import subprocess

    script = os.path.join(tmp, "parent.py")
    with open(script, "w") as f:
        f.write(_PARENT_SCRIPT)
    proc = subprocess.Popen([sys.executable, script, how, src], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    time.sleep(0.5)
    proc.kill()
    proc.wait()
    t0 = time.perf_counter()
    while not all(_gone(p) for p in pids) and time.perf_counter() - t0 < 60:
        time.sleep(0.002)
    return time.perf_counter() - t0


def liveness(trials: int) -> None:
    """Worker liveness numbers (issue 12): how fast a killed worker raises, how far past
    the limit a stuck one is detected, how fast busy workers exit after their parent is
    SIGKILLed, and the time to the first element with fork vs forkserver workers."""
    import signal

    import cairn.data as cd

    died, late, first = [], [], {}
    for _ in range(trials):
        it = iter(
            cd.MapDataset.range(10_000)
            .map(_slow_element)
            .to_iter_dataset(cd.ReadOptions(chunk_records=8))
            .mp_prefetch(2)
        )
        for _ in range(20):
            next(it)
        os.kill(it.worker_pids[1], signal.SIGKILL)
        t0 = time.perf_counter()
        try:
            for _ in range(10_000):
                next(it)
        except cd.WorkerDiedError:
            died.append(time.perf_counter() - t0)
        it.close()
        opts = cd.MultiprocessingOptions(num_workers=2, per_element_timeout_s=0.5)
        it = iter(
            cd.MapDataset.range(40)
            .map(_stuck_on_7)
            .to_iter_dataset(cd.ReadOptions(chunk_records=1))
            .mp_prefetch(opts)
        )
        try:
            list(it)
        except cd.WorkerTimeoutError as e:
            late.append(e.elapsed_s - 0.5)
        it.close()
    tmp = tempfile.mkdtemp()
    try:
        ar = os.path.join(tmp, "ar")
        cd.write_array_record(
            [np.full(16, i, np.int32).tobytes() for i in range(400)], ar, num_shards=4
        )
        src = cd.ArrayRecordDataSource(ar)
        for name, ds in (
            ("fork (range)", cd.MapDataset.range(400)),
            ("forkserver (ArrayRecord)", cd.MapDataset.source(src)),
        ):
            ts = []
            for _ in range(trials):
                t0 = time.perf_counter()
                it = iter(ds.to_iter_dataset().mp_prefetch(2))
                list(it)
                ts.append(time.perf_counter() - t0)
                it.close()
            first[name] = statistics.median(ts)
        deaths = {
            how: [_parent_death_s(h, s, tmp) for _ in range(trials)]
            for how, (h, s) in {
                "fork, started from the main thread (PDEATHSIG)": ("main", "-"),
                "fork, started from another thread (watcher thread)": ("thread", "-"),
                "forkserver (ArrayRecord)": ("main", ar),
            }.items()
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"liveness, {trials} trials each (median / max):")
    print(f"  killed worker -> WorkerDiedError: {statistics.median(died):.3f} / {max(died):.3f} s")
    print(
        f"  stuck worker (per_element_timeout_s=0.5) detected past the limit: "
        f"{statistics.median(late):.3f} / {max(late):.3f} s ({len(late)} of {trials} raised)"
    )
    for how, ts in deaths.items():
        print(
            f"  parent SIGKILLed -> busy workers gone, {how}: {statistics.median(ts):.3f} / {max(ts):.3f} s"
        )
    for name, t in first.items():
        print(f"  2-worker pass over 400 elements incl. start, {name}: {t:.3f} s")


class _Run:
    """One benchmark run's sizes, its result rows and ratios, and the cairn/Grain comparison."""

    def __init__(self, quick: bool, records: int | None, baseline: int) -> None:
        self.quick = quick
        self.n = records or (20_000 if quick else 100_000)
        self.batches = 150 if quick else 400
        self.grain_batches = 50 if quick else 150
        self.repeats = 1 if quick else 3
        self.baseline = baseline
        self.rows: list[tuple[str, float, float, float]] = []
        self.ratios: dict[str, float] = {}

    def add(self, name: str, res: dict) -> None:
        self.rows.append((name, res["c"], res["g"], res["ratio"]))

    def compare(
        self,
        make_c: Callable[[], Iterator],
        make_gs: list[Callable[[], Iterator]],
        label_gs: tuple[str, ...] = ("threads=0", "threads=16 buffer=32"),
    ) -> dict:
        """Interleaved repeats (cairn, then each Grain config), so load changes on a
        shared machine hit both; the ratio per repeat uses Grain's best config."""
        cs, gs, rs, fc, fg, best = [], [], [], [], [], []
        for _ in range(self.repeats):
            settle(self.baseline)
            f, c = measure(make_c, self.batches, 1)
            res = []
            for m in make_gs:
                settle(self.baseline)
                res.append(measure(m, self.grain_batches, 1))
            k = max(range(len(res)), key=lambda i: res[i][1])
            cs.append(c)
            gs.append(res[k][1])
            rs.append(c / res[k][1])
            fc.append(f)
            fg.append(res[0][0])
            best.append(label_gs[k])
        med = statistics.median
        return {
            "c": med(cs),
            "g": med(gs),
            "ratio": med(rs),
            "first_c": med(fc),
            "first_g": med(fg),
            "best": max(set(best), key=best.count),
        }


def _bench_memory(run: _Run, records: list) -> None:
    """1. in memory (Grain's docs recommend num_threads=0 here)."""
    loop = statistics.median(plain_loop(records, run.batches) for _ in range(run.repeats))
    r = run.compare(
        lambda: cairn_iter(records, decode, 0), [lambda: grain_iter(records, decode, 0)]
    )
    run.add("in memory, 0 workers (grain threads=0)", r)
    run.rows.append(("plain Python loop (in memory)", loop, float("nan"), float("nan")))
    run.ratios["memory_vs_grain"] = r["ratio"]
    run.ratios["memory_vs_plain_loop"] = r["c"] / loop


def _bench_arrayrecord(run: _Run, c_ar_src: Any, g_ar_src: Any, ar10_paths: list) -> None:
    """2. ArrayRecord (one n-record file, then ten shards); Grain in its faster of
    num_threads=0 / 16."""
    import grain

    import cairn.data as cd

    for w in (0, 2):
        r = run.compare(
            lambda w=w: cairn_iter(c_ar_src, decode, w),
            [
                lambda w=w: grain_iter(g_ar_src, decode, w),
                lambda w=w: grain_iter(g_ar_src, decode, w, threads=None),
            ],
        )
        run.add(f"ArrayRecord, {w} workers (grain {r['best']})", r)
        run.ratios[f"arrayrecord_{w}w"] = r["ratio"]
        if w == 0:
            ar0 = r
        if w == 2:
            run.ratios["first_batch_2w_cairn_s"] = r["first_c"]
            run.ratios["first_batch_2w_grain_s"] = r["first_g"]

    # Per-record cost must not grow with shard size: 1 shard of n vs 10 shards of n/10.
    c10_src = cd.ArrayRecordDataSource(ar10_paths)
    g10_src = grain.sources.ArrayRecordDataSource(ar10_paths)
    r = run.compare(
        lambda: cairn_iter(c10_src, decode, 0),
        [
            lambda: grain_iter(g10_src, decode, 0),
            lambda: grain_iter(g10_src, decode, 0, threads=None),
        ],
    )
    run.add(f"ArrayRecord, 10 shards, 0 workers (grain {r['best']})", r)
    run.ratios["arrayrecord_1_vs_10_shards_cairn"] = ar0["c"] / r["c"]
    run.ratios["arrayrecord_1_vs_10_shards_grain"] = ar0["g"] / r["g"]


def _bench_read_cost(run: _Run, ar_paths: list, ar10_paths: list) -> tuple[int, int]:
    """The source alone: microseconds per record at random indices from ONE file of n
    records vs ONE file of n/10 (shard 0 of the 10-shard set). cairn is read the way its
    pipeline reads it (a batched __getitems__ per chunk of 1024 indices); Grain's
    MapDataset calls __getitem__ once per record (its batch pushdown is off). Returns the
    two files' sizes."""
    import grain

    import cairn.data as cd

    big_c, small_c = cd.ArrayRecordDataSource(ar_paths), cd.ArrayRecordDataSource(ar10_paths[0])
    big_g = grain.sources.ArrayRecordDataSource(ar_paths)
    small_g = grain.sources.ArrayRecordDataSource(ar10_paths[:1])
    settle(run.baseline)
    c_big, c_small = read_cost_us(
        [(big_c.__getitems__, len(big_c)), (small_c.__getitems__, len(small_c))], 1024
    )
    g_big, g_small = read_cost_us(
        [
            (lambda idx: [big_g[i] for i in idx.tolist()], len(big_g)),
            (lambda idx: [small_g[i] for i in idx.tolist()], len(small_g)),
        ],
        64,
        3000,
    )
    shard_cost = {
        "cairn_big": c_big,
        "cairn_small": c_small,
        "grain_big": g_big,
        "grain_small": g_small,
    }
    for k, v in shard_cost.items():
        run.ratios[f"read_us_per_record_{k}"] = v
    run.ratios["read_cost_big_vs_small_shard_cairn"] = (
        shard_cost["cairn_big"] / shard_cost["cairn_small"]
    )
    run.ratios["read_cost_big_vs_small_shard_grain"] = (
        shard_cost["grain_big"] / shard_cost["grain_small"]
    )
    return len(big_c), len(small_c)


def _bench_parquet(run: _Run, pq_dir: str) -> float:
    """3. Parquet: cairn reads rows at random; Grain has no random-access Parquet source,
    so it gets the table loaded into memory first (load time not counted, returned)."""
    import pyarrow.parquet as pq

    import cairn.data as cd

    c_pq_src = cd.ParquetDataSource(pq_dir)
    t0 = time.perf_counter()
    g_rows = pq.read_table(pq_dir).to_pylist()
    g_load = time.perf_counter() - t0
    for w in (0, 2):
        r = run.compare(
            lambda w=w: cairn_iter(c_pq_src, decode_row, w),
            [lambda w=w: grain_iter(g_rows, decode_row, w)],
        )
        run.add(f"Parquet, {w} workers (grain threads=0)", r)
        run.ratios[f"parquet_{w}w"] = r["ratio"]
    # The rows above reuse one source, whose row-group cache the 0-worker run filled
    # (forked workers keep it). Cold: a fresh source per run, so every worker decodes
    # the row groups it touches during the measurement (a first epoch).
    r = run.compare(
        lambda: cairn_iter(cd.ParquetDataSource(pq_dir), decode_row, 2),
        [lambda: grain_iter(g_rows, decode_row, 2)],
    )
    run.add("Parquet, 2 workers, cold cache (grain threads=0)", r)
    run.ratios["parquet_2w_cold"] = r["ratio"]
    return g_load


def _bench_packing(run: _Run) -> None:
    """4. sequence packing: variable-length int32 sequences (5-20 tokens, 3 features)
    first-fit packed into rows of 64, 8 open rows, batched 32 rows (the examples/lm
    recipe); seconds per batch, ratio = grain time / cairn time. Measured with
    shuffle_bins=False and with shuffle_bins=True (seed 0) on both."""
    seqs = pack_inputs(40_000)  # about 260 batches
    check_same_packing(seqs)
    pack_batches = 100 if run.quick else PACK_BATCHES
    for shuffle, tag in ((False, ""), (True, "_shuffled")):
        pc, pg = [], []
        for _ in range(run.repeats):
            settle(run.baseline)
            pc.append(pack_time(lambda s, sh=shuffle: cairn_pack(s, sh), seqs, pack_batches))
            pg.append(pack_time(lambda s, sh=shuffle: grain_pack(s, sh), seqs, pack_batches))
        pack_c, pack_g = statistics.median(pc), statistics.median(pg)
        run.ratios[f"pack{tag}_vs_grain"] = statistics.median(g / c for c, g in zip(pc, pg))
        run.ratios[f"pack{tag}_cairn_ms_per_batch"] = pack_c * 1e3
        run.ratios[f"pack{tag}_grain_ms_per_batch"] = pack_g * 1e3


def _bench_state(run: _Run, c_ar_src: Any, g_ar_src: Any) -> tuple[int, int]:
    """5. state: get_state, and set_state + next batch; returns the states' sizes (B)."""
    settle(run.baseline)
    get_c, set_c, size_c = state_times(lambda: cairn_iter(c_ar_src, decode, 0))
    _, set_c2, _ = state_times(lambda: cairn_iter(c_ar_src, decode, 2))
    get_g, set_g, size_g = state_times(lambda: grain_iter(g_ar_src, decode, 0))
    run.ratios.update(
        get_state_cairn_us=get_c * 1e6,
        get_state_grain_us=get_g * 1e6,
        set_state_next_cairn_ms=set_c * 1e3,
        set_state_next_cairn_2w_ms=set_c2 * 1e3,
        set_state_next_grain_ms=set_g * 1e3,
    )
    return size_c, size_g


def _print_report(run: _Run, g_load: float, shard_sizes: tuple[int, int], state_sizes: tuple[int, int]) -> None:
    """The table and the summary lines (the JSON line is printed by ``main``)."""
    ratios = run.ratios
    print(
        f"{run.n} records x {RECORD_BYTES} B, shuffle -> decode/x*2+1 -> batch {BATCH}; records/s; ratio = median of {run.repeats} interleaved pairs"
    )
    print(f"{'pipeline':52s} {'cairn':>10s} {'grain':>10s} {'ratio':>8s}")
    for name, c, g, ratio in run.rows:
        print(f"{name:52s} {c:10,.0f} {g:10,.0f} {ratio:8.2f}".replace("nan", "  -"))
    print(f"Grain Parquet -> memory load: {g_load:.2f} s (not counted)")
    big, small = shard_sizes
    print(
        f"shard-size independence, ArrayRecord read cost per record at random indices "
        f"(one {big:,}-record file vs one {small:,}-record file; target ratio ~1.0):"
    )
    for lib in ("cairn", "grain"):
        print(
            f"  {lib}: {ratios[f'read_us_per_record_{lib}_big']:.2f} us vs "
            f"{ratios[f'read_us_per_record_{lib}_small']:.2f} us per record, ratio "
            f"{ratios[f'read_cost_big_vs_small_shard_{lib}']:.2f}"
        )
    print(
        f"  pipeline records/s, 1 file of {big:,} vs 10 files of {small:,}: "
        f"cairn ratio {ratios['arrayrecord_1_vs_10_shards_cairn']:.2f}, "
        f"grain ratio {ratios['arrayrecord_1_vs_10_shards_grain']:.2f}"
    )
    for tag, what in (("", "shuffle_bins=False"), ("_shuffled", "shuffle_bins=True, seed=0")):
        print(
            f"first-fit packing (rows of 64, 8 bins, batch 32, {what} on both): "
            f"cairn {ratios[f'pack{tag}_cairn_ms_per_batch']:.2f} ms/batch, "
            f"grain {ratios[f'pack{tag}_grain_ms_per_batch']:.2f} ms/batch, ratio {ratios[f'pack{tag}_vs_grain']:.2f}"
        )
    print(
        f"first batch, 2 workers: cairn {ratios['first_batch_2w_cairn_s']:.3f} s, grain {ratios['first_batch_2w_grain_s']:.3f} s"
    )
    size_c, size_g = state_sizes
    print(
        f"get_state: cairn {ratios['get_state_cairn_us']:.2f} us ({size_c} B), grain {ratios['get_state_grain_us']:.2f} us ({size_g} B)"
    )
    print(
        f"set_state + next: cairn {ratios['set_state_next_cairn_ms']:.2f} ms (0 workers), "
        f"{ratios['set_state_next_cairn_2w_ms']:.2f} ms (2 workers); grain {ratios['set_state_next_grain_ms']:.2f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small sizes (< 60 s)")
    ap.add_argument("--records", type=int, default=None)
    ap.add_argument(
        "--liveness", type=int, default=0, metavar="TRIALS", help="only the worker liveness numbers"
    )
    args = ap.parse_args()
    if args.liveness:
        liveness(args.liveness)
        return

    try:  # Grain's worker processes read absl flags; parse them so mp_prefetch works.
        from absl import flags

        flags.FLAGS(sys.argv[:1], known_only=True)
    except Exception:
        pass

    import grain

    import cairn.data as cd

    n = args.records or (20_000 if args.quick else 100_000)
    rng = np.random.default_rng(0)
    blob = rng.standard_normal(n * RECORD_BYTES // 4).astype(np.float32).tobytes()
    records = [blob[i * RECORD_BYTES : (i + 1) * RECORD_BYTES] for i in range(n)]

    import threading

    run = _Run(args.quick, args.records, threading.active_count())
    tmp = tempfile.mkdtemp(prefix="cairn_bench_data_")
    try:
        ar_paths = cd.write_array_record(records, os.path.join(tmp, "ar"), num_shards=1)
        ar10_paths = cd.write_array_record(records, os.path.join(tmp, "ar10"), num_shards=10)
        pq_dir = os.path.join(tmp, "pq")
        cd.write_parquet(({"data": r} for r in records), pq_dir, row_group_size=1024)

        _bench_memory(run, records)
        c_ar_src = cd.ArrayRecordDataSource(ar_paths)
        g_ar_src = grain.sources.ArrayRecordDataSource(ar_paths)
        _bench_arrayrecord(run, c_ar_src, g_ar_src, ar10_paths)
        shard_sizes = _bench_read_cost(run, ar_paths, ar10_paths)
        g_load = _bench_parquet(run, pq_dir)
        _bench_packing(run)
        state_sizes = _bench_state(run, c_ar_src, g_ar_src)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    _print_report(run, g_load, shard_sizes, state_sizes)
    print(
        json.dumps(
            {
                "bench": "data",
                "records": run.n,
                **{k: round(v, 4) for k, v in run.ratios.items() if not k.startswith("_")},
            }
        )
    )


if __name__ == "__main__":
    main()
