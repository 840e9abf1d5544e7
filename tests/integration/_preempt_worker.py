"""Child process for the preemption tests: a small cairn.nn MLP trained with cairn.optim on
a cairn.data pipeline, checkpointed by cairn.checkpoint (local tier every 2 steps,
persistent tier every 5), that resumes by itself and exits on SIGTERM.

``python _preempt_worker.py TOTAL_STEPS DIR OUT.npz [DIR OUT.npz ...]`` trains in each DIR
in turn (the test starts one interrupted run per process, then resumes them all, and runs
the uninterrupted reference, in one more process). It prints one event per line before each
phase (``EVENT compile``, ``EVENT data <step>``, ``EVENT step <step>``, ``EVENT eval <step>``,
``EVENT save <step>``), ``RESUMED <step>`` when it restored one, ``PREEMPTED`` when it
leaves with ``PREEMPTION_EXIT_CODE``, and ``DONE`` after writing every final array to OUT.

With ``CAIRN_TEST_COORDINATOR=host:port`` and ``CAIRN_TEST_PROCESS_ID=0|1`` in the
environment it is one of two ``jax.distributed`` processes (one CPU device each): the model
is replicated over both devices, each process feeds its half of every batch's rows, the two
save each step together, and each writes ``OUT.<process id>.npz``.
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.pop("XLA_FLAGS", None)

import jax
import jax.numpy as jnp
import numpy as np

if os.environ.get("CAIRN_TEST_COORDINATOR"):
    jax.distributed.initialize(os.environ["CAIRN_TEST_COORDINATOR"], 2, int(os.environ["CAIRN_TEST_PROCESS_ID"]))

from cairn import checkpoint as cc
from cairn import data, nn, optim
from cairn.core_array import flatten_with_paths


class MLP(nn.Module):
    def __init__(self, rngs):
        self.l1 = nn.Linear(6, 16, rngs=rngs)
        self.l2 = nn.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.gelu(self.l1(x)))


def example(i):
    rng = np.random.default_rng(int(i))
    x = rng.standard_normal(6).astype(np.float32)
    return {"x": x, "y": np.float32(np.sin(x).sum())}


def pipeline():
    return iter(data.MapDataset.range(4096).shuffle(seed=3).map(example).batch(8).to_iter_dataset())


def make_model():
    if jax.process_count() == 1:
        return MLP(nn.Rngs(0))
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("data",))
    return nn.sharded_init(lambda: MLP(nn.Rngs(0)), mesh=mesh)  # replicated on both processes' devices


def to_global(batch):
    """This process's half of the batch's rows, as one global array over both processes."""
    if jax.process_count() == 1:
        return batch
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    n, i = len(batch["y"]) // 2, jax.process_index()
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)[i * n:(i + 1) * n])
            for k, v in batch.items()}


def local_value(x):
    """The whole value of a replicated array (its first addressable copy)."""
    return np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else np.asarray(x)


def event(*what):
    print("EVENT", *what, flush=True)


@nn.jit
def train_step(model, opt, batch):
    def loss_fn(m):
        return jnp.mean((m(batch["x"])[:, 0] - batch["y"]) ** 2)

    loss, grads = nn.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss


@nn.jit
def evaluate(model, x):
    return jnp.mean(model(x))


def main(directory: str, total: int, out: str) -> None:
    opts = cc.CheckpointManagerOptions(
        save_interval_steps=5, max_to_keep=2,
        local_directory=os.path.join(directory, "local"), local_save_interval_steps=2, local_max_to_keep=2,
    )
    mngr = cc.CheckpointManager(os.path.join(directory, "persistent"), opts)
    model = make_model()
    opt = nn.Optimizer(model, optim.adamw(3e-2), wrt=nn.Param)
    it = pipeline()

    def items():
        return {"model": nn.state(model), "optimizer": nn.state(opt, nn.OptState), "data": it}

    with cc.GoodputRecorder(mngr.directory, compile_first_step=False) as gp:  # written on SystemExit too
        step, restored = mngr.resume(items())
        gp.resumed(step)
        if step is not None:
            nn.update(model, restored["model"])
            nn.update(opt, restored["optimizer"])
            print("RESUMED", step, flush=True)
        step = step or 0
        event("compile")
        with gp.phase("compile"):
            train_step.lower(model, opt, to_global({"x": np.zeros((8, 6), np.float32),
                                                    "y": np.zeros(8, np.float32)})).compile()
        while step < total:
            event("data", step)
            with gp.phase("data"):
                batch = to_global(next(it))
            event("step", step)
            with gp.step(step + 1):
                jax.block_until_ready(train_step(model, opt, batch))
            step += 1
            if step % 3 == 0:
                event("eval", step)
                with gp.phase("eval"):
                    jax.block_until_ready(evaluate(model, batch["x"]))
            if mngr.should_save(step):
                event("save", step)
                with gp.phase("checkpoint"):
                    mngr.save(step, items())
            with gp.phase("checkpoint"):
                mngr.exit_if_preempted(step, items())
        mngr.close()
    print("GOODPUT", json.dumps(gp.report()), flush=True)
    flat = flatten_with_paths({"model": nn.state(model), "opt": nn.state(opt, nn.OptState)})
    arrays = {k.replace("/", "."): local_value(v) for k, v in flat.items()}
    arrays["data_state"] = np.frombuffer(repr(sorted(it.get_state().items())).encode(), np.uint8)
    np.savez(out if jax.process_count() == 1 else f"{out}.{jax.process_index()}.npz", **arrays)
    print("DONE", flush=True)


if __name__ == "__main__":
    try:
        for d, o in zip(sys.argv[2::2], sys.argv[3::2], strict=True):
            main(d, int(sys.argv[1]), o)
    except SystemExit as e:
        if e.code == cc.PREEMPTION_EXIT_CODE:
            print("PREEMPTED", flush=True)
        raise
