"""cairn.llm LoRA: adapters through cairn.quant's rules, merge_lora, and PEFT's file layout.

References: peft's own logits on the committed adapters (tests/llm/fixtures/peft, written by
make_peft_fixtures.py with peft 0.21 and transformers), and a float64 NumPy
``W + alpha / r * A @ B``.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from llm_testlib import FIXTURES
from safetensors.numpy import load_file, save_file

from cairn import llm, nn, optim, quant
from cairn.llm import CheckpointError

PEFT = FIXTURES / "peft"
PEFT_VARIANTS = sorted(p.name for p in PEFT.iterdir() if (p / "adapter_config.json").exists())


@jax.jit
def _run(model, ids):
    """``model(ids)`` compiled (a model wrapped by apply_lora is a pytree like the model itself)."""
    return model(ids)


def _fresh(variant: str = "llama") -> llm.CausalLM:
    return llm.from_pretrained(FIXTURES / variant)  # apply_lora changes the model in place: one per test


def _peft_reference(variant: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    with np.load(PEFT / variant / "reference.npz") as z:
        return z["input_ids"], z["logits"], z["merged_logits"]


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def _randomize_b(model, seed=0):
    """Give every adapter a nonzero B (fresh adapters start at B = 0)."""
    for i, (path, (_, b)) in enumerate(sorted(llm.lora_adapters(model).weights.items())):
        owner = model.model
        for part in path.split("/")[:-1]:
            owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
        owner.lora["lora_b"].value = jax.random.normal(jax.random.key(seed + i), b.shape) * 0.3


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.parametrize("variant", PEFT_VARIANTS)
def test_a_peft_adapter_gives_peft_logits_adapted_and_merged(variant):
    ids, want, want_merged = _peft_reference(variant)
    base = _fresh(variant)
    adapters = llm.load_lora(PEFT / variant, base)
    config = json.loads((PEFT / variant / "adapter_config.json").read_text())
    assert adapters.rank == config["r"] and adapters.alpha == config["lora_alpha"]
    assert adapters.base_model_name_or_path == variant
    lora = llm.apply_lora(base, adapters=adapters)
    _close(np.asarray(_run(lora, ids)), want)
    _close(np.asarray(_run(llm.merge_lora(lora), ids)), want_merged)
    # the adapters matter: the base model's logits are far from peft's
    assert np.abs(np.asarray(_run(_fresh(variant), ids)) - want).max() > 100 * 1e-4 * np.abs(want).max()


@pytest.mark.slow  # over ~5 s on a 2-core machine: tests_slow runs it, keeping `nox -s tests` under 10 minutes
def test_merged_weights_are_w_plus_scaled_a_b_and_give_the_lora_logits():
    base = _fresh("llama")
    w_before = {p: np.asarray(v[...], np.float64) for p, v in
                {"/".join(map(str, k)): v for k, v in nn.state(base).flat_state().items()}.items()}
    lora = llm.apply_lora(base, rank=3, alpha=5.0, target_modules="all-linear", rng=jax.random.key(1))
    _randomize_b(lora)
    adapters = llm.lora_adapters(lora)
    assert len(adapters.weights) == 7 * 3  # seven projections in each of three layers
    merged = llm.merge_lora(lora)
    merged_w = {"/".join(map(str, k)): np.asarray(v[...]) for k, v in nn.state(merged).flat_state().items()}
    assert set(merged_w) == set(w_before)  # no adapters left
    for path, w in w_before.items():
        if path in adapters.weights:
            a, b = (np.asarray(x, np.float64) for x in adapters.weights[path])
            want = w + 5.0 / 3 * (a @ b).reshape(w.shape)
            np.testing.assert_allclose(merged_w[path], want, rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_array_equal(merged_w[path], w)
    ids = np.array([[3, 14, 15, 92, 65, 35, 8, 9]], np.int32)
    _close(np.asarray(_run(merged, ids)), np.asarray(_run(lora, ids)))
    # the model passed to merge_lora keeps its own weights
    np.testing.assert_array_equal(np.asarray(lora.model.layers[0].attn.q.kernel[...]), w_before["layers/0/attn/q/kernel"])


@pytest.mark.slow  # eager gradients through the provider: ~50 s
def test_fresh_adapters_leave_the_logits_unchanged_and_only_they_train():
    base = _fresh("qwen2")
    ids = np.array([[1, 5, 9, 13, 17, 21]], np.int32)
    before = np.asarray(_run(base, ids))
    lora = llm.apply_lora(base, rank=2, alpha=4.0, rng=jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(_run(lora, ids)), before)
    frozen = {k: np.asarray(v[...]) for k, v in nn.state(base, nn.Param).flat_state().items() if "lora" not in k}
    opt = nn.Optimizer(base, optim.adam(1e-2), wrt=nn.LoRAParam)

    def loss(m):
        out = quant.quantize_model(m, lora.provider)(ids[:, :-1])
        return -jax.nn.log_softmax(out, -1)[0, np.arange(5), ids[0, 1:]].mean()

    first = float(loss(base))
    for _ in range(3):
        opt.update(base, nn.grad(loss, wrt=nn.LoRAParam)(base))
    assert float(loss(base)) < first
    for k, v in nn.state(base, nn.Param).flat_state().items():
        if "lora" not in k:
            np.testing.assert_array_equal(np.asarray(v[...]), frozen[k])


def test_save_lora_writes_peft_names_shapes_and_config_and_loads_back(tmp_path):
    base = _fresh("llama")
    peft_tensors = load_file(str(PEFT / "llama" / "adapter_model.safetensors"))
    lora = llm.apply_lora(base, adapters=llm.load_lora(PEFT / "llama", base))
    assert llm.save_lora(lora, tmp_path, base_model_name_or_path="llama") == ["adapter_config.json",
                                                                             "adapter_model.safetensors"]
    ours = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(peft_tensors)
    for name, value in peft_tensors.items():
        np.testing.assert_array_equal(ours[name], value)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    peft_config = json.loads((PEFT / "llama" / "adapter_config.json").read_text())
    for key in ("r", "lora_alpha", "target_modules", "peft_type", "task_type", "base_model_name_or_path", "bias",
                "use_dora", "use_rslora", "fan_in_fan_out"):
        assert config[key] == peft_config[key], key
    assert peft_tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"].shape == (4, 32)  # [r, in]
    assert peft_tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].shape == (16, 4)  # [out, r]
    again = llm.load_lora(tmp_path, base)
    assert sorted(again.weights) == sorted(llm.lora_adapters(lora).weights)


def test_adapters_on_some_layers_write_layers_to_transform(tmp_path):
    base = _fresh("llama")
    lora = llm.apply_lora(base, rank=2, alpha=2.0, target_modules=["o_proj"])
    adapters = llm.lora_adapters(lora)
    some = llm.LoraAdapters(2, 2.0, {k: v for k, v in adapters.weights.items() if k.startswith("layers/1/")})
    llm.save_lora(_fresh("llama"), tmp_path, some)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["layers_to_transform"] == [1] and config["target_modules"] == ["o_proj"]


@pytest.mark.slow  # two generate compiles: ~15 s
def test_generate_with_adapters_equals_generate_with_the_merged_model():
    base = _fresh("gemma2")
    lora = llm.apply_lora(base, adapters=llm.load_lora(PEFT / "gemma2", base))
    merged = llm.merge_lora(lora)
    prompts = [[4, 8, 15, 16, 23], [42]]
    a = llm.generate(lora, prompts, 8)
    b = llm.generate(merged, prompts, 8)
    assert a.tokens == b.tokens
    for x, y in zip(a.logprobs, b.logprobs):
        np.testing.assert_allclose(x, y, atol=1e-4)


# --- bad input ---

def test_unknown_target_modules_list_the_supported_ones():
    with pytest.raises(ValueError, match=r"\['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\]"):
        llm.apply_lora(_fresh("llama"), target_modules=["q_proj", "lm_head"])
    assert llm.lora_target_modules(_fresh("llama").config)[0] == "down_proj"


def test_adapters_twice_are_refused():
    base = _fresh("llama")
    llm.apply_lora(base)
    with pytest.raises(ValueError, match="already has adapters"):
        llm.apply_lora(base)


def _copy_peft(tmp_path, edit_config=None, edit_tensors=None):
    config = json.loads((PEFT / "llama" / "adapter_config.json").read_text())
    tensors = load_file(str(PEFT / "llama" / "adapter_model.safetensors"))
    if edit_config:
        edit_config(config)
    if edit_tensors:
        edit_tensors(tensors)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    return tmp_path


@pytest.mark.parametrize("edit_config, edit_tensors, match", [
    (lambda c: c.update(use_dora=True), None, "use_dora=True is not supported"),
    (lambda c: c.update(use_rslora=True), None, "use_rslora=True is not supported"),
    (lambda c: c.update(rank_pattern={"q_proj": 8}), None, "rank_pattern"),
    (lambda c: c.update(bias="all"), None, "bias='all' is not supported"),
    (lambda c: c.update(modules_to_save=["lm_head"]), None, "modules_to_save"),
    (lambda c: c.update(peft_type="IA3"), None, "peft_type 'IA3' is not supported"),
    (lambda c: c.update(r=8), None, r"r=8\) do not fit .*\n.*layers\.0\.self_attn\.k_proj \(layers/0/attn/k/kernel\): "
     r"lora_A \(4, 32\) / lora_B \(16, 4\), expected \[r, in\] = \(8, 32\) / \[out, r\] = \(16, 8\)"),
    (None, lambda t: t.pop("base_model.model.model.layers.2.mlp.up_proj.lora_B.weight"),
     r"base_model\.model\.model\.layers\.2\.mlp\.up_proj \(layers/2/mlp/up/kernel\): lora_B\.weight is missing"),
    (None, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": np.zeros((4, 32), np.float32)}),
     r"no LoRA A/B of a projection.*lm_head"),
])
def test_peft_folders_that_do_not_fit_are_refused_by_name(tmp_path, edit_config, edit_tensors, match):
    folder = _copy_peft(tmp_path, edit_config, edit_tensors)
    with pytest.raises(CheckpointError, match=match):
        llm.load_lora(folder, _fresh("llama"))


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        llm.load_lora(tmp_path, _fresh("llama"))
    folder = _copy_peft(tmp_path)
    (folder / "adapter_model.safetensors").write_bytes(b"\x00\x01truncated")
    with pytest.raises(CheckpointError, match="adapter_model.safetensors: cannot be read"):
        llm.load_lora(folder, _fresh("llama"))
