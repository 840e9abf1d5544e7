"""Two JAX processes connected with jax.distributed save one step and restore it resharded."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import cairn.checkpoint as cc

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ckpt_multihost_worker.py")


@pytest.mark.multiprocess
def test_two_processes_write_own_shards_and_reshard(tmp_path):
    with socket.socket() as sock:  # an unused port, chosen by the kernel
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    d = str(tmp_path / "ckpts")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [
        subprocess.Popen([sys.executable, WORKER, str(port), str(i), d], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
        for i in range(2)
    ]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    for i, (rc, out, err) in enumerate(outs):
        assert rc == 0 and f"OK {i}" in out, f"process {i} failed:\n{err[-3000:]}"
    # one process, one device: the same step restores whole
    mngr = cc.CheckpointManager(d)
    got = mngr.restore(5, ["params"])["params"]
    np.testing.assert_array_equal(np.asarray(got["x"]), np.arange(64, dtype=np.float32).reshape(8, 8))
    np.testing.assert_array_equal(np.asarray(got["r"]), np.arange(12, dtype=np.int32))
    files = [f for _, _, fs in os.walk(os.path.join(d, "5")) for f in fs]
    assert len(files) < 30, files
