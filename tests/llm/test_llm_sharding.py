"""from_pretrained straight onto an 8-device CPU mesh (FSDP x tensor-parallel rules): every device
holds its share of every tensor, and the logits equal the single-device ones."""

from __future__ import annotations

import json
import textwrap

import pytest
from llm_testlib import FIXTURES

CODE = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from cairn import llm, nn
    from cairn.core_array import LogicalAxisRules

    path, variant = sys.argv[1], sys.argv[2]
    assert jax.device_count() == 8
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp"))
    rules = LogicalAxisRules([("embed", "fsdp"), ("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp"), ("vocab", "tp")])
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


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["qwen2", "gemma3_text"])
def test_load_onto_an_fsdp_tp_mesh(run_on_cpu_devices, variant):
    r = run_on_cpu_devices(CODE, str(FIXTURES / variant), variant)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(r.stdout.split("REPORT", 1)[1])
    cfg = json.loads((FIXTURES / variant / "config.json").read_text())
    hidden, heads, kv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg.get("head_dim", 8)
    # [hidden, heads, head_dim]: hidden over fsdp (4), heads over tp (2): each device an eighth
    assert report["layers/0/attn/q/kernel"][:3] == [[hidden, heads, hd], [hidden // 4, heads // 2, hd], 8]
    assert report["layers/0/attn/k/kernel"][1] == [hidden // 4, kv // 2, hd]
    assert report["layers/0/mlp/down/kernel"][1] == [cfg["intermediate_size"] // 2, hidden // 4]
    assert report["embed/embedding"][1] == [cfg["vocab_size"] // 2, hidden // 4]
    assert report["norm/scale"][1] == [hidden // 4]
