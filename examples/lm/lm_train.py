"""The training loop: cairn.data -> cairn.nn model -> cairn.optim AdamW -> cairn.checkpoint."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import lm_cli
import lm_config
import lm_data
import lm_model
import lm_report
import lm_task
import numpy as np

import cairn.kernels as ck
from cairn import checkpoint as ckpt
from cairn import llm, nn, optim
from cairn.core_array import LogicalAxisRules, flatten_with_paths

BATCH_KEYS = ("inputs", "targets", "weights", "segment_ids", "positions")


@dataclasses.dataclass
class Setup:
    cfg: lm_config.Config
    mesh: jax.sharding.Mesh
    rules: LogicalAxisRules
    batch_sharding: jax.sharding.NamedSharding
    run_dir: pathlib.Path
    impl: lm_model.Impl = lm_model.Impl()  # set from choose_kernels before training
    codec: Any = lm_task.BYTES  # the tokenizer's task-facing form (lm_tokenizer.Codec for the BPE); set by _build
    tokenizer: llm.Tokenizer | None = None  # the run's tokenizer (BPE or bytes); set by _build


def make_setup(cfg: lm_config.Config) -> Setup:
    """Mesh and shardings; raises ConfigError for an impossible mesh or batch."""
    n = jax.device_count()
    data, model = lm_config.mesh_shape(cfg, n)
    if cfg.data.batch_size % jax.process_count():
        raise lm_config.ConfigError(
            f"config key 'data.batch_size': {cfg.data.batch_size} is not divisible by {jax.process_count()} processes"
        )
    devices = np.asarray(jax.devices()).reshape(data, model)
    mesh = jax.sharding.Mesh(devices, ("data", "model"))
    rules = LogicalAxisRules([tuple(r) for r in cfg.mesh.rules])
    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))
    return Setup(cfg, mesh, rules, batch_sharding, pathlib.Path(cfg.run.dir))


def create_model(setup: Setup) -> llm.CausalLM:
    """Build the model (a cairn.llm ``CausalLM``) with every parameter created directly in its NamedSharding."""
    cfg = setup.cfg
    return nn.sharded_init(lambda: lm_model.build(cfg, cfg.run.seed), mesh=setup.mesh, rules=setup.rules)


def make_optimizer(cfg: lm_config.Config) -> tuple[optim.GradientTransformation, Callable[[int], Any]]:
    o = cfg.optim
    schedule = optim.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.learning_rate,
        warmup_steps=o.warmup_steps,
        decay_steps=cfg.train.steps,
        end_value=o.learning_rate * o.end_lr_ratio,
    )
    # weight decay on matrices only (kernels and the embedding), as is usual for transformers
    tx = optim.chain(
        optim.clip_by_global_norm(o.clip_norm),
        optim.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=".*(kernel|embedding)"),
    )
    return tx, schedule


# --- cairn.kernels or plain XLA, chosen by measurement on the run's own shapes ---

KERNEL_OPS = ("attention", "loss")
# cairn.kernels must beat plain XLA by this fraction to be chosen: a near-tie stays on plain
# XLA, so run-to-run timing noise does not flip the numerics between two runs of one config
AUTO_MARGIN = 0.05
_TIMING_REPS = 7
_CHOICES: dict[str, dict] = {}  # this process's decisions, keyed like the on-disk cache


def _timing_inputs(cfg: lm_config.Config) -> dict[str, jax.Array]:
    """Random arrays of this process's share of a training batch, split over its local devices
    (process-local: timing needs no collective, so processes never wait on each other)."""
    m = cfg.model
    b, s, hd = cfg.data.batch_size // jax.process_count(), cfg.data.seq_len, m.d_model // m.num_heads
    devices = jax.local_devices() if b % jax.local_device_count() == 0 else jax.local_devices()[:1]
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.asarray(devices), ("data",)),
                                          jax.sharding.PartitionSpec("data"))
    rng = np.random.default_rng(0)
    dt = lm_model._DTYPES[m.dtype]
    pos = np.arange(s)
    seg = np.broadcast_to(np.where(pos < s - s // 8, 1 + pos // max(1, s // 3), 0), (b, s))  # packed + padding
    arrays = {
        "q": rng.standard_normal((b, s, m.num_heads, hd), np.float32),
        "k": rng.standard_normal((b, s, m.num_kv_heads, hd), np.float32),
        "v": rng.standard_normal((b, s, m.num_kv_heads, hd), np.float32),
        "x": rng.standard_normal((b, s, m.d_model), np.float32),
        "projection": rng.standard_normal((m.d_model, lm_config.vocab_size(cfg)), np.float32) * m.d_model**-0.5,
    }
    arrays = {k: jnp.asarray(v, dt) for k, v in arrays.items()}
    arrays["segment_ids"] = seg.astype(np.int32)
    arrays["targets"] = rng.integers(0, lm_config.vocab_size(cfg), (b, s), dtype=np.int32)
    arrays["weights"] = np.broadcast_to(pos >= s // 2, (b, s)).astype(np.float32)
    return {k: jax.device_put(v, sharding) for k, v in arrays.items()}


def _candidate(op: str, impl: str) -> tuple[Callable[..., Any], tuple[str, ...]]:
    """The op of one training step under ``impl`` as a scalar function, and its argument names."""
    if op == "attention":
        def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
            out = lm_model.attend(q, k, v, segment_ids, impl)
            return jnp.sum(out.astype(jnp.float32) ** 2)

        return attention, ("q", "k", "v", "segment_ids")

    def loss(x: jax.Array, projection: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
        if impl == "kernels":
            return lm_model.fused_loss(x, targets, weights, projection)
        logits = jnp.einsum("bsd,dv->bsv", x, projection).astype(jnp.float32)
        return lm_model.logits_loss(logits, targets, weights)

    return loss, ("x", "projection", "targets", "weights")


def _kernels_trace(op: str, inputs: dict[str, jax.Array]) -> dict:
    """Which cairn.kernels implementation and config the op's kernels path runs (traced, not run)."""
    fn, names = _candidate(op, "kernels")
    with ck.recording() as calls:
        jax.eval_shape(lambda *a: jax.grad(fn, argnums=(0, 1))(*a), *(inputs[n] for n in names))
    if not calls:
        return {}
    return {"kernels_op": calls[0].op, "kernels_implementation": calls[0].implementation,
            "kernels_config": dict(calls[0].config), "kernels_source": calls[0].describe_source()}


def _time_op(op: str, inputs: dict[str, jax.Array]) -> dict[str, float]:
    """Median milliseconds of one jitted forward + backward per implementation, interleaved."""
    fns, args = {}, ()
    for impl in lm_model.IMPLEMENTATIONS:
        fn, names = _candidate(op, impl)
        fns[impl] = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
        args = tuple(inputs[n] for n in names)
    for f in fns.values():
        jax.block_until_ready(f(*args))  # compile
    times: dict[str, list[float]] = {impl: [] for impl in fns}
    for _ in range(_TIMING_REPS):
        for impl, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[impl].append(time.perf_counter() - t0)
    return {impl: round(1e3 * statistics.median(ts), 4) for impl, ts in times.items()}


def _choice_key(cfg: lm_config.Config, op: str) -> str:
    m, d = cfg.model, cfg.data
    dev = jax.local_devices()[0]
    return json.dumps([op, d.batch_size // jax.process_count(), d.seq_len, m.d_model, m.num_heads,
                       m.num_kv_heads, m.dtype, lm_config.vocab_size(cfg), dev.platform, dev.device_kind,
                       jax.local_device_count(), jax.__version__, ck.__version__])


def _cache_file() -> pathlib.Path:
    """Beside cairn.kernels' autotune cache: ``$CAIRN_KERNELS_CACHE_DIR``, else ``~/.cache/cairn/kernels``."""
    base = os.environ.get("CAIRN_KERNELS_CACHE_DIR") or pathlib.Path.home() / ".cache" / "cairn" / "kernels"
    return pathlib.Path(base) / "lm_recipe_choices.json"


def _read_json(path: pathlib.Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: pathlib.Path, data: dict) -> None:
    """Atomically (several runs may share the file): a temporary file renamed over it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a cache that cannot be written only costs a measurement next time


def _auto_choice(cfg: lm_config.Config, op: str, inputs: dict[str, jax.Array]) -> dict:
    """Measure (or recall) both implementations of ``op`` and pick the faster, by `AUTO_MARGIN`."""
    key = _choice_key(cfg, op)
    if key in _CHOICES:
        return {**_CHOICES[key], "source": "memo"}
    cached = _read_json(_cache_file()).get(key)
    if isinstance(cached, dict) and cached.get("implementation") in lm_model.IMPLEMENTATIONS:
        _CHOICES[key] = cached
        return {**cached, "source": "cache"}
    ms = _time_op(op, inputs)
    impl = "kernels" if ms["kernels"] < (1.0 - AUTO_MARGIN) * ms["xla"] else "xla"
    entry = {"implementation": impl, "candidates_ms": ms, "chosen_by": "auto", "measured": ck.measurement_context()}
    _CHOICES[key] = entry
    _write_json(_cache_file(), {**_read_json(_cache_file()), key: entry})
    return {**entry, "source": "measured"}


def _broadcast_json(data: dict) -> dict:
    """Process 0's ``data`` on every process (one decision for the whole job)."""
    if jax.process_count() == 1:
        return data
    from jax.experimental import multihost_utils

    raw = json.dumps(data).encode()
    buf = np.zeros(1 << 16, np.uint8)
    buf[: len(raw)] = np.frombuffer(raw, np.uint8)
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return json.loads(out.tobytes().rstrip(b"\0").decode())


def choose_kernels(cfg: lm_config.Config, run_dir: pathlib.Path | None = None, *, resume: bool = False) -> dict:
    """Which implementation, ``"xla"`` or ``"kernels"``, runs the attention and the loss.

    Per op, `cfg.kernels` says ``"xla"`` or ``"kernels"`` (``chosen_by: "config"``) or
    ``"auto"``: time both on this run's per-process training shapes (forward + backward,
    jitted, `_TIMING_REPS` interleaved runs, median) and take cairn.kernels only when it is
    more than `AUTO_MARGIN` faster. A decision is remembered per shapes, device and versions
    (in this process and in a file beside cairn.kernels' autotune cache), a resumed run
    reuses its run directory's, and every process takes process 0's.

    Returns:
      ``{"attention": entry, "loss": entry}``, each entry ``{"implementation",
      "candidates_ms", "chosen_by", "source", "kernels_op", "kernels_implementation",
      "kernels_config"}``: the last three name what cairn.kernels runs (its registry's choice).
    """
    saved = _read_json(run_dir / "kernels.json") if resume and run_dir is not None else {}
    inputs = _timing_inputs(cfg)
    out = {}
    for op in KERNEL_OPS:
        setting = getattr(cfg.kernels, op)
        if setting != "auto":
            entry = {"implementation": setting, "candidates_ms": {}, "chosen_by": "config", "source": "config"}
        elif isinstance(saved.get(op), dict) and saved[op].get("chosen_by") == "auto":
            entry = {**saved[op], "source": "run_dir"}
        else:
            entry = _auto_choice(cfg, op, inputs)
        out[op] = {**entry, **_kernels_trace(op, inputs)}
        out[op]["provenance"] = _provenance(out[op])
    out = _broadcast_json(out)
    if run_dir is not None and jax.process_index() == 0:
        _write_json(run_dir / "kernels.json", out)
    return out


def _provenance(e: dict) -> str:
    """Where an entry's choice came from: the xla-or-kernels decision (with the date and load
    of its measurement) and, for cairn.kernels, where its implementation and config came from."""
    m = e.get("measured") or {}
    when = (f"{m['date']}, load {m['loadavg'][0]:g} on {m['cpu_count']} CPUs" if m.get("date") and m.get("loadavg")
            else "no record of when or under what load")
    where = {"config": "the run's config", "measured": f"a measurement now ({when})",
             "memo": f"a measurement earlier in this process ({when})",
             "cache": f"the choice cache {_cache_file()} (measured {when})",
             "run_dir": f"the resumed run's kernels.json (measured {when})"}
    text = where.get(e.get("source", ""), str(e.get("source")))
    if e["implementation"] == "kernels" and e.get("kernels_source"):
        text += f"; cairn.kernels config {e.get('kernels_config')} from {e['kernels_source']}"
    return text


def describe_kernels(choice: dict) -> str:
    """One line, e.g. ``kernels: attention=cairn.kernels[xla] (auto: xla 4.12 ms, kernels 3.22 ms;
    from measured now (...); cairn.kernels config {...} from ...); loss=plain XLA (config; from
    set in the config)``: per op what runs, why (the timings when measured) and where the
    choice came from (`_provenance`)."""
    parts = []
    for op, e in choice.items():
        what = f"cairn.kernels[{e.get('kernels_implementation', '?')}]" if e["implementation"] == "kernels" else "plain XLA"
        why = e["chosen_by"]
        if e.get("candidates_ms"):
            why += ": " + ", ".join(f"{k} {v:.2f} ms" for k, v in e["candidates_ms"].items())
        parts.append(f"{op}={what} ({why}; from {e.get('provenance', e.get('source', '?'))})")
    return "kernels: " + "; ".join(parts)


def _train_step(model: llm.CausalLM, optimizer: nn.Optimizer, batch: dict, impl: lm_model.Impl) -> dict:
    (_, aux), grads = nn.value_and_grad(lm_model.loss_and_metrics, has_aux=True)(model, batch, impl)
    optimizer.update(model, grads)
    # the fused loss never forms the logits: no token accuracy then (evaluation has it)
    return {k: aux[k] for k in ("loss", "token_accuracy") if k in aux}


train_step = nn.jit(_train_step, donate_argnums=(0, 1), static_argnums=3)


@functools.partial(nn.jit, static_argnums=3)
def eval_step(model: llm.CausalLM, batch: dict, valid: jax.Array, impl: lm_model.Impl) -> jax.Array:
    """How many valid rows are exactly right (a replicated scalar every process can read)."""
    _, aux = lm_model.logit_metrics(model, batch, impl)
    return jnp.sum(aux["row_exact"] & valid)


def to_global(setup: Setup, local_batch: dict) -> dict:
    """Per-process numpy batch -> global jax.Arrays sharded over the data axis."""
    return {
        k: jax.make_array_from_process_local_data(setup.batch_sharding, np.asarray(local_batch[k]))
        for k in BATCH_KEYS
    }


def _local_rows(x: np.ndarray) -> np.ndarray:
    """This process's contiguous block of a global batch's rows."""
    n = x.shape[0] // jax.process_count()
    return x[jax.process_index() * n : (jax.process_index() + 1) * n]


def evaluate(setup: Setup, model: llm.CausalLM, texts: list[str]) -> float:
    """Exact match on held-out problems: every answer token right under teacher forcing,
    which is the same as greedy decoding producing the whole answer."""
    if not texts:
        return float("nan")
    bs = setup.cfg.data.batch_size
    valid_sharding = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec("data"))
    correct = 0
    for start in range(0, len(texts), bs):
        chunk = texts[start : start + bs]
        batch = lm_task.eval_batch(chunk + [chunk[-1]] * (bs - len(chunk)), setup.cfg.data.seq_len, setup.codec)
        valid = jax.make_array_from_process_local_data(valid_sharding, _local_rows(np.arange(bs) < len(chunk)))
        local = {k: _local_rows(v) for k, v in batch.items()}
        correct += int(eval_step(model, to_global(setup, local), valid, setup.impl))
    return correct / len(texts)


def param_partition_specs(model: nn.Module) -> dict[str, str]:
    """``{path: partition spec}`` of every parameter, to check the sharding rules took effect."""
    return {p: str(tuple(x.sharding.spec)) for p, x in flatten_with_paths(nn.state(model, nn.Param)).items()}


def per_device_bytes(tree: Any) -> int:
    """The most bytes any one local device holds of ``tree``'s arrays (its shards)."""
    per: dict = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values(), default=0)


HISTORY_ITEM = "history"


def _items(model: nn.Module, optimizer: nn.Optimizer, data_iter: Iterator, history: Any) -> dict:
    """What one checkpoint step holds: model, optimizer state, the data iterator's position and
    the run's history up to the step (`_LoopStats.history`: loss curve, counters), committed
    together; ``history``: a ``JsonSave`` to save, a ``JsonRestore`` to restore."""
    return {"model": nn.state(model), "optimizer": nn.state(optimizer, nn.OptState), "data": data_iter,
            HISTORY_ITEM: history}


def _digest(batch: dict) -> str:
    h = hashlib.sha1()
    for k in ("inputs", "targets", "weights", "segment_ids"):
        h.update(np.ascontiguousarray(batch[k]).tobytes())
    return h.hexdigest()[:16]


class RunDirError(RuntimeError):
    """The run directory already holds checkpoints and neither resume nor overwrite was asked."""


existing_checkpoints = lm_cli.existing_checkpoints


def check_run_dir(run_dir: pathlib.Path, *, resume: bool, overwrite: bool) -> None:
    """Decide what to do with a run directory that already holds checkpoints, before any work.

    - `resume=True`: keep them; training continues from the latest one.
    - `overwrite=True`: delete `run_dir/checkpoints` (process 0 only) and start afresh.
    - neither: raise RunDirError naming the directory and the three choices
      (`lm_cli.run_dir_refusal`, the check `nox -s demo` makes before it installs anything).
    """
    refusal = lm_cli.run_dir_refusal(run_dir, resume=resume, overwrite=overwrite)
    if refusal is not None:
        raise RunDirError(refusal)
    if not overwrite:
        return
    marker = pathlib.Path(run_dir) / lm_cli.PREEMPTED_FILE
    if jax.process_index() == 0 and marker.exists():
        marker.unlink()
    if jax.process_index() == 0:  # what the earlier run's later stages left: trained again from scratch
        for name in lm_cli.STAGE_DIRS:
            if (pathlib.Path(run_dir) / name).exists():
                shutil.rmtree(pathlib.Path(run_dir) / name)
    if not existing_checkpoints(run_dir):
        return
    if jax.process_index() == 0:
        shutil.rmtree(pathlib.Path(run_dir) / "checkpoints")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("cairn-lm-overwrite")


def _open_manager(cfg: lm_config.Config, run_dir: pathlib.Path) -> ckpt.CheckpointManager:
    return ckpt.CheckpointManager(
        run_dir / "checkpoints",
        ckpt.CheckpointManagerOptions(
            save_interval_steps=cfg.checkpoint.every,
            max_to_keep=cfg.checkpoint.max_to_keep,
            enable_async=cfg.checkpoint.enable_async,
        ),
    )


@dataclasses.dataclass
class _LoopStats:
    """What the training loop measured and recorded, since step 0 of the run: a resumed run
    starts from the history saved with its checkpoint (`history` / `from_history`)."""

    step: int
    curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    data_blocked: float = 0.0
    ckpt_blocked: float = 0.0
    compile_s: float = 0.0
    saved: int = 0
    timed_tokens: int = 0
    timed_s: float = 0.0
    last_loss: float = float("nan")
    digests: dict[int, str] = dataclasses.field(default_factory=dict)
    wall_before: float = 0.0  # wall seconds of the earlier sessions, up to the checkpoint resumed from
    history_missing: int = 0  # steps 1..this are not in the curve (resumed from a checkpoint without history)
    preemptions: list[dict] = dataclasses.field(default_factory=list)  # {"step", "resumed_from"} of each one
    t_start: float = dataclasses.field(default_factory=time.perf_counter)  # this session's start
    resumed_from: int | None = None  # the step this session restored (not saved: each session's own)

    def wall_s(self) -> float:
        return self.wall_before + time.perf_counter() - self.t_start

    def history(self) -> dict:
        """What a checkpoint of step `step` saves (JSON): the loss of every step up to it
        and the counters behind the report, so a resumed run reports the whole run."""
        return {"step": self.step, "curve": [[s, v] for s, v in self.curve], "data_blocked_s": self.data_blocked,
                "checkpoint_blocked_s": self.ckpt_blocked, "compile_s": self.compile_s,
                "checkpoints_saved": self.saved, "timed_tokens": self.timed_tokens, "timed_s": self.timed_s,
                "wall_s": self.wall_s(), "data_digests": {str(k): v for k, v in self.digests.items()},
                "history_missing": self.history_missing, "preemptions": self.preemptions}

    @classmethod
    def from_history(cls, h: dict, t_start: float) -> _LoopStats:
        curve = [(int(s), float(v)) for s, v in h["curve"]]
        return cls(step=int(h["step"]), curve=curve, data_blocked=h["data_blocked_s"],
                   ckpt_blocked=h["checkpoint_blocked_s"], compile_s=h["compile_s"], saved=h["checkpoints_saved"],
                   timed_tokens=h["timed_tokens"], timed_s=h["timed_s"],
                   last_loss=curve[-1][1] if curve else float("nan"),
                   digests={int(k): v for k, v in h["data_digests"].items()}, wall_before=h["wall_s"],
                   history_missing=h["history_missing"], preemptions=list(h.get("preemptions", [])),
                   t_start=t_start)


def _resume(manager: ckpt.CheckpointManager, model: nn.Module, optimizer: nn.Optimizer, data_iter: Iterator,
            t_start: float) -> _LoopStats | None:
    """Restore model, optimizer, data position and the run's history from the latest
    checkpoint; the loop's stats from there, or None when there is no checkpoint."""
    step = manager.latest_step()
    if step is None:
        return None
    if HISTORY_ITEM not in manager.item_metadata(step):  # written before the history was saved
        items = _items(model, optimizer, data_iter, None)
        del items[HISTORY_ITEM]
        restored = manager.restore(step, items)
        nn.update(model, restored["model"])
        nn.update(optimizer, restored["optimizer"])
        return _LoopStats(step=step, history_missing=step, t_start=t_start)
    restored = manager.restore(step, _items(model, optimizer, data_iter, ckpt.args.JsonRestore()))
    nn.update(model, restored["model"])
    nn.update(optimizer, restored["optimizer"])
    history = restored[HISTORY_ITEM]
    if history.get("step") != step:
        raise RunDirError(f"the checkpoint of step {step} in {manager.directory} holds the history of step "
                          f"{history.get('step')}: it is not this run's")
    return _LoopStats.from_history(history, t_start)


def finished_report(cfg: lm_config.Config, run_dir: pathlib.Path) -> dict | None:
    """The report of the run in ``run_dir`` when it already reached ``train.steps`` and its
    ``metrics.json`` is the report of that checkpoint (same step, same loss history); None
    otherwise (nothing to resume, steps left, or a report missing or from another run).

    Reads only: the checkpoint manager is opened without creating or cleaning anything.
    """
    ckpt_dir = pathlib.Path(run_dir) / "checkpoints"
    if not ckpt_dir.is_dir():
        return None
    manager = ckpt.CheckpointManager(ckpt_dir, ckpt.CheckpointManagerOptions(create=False, cleanup_tmp_directories=False))
    try:
        step = manager.latest_step()
        if step is None or step < cfg.train.steps or HISTORY_ITEM not in manager.item_metadata(step):
            return None
        history = manager.restore(step, {HISTORY_ITEM: ckpt.args.JsonRestore()})[HISTORY_ITEM]
    finally:
        manager.close()
    report = _read_json(pathlib.Path(run_dir) / "metrics.json")
    same = (report.get("steps") == step and not report.get("stopped_early")
            and json.dumps(report.get("curve")) == json.dumps(history["curve"]))
    return {**report, "already_finished": {"step": step, "train_steps": cfg.train.steps}} if same else None


_NULL = contextlib.nullcontext()


def _in_window(prof: nn.Profiler | None, step: int) -> bool:
    return prof is not None and prof.start_step <= step < prof.start_step + prof.num_steps


def _run_loop(
    setup: Setup,
    model: nn.Module,
    optimizer: nn.Optimizer,
    data_iter: Iterator,
    manager: ckpt.CheckpointManager,
    schedule: Callable[[int], Any],
    progress: lm_report.Progress,
    s: _LoopStats,
    stop_after: int | None,
    gp: ckpt.GoodputRecorder,
    prof: nn.Profiler | None = None,
) -> _LoopStats:
    """Train from step ``s.step`` to ``cfg.train.steps`` (or ``stop_after``), adding to ``s``
    and saving checkpoints (each with ``s.history()``); waits for the last save and closes the
    progress bar and the data iterator (also when it leaves on a preemption).

    After each step the manager is asked whether a preemption notice arrived (`SIGTERM`,
    seen whenever it came: during a step, the compilation, a data wait or an async save);
    then the step is saved (model, optimizer, data position, history), committed, and
    ``SystemExit(PREEMPTION_EXIT_CODE)`` is raised. Time goes to ``gp`` (data, step,
    checkpoint); steps inside ``prof``'s window are traced and waited for.
    """
    cfg = setup.cfg
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    start_step = s.step
    pending = None
    try:
        with gp.phase("checkpoint"):  # a notice during start-up: nothing more to save, stop now
            _exit_if_preempted(manager, s, model, optimizer, data_iter)
        while s.step < cfg.train.steps:
            t0 = time.perf_counter()
            with gp.phase("data"):
                local = next(data_iter)
            s.data_blocked += time.perf_counter() - t0
            s.digests[s.step + 1] = _digest(local)
            batch = to_global(setup, local)
            first = s.step == start_step
            if first and prof is not None:  # compiled again for the profile's cost and memory analysis
                with gp.phase("compile"):
                    prof.add_compiled("train_step", train_step.lower(model, optimizer, batch, setup.impl).compile())
            t1 = time.perf_counter()
            with gp.step(s.step + 1), (prof.step(s.step + 1) if prof is not None else _NULL):
                metrics = train_step(model, optimizer, batch, setup.impl)
                if pending is not None:
                    # read the previous step's loss now: the device ran ahead while we fetched data
                    s.curve.append((s.step, float(pending["loss"])))
                if first or _in_window(prof, s.step + 1):
                    jax.block_until_ready(metrics)
            s.step += 1
            pending = metrics
            if first:
                s.compile_s += time.perf_counter() - t1
            else:
                s.timed_tokens += tokens_per_step
                s.timed_s += time.perf_counter() - t0
            if s.step % cfg.train.log_every == 0 or s.step == cfg.train.steps:
                s.last_loss = float(metrics["loss"])
                tps = s.timed_tokens / s.timed_s if s.timed_s else 0.0
                progress.update(s.step, s.last_loss, tps, float(schedule(s.step)))
            with gp.phase("checkpoint"):
                pending = _checkpoint(manager, s, model, optimizer, data_iter, pending, last=s.step == cfg.train.steps)
            if stop_after is not None and s.step >= stop_after:
                break
        if pending is not None:
            s.curve.append((s.step, float(pending["loss"])))
        if s.curve:
            s.last_loss = s.curve[-1][1]
        t3 = time.perf_counter()
        with gp.phase("checkpoint"):
            manager.wait_until_finished()
        s.ckpt_blocked += time.perf_counter() - t3
    finally:
        progress.close()
        if prof is not None:
            prof.close()
        if hasattr(data_iter, "close"):
            data_iter.close()
    return s


def _checkpoint(manager: ckpt.CheckpointManager, s: _LoopStats, model: nn.Module, optimizer: nn.Optimizer,
                data_iter: Iterator, pending: dict | None, *, last: bool) -> dict | None:
    """After step ``s.step`` (its metrics ``pending``, not yet in the curve): save it when due,
    the last or preempted (``should_save`` asks the manager about a notice every step; the
    processes of a multi-process run agree on it there), and leave on a preemption. Returns
    the metrics still to be read into the curve (None once they are)."""
    if manager.should_save(s.step) or last:
        assert pending is not None
        s.curve.append((s.step, float(pending["loss"])))  # the step's loss goes into its checkpoint
        pending = None
        s.saved += 1
        t2 = time.perf_counter()
        history = ckpt.args.JsonSave(s.history())
        manager.save(s.step, _items(model, optimizer, data_iter, history), force=last)
        s.ckpt_blocked += time.perf_counter() - t2
    if pending is not None and manager.reached_preemption(s.step):
        s.curve.append((s.step, float(pending["loss"])))
        pending = None
    _exit_if_preempted(manager, s, model, optimizer, data_iter)
    return pending


def _exit_if_preempted(manager: ckpt.CheckpointManager, s: _LoopStats, model: nn.Module, optimizer: nn.Optimizer,
                       data_iter: Iterator) -> None:
    """`CheckpointManager.exit_if_preempted` at step ``s.step``: when a notice was reached,
    save the step (unless committed already) with its history, wait, raise ``SystemExit(75)``.
    The loss of ``s.step`` must be in ``s.curve`` by then."""
    if manager.reached_preemption(s.step):
        manager.wait_until_finished()
        s.saved += manager.latest_step() != s.step  # saved now, so the history counts it
        manager.exit_if_preempted(s.step, _items(model, optimizer, data_iter, ckpt.args.JsonSave(s.history())))


def _report(
    setup: Setup,
    model: nn.Module,
    optimizer: nn.Optimizer,
    s: _LoopStats,
    *,
    resumed_from: int | None,
    eval_texts: list[str],
    peak: float,
    gp: ckpt.GoodputRecorder | None = None,
    progress_output: bool = False,
) -> dict:
    """The run's report: held-out exact match (when the run finished), throughput, memory;
    the curve, times and counters cover the whole run, resumed or not (``s``'s history)."""
    cfg, run_dir = setup.cfg, setup.run_dir
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    flops_per_step = lm_config.flops_per_token(cfg, lm_config.vocab_size(cfg)) * tokens_per_step
    stopped_early = s.step < cfg.train.steps
    if not stopped_early and cfg.train.progress and progress_output and jax.process_index() == 0:
        print(f"evaluating: exact match on {len(eval_texts)} held-out problems", file=sys.stderr, flush=True)
    with gp.phase("eval") if gp is not None else _NULL:
        acc = float("nan") if stopped_early else evaluate(setup, model, eval_texts)
    tps = s.timed_tokens / s.timed_s if s.timed_s else 0.0
    answer_digits = cfg.data.max_digits + 1
    return {
        "steps": s.step,
        "resumed_from": resumed_from,
        "final_loss": s.last_loss,
        "heldout_exact_match": acc,
        "heldout_examples": len(eval_texts),
        "chance_exact_match": 10.0 ** -answer_digits,
        "tokens_per_s": tps,
        "peak_flops": peak,
        "mfu": (tps * flops_per_step / tokens_per_step) / peak if peak else 0.0,
        # the machine's load when the speeds were measured: on a shared machine it explains them
        "loadavg": list(os.getloadavg()),
        "cpu_count": os.cpu_count(),
        "checkpoint_blocked_s": s.ckpt_blocked,
        "checkpoints_saved": s.saved,
        "data_blocked_s": s.data_blocked,
        "compile_s": s.compile_s,
        "wall_s": s.wall_s(),
        "mesh": dict(setup.mesh.shape),
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "run_dir": str(run_dir),
        "config": lm_config.to_dict(cfg),
        "params": int(sum(math.prod(x.shape) for x in jax.tree.leaves(nn.state(model, nn.Param)))),
        "param_partition_specs": param_partition_specs(model),
        # per-device memory: optimizer state is sharded like the params (2 moments for AdamW)
        "per_device_param_bytes": per_device_bytes(nn.state(model, nn.Param)),
        "per_device_optimizer_bytes": per_device_bytes(nn.state(optimizer, nn.OptState)),
        "curve": s.curve,
        "curve_missing_steps": s.history_missing,
        "data_digests": s.digests,
        "stopped_early": stopped_early,
        "preemptions": s.preemptions,
        "tokenizer": _describe_tokenizer(setup),
    }


def _describe_tokenizer(setup: Setup) -> dict:
    """The report's entry on the run's tokenizer: its kind, size and how it splits a question."""
    cfg = setup.cfg
    if setup.tokenizer is None or cfg.tokenizer.kind == "byte":
        return {"kind": cfg.tokenizer.kind}
    import lm_tokenizer

    return {"kind": "bpe", "path": str(setup.run_dir / "tokenizer"),
            **lm_tokenizer.describe(setup.tokenizer, lm_task.question("372+59=134"))}


def train(cfg: lm_config.Config, *, resume: bool = False, stop_after: int | None = None, quiet: bool = False,
          overwrite: bool = False, after_training: Callable[[Setup, nn.Module, list[str], dict], None] | None = None,
          profile: tuple[int, int] | None = None, start_time: float | None = None) -> dict:
    """Run the recipe; returns the report dict (also written to the run directory).

    ``after_training(setup, model, eval_texts, report)``, when given, runs once the last
    checkpoint is written and the held-out score is in the report (the production steps:
    quantize, export, serve); it adds its own entries to ``report`` before it is written.

    A run directory that already holds checkpoints needs `resume=True` or `overwrite=True`
    (see `check_run_dir`); otherwise RunDirError is raised before any work starts. Resuming
    a run that already reached ``train.steps`` and has its report changes nothing: the
    report read back from ``metrics.json`` is returned, its ``"already_finished"`` naming the
    checkpoint's step and ``train.steps`` (see `finished_report`).

    Preemption: a ``SIGTERM`` (or another notice the checkpoint manager watches) makes the
    run save the step it reached (model, optimizer, data position, history), wait for the
    commit, write ``run.dir/PREEMPTED.json`` and raise ``SystemExit(PREEMPTION_EXIT_CODE)``
    (75); the next start into ``run.dir`` resumes from it without `resume=True`. The report
    covers every run (curve, counters, ``preemptions``) and ``goodput`` (a
    ``GoodputRecorder`` over all runs, in ``run.dir/checkpoints/_GOODPUT.json``).

    ``profile=(start, num)``: trace steps ``start .. start + num - 1`` (process 0) with
    ``nn.Profiler`` into ``run.dir/profile`` (trace and ``profile_summary.json``).
    ``start_time``: when the process started (``time.time()``; default: now), for goodput.
    """
    start_time = time.time() if start_time is None else start_time
    t_start = time.perf_counter()
    setup = make_setup(cfg)
    run_dir = setup.run_dir
    preempted_at = None if overwrite else lm_cli.preempted_step(run_dir)
    auto_resume = preempted_at is not None and not resume
    check_run_dir(run_dir, resume=resume or auto_resume, overwrite=overwrite)
    resume = resume or auto_resume
    done = finished_report(cfg, run_dir) if resume else None
    if done is not None:
        return done
    manager = _open_manager(cfg, run_dir)
    # the first question installs the manager's SIGTERM handler: from here on a notice (during
    # the kernel timing, data preparation, compilation...) is kept until the loop asks
    manager.reached_preemption(0)
    if auto_resume and not quiet and jax.process_index() == 0:
        print(f"resuming: {run_dir} holds the checkpoint of step {preempted_at}, saved when the run was preempted",
              flush=True)
    # measured before the data workers start, so they do not disturb the timings
    choice = choose_kernels(cfg, run_dir, resume=resume)
    if not quiet and jax.process_index() == 0:
        print(describe_kernels(choice), flush=True)
    setup.impl = lm_model.Impl(choice["attention"]["implementation"], choice["loss"]["implementation"])
    data_iter, eval_texts, model, optimizer, schedule = _build(setup)
    stats: _LoopStats | None = None
    try:
        with ckpt.GoodputRecorder(manager.directory, start_time=start_time) as gp:  # written on exit 75 too
            stats = _start_stats(manager, model, optimizer, data_iter, t_start, resume, preempted_at, quiet)
            gp.resumed(stats.resumed_from)
            report = _train_and_report(setup, model, optimizer, data_iter, manager, schedule, stats, gp,
                                       stop_after=stop_after, quiet=quiet, eval_texts=eval_texts, profile=profile)
            report["goodput"] = gp.report()
    except SystemExit as e:
        if e.code == ckpt.PREEMPTION_EXIT_CODE and stats is not None:
            _mark_preempted(run_dir, stats.step, quiet)
        raise
    except Exception:
        manager.close()  # the previous SIGTERM handler back, a pending save finished
        raise
    assert stats is not None
    report["kernels"] = choice
    manager.close()
    if after_training is not None and not report["stopped_early"]:
        after_training(setup, model, eval_texts, report)
    if jax.process_index() == 0:
        lm_report.write_report(run_dir, report, stats.curve)
        if not report["stopped_early"]:  # the run is complete: a later start must choose again
            (run_dir / lm_cli.PREEMPTED_FILE).unlink(missing_ok=True)
    return report


def _build(setup: Setup) -> tuple[Iterator, list[str], llm.CausalLM, nn.Optimizer, Callable[[int], Any]]:
    """The data iterator (this process's shard), the held-out texts, the model, its optimizer
    and the learning-rate schedule."""
    cfg = setup.cfg
    shards = lm_data.prepare_synthetic(cfg) if cfg.data.source == "synthetic" else None
    src, fmt, eval_texts = lm_data.open_source(cfg, shards)
    setup.tokenizer, setup.codec = lm_data.run_tokenizer(cfg, src, fmt, save=jax.process_index() == 0)
    pipeline = lm_data.build_pipeline(cfg, src, fmt, jax.process_index(), jax.process_count(), codec=setup.codec)
    model = create_model(setup)
    tx, schedule = make_optimizer(cfg)
    return iter(pipeline), eval_texts, model, nn.Optimizer(model, tx, wrt=nn.Param), schedule


def _start_stats(manager: ckpt.CheckpointManager, model: nn.Module, optimizer: nn.Optimizer, data_iter: Iterator,
                 t_start: float, resume: bool, preempted_at: int | None, quiet: bool) -> _LoopStats:
    """The loop's stats: restored with the latest checkpoint when resuming (the preemption
    it follows recorded once), else fresh."""
    stats = _resume(manager, model, optimizer, data_iter, t_start) if resume else None
    if stats is None:
        return _LoopStats(step=0, t_start=t_start)
    if stats.history_missing and not quiet and jax.process_index() == 0:
        print(f"note: the checkpoint of step {stats.step} holds no loss history (written by an older "
              f"version): the report covers steps {stats.step + 1} after it only", flush=True)
    if preempted_at is not None and all(p.get("step") != preempted_at for p in stats.preemptions):
        stats.preemptions.append({"step": preempted_at, "resumed_from": stats.step})
    stats.resumed_from = stats.step
    return stats


def _train_and_report(setup: Setup, model: nn.Module, optimizer: nn.Optimizer, data_iter: Iterator,
                      manager: ckpt.CheckpointManager, schedule: Callable[[int], Any], stats: _LoopStats,
                      gp: ckpt.GoodputRecorder, *, stop_after: int | None, quiet: bool, eval_texts: list[str],
                      profile: tuple[int, int] | None) -> dict:
    """The loop, the held-out score and the report (a notice during the evaluation: exit 75)."""
    cfg = setup.cfg
    peak = lm_report.measure_peak_flops()
    progress = lm_report.Progress(cfg.train.steps, stats.step, cfg.train.log_every,
                                  enabled=cfg.train.progress and not quiet and jax.process_index() == 0)
    prof = None
    if profile is not None and jax.process_index() == 0:
        prof = nn.Profiler(setup.run_dir / "profile", start_step=profile[0], num_steps=profile[1])
    resumed_from = stats.resumed_from
    stats = _run_loop(setup, model, optimizer, data_iter, manager, schedule, progress, stats, stop_after, gp, prof)
    report = _report(setup, model, optimizer, stats, resumed_from=resumed_from, eval_texts=eval_texts, peak=peak, gp=gp,
                     progress_output=not quiet)
    with gp.phase("checkpoint"):
        _exit_if_preempted(manager, stats, model, optimizer, data_iter)
    if prof is not None:
        with gp.phase("profile"):
            report["profile"] = _profile_report(prof, stats, quiet)
    return report


def _profile_report(prof: nn.Profiler, s: _LoopStats, quiet: bool) -> dict:
    """The profile's summary (printed unless ``quiet``; written to ``profile_summary.json``),
    in short for the report; or why there is none (the window was not reached)."""
    if not prof.done:
        return {"skipped": f"steps {prof.start_step}..{prof.start_step + prof.num_steps - 1} were not run "
                           f"(this run trained steps {s.resumed_from or 0}+1..{s.step})"}
    summary = prof.summary(print_fn=None if quiet else print)
    fn = summary["functions"].get("train_step", {})
    return {"summary": str(pathlib.Path(prof.log_dir) / nn.SUMMARY_FILE), "trace_dir": summary["trace_dir"],
            "steps": summary["steps"], "step_time_ms": 1e3 * summary["step_time_s"]["mean"],
            "roofline": fn.get("roofline"), "memory_total_bytes": (fn.get("memory") or {}).get("total_bytes")}


def _mark_preempted(run_dir: pathlib.Path, step: int, quiet: bool) -> None:
    """After the preemption save is committed: ``run.dir/PREEMPTED.json`` (the next start
    resumes from it by itself) and a line saying so."""
    if jax.process_index() != 0:
        return
    marker = run_dir / lm_cli.PREEMPTED_FILE
    _write_json(marker, {"step": step, "time": time.time(), "exit_code": ckpt.PREEMPTION_EXIT_CODE})
    print(f"preempted: step {step} is committed in {run_dir / 'checkpoints'}; exiting with status "
          f"{ckpt.PREEMPTION_EXIT_CODE}. Start `{lm_cli.command()}` with the same settings again to resume "
          f"from it (no --resume needed).", file=sys.stderr, flush=True)
