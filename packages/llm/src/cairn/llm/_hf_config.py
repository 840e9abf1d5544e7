"""``config.json`` <-> ``LlmConfig``, read through the family tables.

Both spellings of the rotary parameters are read: transformers 5's ``rope_parameters``
(one dict, or one per layer type as Gemma 3 writes it) and transformers 4's
``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``. Saving writes back the
spelling the file came with.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from cairn.llm._config import FULL, SLIDING, LlmConfig
from cairn.llm._families import Family, family_of
from cairn.llm._rope import check_rope

__all__ = ["config_from_hf", "config_to_hf"]


def _default_layer_types(family: Family, d: Mapping[str, Any], n: int, window: int | None) -> list[str]:
    """Layer types when the file lists none; ``window`` is the sliding window after defaults."""
    if family.layers == "mistral":
        return [SLIDING if window else FULL] * n
    if family.layers == "qwen2":
        first = d.get("max_window_layers", 28)
        return [SLIDING if d.get("use_sliding_window") and i >= first else FULL for i in range(n)]
    if family.layers == "every_layer":  # Qwen3-MoE: the window applies only with use_sliding_window
        return [SLIDING if d.get("use_sliding_window") and window else FULL] * n
    if family.layers == "alternate":
        return [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    if family.layers == "every_nth":
        every = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
        return [SLIDING if (i + 1) % every else FULL for i in range(n)]
    return [FULL] * n


def _normal_rope(params: Mapping[str, Any] | None, theta: float) -> dict[str, Any]:
    p = dict(params or {})
    if "type" in p and "rope_type" not in p:
        p["rope_type"] = p.pop("type")
    p.setdefault("rope_type", "default")
    p.setdefault("rope_theta", theta)
    p["rope_theta"] = float(p["rope_theta"])
    check_rope(p)
    return p


def _read_rope(d: Mapping[str, Any], family: Family) -> tuple[dict, dict | None]:
    """``(full-layer rope, sliding-layer rope or None)`` from either spelling."""
    rp = d.get("rope_parameters")
    if rp is None:
        scaling = {k: v for k, v in (d.get("rope_scaling") or {}).items()}
        glob = _normal_rope(scaling, d.get("rope_theta", family.rope_theta))
        local_theta = d.get("rope_local_base_freq")
        return glob, None if local_theta is None else _normal_rope(None, local_theta)
    if FULL in rp or SLIDING in rp:
        glob = _normal_rope(rp.get(FULL), family.rope_theta)
        return glob, None if rp.get(SLIDING) is None else _normal_rope(rp[SLIDING], 10000.0)
    return _normal_rope(rp, family.rope_theta), None


def _key(d: Mapping[str, Any], key: str) -> str:
    """The ``config.json`` key of a table entry: of alternatives ``"a|b"``, the first one
    present in ``d`` (the first one when none is)."""
    names = key.split("|")
    return next((n for n in names if n in d), names[0])


def config_from_hf(d: Mapping[str, Any]) -> LlmConfig:
    """The ``LlmConfig`` of a Hugging Face ``config.json`` (already parsed to a dict).

    Args:
      d: the parsed ``config.json``.

    Raises:
      UnsupportedModelError: an unknown ``model_type`` (the message lists the supported
        ones) or an unsupported rope type.
      ValueError: a required key is missing, or values do not fit together.
    """
    family = family_of(d.get("model_type"))
    kw: dict[str, Any] = dict(family.fixed)
    for field, (keys, default) in family.keys.items():
        key = _key(d, keys)
        value = d.get(key, default)
        if value is None and default is None and field in ("vocab_size", "hidden_size", "intermediate_size",
                                                            "num_hidden_layers", "num_attention_heads"):
            raise ValueError(f"config.json of model_type {d.get('model_type')!r} has no {key!r}")
        kw[field] = value
    heads = kw["num_attention_heads"]
    kw["num_key_value_heads"] = d.get("num_key_value_heads") or heads
    kw["head_dim"] = d.get("head_dim") or kw["hidden_size"] // heads
    kw["layer_types"] = tuple(d.get("layer_types") or _default_layer_types(family, d, kw["num_hidden_layers"], kw.get("sliding_window")))
    kw.setdefault("sliding_window", None)
    glob, local = _read_rope(d, family)
    kw["rope"], kw["local_rope"] = glob, local
    kw["dtype"] = str(d.get("dtype") or d.get("torch_dtype") or "float32")
    kw["model_type"] = d["model_type"]
    kw["hf"] = json.dumps(dict(d), sort_keys=True)
    return LlmConfig(**kw)


def _write_rope(out: dict[str, Any], cfg: LlmConfig) -> None:
    glob = dict(cfg.rope)
    local = None if cfg.local_rope is None else dict(cfg.local_rope)
    if "rope_parameters" not in out and ("rope_theta" in out or "rope_scaling" in out):
        out["rope_theta"] = glob["rope_theta"]
        scaling = {k: v for k, v in glob.items() if k != "rope_theta"}
        out["rope_scaling"] = None if scaling == {"rope_type": "default"} else scaling
        if local is not None:
            out["rope_local_base_freq"] = local["rope_theta"]
        return
    out["rope_parameters"] = glob if local is None else {FULL: glob, SLIDING: local}


def config_to_hf(cfg: LlmConfig) -> dict[str, Any]:
    """The ``config.json`` dict of ``cfg``: the file it was read from with every modelled
    key written from ``cfg``; a config built by hand gets the family's architecture name.

    Args:
      cfg: the config to write.

    Raises:
      ValueError: ``cfg`` has a combination its family cannot express (the fields named).
    """
    family = family_of(cfg.model_type)
    out: dict[str, Any] = json.loads(cfg.hf) if cfg.hf else {"architectures": [family.architecture]}
    raw_layer_types = "layer_types" in out
    out["model_type"] = cfg.model_type
    for field, (keys, _) in family.keys.items():
        value = getattr(cfg, field)
        out[_key(out, keys)] = list(value) if isinstance(value, tuple) else value
    out["num_key_value_heads"] = cfg.num_key_value_heads
    if "head_dim" in out or cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:
        out["head_dim"] = cfg.head_dim
    _write_rope(out, cfg)
    if raw_layer_types or list(cfg.layer_types) != _default_layer_types(family, out, cfg.num_hidden_layers, cfg.sliding_window):
        out["layer_types"] = list(cfg.layer_types)
    out["torch_dtype" if "torch_dtype" in out else "dtype"] = cfg.dtype
    back = config_from_hf(out)
    diff = [f.name for f in dataclasses.fields(LlmConfig) if f.compare and getattr(back, f.name) != getattr(cfg, f.name)]
    if diff:
        raise ValueError(
            f"config_to_hf: model_type {cfg.model_type!r} cannot express "
            + ", ".join(f"{n}={getattr(cfg, n)!r}" for n in diff)
            + " (the family fixes or shares these fields; config_from_hf fills a family's fixed fields)"
        )
    return out
