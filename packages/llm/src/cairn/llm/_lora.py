"""LoRA on the model families through cairn.quant's rules, merging, and PEFT's file layout.

``apply_lora`` adds a ``cairn.quant.LoraRule`` adapter to every projection a Hugging Face
module name selects (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``,
``up_proj``, ``down_proj``; the names come from the family tables). A projection
``y = x W`` gains ``(x A) B * alpha / rank`` with ``A [in, rank]`` and ``B [rank, out]``
(``in``/``out`` are the weight's contracted/other axes, flattened in order: a query kernel
``[hidden, heads, head_dim]`` has ``in = hidden``, ``out = heads * head_dim``, the layout
of transformers' ``q_proj``). The adapters live in the model as ``nn.LoRAParam`` variables
at cairn.quant's paths (``layers/0/attn/q/lora/lora_a``), so
``nn.Optimizer(model, tx, wrt=nn.LoRAParam)`` trains only them.

On disk, adapters use PEFT's layout: ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ``peft_type: "LORA"``, ``task_type: "CAUSAL_LM"``, ...) and
``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight`` ``[r, in]``
(= ``A^T``) and ``...lora_B.weight`` ``[out, r]`` (= ``B^T``), so adapters move between
cairn.llm and peft / transformers both ways.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from cairn import nn, quant
from cairn.core_array import QArray
from cairn.llm._config import LlmConfig
from cairn.llm._errors import CheckpointError
from cairn.llm._families import family_of
from cairn.llm._model import CausalLM

__all__ = ["LoraAdapters", "apply_lora", "load_lora", "lora_adapters", "lora_target_modules", "merge_lora", "save_lora"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


@dataclasses.dataclass(frozen=True)
class LoraAdapters:
    """LoRA adapters of a model: ``weights`` maps each adapted weight's path
    (``layers/0/attn/q/kernel``) to ``(A [in, rank], B [rank, out])``; the update of that
    weight is ``alpha / rank * A @ B`` reshaped to the weight's shape.

    Args:
      rank: the adapters' rank.
      alpha: the scale numerator (the update is ``alpha / rank * A @ B``).
      weights: ``{weight path: (A [in, rank], B [rank, out])}``.
      base_model_name_or_path: the base model's name, written to PEFT's ``adapter_config.json``;
        None for none.
    """

    rank: int
    alpha: float
    weights: Mapping[str, tuple[Any, Any]]
    base_model_name_or_path: str | None = None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _projections(cfg: LlmConfig) -> dict[str, dict[str, str]]:
    """Hugging Face module name (``q_proj``) -> {model weight path: Hugging Face module path},
    read from the family table: every per-layer ``[out, in]`` matrix."""
    out: dict[str, dict[str, str]] = {}
    for rule in family_of(cfg.model_type).weights:
        if rule.transpose and "{i}" in rule.hf and rule.hf.endswith(".weight") and not rule.when:
            name = rule.hf.split(".")[-2]
            out[name] = {rule.path.format(i=i): rule.hf.format(i=i).removesuffix(".weight")
                         for i in range(cfg.num_hidden_layers)}
    return out


def _size(cfg: LlmConfig, expr: str) -> int:
    """A family table's shape entry (``num_attention_heads*head_dim``) for ``cfg``."""
    return math.prod(int(getattr(cfg, f)) for f in expr.split("*"))


def _out_in(cfg: LlmConfig) -> dict[str, tuple[int, int]]:
    """Model weight path -> ``(out, in)`` of its Hugging Face ``[out, in]`` matrix (the family table's shapes)."""
    sizes: dict[str, tuple[int, int]] = {}
    for rule in family_of(cfg.model_type).weights:
        if rule.transpose and "{i}" in rule.hf and not rule.when:
            out_expr, in_expr = rule.hf_shape
            out_in = (_size(cfg, out_expr), _size(cfg, in_expr))
            sizes.update({rule.path.format(i=i): out_in for i in range(cfg.num_hidden_layers)})
    return sizes


def lora_target_modules(config: LlmConfig) -> list[str]:
    """The Hugging Face module names LoRA can target on this family (``"all-linear"``: all).

    Args:
      config: the model's config.
    """
    return sorted(_projections(config))


def _base(model: Any) -> CausalLM:
    base = model.model if isinstance(model, quant.QuantizedModel) else model
    if not isinstance(base, CausalLM):
        raise TypeError(f"expected a cairn.llm.CausalLM (or the model apply_lora returns), got {type(model).__name__}")
    return base


def _select(cfg: LlmConfig, target_modules: str | Sequence[str]) -> dict[str, str]:
    table = _projections(cfg)
    names = list(table) if target_modules == "all-linear" else (
        [target_modules] if isinstance(target_modules, str) else list(target_modules))
    unknown = [n for n in names if n not in table]
    if unknown or not names:
        raise ValueError(f"LoRA target_modules {unknown or names!r} are not projections of a {cfg.model_type!r} model; "
                         f"choose among {sorted(table)} (or 'all-linear')")
    return {path: hf for n in names for path, hf in table[n].items()}


def _owner(model: CausalLM, weight_path: str) -> Any:
    node: Any = model
    for part in weight_path.split("/")[:-1]:
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def apply_lora(model: CausalLM, rank: int = 8, alpha: float = 16.0,
               target_modules: str | Sequence[str] = ("q_proj", "v_proj"), *, adapters: LoraAdapters | None = None,
               rng: Any = None, dropout: float = 0.0, weight_qtype: str | None = None) -> quant.QuantizedModel:
    """Add LoRA adapters to ``model`` (in place) and return it wrapped to run with them.

    Args:
      model: a :class:`CausalLM` without adapters.
      rank: the adapters' rank ``r``.
      alpha: the scale numerator (the update is ``alpha / r * A @ B``).
      target_modules: Hugging Face module names (``"q_proj"``, ``"o_proj"``, ``"down_proj"``...;
        ``lora_target_modules(config)`` lists them) or ``"all-linear"``.
      adapters: existing adapters (``load_lora``, ``lora_adapters``) instead of fresh ones;
        ``rank``, ``alpha`` and ``target_modules`` are then theirs.
      rng: PRNG key of the fresh adapters (``A`` He-uniform, ``B`` zero: the output starts
        unchanged); default ``jax.random.key(0)``.
      dropout: adapter-input dropout rate, applied when the provider gets a ``dropout_rng``.
      weight_qtype: QLoRA: store the adapted weights quantized (``"nf4"``, ``"int8"``,
        ``"int4"``...; 4-bit ones packed two to a byte) and train the adapters over them.
        The base weights are replaced in ``model``; ``merge_lora`` dequantizes them.

    Returns:
      ``cairn.quant.quantize_model(model, provider)``: call it like the model (with a
      cache too, so ``generate`` takes it); ``.model`` is ``model``, ``.provider`` the
      ``LoraProvider``.
    """
    base = _base(model)
    if isinstance(model, quant.QuantizedModel):
        raise ValueError("apply_lora: this model already runs through a provider; pass the plain CausalLM")
    if adapters is not None:
        rank, alpha, paths = adapters.rank, adapters.alpha, sorted(adapters.weights)
    else:
        paths = sorted(_select(base.config, target_modules))
    present = [p for p in paths if getattr(_owner(base, p), "lora", None) is not None]
    if present:
        raise ValueError(f"apply_lora: the model already has adapters at {present[:3]}...; merge_lora them or "
                         "start from a model without adapters")
    modules = sorted({p.rpartition("/")[0] for p in paths})
    rule = quant.LoraRule(module_path="|".join(re.escape(m) for m in modules), rank=rank, alpha=float(alpha),
                          dropout=dropout, weight_qtype=weight_qtype)
    provider = quant.LoraProvider([rule])
    example = jnp.zeros((1, 1), jnp.int32)
    quant.apply_lora_to_model(base, provider, example, rng=jax.random.key(0) if rng is None else rng)
    if weight_qtype is not None:
        nn.update(base, nn.state(quant.quantize_params(base, provider, lambda m, x: m(x), example, pack=True)))
    if adapters is not None:
        for path, (a, b) in adapters.weights.items():
            slot = _owner(base, path).lora
            for key, value in (("lora_a", a), ("lora_b", b)):
                var = slot[key]
                if tuple(np.shape(value)) != tuple(var.value.shape):
                    raise ValueError(f"apply_lora: adapter {key} of {path!r} has shape {tuple(np.shape(value))}, "
                                     f"the model needs {tuple(var.value.shape)}")
                var.value = jnp.asarray(value, var.value.dtype)
    return quant.quantize_model(base, provider)


def lora_adapters(model: quant.QuantizedModel) -> LoraAdapters:
    """The adapters of a model returned by :func:`apply_lora` (their current, trained values).

    Args:
      model: what :func:`apply_lora` returned.

    Raises:
      TypeError: ``model`` is not such a model.
    """
    if not isinstance(model, quant.QuantizedModel) or not isinstance(model.provider, quant.LoraProvider):
        raise TypeError(f"lora_adapters expects the model apply_lora returns, got {type(model).__name__}")
    base = _base(model)
    rule = next(r for r in model.provider.rules if isinstance(r, quant.LoraRule))
    weights = {}
    for path in _select(base.config, "all-linear"):
        slot = getattr(_owner(base, path), "lora", None)
        if slot is not None:
            weights[path] = (slot["lora_a"].value, slot["lora_b"].value)
    return LoraAdapters(rule.rank, rule.alpha, weights)


def _merged(w: jax.Array, a: Any, b: Any, scale: float, path: str) -> jax.Array:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    n_in = a.shape[0]
    lead = [math.prod(w.shape[:k]) for k in range(1, w.ndim)]
    if n_in not in lead or a.shape[0] * b.shape[1] != w.size or a.shape[1] != b.shape[0]:
        raise ValueError(f"merge_lora: adapters of {path!r} have shapes {a.shape}, {b.shape}, which do not fit "
                         f"the weight's {tuple(w.shape)}")
    return (w.astype(jnp.float32) + scale * (a @ b).reshape(w.shape)).astype(w.dtype)


def merge_lora(model: Any, adapters: LoraAdapters | None = None) -> CausalLM:
    """A new :class:`CausalLM` whose weights are ``W + alpha / rank * A @ B`` (float32
    arithmetic, stored in the weight's dtype; a QLoRA base's quantized weights are
    dequantized to the model's dtype first), without adapters.

    ``model`` is the base model or what :func:`apply_lora` returned; ``adapters`` default to
    the latter's. The model passed in is not changed.

    Args:
      model: the base model, or what :func:`apply_lora` returned.
      adapters: the adapters to merge; None takes those of ``model`` (which must then come from
        :func:`apply_lora`).

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from cairn import nn
    >>> from cairn.llm import CausalLM, LlmConfig, apply_lora, lora_target_modules, merge_lora
    >>> cfg = LlmConfig("llama", vocab_size=32, hidden_size=16, intermediate_size=32,
    ...                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=4)
    >>> lora_target_modules(cfg)
    ['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']
    >>> lora = apply_lora(CausalLM(cfg, rngs=nn.Rngs(0)), rank=2, alpha=4.0, target_modules=["q_proj"])
    >>> slot = lora.model.layers[0].attn.q.lora
    >>> slot["lora_a"].value.shape, slot["lora_b"].value.shape  # A [in, r], B [r, heads * head_dim]
    ((16, 2), (2, 16))
    >>> slot["lora_b"].value = jnp.ones((2, 16))                # as if trained
    >>> ids = jnp.array([[1, 2, 3]])
    >>> bool(np.allclose(merge_lora(lora)(ids), lora(ids), atol=1e-5))
    True
    """
    base = _base(model)
    if adapters is None:
        if not isinstance(model, quant.QuantizedModel):
            raise ValueError("merge_lora: pass adapters=, or the model apply_lora returned")
        adapters = lora_adapters(model)
    state = nn.state(base)
    assert isinstance(state, nn.State)
    values = {}
    for p, var in state.flat_state().items():
        if "lora" in p:
            continue
        path = "/".join(map(str, p))
        w = var[...]
        if isinstance(w, QArray):  # a QLoRA base: merged in float, the model's dtype
            w = jnp.asarray(w.dequantize(), base.dtype)
        if path in adapters.weights:
            w = _merged(w, *adapters.weights[path], adapters.scale, path)
        values[p] = w
    unknown = sorted(set(adapters.weights) - {"/".join(map(str, p)) for p in values})
    if unknown:
        raise ValueError(f"merge_lora: the model has no weights at {unknown}")
    merged = nn.abstract_model(lambda: CausalLM(base.config, dtype=base.dtype, rngs=nn.Rngs(0)))
    nn.update(merged, nn.State.from_flat(values))
    return merged


def _peft_config(adapters: LoraAdapters, cfg: LlmConfig, base_model_name_or_path: str | None) -> dict[str, Any]:
    table = _projections(cfg)
    names = sorted(n for n, paths in table.items() if any(p in adapters.weights for p in paths))
    layers = sorted({int(p.split("/")[1]) for p in adapters.weights})
    complete = all(p in adapters.weights for n in names for p in table[n])
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapters.rank, "lora_alpha": adapters.alpha,
        "target_modules": names, "base_model_name_or_path": base_model_name_or_path or adapters.base_model_name_or_path,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None if complete else layers, "rank_pattern": {},
        "alpha_pattern": {}, "init_lora_weights": True, "inference_mode": True,
    }


def save_lora(model: Any, path: str | os.PathLike, adapters: LoraAdapters | None = None, *,
              base_model_name_or_path: str | None = None) -> list[str]:
    """Write adapters in PEFT's layout: ``path/adapter_config.json`` and
    ``path/adapter_model.safetensors`` (float32 unless the adapters are another float dtype),
    which ``peft.PeftModel.from_pretrained`` loads onto the transformers model.

    ``model``: what :func:`apply_lora` returned (its adapters are saved) or the base model
    with ``adapters``. Adapters that cover only some layers write ``layers_to_transform``.
    Returns the file names written.

    Args:
      model: what :func:`apply_lora` returned, or the base model (then pass ``adapters``).
      path: the folder to write (created if missing).
      adapters: the adapters to save; None takes those of ``model``.
      base_model_name_or_path: written to ``adapter_config.json``; None keeps the adapters' own.

    Raises:
      ValueError: adapters on weights that are not projections of the model.
    """
    base = _base(model)
    if adapters is None:
        adapters = lora_adapters(model)
    hf_names = {p: hf for paths in _projections(base.config).values() for p, hf in paths.items()}
    unknown = sorted(set(adapters.weights) - set(hf_names))
    if unknown:
        raise ValueError(f"save_lora: {unknown} are not projections of this model; adapters sit on {sorted(hf_names)[:4]}...")
    tensors = {}
    for p, (a, b) in sorted(adapters.weights.items()):
        tensors[f"{_PREFIX}{hf_names[p]}.lora_A.weight"] = np.ascontiguousarray(np.asarray(jax.device_get(a)).T)
        tensors[f"{_PREFIX}{hf_names[p]}.lora_B.weight"] = np.ascontiguousarray(np.asarray(jax.device_get(b)).T)
    folder = pathlib.Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = _peft_config(adapters, base.config, base_model_name_or_path)
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return [CONFIG_FILE, WEIGHTS_FILE]


# PEFT options that change the computation beyond W + alpha / r * B A; refused, not ignored
_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "lora_bias": False,
                "bias": "none", "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
                "layer_replication": None, "target_parameters": None, "trainable_token_indices": None,
                "use_qalora": False, "alora_invocation_tokens": None}


def _read_peft_config(folder: pathlib.Path) -> dict[str, Any]:
    file = folder / CONFIG_FILE
    if not file.exists():
        raise FileNotFoundError(f"{file}: no {CONFIG_FILE} (a PEFT adapter folder has one)")
    try:
        config = json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file}: not valid JSON: {e}") from e
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{file}: peft_type {config.get('peft_type')!r} is not supported; only 'LORA'")
    for key, neutral in _UNSUPPORTED.items():
        value = config.get(key, neutral)
        if value != neutral and not (neutral is None and value in ([], {})) and not (neutral == {} and value is None):
            raise CheckpointError(f"{file}: {key}={value!r} is not supported (only {neutral!r}): cairn.llm applies "
                                  "plain LoRA, W + lora_alpha / r * B A")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or isinstance(config.get(key), bool) or config[key] <= 0:
            raise CheckpointError(f"{file}: {key} must be a positive number, got {config.get(key)!r}")
    return config


def load_lora(path: str | os.PathLike, model: Any) -> LoraAdapters:
    """Read a PEFT LoRA adapter folder (``adapter_config.json``, ``adapter_model.safetensors``)
    for ``model`` (a :class:`CausalLM` or ``model.config``'s owner); pass the result to
    :func:`apply_lora` or :func:`merge_lora`.

    Args:
      path: the PEFT adapter folder.
      model: the model the adapters are for (its ``config`` gives the shapes).

    Raises:
      FileNotFoundError: no config or weights file (``adapter_model.bin`` is not read).
      CheckpointError: an option that changes the computation (DoRA, rsLoRA, rank or alpha
        patterns, biases, modules_to_save, ...), tensors that are no projection of the model
        or lack their A/B partner (listed by name), ``target_modules`` naming a module the
        model lacks or one with no tensor in the file, or shapes that do not fit (tensor,
        both shapes).
    """
    folder = pathlib.Path(path)
    config = _read_peft_config(folder)
    cfg: LlmConfig = model.config
    rank = config["r"]
    weights_file = folder / WEIGHTS_FILE
    if not weights_file.exists():
        raise FileNotFoundError(f"{weights_file}: no {WEIGHTS_FILE}" +
                                (" (adapter_model.bin, a pickle, is not read)" if (folder / "adapter_model.bin").exists() else ""))
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{weights_file}: cannot be read as safetensors: {e}") from e
    by_hf = {hf: p for paths in _projections(cfg).values() for p, hf in paths.items()}
    sizes = _out_in(cfg)
    hf_of = {p: hf for hf, p in by_hf.items()}
    pattern = re.compile(re.escape(_PREFIX) + r"(.+)\.lora_([AB])(?:\.default)?\.weight")
    found: dict[str, dict[str, np.ndarray]] = {}
    unexpected = []
    for name, value in tensors.items():
        m = pattern.fullmatch(name)
        if m is None or m.group(1) not in by_hf:
            unexpected.append(name)
        else:
            found.setdefault(by_hf[m.group(1)], {})[m.group(2)] = value
    problems = [f"{len(unexpected)} tensor(s) that are no LoRA A/B of a projection of this {cfg.model_type!r} "
                f"model: {sorted(unexpected)}"] if unexpected else []
    problems += _check_targets(config.get("target_modules"), cfg, {hf_of[p].split(".")[-1] for p in found})
    weights = {}
    for p, pair in sorted(found.items()):
        problems += _check_pair(f"{_PREFIX}{hf_of[p]} ({p})", pair, rank, sizes[p])
        if not problems:
            weights[p] = (pair["A"].T.copy(), pair["B"].T.copy())
    if problems or not weights:
        raise CheckpointError(f"{folder}: the adapters (r={rank}) do not fit the {cfg.model_type!r} model:\n  "
                              + "\n  ".join(problems or ["no adapters"]))
    return LoraAdapters(rank, float(config["lora_alpha"]), weights, config.get("base_model_name_or_path"))


def _check_targets(targets: Any, cfg: LlmConfig, present: set[str]) -> list[str]:
    """What is wrong with ``target_modules`` (a list of module names; a regex string or
    ``"all-linear"`` is peft's to expand and is not checked): names that are no projection
    of the model, and names with no tensor in the file."""
    if not isinstance(targets, (list, tuple)):
        return []
    table = _projections(cfg)
    unknown = [t for t in targets if t not in table]
    absent = [t for t in targets if t in table and t not in present]
    out = [f"target module {t!r} is not a module of this {cfg.model_type!r} model (its LoRA targets: {sorted(table)})"
           for t in unknown]
    return out + [f"target module {t!r} is in target_modules but the file has no lora_A/lora_B tensor for it"
                  for t in absent]


def _check_pair(name: str, pair: dict[str, np.ndarray], rank: int, out_in: tuple[int, int]) -> list[str]:
    if set(pair) != {"A", "B"}:
        return [f"{name}: lora_{'A' if 'A' not in pair else 'B'}.weight is missing (each adapted module has both)"]
    n_out, n_in = out_in
    a, b = pair["A"], pair["B"]
    if tuple(a.shape) == (rank, n_in) and tuple(b.shape) == (n_out, rank):
        return []
    return [f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, expected [r, in] = ({rank}, {n_in}) / "
            f"[out, r] = ({n_out}, {rank})"]
