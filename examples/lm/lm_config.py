"""Configuration of the reference LM recipe: one TOML file, overridable from the command line.

Every key is declared in a dataclass below; an unknown key, a value of the wrong type, an
impossible mesh, a batch the data axis cannot divide or a data path that does not exist
stops the run *before* training with a `ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import glob
import pathlib
import tomllib
import typing
import warnings
from typing import Any


class ConfigError(ValueError):
    """A configuration problem, naming the offending key."""


class ConfigWarning(UserWarning):
    """A config value adjusted to fit the others (the message names the key and both values)."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/lm"
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "synthetic"  # "synthetic", "parquet" or "arrayrecord"
    paths: tuple[str, ...] = ()  # user files or globs, for source = "parquet" / "arrayrecord"
    text_column: str = "text"  # Parquet column with the text of each example
    eval_paths: tuple[str, ...] = ()  # held-out user files (optional)
    train_format: str = "arrayrecord"  # which of the synthetic shards to train from
    num_train: int = 50_000
    num_eval: int = 500
    # of the synthetic training problems, the share written as worksheets (the instruction,
    # "What is a+b?", the answer on its own line: lm_task.worksheet) rather than "a+b=answer"
    worksheet_share: float = 0.0
    max_digits: int = 3
    num_shards: int = 4
    seq_len: int = 64
    batch_size: int = 32
    num_workers: int = 2
    shuffle_seed: int = 0


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    # "bpe": a byte-level BPE the job trains on its corpus with the `tokenizers` library
    # (lm_tokenizer); "byte": the earlier byte tokenizer (no chat markers: no post-training)
    kind: str = "bpe"
    vocab_size: int = 384  # the BPE's most tokens; the model's embedding has this many rows


@dataclasses.dataclass(frozen=True)
class PosttrainConfig:
    """SFT with LoRA on chat-formatted problems, then GRPO with the exact-answer reward
    (lm_posttrain), each starting from the Hugging Face checkpoint the stage before saved."""

    enabled: bool = True
    num_train: int = 4000  # chat examples (training split) for SFT and GRPO's prompts
    num_eval: int = 500  # held-out problems scored by generation after each stage
    hf_shard_size: str = "512KB"  # save_pretrained's max_shard_size: the hand-over is sharded
    lora_rank: int = 16
    lora_alpha: float = 32.0
    sft_steps: int = 200
    sft_batch_size: int = 32
    sft_learning_rate: float = 6e-3
    grpo_steps: int = 20
    grpo_prompts: int = 16  # prompts per batch of rollouts
    grpo_generations: int = 8  # completions per prompt (the group)
    grpo_temperature: float = 1.0
    grpo_learning_rate: float = 5e-4
    grpo_beta: float = 0.04
    save_every: int = 10  # post-training checkpoint interval (a SIGTERM waits at most this many steps)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    mlp_dim: int = 384
    tie_embeddings: bool = True
    rope_base: float = 10_000.0
    dtype: str = "float32"
    param_dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 3e-3
    warmup_steps: int = 80
    end_lr_ratio: float = 0.05
    weight_decay: float = 0.05
    b1: float = 0.9
    b2: float = 0.98
    clip_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 800
    log_every: int = 50
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 200
    max_to_keep: int = 2
    enable_async: bool = True


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = -1  # -1: every device not used by the other axes
    model: int = 1
    rules: tuple[tuple[str, Any], ...] = (
        ("batch", "data"),
        ("vocab", "model"),
        ("heads", "model"),
        ("kv_heads", "model"),
        ("mlp", "model"),
        ("embed", None),
    )


@dataclasses.dataclass(frozen=True)
class KernelsConfig:
    # "auto": time cairn.kernels against plain XLA on the recipe's shapes at start-up and use
    # the faster; "kernels" / "xla" force one. The report says which ran and the timings.
    attention: str = "auto"
    loss: str = "auto"


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    enabled: bool = True
    # the quantized variants evaluated after training: "w8" (int8 weight-only, per channel),
    # "w4_gptq" (int4 GPTQ, per tile), "w4_awq" (int4 AWQ, per tile)
    methods: tuple[str, ...] = ("w8", "w4_gptq")
    tile_size: int = 64
    calibration_batches: int = 4


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    enabled: bool = True
    models: tuple[str, ...] = ("w4_gptq",)  # which variants ("float" or a quant.methods entry) are exported and served
    num_slots: int = 16  # KV-cache slots of the continuous batcher
    prefill_batch: int = 4
    concurrency: tuple[int, ...] = (1, 16)
    max_new_tokens: int = 6
    startup_timeout: float = 180.0
    kv_layout: str = "paged"  # "paged": a pool of KV blocks with prefix caching (the system prompt is shared); "contiguous"
    block_size: int = 8  # tokens per KV block (paged)
    openai_streamed: int = 100  # of the held-out problems asked through the openai client, how many also streamed


@dataclasses.dataclass(frozen=True)
class Config:
    run: RunConfig = RunConfig()
    data: DataConfig = DataConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshConfig = MeshConfig()
    kernels: KernelsConfig = KernelsConfig()
    posttrain: PosttrainConfig = PosttrainConfig()
    quant: QuantConfig = QuantConfig()
    serve: ServeConfig = ServeConfig()


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key {key!r}: expected true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key {key!r}: expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key {key!r}: expected a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key {key!r}: expected a string, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key {key!r}: expected a list, got {value!r}")
        args = typing.get_args(annotation)
        if args and args[-1] is Ellipsis and args[0] is int:
            bad = [v for v in value if isinstance(v, bool) or not isinstance(v, int)]
            if bad:
                raise ConfigError(f"config key {key!r}: expected a list of integers, got {bad!r}")
            return tuple(value)
        if args and args[-1] is Ellipsis and args[0] is str:
            bad = [v for v in value if not isinstance(v, str)]
            if bad:
                raise ConfigError(f"config key {key!r}: expected a list of strings, got {bad!r}")
            return tuple(value)
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    return value


def _build(cls: type, table: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - names)
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix + unknown[0]!r}" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
            + f"; known keys under {prefix.rstrip('.') or 'the top level'}: {', '.join(sorted(names))}"
        )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in table:
            continue
        value = table[f.name]
        key = prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {key!r}: expected a table, got {value!r}")
            kwargs[f.name] = _build(hints[f.name], value, key + ".")
        else:
            kwargs[f.name] = _coerce(key, value, hints[f.name])
    return cls(**kwargs)


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # bare words are strings: --set data.source=parquet


def apply_overrides(table: dict, overrides: list[str]) -> dict:
    """Apply ``key.sub=value`` overrides (TOML values; bare words are strings)."""
    table = {k: (dict(v) if isinstance(v, dict) else v) for k, v in table.items()}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        node = table
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r}: {p!r} is not a table")
        node[parts[-1]] = _parse_value(text.strip())
    return table


def load_config(path: str | pathlib.Path | None = None, overrides: list[str] = ()) -> Config:
    """Read the TOML file (or the defaults), apply overrides, check every key and value."""
    table: dict = {}
    if path is not None:
        p = pathlib.Path(path)
        if not p.exists():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            table = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    table = apply_overrides(table, list(overrides))
    cfg = _fit_warmup(_build(Config, table, ""), overrides)
    validate_static(cfg)
    return cfg


def _fit_warmup(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """A warm-up from the config file that leaves no room for the decay (``optim.warmup_steps
    >= train.steps``, as after ``--set train.steps=60`` with the file's 80) becomes a tenth of
    the run, the file's own proportion (80 of 800), with a `ConfigWarning` saying so; one
    set explicitly on the command line is left for `validate_static` to refuse."""
    warmup, steps = cfg.optim.warmup_steps, cfg.train.steps
    explicit = any(o.split("=", 1)[0].strip() == "optim.warmup_steps" for o in overrides)
    if explicit or steps <= 0 or warmup < steps:
        return cfg
    fitted = steps // 10
    warnings.warn(f"config key 'optim.warmup_steps': {warmup} does not fit in train.steps = {steps} "
                  f"(the warm-up must end before the last step); using {fitted}, a tenth of the run; "
                  f"set optim.warmup_steps below {steps} to choose another", ConfigWarning, stacklevel=3)
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, warmup_steps=fitted))


def validate_static(cfg: Config) -> None:
    """Checks that need no devices: values in range, sources that exist."""
    d, m = cfg.data, cfg.model
    if d.source not in ("synthetic", "parquet", "arrayrecord"):
        raise ConfigError(f"config key 'data.source': expected 'synthetic', 'parquet' or 'arrayrecord', got {d.source!r}")
    if d.train_format not in ("parquet", "arrayrecord"):
        raise ConfigError(f"config key 'data.train_format': expected 'parquet' or 'arrayrecord', got {d.train_format!r}")
    if d.source != "synthetic":
        if not d.paths:
            raise ConfigError(f"config key 'data.paths': data.source = {d.source!r} needs at least one file or glob")
        for pattern in d.paths + d.eval_paths:
            if not glob.glob(pattern):
                key = "data.paths" if pattern in d.paths else "data.eval_paths"
                raise ConfigError(f"config key {key!r}: {pattern!r} does not exist (no file matches)")
    positive = {
        "data.seq_len": d.seq_len, "data.batch_size": d.batch_size, "data.num_train": d.num_train,
        "data.num_eval": d.num_eval, "data.max_digits": d.max_digits, "data.num_shards": d.num_shards,
        "model.d_model": m.d_model, "model.num_layers": m.num_layers, "model.num_heads": m.num_heads,
        "model.num_kv_heads": m.num_kv_heads, "model.mlp_dim": m.mlp_dim, "train.steps": cfg.train.steps,
        "train.log_every": cfg.train.log_every, "checkpoint.every": cfg.checkpoint.every,
        "checkpoint.max_to_keep": cfg.checkpoint.max_to_keep,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"config key {key!r}: must be positive, got {value}")
    if not 0.0 <= d.worksheet_share <= 1.0:
        raise ConfigError(f"config key 'data.worksheet_share': must be within [0, 1], got {d.worksheet_share}")
    if d.num_workers < 0:
        raise ConfigError(f"config key 'data.num_workers': must be >= 0, got {d.num_workers}")
    if m.d_model % m.num_heads:
        raise ConfigError(f"config key 'model.num_heads': {m.num_heads} does not divide model.d_model = {m.d_model}")
    if (m.d_model // m.num_heads) % 2:
        raise ConfigError("config key 'model.d_model': the head size d_model / num_heads must be even for rotary embeddings")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(f"config key 'model.num_kv_heads': {m.num_kv_heads} does not divide model.num_heads = {m.num_heads}")
    if d.source == "synthetic" and 3 * d.max_digits + 5 > d.seq_len:
        raise ConfigError(f"config key 'data.seq_len': {d.seq_len} cannot hold one {d.max_digits}-digit problem")
    if not 0 <= cfg.optim.warmup_steps < cfg.train.steps:
        raise ConfigError(
            f"config key 'optim.warmup_steps': {cfg.optim.warmup_steps} must be within [0, train.steps = "
            f"{cfg.train.steps}), so that the learning rate decays after the warm-up; e.g. "
            f"optim.warmup_steps={cfg.train.steps // 10}"
        )
    if cfg.optim.learning_rate <= 0:
        raise ConfigError(f"config key 'optim.learning_rate': must be positive, got {cfg.optim.learning_rate}")
    for dtype_key in ("dtype", "param_dtype"):
        if getattr(m, dtype_key) not in ("float32", "bfloat16"):
            raise ConfigError(f"config key 'model.{dtype_key}': expected 'float32' or 'bfloat16'")
    if m.param_dtype != m.dtype:  # a cairn.llm CausalLM has one dtype for its weights and its computation
        raise ConfigError(f"config key 'model.param_dtype': {m.param_dtype!r} differs from model.dtype = {m.dtype!r}; "
                          "the model (a cairn.llm CausalLM) keeps its parameters in its computation dtype")
    _validate_after_training(cfg)
    for i, rule in enumerate(cfg.mesh.rules):
        if len(rule) != 2 or not isinstance(rule[0], str) or not (rule[1] is None or rule[1] in ("data", "model")):
            raise ConfigError(f"config key 'mesh.rules' entry {i}: {list(rule)!r} must be [logical_axis, 'data' | 'model' | null]")


BYTE_VOCAB_SIZE = 320  # lm_task.VOCAB_SIZE: 256 bytes + 3 special tokens, padded


def vocab_size(cfg: Config) -> int:
    """The model's vocabulary: the BPE's ``tokenizer.vocab_size`` rounded up to a multiple of
    64, or the byte tokenizer's 320."""
    if cfg.tokenizer.kind == "byte":
        return BYTE_VOCAB_SIZE
    return -(-cfg.tokenizer.vocab_size // 64) * 64


def _validate_posttrain(cfg: Config) -> None:
    t, p = cfg.tokenizer, cfg.posttrain
    if t.kind not in ("bpe", "byte"):
        raise ConfigError(f"config key 'tokenizer.kind': expected 'bpe' or 'byte', got {t.kind!r}")
    if t.kind == "bpe" and t.vocab_size < 264:
        raise ConfigError(f"config key 'tokenizer.vocab_size': {t.vocab_size} cannot hold the 256 bytes and the "
                          "8 special tokens of the byte-level BPE: use at least 264")
    if p.enabled and t.kind != "bpe":
        raise ConfigError("config key 'posttrain.enabled': post-training formats chats with the BPE tokenizer's "
                          "chat markers; set tokenizer.kind = \"bpe\" or posttrain.enabled = false")
    for key in ("num_train", "num_eval", "lora_rank", "sft_steps", "sft_batch_size", "grpo_steps", "grpo_prompts",
                "save_every"):
        if getattr(p, key) <= 0:
            raise ConfigError(f"config key 'posttrain.{key}': must be positive, got {getattr(p, key)}")
    if p.grpo_generations < 2:
        raise ConfigError(f"config key 'posttrain.grpo_generations': a group needs at least 2, got {p.grpo_generations}")
    for key in ("lora_alpha", "sft_learning_rate", "grpo_learning_rate", "grpo_temperature"):
        if not getattr(p, key) > 0:
            raise ConfigError(f"config key 'posttrain.{key}': must be positive, got {getattr(p, key)}")
    if p.grpo_beta < 0:
        raise ConfigError(f"config key 'posttrain.grpo_beta': must be >= 0, got {p.grpo_beta}")


def _validate_after_training(cfg: Config) -> None:
    """The tokenizer, kernels, posttrain, quant and serve sections."""
    _validate_posttrain(cfg)
    for key in ("attention", "loss"):
        if getattr(cfg.kernels, key) not in ("auto", "kernels", "xla"):
            raise ConfigError(f"config key 'kernels.{key}': expected 'auto', 'kernels' or 'xla', got {getattr(cfg.kernels, key)!r}")
    known = ("w8", "w4_gptq", "w4_awq")
    for method in cfg.quant.methods:
        if method not in known:
            raise ConfigError(f"config key 'quant.methods': unknown method {method!r}; expected some of {', '.join(known)}")
    if len(set(cfg.quant.methods)) != len(cfg.quant.methods):
        raise ConfigError(f"config key 'quant.methods': {list(cfg.quant.methods)} names a method twice")
    for key, value in (("quant.tile_size", cfg.quant.tile_size), ("quant.calibration_batches", cfg.quant.calibration_batches),
                       ("serve.num_slots", cfg.serve.num_slots), ("serve.prefill_batch", cfg.serve.prefill_batch),
                       ("serve.max_new_tokens", cfg.serve.max_new_tokens)):
        if value <= 0:
            raise ConfigError(f"config key {key!r}: must be positive, got {value}")
    variants = ("float",) + (cfg.quant.methods if cfg.quant.enabled else ())
    if cfg.serve.enabled:  # the served models must be among the variants built after training
        for name in cfg.serve.models:
            if name not in variants:
                raise ConfigError(f"config key 'serve.models': {name!r} is not one of the evaluated variants "
                                  f"{', '.join(variants)} (quant.enabled = {str(cfg.quant.enabled).lower()})")
        if not cfg.serve.models:
            raise ConfigError("config key 'serve.models': serve.enabled needs at least one variant to serve")
    if cfg.serve.kv_layout not in ("paged", "contiguous"):
        raise ConfigError(f"config key 'serve.kv_layout': expected 'paged' or 'contiguous', got {cfg.serve.kv_layout!r}")
    if cfg.serve.block_size <= 0 or cfg.data.seq_len % cfg.serve.block_size:
        raise ConfigError(f"config key 'serve.block_size': must be positive and divide data.seq_len = "
                          f"{cfg.data.seq_len}, got {cfg.serve.block_size}")
    if cfg.serve.openai_streamed < 0:
        raise ConfigError(f"config key 'serve.openai_streamed': must be >= 0, got {cfg.serve.openai_streamed}")
    if not cfg.serve.concurrency or any(c <= 0 for c in cfg.serve.concurrency):
        raise ConfigError(f"config key 'serve.concurrency': needs positive levels, got {list(cfg.serve.concurrency)}")
    if cfg.serve.startup_timeout <= 0:
        raise ConfigError(f"config key 'serve.startup_timeout': must be positive, got {cfg.serve.startup_timeout}")


def mesh_shape(cfg: Config, device_count: int) -> tuple[int, int]:
    """The (data, model) mesh shape for ``device_count`` devices, or a ConfigError."""
    model = cfg.mesh.model
    if model <= 0:
        raise ConfigError(f"config key 'mesh.model': must be positive, got {model}")
    data = cfg.mesh.data
    if data == -1:
        if device_count % model:
            raise ConfigError(f"config key 'mesh.model': {model} does not divide the {device_count} available devices")
        data = device_count // model
    if data <= 0 or data * model != device_count:
        raise ConfigError(
            f"config key 'mesh.data': a mesh of data={data} x model={model} = {data * model} devices "
            f"is impossible with {device_count} devices"
        )
    if cfg.data.batch_size % data:
        raise ConfigError(
            f"config key 'data.batch_size': {cfg.data.batch_size} is not divisible by the data axis of size {data}"
        )
    m = cfg.model
    for key, size in (("model.num_heads", m.num_heads), ("model.num_kv_heads", m.num_kv_heads), ("model.mlp_dim", m.mlp_dim)):
        if size % model:
            raise ConfigError(f"config key {key!r}: {size} is not divisible by the model axis of size {model}")
    return data, model


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def flops_per_token(cfg: Config, vocab_size: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), matmuls and attention."""
    m, s = cfg.model, cfg.data.seq_len
    hd = m.d_model // m.num_heads
    attn_proj = 2 * m.d_model * (m.num_heads * hd) * 2 + 2 * m.d_model * (m.num_kv_heads * hd) * 2
    attn_scores = 2 * 2 * s * m.num_heads * hd  # QK^T and AV, per query token
    mlp = 3 * 2 * m.d_model * m.mlp_dim
    head = 2 * m.d_model * vocab_size
    return 3.0 * (m.num_layers * (attn_proj + attn_scores + mlp) + head)


__all__ = ["Config", "ConfigError", "ConfigWarning", "load_config", "mesh_shape", "apply_overrides", "to_dict", "flops_per_token"]
