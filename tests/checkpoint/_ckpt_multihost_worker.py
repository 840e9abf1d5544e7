"""One of two JAX processes (2 CPU devices each) saving and resharding one checkpoint."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import cairn.checkpoint as cc

port, pid, directory = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
assert jax.device_count() == 4 and jax.local_device_count() == 2

GLOBAL = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)
ROW = np.arange(12, dtype=np.int32)

mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
x = jax.make_array_from_callback(GLOBAL.shape, NamedSharding(mesh, P("data", "model")), lambda i: GLOBAL[i])
r = jax.make_array_from_callback(ROW.shape, NamedSharding(mesh, P()), lambda i: ROW[i])  # replicated

BIG = np.arange(1024 * 1024, dtype=np.float32).reshape(1024, 1024)  # 4 MiB, 4 blocks of 1 MiB
big = jax.make_array_from_callback(BIG.shape, NamedSharding(mesh, P("data", "model")), lambda i: BIG[i])

mngr = cc.CheckpointManager(directory, cc.CheckpointManagerOptions(enable_async=True))


class It:
    def __init__(self, pos):
        self.pos = pos

    def get_state(self):
        return {"pos": self.pos}

    def set_state(self, s):
        self.pos = s["pos"]


mngr.save(5, {"params": {"x": x, "r": r, "note": "hello"}, "data": It(100 + pid), "big": {"w": big}})
mngr.wait_until_finished()
assert mngr.all_steps() == [5]

# each process wrote only its own shards
regions = os.path.join(directory, "5", "params", f"_REGIONS.process_{pid}.json")
from cairn.checkpoint import _fs  # noqa: E402

mine = _fs.read_json(regions)
assert len(mine["x"]) == 2, mine  # two of the four (data, model) blocks
assert ("r" in mine) == (pid == 0), mine  # replicated: written once, by the owner of replica 0

# restore onto another layout: 4 devices in one axis, sharding the columns
mesh2 = Mesh(np.array(jax.devices()[::-1]), ("all",))
target = {
    "x": jax.ShapeDtypeStruct(GLOBAL.shape, np.float32, sharding=NamedSharding(mesh2, P(None, "all"))),
    "r": jax.ShapeDtypeStruct(ROW.shape, np.int32, sharding=NamedSharding(mesh2, P("all"))),
    "note": "",
}
it = It(0)
got = mngr.restore(items={"params": target, "data": it})
for shard in got["params"]["x"].addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), GLOBAL[shard.index])
for shard in got["params"]["r"].addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), ROW[shard.index])
assert got["params"]["note"] == "hello" and it.pos == 100 + pid


def bytes_read() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


# the same 2x2 layout with the devices reversed: each process now holds the two 1 MiB blocks
# (chunks) that the other process saved, and reads exactly those from the other's database
mesh3 = Mesh(np.array(jax.devices()[::-1]).reshape(2, 2), ("data", "model"))
blocks = NamedSharding(mesh3, P("data", "model"))
before = bytes_read()
gotbig = mngr.restore(items={"big": {"w": jax.ShapeDtypeStruct(BIG.shape, np.float32, sharding=blocks)}})
read = bytes_read() - before
for shard in gotbig["big"]["w"].addressable_shards:
    assert shard.index[0] == slice(512 * (1 - pid), 512 * (2 - pid)), shard.index
    np.testing.assert_array_equal(np.asarray(shard.data), BIG[shard.index])
assert 2 * 2**20 <= read < 2.25 * 2**20, read  # 2 of the 4 MiB, plus JSON and OCDBT index

# finer shards than the saved chunks: 256-row strips, two per process, each touching both
# 512x512 chunks of its half; every needed chunk is still read once, not once per strip
strips = NamedSharding(mesh2, P("all", None))
for _ in range(3):
    before = bytes_read()
    gotbig = mngr.restore(items={"big": {"w": jax.ShapeDtypeStruct(BIG.shape, np.float32, sharding=strips)}})
    read = bytes_read() - before
    for shard in gotbig["big"]["w"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), BIG[shard.index])
    assert 2 * 2**20 <= read < 2.25 * 2**20, read
mngr.close()
print("OK", pid, flush=True)
