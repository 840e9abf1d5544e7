"""What every post-training loop shares: the trainable part of a model (LoRA/QLoRA adapters
or every weight), the run directory with its checkpoints (model, optimizer and data-iterator
position committed together, so a resumed run is bit-identical), metrics as JSON lines, and
the loss plot.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cairn import checkpoint as ckpt
from cairn import nn, optim, quant
from cairn.llm._lora import apply_lora
from cairn.llm._model import CausalLM

__all__ = ["LoraSettings", "TrainerRun", "Trainable", "accumulating_step", "plot_metrics", "read_metrics",
           "window_logits"]

METRICS_FILE = "metrics.jsonl"
STATE_ITEM = "trainer"


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """Train LoRA adapters instead of every weight (QLoRA with ``weight_qtype``).

    Args:
      rank: the adapters' rank.
      alpha: the scale numerator: the update is ``alpha / rank * A @ B``.
      target_modules: Hugging Face module names or ``"all-linear"``.
      weight_qtype: store the adapted base weights quantized (``"nf4"``, ``"int8"``...): QLoRA.
      seed: the adapters' initialization seed.
    """

    rank: int = 8
    alpha: float = 16.0
    target_modules: str | tuple[str, ...] = "all-linear"
    weight_qtype: str | None = None
    seed: int = 0


class TrainerConfig:
    """What the trainers' configs share: positive-integer checks and their JSON form."""

    def _check_positive(self, *names: str) -> None:
        for name in names:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be a positive integer, got {v!r}")

    def to_json(self) -> dict[str, Any]:
        """The settings, as JSON (a resumed run must have the same)."""
        d = dataclasses.asdict(self)  # type: ignore[call-overload]
        if d.get("lora") is not None and isinstance(d["lora"]["target_modules"], tuple):
            d["lora"]["target_modules"] = list(d["lora"]["target_modules"])
        return d


class Trainable:
    """A :class:`CausalLM` prepared for training: ``forward(model, ids, ...)`` and the filter
    ``wrt`` of the variables that train (``nn.LoRAParam`` with LoRA, ``nn.Param`` without).

    With LoRA the adapters are added to ``model`` in place; ``self.model`` is the module that
    holds every variable (the base with its adapter slots) and ``self.provider`` the LoRA
    provider the forward pass runs through (``None`` for full fine-tuning).
    """

    def __init__(self, model: CausalLM, lora: LoraSettings | None) -> None:
        if not isinstance(model, CausalLM):
            raise TypeError(f"expected a cairn.llm.CausalLM, got {type(model).__name__}")
        self.lora = lora
        if lora is None:
            self.model, self.provider, self.wrt = model, None, nn.Param
        else:
            wrapped = apply_lora(model, lora.rank, lora.alpha, lora.target_modules, rng=jax.random.key(lora.seed),
                                 weight_qtype=lora.weight_qtype)
            self.model, self.provider, self.wrt = model, wrapped.provider, nn.LoRAParam

    def runner(self, model: CausalLM | None = None) -> Any:
        """What to call like the model (and pass to ``generate``): the model itself, or the
        model running through the LoRA provider."""
        m = self.model if model is None else model
        return m if self.provider is None else quant.quantize_model(m, self.provider)

    def frozen_fingerprint(self) -> str:
        """A digest of the weights that do not train (shapes, dtypes and a sample of values):
        a resumed LoRA run checks it starts from the same base."""
        if self.provider is None:
            return ""
        h = hashlib.sha256()
        state = nn.state(self.model)
        assert isinstance(state, nn.State)
        flat = state.flat_state()
        for path in sorted(flat, key=str):
            if isinstance(flat[path], nn.LoRAParam):
                continue
            leaf = flat[path][...]
            arrays = leaf.tree_flatten()[0] if hasattr(leaf, "tree_flatten") else [leaf]
            h.update(str(path).encode())
            for x in arrays:
                a = np.asarray(jax.device_get(x)).reshape(-1)
                h.update(f"{a.dtype}{a.shape}".encode())
                h.update(np.ascontiguousarray(a[:: max(1, a.size // 256)]).tobytes())
        return h.hexdigest()[:32]


def default_optimizer(learning_rate: float, steps: int, warmup_steps: int, weight_decay: float,
                      max_grad_norm: float | None) -> Any:
    """AdamW with linear warmup then cosine decay to 10%, after global-norm clipping."""
    schedule: Any = optim.warmup_cosine_decay_schedule(0.0 if warmup_steps else learning_rate, learning_rate,
                                                  max(warmup_steps, 0), max(steps, warmup_steps + 1),
                                                  end_value=learning_rate * 0.1)
    parts = [] if max_grad_norm is None else [optim.clip_by_global_norm(max_grad_norm)]
    return optim.chain(*parts, optim.adamw(schedule, weight_decay=weight_decay))


class TrainerRun:
    """A trainer's run directory: ``checkpoints/`` (cairn.checkpoint), ``metrics.jsonl`` and
    ``loss.png``.

    Each checkpoint holds the trainable variables (the adapters alone with LoRA), the
    optimizer state, the data iterator's position and a JSON item with the step, the
    trainer's config and the frozen weights' fingerprint. :meth:`resume` restores the newest;
    metrics lines of steps after it (work redone after a crash) are dropped from the file.
    """

    def __init__(self, run_dir: str | os.PathLike, trainable: Trainable, optimizer: nn.Optimizer,
                 data_iter: Iterator, config: dict[str, Any], *, save_every: int, max_to_keep: int) -> None:
        self.dir = pathlib.Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.trainable, self.optimizer, self.data_iter, self.config = trainable, optimizer, data_iter, config
        self.manager = ckpt.CheckpointManager(
            self.dir / "checkpoints", ckpt.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=max_to_keep))

    def _items(self, meta: Any) -> dict[str, Any]:
        return {"model": nn.state(self.trainable.model, self.trainable.wrt),
                "optimizer": nn.state(self.optimizer, nn.OptState), "data": self.data_iter, STATE_ITEM: meta}

    def resume(self) -> int:
        """Restore the newest checkpoint; the step to continue from (0 without one).

        Raises:
          ValueError: the checkpoint was written by a run with another config or base model.
        """
        step = self.manager.latest_step()
        if step is None:
            _truncate_metrics(self.dir / METRICS_FILE, 0)
            return 0
        restored = self.manager.restore(step, self._items(ckpt.args.JsonRestore()))
        meta = restored[STATE_ITEM]
        mine, theirs = json.loads(json.dumps(self.config)), meta.get("config") or {}
        if theirs != mine:
            diff = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
            raise ValueError(f"{self.dir}: the checkpoint of step {step} was written with another trainer config "
                             f"(differs in {diff}); use a new run directory or the same config")
        if meta.get("base_fingerprint") != self.trainable.frozen_fingerprint():
            raise ValueError(f"{self.dir}: the checkpoint of step {step} trained adapters on another base model "
                             "(its frozen weights differ); start from the same pretrained weights")
        nn.update(self.trainable.model, restored["model"])
        nn.update(self.optimizer, restored["optimizer"])
        _truncate_metrics(self.dir / METRICS_FILE, step)
        return step

    def maybe_save(self, step: int, *, force: bool = False) -> float:
        """Save when the interval (or ``force``) says so; the seconds the loop was blocked."""
        if not (force or self.manager.should_save(step)):
            return 0.0
        t = time.perf_counter()
        meta = {"step": step, "config": self.config, "base_fingerprint": self.trainable.frozen_fingerprint()}
        self.manager.save(step, self._items(ckpt.args.JsonSave(meta)), force=force)
        return time.perf_counter() - t

    def log(self, record: dict[str, Any]) -> None:
        """Append one metrics line (finite floats; NaN written as null)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.dir / METRICS_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(clean) + "\n")

    def close(self) -> None:
        """Wait for the last checkpoint to commit and close the manager."""
        self.manager.wait_until_finished()
        self.manager.close()


def _truncate_metrics(path: pathlib.Path, step: int) -> None:
    if not path.exists():
        return
    keep = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()
            and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in keep), encoding="utf-8")


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The metrics lines of a trainer's run directory, oldest first.

    Args:
      run_dir: the trainer's run directory.

    Raises:
      FileNotFoundError: no ``metrics.jsonl`` there.
    """
    path = pathlib.Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: no metrics (has the trainer run here?)")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def plot_metrics(run_dir: str | os.PathLike, keys: tuple[str, ...] = ("loss",), out: str | None = None) -> str:
    """Plot ``keys`` of ``metrics.jsonl`` against the step into ``loss.png`` (or ``out``).

    Needs matplotlib (not a dependency of cairn-llm: ``pip install matplotlib``).

    Args:
      run_dir: the trainer's run directory (with ``metrics.jsonl``).
      keys: the metrics to plot, one panel each.
      out: the image path; None writes ``run_dir/loss.png``.

    Returns:
      The image's path.

    Raises:
      ImportError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plot_metrics needs matplotlib: pip install 'cairn-llm[plot]'") from e
    rows = read_metrics(run_dir)
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts])
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out or str(pathlib.Path(run_dir) / "loss.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def token_nll_sum(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``sum(weights * -log p(target))`` over a batch and ``sum(weights)`` (float32)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    w = weights.astype(jnp.float32)
    return jnp.sum(nll * w), jnp.sum(w)


def window_logits(model: Any, inputs: jax.Array, start: int) -> jax.Array:
    """``model(inputs)[:, start:]`` in float32.

    A :class:`CausalLM`, or one running through a ``cairn.quant`` provider (a LoRA policy:
    ``quant.quantize_model``), computes only those positions' logits (``logits_start``: the
    last layer's queries and MLP and the vocabulary projection from ``start`` on); any other
    callable runs in full, then is sliced. XLA does not move such a slice before the products.
    """
    if start and _takes_logits_start(model):
        return model(inputs, logits_start=start).astype(jnp.float32)
    return model(inputs)[:, start:].astype(jnp.float32)


def _takes_logits_start(model: Any) -> bool:
    """Whether calling ``model`` is calling a :class:`CausalLM` (itself, or through a provider)."""
    if isinstance(model, CausalLM):
        return True
    return (isinstance(model, quant.QuantizedModel) and model.method == "__call__"
            and isinstance(model.model, CausalLM))


def accumulating_step(trainable: Trainable, micro_loss: Any) -> Any:
    """The jitted optimizer step ``step(model, optimizer, batch) -> metrics`` over a batch of
    ``[accum, ...]`` micro-batches.

    ``micro_loss(policy, base, micro_batch) -> (loss_sum, count, {name: sum})`` scores one
    micro-batch: ``policy`` is what to call like the model (through the adapters with LoRA),
    ``base`` the module itself (without the adapters: the reference policy with LoRA). The
    step sums the losses, counts, metric sums and gradients over a ``lax.scan`` (one
    micro-batch of activations alive at a time) and divides by the total count, so the update
    equals that of one batch ``accum`` times larger. Returns ``loss``, ``count``,
    ``grad_norm`` and each metric averaged the same way.
    """
    wrt, runner = trainable.wrt, trainable.runner

    def step(model: Any, optimizer: nn.Optimizer, batch: Any) -> dict:
        graphdef, params, rest = nn.split(model, wrt, ...)

        def loss(p: Any, mb: Any) -> tuple:
            m: Any = nn.merge(graphdef, p, rest)
            total, count, metrics = micro_loss(runner(m), m, mb)
            return total, (count, metrics)

        first = jax.tree.map(lambda x: x[0], batch)

        def micro_grads(mb: Any) -> tuple:
            (total, (count, metrics)), g = jax.value_and_grad(loss, has_aux=True)(params, mb)
            return g, total, count, metrics

        if jax.tree.leaves(batch)[0].shape[0] == 1:
            # one micro-batch: its sums are the batch's (no zeroed accumulators, no loop)
            grads, total, count, metrics = micro_grads(first)
        else:
            _, (_, shapes) = jax.eval_shape(loss, params, first)
            zeros = (jax.tree.map(jnp.zeros_like, params), jnp.float32(0), jnp.float32(0),
                     jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), shapes))

            def micro(acc: tuple, mb: Any) -> tuple:
                return jax.tree.map(jnp.add, acc, micro_grads(mb)), None

            (grads, total, count, metrics), _ = jax.lax.scan(micro, zeros, batch)
        denom = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        optimizer.update(model, grads)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)))
        return {"loss": total / denom, "count": count, "grad_norm": norm, **{k: v / denom for k, v in metrics.items()}}

    return nn.jit(step, donate_argnums=(0, 1))
