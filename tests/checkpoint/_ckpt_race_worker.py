"""Child process of the reader-race tests: a writer saving steps, or a reader polling them.

``writer DIR N``: saves steps 0..N-1 (async, waiting for each) and prints ``COMMITTED s``
once ``wait_until_finished`` reported step ``s`` committed, ``FAILED s ...`` if the save raised.
``reader DIR STOPFILE``: until STOPFILE exists, re-opens a CheckpointManager on DIR every
20 ms (each open runs its cleanup of leftovers), restores the latest step and compares it with the expected
values; prints ``READS n``, and ``BAD ...`` for every failed or wrong restore.
"""

import os
import sys
import time
import traceback

import numpy as np

import cairn.checkpoint as cc


def tree(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {f"l{i}": {"w": rng.standard_normal((32, 128), dtype=np.float32)} for i in range(4)}


def check(got: dict, step: int) -> None:
    ref = tree(step)
    assert set(got["model"]) == set(ref), sorted(got["model"])
    for k in ref:
        np.testing.assert_array_equal(got["model"][k]["w"], ref[k]["w"])
    assert int(got["it"]["pos"]) == step


def writer(directory: str, n: int) -> None:
    mngr = cc.CheckpointManager(directory, cc.CheckpointManagerOptions(enable_async=True))
    for step in range(n):
        try:
            mngr.save(step, {"model": tree(step), "it": {"pos": np.int64(step)}}, metrics={"step": step})
            mngr.wait_until_finished()
        except Exception as err:  # noqa: BLE001 - reported; the test requires none
            print(f"FAILED {step} {err!r}"[:500].replace("\n", " "), flush=True)
            continue
        print(f"COMMITTED {step}", flush=True)


def reader(directory: str, stopfile: str) -> None:
    reads = 0
    while not os.path.exists(stopfile):
        try:
            mngr = cc.CheckpointManager(directory)
            step = mngr.latest_step()
            if step is not None:
                check(mngr.restore(step), step)
                reads += 1
        except Exception:  # noqa: BLE001 - every failure is reported to the test
            print("BAD " + traceback.format_exc().replace("\n", " | "), flush=True)
        time.sleep(0.02)
    print(f"READS {reads}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "writer":
        writer(sys.argv[2], int(sys.argv[3]))
    else:
        reader(sys.argv[2], sys.argv[3])
