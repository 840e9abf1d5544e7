"""One of two JAX processes (jax.distributed on CPU) running a small checkpointed loop.

``python _ckpt_preempt_worker.py PORT PID DIR MODE TOTAL``. MODE ``train``: resume if DIR
holds a step, then ``TOTAL`` steps of ``w = w / 2 + step`` (and a per-process data position),
asking ``should_save``/``exit_if_preempted`` after each; prints ``STEP <n>``, ``RESUMED <n>``,
``PREEMPTED <n>`` (then exits with PREEMPTION_EXIT_CODE) and ``FINAL <pos> <w...>``.
MODE ``stall``: process 1 never reaches the preemption check; process 0 prints the
``SyncTimeoutError`` it gets.
"""

import os
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.pop("XLA_FLAGS", None)

import jax
import numpy as np

import cairn.checkpoint as cc

port, pid, directory, mode, total = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)


class Position:
    def __init__(self, pos):
        self.pos = pos

    def get_state(self):
        return {"pos": self.pos}

    def set_state(self, state):
        self.pos = state["pos"]


def train() -> None:
    mngr = cc.CheckpointManager(directory, cc.CheckpointManagerOptions(save_interval_steps=100, timeout_secs=60))
    it = Position(1000 * pid)
    w = np.zeros(4)
    step, restored = mngr.resume({"w": w, "data": it})
    if step is not None:
        w = restored["w"]
        print("RESUMED", step, flush=True)
    step = step or 0
    try:
        while step < total:
            time.sleep(0.02)
            w = w / 2 + step
            it.pos += 1
            step += 1
            print("STEP", step, flush=True)
            if mngr.should_save(step):
                mngr.save(step, {"w": w, "data": it})
            mngr.exit_if_preempted(step, {"w": w, "data": it})
    except SystemExit:
        print("PREEMPTED", mngr.preemption_step, flush=True)
        raise
    mngr.close()
    print("FINAL", it.pos, *w.tolist(), flush=True)


def stall() -> None:
    mngr = cc.CheckpointManager(directory, cc.CheckpointManagerOptions(timeout_secs=3))
    if pid == 1:
        time.sleep(6)  # never reaches the check of step 1
        return
    try:
        mngr.reached_preemption(1)
    except cc.SyncTimeoutError as err:
        print("TIMEOUT", err.missing, err, flush=True)


train() if mode == "train" else stall()
