"""Child process for the SIGKILL tests: saves one step asynchronously and may be killed."""

import sys

import numpy as np

import cairn.checkpoint as cc


def tree(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {f"l{i}": {"w": rng.standard_normal((256, 1024), dtype=np.float32)} for i in range(12)}


if __name__ == "__main__":
    directory, step = sys.argv[1], int(sys.argv[2])
    mngr = cc.CheckpointManager(directory, cc.CheckpointManagerOptions(enable_async=True))
    data = tree(step)
    print("READY", flush=True)
    mngr.save(step, {"model": data, "it": {"pos": np.int64(step)}})
    print("SAVING", flush=True)
    mngr.wait_until_finished()
    print("DONE", flush=True)
