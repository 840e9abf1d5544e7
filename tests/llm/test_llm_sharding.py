"""from_pretrained straight onto an 8-device CPU mesh (FSDP x tensor-parallel rules): every device
holds its share of every tensor, and the logits equal the single-device ones."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llm_testlib import FIXTURES

from cairn import llm

CODE = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from cairn import llm, nn
    from cairn.core_array import LogicalAxisRules

    path, variant = sys.argv[1], sys.argv[2]
    assert jax.device_count() == 8
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp"))
    # expert parallelism first: an expert kernel [expert, embed, mlp] takes tp for its experts
    rules = LogicalAxisRules([("embed", "fsdp"), ("heads", "tp"), ("kv_heads", "tp"), ("expert", "tp"), ("mlp", "tp"),
                              ("vocab", "tp")])
    sharded = llm.from_pretrained(path, mesh=mesh, rules=rules)
    plain = llm.from_pretrained(path)
    report = {}
    for (p, v), (_, w) in zip(nn.state(sharded).flat_items(), nn.state(plain).flat_items()):
        arr = v[...]
        shards = arr.addressable_shards
        report[p] = [list(arr.shape), list(shards[0].data.shape), len(shards), str(arr.sharding.spec)]
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(w[...]))  # same values, placed
    with np.load(path + "/reference.npz") as z:
        ids, expected = z["input_ids"], z["logits"]
    f = nn.jit(lambda m, x: m(x))
    got = np.asarray(f(sharded, ids))
    np.testing.assert_allclose(got, np.asarray(f(plain, ids)), rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    print("REPORT" + json.dumps(report))
""")


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["qwen2", "gemma3_text", "qwen3_moe"])
def test_load_onto_an_fsdp_tp_mesh(run_on_cpu_devices, variant):
    r = run_on_cpu_devices(CODE, str(FIXTURES / variant), variant)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(r.stdout.split("REPORT", 1)[1])
    cfg = json.loads((FIXTURES / variant / "config.json").read_text())
    hidden, heads, kv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg.get("head_dim", 8)
    # [hidden, heads, head_dim]: hidden over fsdp (4), heads over tp (2): each device an eighth
    assert report["layers/0/attn/q/kernel"][:3] == [[hidden, heads, hd], [hidden // 4, heads // 2, hd], 8]
    assert report["layers/0/attn/k/kernel"][1] == [hidden // 4, kv // 2, hd]
    dense = 1 if variant == "qwen3_moe" else 0  # qwen3_moe: layer 1 is its dense layer
    assert report[f"layers/{dense}/mlp/down/kernel"][1] == [cfg["intermediate_size"] // 2, hidden // 4]
    if variant == "qwen3_moe":  # experts over tp, hidden over fsdp: each device half the experts
        experts, m = cfg["num_local_experts"], cfg["moe_intermediate_size"]
        assert report["layers/0/mlp/experts/gate"][:3] == [[experts, hidden, m], [experts // 2, hidden // 4, m], 8]
        assert report["layers/2/mlp/experts/down"][1] == [experts // 2, m, hidden // 4]
    assert report["embed/embedding"][1] == [cfg["vocab_size"] // 2, hidden // 4]
    assert report["norm/scale"][1] == [hidden // 4]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_shard_reads_only_its_box_of_the_file(data):
    """Any box of a model parameter maps to the box of the Hugging Face tensor that holds
    it (or to None, when it is not one box): reading that box gives the same values as
    reading everything and slicing."""
    from cairn.llm._hf_io import _source_box, _Tensor, _to_model, expected_tensors

    cfg = llm.config_from_hf({"model_type": "qwen2", "vocab_size": 12, "hidden_size": 8, "intermediate_size": 6,
                              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2})
    tensors = {t.path: t for t in expected_tensors(cfg)}
    path = data.draw(st.sampled_from(sorted(tensors)))
    t: _Tensor = tensors[path]
    model_shape = {"layers/0/attn/q/kernel": (8, 4, 2), "layers/0/attn/k/kernel": (8, 2, 2),
                   "layers/0/attn/v/kernel": (8, 2, 2), "layers/0/attn/o/kernel": (4, 2, 8),
                   "layers/0/attn/q/bias": (4, 2), "layers/0/attn/k/bias": (2, 2), "layers/0/attn/v/bias": (2, 2),
                   "embed/embedding": (12, 8)}.get(path)
    if model_shape is None:
        model_shape = t.hf_shape[::-1] if t.transpose else t.hf_shape
    hf = np.arange(np.prod(t.hf_shape), dtype=np.float32).reshape(t.hf_shape)
    model = _to_model(t, hf, model_shape, np.float32)
    index = []
    for n in model_shape:
        parts = data.draw(st.sampled_from([d for d in (1, 2, 4) if n % d == 0]))
        k = data.draw(st.integers(0, parts - 1))
        index.append(slice(k * n // parts, (k + 1) * n // parts) if parts > 1 else slice(None))
    index = tuple(index)
    box = _source_box(t, model_shape, index)
    if box is not None:
        shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, model_shape))
        np.testing.assert_array_equal(_to_model(t, hf[box], shape, np.float32), model[index])
    else:  # only when head_dim, the inner part of a split [heads * head_dim] dim, is cut
        head_axis = 1 if path.endswith("o/kernel") else len(model_shape) - 1
        assert "/attn/" in path and index[head_axis] != slice(None), (path, index)
