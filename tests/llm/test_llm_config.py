"""config.json <-> LlmConfig: both rope spellings, family defaults, round trips, refusals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from llm_testlib import FIXTURES, VARIANTS

from cairn import llm
from cairn.llm._rope import inverse_frequencies


@pytest.mark.parametrize("variant", VARIANTS)
def test_fixture_configs_round_trip_exactly(variant):
    d = json.loads((FIXTURES / variant / "config.json").read_text())
    assert llm.config_to_hf(llm.config_from_hf(d)) == d


def test_transformers_4_spelling_reads_as_the_same_config_and_is_written_back():
    v5 = json.loads((FIXTURES / "gemma3_text" / "config.json").read_text())
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "dtype")}
    v4.update(rope_theta=1000000.0, rope_local_base_freq=10000.0, torch_dtype="float32",
              rope_scaling={"type": "linear", "factor": 2.0})
    assert llm.config_from_hf(v4) == llm.config_from_hf(v5)
    back = llm.config_to_hf(llm.config_from_hf(v4))
    assert "rope_parameters" not in back and back["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert back["rope_local_base_freq"] == 10000.0 and back["torch_dtype"] == "float32"


def test_family_defaults_fill_what_the_file_leaves_out():
    base = {"vocab_size": 10, "hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 4, "num_attention_heads": 4}
    gemma2 = llm.config_from_hf({**base, "model_type": "gemma2"})
    assert gemma2.layer_types == ("sliding_attention", "full_attention") * 2
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping, gemma2.norm_offset) == (50.0, 30.0, 1.0)
    assert gemma2.hidden_act == "gelu_pytorch_tanh" and gemma2.tie_word_embeddings and gemma2.embed_scale
    assert gemma2.num_key_value_heads == 4 and gemma2.head_dim == 4
    gemma3 = llm.config_from_hf({**base, "model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window_pattern": 3})
    assert [t[0] for t in gemma3.layer_types] == list("ssfssfs")
    assert dict(gemma3.rope)["rope_theta"] == 1e6 and gemma3.local_rope is None and gemma3.qk_norm
    qwen2 = llm.config_from_hf({**base, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 3,
                                "max_window_layers": 2})
    assert qwen2.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2 and qwen2.qkv_bias
    mistral = llm.config_from_hf({**base, "model_type": "mistral", "sliding_window": None})
    assert set(mistral.layer_types) == {"full_attention"}
    assert llm.config_from_hf({**base, "model_type": "mistral"}).window(0) == 4096


def test_inexpressible_configs_are_refused_on_save():
    cfg = llm.LlmConfig("llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=4, qk_norm=True)
    with pytest.raises(ValueError, match="model_type 'llama' cannot express qk_norm=True"):
        llm.config_to_hf(cfg)
    assert llm.config_to_hf(llm.LlmConfig("llama", 8, 8, 8, 1, 2, 1, 4))["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize("bad, match", [
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads 3"),
    ({"head_dim": 0}, "head_dim must be a positive int"),
    ({"layer_types": ("full_attention",) * 2}, "2 entries for num_hidden_layers=1"),
    ({"layer_types": ("local",)}, "unknown"),
    ({"layer_types": ("sliding_attention",)}, "need a positive sliding_window"),
])
def test_llm_config_validates(bad, match):
    kw = dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1, head_dim=4) | bad
    with pytest.raises(ValueError, match=match):
        llm.LlmConfig(**kw)


def test_missing_required_key_is_named():
    with pytest.raises(ValueError, match="has no 'hidden_size'"):
        llm.config_from_hf({"model_type": "llama", "vocab_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
                            "num_attention_heads": 2})


def test_llama3_frequencies_against_the_published_formula():
    """Meta's llama3 rule in float64: long wavelengths / factor, short kept, a smooth band between."""
    p = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    got, attention = inverse_frequencies(p, 128, 131072)
    inv = 500000.0 ** (-np.arange(0, 128, 2) / 128)
    want = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4.0:
            want.append(f)
        elif wavelen > 8192 / 1.0:
            want.append(f / 8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            want.append((1 - smooth) * f / 8.0 + smooth * f)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert attention == 1.0


def test_yarn_attention_factor_and_limits():
    p = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 2048}
    got, attention = inverse_frequencies(p, 64, 8192)
    assert attention == pytest.approx(0.1 * math.log(4.0) + 1.0)
    inv = 10000.0 ** (-np.arange(0, 64, 2) / 64)
    # the fastest dimensions extrapolate (unchanged), the slowest interpolate (/ factor)
    np.testing.assert_allclose(got[0], inv[0], rtol=1e-6)
    np.testing.assert_allclose(got[-1], inv[-1] / 4.0, rtol=1e-5)
