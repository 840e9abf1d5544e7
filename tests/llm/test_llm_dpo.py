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


def _perturbed_lora_trainer(tmp_path, data, **kw):
    """A trainer whose adapters are away from zero, so the policy differs from its base."""
    import jax

    t = llm.DPOTrainer(tiny_chat_model(layers=2), TOK, data, _config(steps=1, **kw), tmp_path)
    lora = nn.state(t.trainable.model, nn.LoRAParam)
    nn.update(t.trainable.model, jax.tree.map(lambda x: x + 0.05, lora))
    return t


def test_window_start_is_the_shortest_prompts_end():
    data = successor_preferences(12)
    data[3] = {**data[3], "prompt": [{"role": "user", "content": "a much longer question here"}]}
    rows = [llm._dpo._pair(TOK, ex, 32, "x") for ex in data]
    want = min(int(np.flatnonzero(r[f"{side}_weights"])[0]) for r in rows for side in ("chosen", "rejected"))
    assert llm._dpo.window_start(TOK, data, 32) == want > 0
    assert llm._dpo.window_start(TOK, data[3:4], 32) > want  # the long prompt alone starts later


@pytest.mark.slow  # eager LoRA forwards: over 7 s on 2 cores (the window's logits run by default in test_llm_grpo.py)
def test_windowed_logps_of_a_lora_policy_equal_float64_numpy():
    """The log-probabilities from the shortest prompt's end (a LoRA policy: the model through
    its adapters) equal float64 NumPy on the full rows, summed and averaged."""
    import jax

    from cairn.llm._trainer import Trainable

    data = successor_preferences(4)
    model = tiny_chat_model(layers=2)
    policy = Trainable(model, llm.LoraSettings(rank=4, alpha=8.0))
    nn.update(model, jax.tree.map(lambda x: x + 0.05, nn.state(model, nn.LoRAParam)))
    rows = [llm._dpo._pair(TOK, ex, 16, "x") for ex in data]
    mb = {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}
    s = llm._dpo.window_start(TOK, data, 16)
    assert s > 0
    for average in (False, True):
        got = np.stack(llm._dpo._logps(policy.runner(), mb, average, s), 1)
        want = np.stack([_np_logps(policy.runner(), rows, side, average) for side in ("chosen", "rejected")], 1)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, np.stack(llm._dpo._logps(model, mb, True, s), 1), atol=1e-3)  # the adapters count


@pytest.mark.slow  # a trainer and two un-jitted gradients: over 7 s
def test_windowed_step_equals_the_full_rows(tmp_path):
    """With LoRA (policy through the adapters, reference the base): the trainer's step scores
    from the shortest prompt's end, and its loss and adapter gradient equal those of the full
    rows (start 0)."""
    import jax

    data = successor_preferences(8)
    t = _perturbed_lora_trainer(tmp_path, data)
    assert t._start == llm._dpo.window_start(TOK, data, 16) > 0
    rows = [llm._dpo._pair(TOK, ex, 16, "x") for ex in data[:4]]
    mb = {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}
    windowed, full = llm._dpo._preference_loss(t.config, t._start), llm._dpo._preference_loss(t.config)

    def loss(fn):
        return lambda m: fn(t.trainable.runner(m), m, mb)[0]

    np.testing.assert_allclose(float(loss(windowed)(t.trainable.model)), float(loss(full)(t.trainable.model)), rtol=1e-5)
    gw = nn.grad(loss(windowed), wrt=nn.LoRAParam)(t.trainable.model)
    gf = nn.grad(loss(full), wrt=nn.LoRAParam)(t.trainable.model)
    for a, b in zip(jax.tree.leaves(gw), jax.tree.leaves(gf)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)
    assert any(np.abs(np.asarray(a)).max() > 0 for a in jax.tree.leaves(gw))
    t.close()
