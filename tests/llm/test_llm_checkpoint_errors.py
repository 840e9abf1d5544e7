"""Bad checkpoints get clear errors, raised before any tensor is read (nothing half-loaded)."""

from __future__ import annotations

import json
import shutil

import ml_dtypes  # noqa: F401  (bfloat16 for safetensors' NumPy reader)
import numpy as np
import pytest
from llm_testlib import FIXTURES
from safetensors import safe_open
from safetensors.numpy import save_file

from cairn import llm
from cairn.llm import _hf_files


def _copy(variant, tmp_path):
    d = tmp_path / variant
    shutil.copytree(FIXTURES / variant, d)
    return d


def _as_single_file(d, edit):
    """Rewrites ``d``'s shards as one ``model.safetensors`` with ``edit(tensors)`` applied."""
    tensors = {}
    for f in sorted(d.glob("model-*.safetensors")):
        with safe_open(str(f), framework="np") as st:
            tensors.update({k: st.get_tensor(k) for k in st.keys()})
        f.unlink()
    (d / "model.safetensors.index.json").unlink()
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture
def tensor_reads(monkeypatch):
    """The names of every tensor the loader starts reading (a test asserts it stays empty)."""
    reads = []
    original = _hf_files.ShardedReader.read

    def read(self, names):
        reads.extend(names)
        return original(self, names)

    monkeypatch.setattr(_hf_files.ShardedReader, "read", read)
    return reads


def test_unknown_model_type_lists_the_supported_ones(tmp_path, tensor_reads):
    d = _copy("llama", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    with pytest.raises(llm.UnsupportedModelError) as e:
        llm.from_pretrained(d)
    assert "'gpt_neox' is not supported" in str(e.value)
    for name in ("gemma2", "gemma3_text", "llama", "mistral", "qwen2", "qwen3"):
        assert repr(name) in str(e.value)
    assert tensor_reads == []


def test_unknown_rope_type_lists_the_supported_ones(tmp_path, tensor_reads):
    d = _copy("llama", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(llm.UnsupportedModelError, match=r"rope_type 'longrope' is not supported; supported: \['default', 'linear', 'dynamic', 'llama3', 'yarn'\]"):
        llm.from_pretrained(d)
    assert tensor_reads == []


def test_missing_and_unexpected_tensors_are_listed_by_name(tmp_path, tensor_reads):
    d = _copy("qwen2", tmp_path)

    def edit(t):
        del t["model.layers.1.self_attn.k_proj.bias"], t["model.norm.weight"]
        t["model.layers.0.self_attn.extra.weight"] = np.zeros(3, np.float32)

    _as_single_file(d, edit)
    with pytest.raises(llm.CheckpointError) as e:
        llm.from_pretrained(d)
    msg = str(e.value)
    assert "2 missing tensor(s): model.norm.weight, model.layers.1.self_attn.k_proj.bias" in msg
    assert "1 unexpected tensor(s): model.layers.0.self_attn.extra.weight" in msg
    assert tensor_reads == []


def test_a_tied_model_with_an_lm_head_tensor_is_refused(tmp_path, tensor_reads):
    d = _copy("qwen2", tmp_path)  # tie_word_embeddings: true
    _as_single_file(d, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"]))
    with pytest.raises(llm.CheckpointError, match=r"1 unexpected tensor\(s\): lm_head.weight"):
        llm.from_pretrained(d)
    assert tensor_reads == []


def test_old_rotary_buffers_are_ignored(tmp_path):
    d = _copy("llama", tmp_path)
    _as_single_file(d, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", np.ones(4, np.float32)))
    assert llm.from_pretrained(d).config.model_type == "llama"


def test_shape_mismatch_names_tensor_shapes_and_config_field(tmp_path, tensor_reads):
    d = _copy("qwen3", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 40}))
    with pytest.raises(llm.CheckpointError) as e:
        llm.from_pretrained(d)
    msg = str(e.value)
    assert ("tensor model.layers.0.mlp.gate_proj.weight (model-00001-of-00004.safetensors) has shape (48, 32) "
            "but the config expects (40, 32) from intermediate_size=40, hidden_size=32") in msg
    assert msg.count("has shape") == 9  # gate, up, down of each of the 3 layers
    assert tensor_reads == []


def test_integer_weights_are_refused_not_cast(tmp_path, tensor_reads):
    d = _copy("llama", tmp_path)
    _as_single_file(d, lambda t: t.__setitem__("model.norm.weight", np.ones(32, np.int8)))
    with pytest.raises(llm.CheckpointError, match=r"tensor model.norm.weight \(model.safetensors\) has dtype I8; expected a float"):
        llm.from_pretrained(d)
    assert tensor_reads == []


def test_head_shape_mismatch_names_the_product(tmp_path, tensor_reads):
    d = _copy("qwen3", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "head_dim": 8}))
    with pytest.raises(llm.CheckpointError) as e:
        llm.from_pretrained(d)
    assert ("model.layers.0.self_attn.q_proj.weight (model-00001-of-00004.safetensors) has shape (64, 32) but the "
            "config expects (32, 32) from num_attention_heads*head_dim=4*8=32, hidden_size=32") in str(e.value)
    assert tensor_reads == []


@pytest.mark.parametrize("damage", ["truncate", "garbage", "delete"])
def test_an_unreadable_shard_is_named_before_anything_is_read(tmp_path, tensor_reads, damage):
    d = _copy("mistral", tmp_path)
    shard = d / "model-00003-of-00003.safetensors"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "garbage":
        shard.write_bytes(b"\x00" * 64)
    else:
        shard.unlink()
    with pytest.raises(llm.CheckpointError) as e:
        llm.from_pretrained(d)
    assert str(shard) in str(e.value)
    assert tensor_reads == []


def test_index_placing_a_tensor_in_the_wrong_shard(tmp_path, tensor_reads):
    d = _copy("gemma2", tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    holder = index["weight_map"]["model.norm.weight"]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != holder)
    index["weight_map"]["model.norm.weight"] = other
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(llm.CheckpointError, match=rf"shards that do not hold them: model.norm.weight \(in {other}\)"):
        llm.from_pretrained(d)
    assert tensor_reads == []


def test_a_directory_without_weights_or_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(json.loads((FIXTURES / "llama" / "config.json").read_text())))
    with pytest.raises(llm.CheckpointError, match="no model.safetensors and no model.safetensors.index.json"):
        llm.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        llm.from_pretrained(tmp_path / "nowhere")
