"""ShardedReader's whole-tensor reads (plain file reads, not a memory map) give the file's bytes."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from cairn.llm._hf_files import ShardedReader


def test_whole_reads_equal_safetensors_bit_for_bit_in_every_float_dtype(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        f"t.{np.dtype(dt).name}": rng.standard_normal((7, 5)).astype(dt)
        for dt in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64)
    }
    tensors["vector"] = rng.standard_normal(3).astype(np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    reader = ShardedReader(tmp_path)
    seen = {}
    for name, lazy in reader.read(sorted(tensors)):
        whole, box = lazy[...], lazy[1:3]
        assert whole.flags.owndata  # a fresh array, not a view of a memory-mapped file
        seen[name] = (whole, box)
    with safe_open(str(tmp_path / "model.safetensors"), framework="np") as f:
        for name in tensors:
            ref = f.get_tensor(name)
            whole, box = seen[name]
            assert whole.dtype == ref.dtype and whole.shape == ref.shape
            assert whole.tobytes() == ref.tobytes() == tensors[name].tobytes()
            assert box.tobytes() == ref[1:3].tobytes()


def _rss_file_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) / 1024
    pytest.skip("no RssFile in /proc/self/status (not Linux)")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_a_whole_read_does_not_map_the_file_into_resident_memory(tmp_path):
    # a memory-mapped read makes every touched page of the shard part of this process's
    # resident set (RssFile) until the file is closed: a 0.9 GiB load peaked at 1.39x its size
    big = np.ones((16, 2**20 // 4), np.float32)  # 16 MiB
    save_file({"big": big}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "model.safetensors").read_bytes()  # in the page cache, as after a download
    reader = ShardedReader(tmp_path)
    for _, lazy in reader.read(["big"]):
        before = _rss_file_mib()
        arr = lazy[...]
        grown = _rss_file_mib() - before
        assert arr.sum() == big.size
        assert grown < 4, f"reading 16 MiB grew the file-backed resident set by {grown:.1f} MiB"
