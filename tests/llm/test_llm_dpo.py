"""DPOTrainer: each loss type's first step against its published equation (fresh adapters:
policy == reference), the reference as the base without adapters (LoRA) or precomputed
(full fine-tuning), resume, bad input, and DPO raising held-out preference accuracy."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from llm_testlib import chat_tokenizer, successor_preferences, tiny_chat_model

from cairn import llm, nn

TOK = chat_tokenizer()


def _config(**kw) -> llm.DPOConfig:
    base = dict(steps=2, batch_size=4, seq_len=16, learning_rate=1e-2, log_every=1, save_every=2, beta=0.5,
                lora=llm.LoraSettings(rank=4, alpha=8.0))
    return llm.DPOConfig(**{**base, **kw})


def _np_logps(model, rows: list[dict], side: str, average: bool) -> np.ndarray:
    """float64 NumPy: summed (or averaged) log-probabilities of one side's completion tokens."""
    ids = np.stack([r[f"{side}_inputs"] for r in rows])
    logits = np.asarray(model(jnp.asarray(ids)), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    tgt = np.stack([r[f"{side}_targets"] for r in rows])
    w = np.stack([r[f"{side}_weights"] for r in rows]).astype(np.float64)
    s = (np.take_along_axis(logp, tgt[..., None], -1)[..., 0] * w).sum(-1)
    return s / w.sum(-1) if average else s


@pytest.mark.parametrize("loss_type, kw, want", [
    ("sigmoid", {}, math.log(2.0)),                           # z = 0: -log sigmoid(0)
    pytest.param("sigmoid", {"label_smoothing": 0.2}, math.log(2.0), marks=pytest.mark.slow),  # both terms: log 2
    pytest.param("ipo", {}, (1 / (2 * 0.5)) ** 2, marks=pytest.mark.slow),  # (z - 1/(2 beta))^2 at z = 0
])
def test_first_step_with_fresh_adapters_matches_the_equation(tmp_path, loss_type, kw, want):
    t = llm.DPOTrainer(tiny_chat_model(), TOK, successor_preferences(16), _config(steps=1, loss_type=loss_type, **kw),
                       tmp_path)
    out = t.train()
    t.close()
    np.testing.assert_allclose(out["loss"], want, rtol=1e-5)
    assert out["reward_margin"] == pytest.approx(0.0, abs=1e-6) and out["reward_accuracy"] == 0.0


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_simpo_first_step_matches_float64_numpy(tmp_path):
    data = successor_preferences(16)
    model = tiny_chat_model()
    rows = [llm._dpo._pair(TOK, ex, 16, "x") for ex in data]
    c, r = _np_logps(model, rows, "chosen", True), _np_logps(model, rows, "rejected", True)
    beta, gamma = 2.0, 0.5
    want_all = np.logaddexp(0.0, -(beta * (c - r) - gamma))   # -log sigmoid(beta (c - r) - gamma)
    t = llm.DPOTrainer(model, TOK, data, _config(steps=1, loss_type="simpo", beta=beta, simpo_gamma=gamma), tmp_path)
    first = next(iter(llm.preference_dataset(data, TOK, seq_len=16, batch_size=4, seed=0)))
    order = [next(i for i, row in enumerate(rows) if np.array_equal(row["chosen_inputs"], ci))
             for ci in first["chosen_inputs"]]
    out = t.train()
    t.close()
    np.testing.assert_allclose(out["loss"], want_all[order].mean(), rtol=1e-4)


@pytest.mark.slow  # several trainers compiled: kept out of the 10-minute default suite
def test_lora_reference_is_the_base_without_adapters(tmp_path):
    data = successor_preferences(24)
    model = tiny_chat_model()
    before = {k: np.asarray(v[...]) for k, v in nn.state(model, nn.Param).flat_state().items()}
    t = llm.DPOTrainer(model, TOK, data, _config(steps=3), tmp_path)
    base_logps = t.sequence_logps(data[:8], model=t.trainable.model)
    t.train()
    t.close()
    # the base did not move, so it is still the reference; the adapted policy did move
    for k, v in nn.state(model, nn.Param).flat_state().items():
        if "lora" not in str(k):
            np.testing.assert_array_equal(np.asarray(v[...]), before[k])
    np.testing.assert_array_equal(t.sequence_logps(data[:8], model=t.trainable.model), base_logps)
    assert not np.allclose(t.sequence_logps(data[:8]), base_logps)


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_full_fine_tuning_precomputes_the_reference(tmp_path):
    data = successor_preferences(8)
    model = tiny_chat_model()
    rows = [llm._dpo._pair(TOK, ex, 16, "x") for ex in data]
    want = np.stack([_np_logps(model, rows, "chosen", False), _np_logps(model, rows, "rejected", False)], 1)
    t = llm.DPOTrainer(model, TOK, data, _config(steps=1, lora=None, learning_rate=1e-3), tmp_path)
    batch = next(t.data_iter)
    idx = [next(i for i, row in enumerate(rows) if np.array_equal(row["chosen_inputs"], ci))
           for ci in batch["chosen_inputs"]]
    np.testing.assert_allclose(np.stack([batch["ref_chosen"], batch["ref_rejected"]], 1), want[idx], rtol=1e-5)
    t.close()


@pytest.mark.slow  # several trainers compiled: kept out of the 10-minute default suite
def test_resume_is_bit_identical(tmp_path):
    data = successor_preferences(32)
    a = llm.DPOTrainer(tiny_chat_model(), TOK, data, _config(steps=3), tmp_path / "a")
    a.train()
    a.close()
    b = llm.DPOTrainer(tiny_chat_model(), TOK, data, _config(steps=3), tmp_path / "b")
    b.train(stop_after=2)
    b.close()
    b = llm.DPOTrainer(tiny_chat_model(), TOK, data, _config(steps=3), tmp_path / "b")
    assert b.step == 2
    b.train()
    b.close()
    get = lambda t: {str(k): np.asarray(v[...]) for k, v in nn.state(t.trainable.model, nn.LoRAParam).flat_state().items()}  # noqa: E731
    for k, v in get(a).items():
        np.testing.assert_array_equal(get(b)[k], v, err_msg=k)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="loss_type must be one of"):
        llm.DPOConfig(steps=1, loss_type="kto")
    with pytest.raises(ValueError, match="label_smoothing applies to loss_type='sigmoid' only"):
        llm.DPOConfig(steps=1, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="example 3: expected a dict with 'prompt', 'chosen' and 'rejected'"):
        llm._dpo._pair(TOK, {"prompt": "ab", "chosen": "bc"}, 16, "example 3")
    with pytest.raises(ValueError, match="example 4: the rejected completion is empty"):
        llm._dpo._pair(TOK, {"prompt": "ab", "chosen": "bc", "rejected": " "}, 16, "example 4")
    with pytest.raises(ValueError, match="example 5: the chosen completion is empty"):
        llm._dpo._pair(TOK, {"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "assistant", "content": ""}],
                             "rejected": [{"role": "assistant", "content": "b"}]}, 16, "example 5")
    # a prompt that fills the context leaves no completion token: named, not trained on silently
    with pytest.raises(ValueError, match=r"example 6 \(chosen\): no completion token"):
        llm._dpo._pair(TOK, {"prompt": "abcdefghijklmnopqrstuvwxyz", "chosen": "b", "rejected": "c"}, 16, "example 6")


@pytest.mark.slow  # ~40 s: 60 steps and two scorings
def test_dpo_raises_heldout_preference_accuracy(tmp_path):
    data = successor_preferences(400)
    train, held = data[:320], data[320:]
    t = llm.DPOTrainer(tiny_chat_model(layers=2), TOK, train, llm.DPOConfig(
        steps=60, batch_size=16, seq_len=16, beta=0.5, learning_rate=5e-3, log_every=10, save_every=1000,
        lora=llm.LoraSettings(rank=8, alpha=16.0)), tmp_path)
    before = t.preference_accuracy(held)
    t.train()
    after = t.preference_accuracy(held)
    t.close()
    assert 0.2 <= before <= 0.8 and after >= 0.9, (before, after)
