"""GRPOTrainer: rollouts scored and turned into group-relative advantages (checked against
NumPy), the first update at ratio 1 (loss = -mean advantage = 0, KL 0 with fresh adapters),
the reference as the base without adapters, resume, bad reward functions, and GRPO raising
the reward of an SFT-started policy."""

from __future__ import annotations

import numpy as np
import pytest
from llm_testlib import chat_tokenizer, successor_chats, tiny_chat_model

from cairn import llm

TOK = chat_tokenizer()


def _prompts(n: int, seed: int = 0) -> list[dict]:
    return [{"prompt": ex["messages"][:1], "answer": ex["messages"][1]["content"]} for ex in successor_chats(n, seed)]


def exact(prompts, completions, examples):
    return [float(c.strip() == ex["answer"]) for c, ex in zip(completions, examples)]


def first_letter(prompts, completions, examples):
    """A dense reward: 1 when the first letter is right (so random groups differ)."""
    return [float(c[:1] == ex["answer"][:1]) for c, ex in zip(completions, examples)]


def _config(**kw) -> llm.GRPOConfig:
    base = dict(steps=2, prompts_per_batch=4, num_generations=4, max_new_tokens=4, temperature=1.0,
                learning_rate=1e-3, beta=0.1, lora=llm.LoraSettings(rank=4, alpha=8.0), save_every=1)
    return llm.GRPOConfig(**{**base, **kw})


def test_rollouts_rewards_and_advantages(tmp_path):
    t = llm.GRPOTrainer(tiny_chat_model(), TOK, _prompts(16), [exact, first_letter], _config(), tmp_path,
                        reward_weights=[2.0, 1.0])
    rows, stats = t._rollouts(np.arange(4))
    texts = [TOK.decode([int(x) for x in row[m > 0]], skip_special_tokens=True)
             for row, m in zip(rows["targets"], rows["mask"])]
    examples = [ex for ex in t.prompts[:4] for _ in range(4)]
    reward = np.array([2.0 * (s.strip() == ex["answer"]) + (s[:1] == ex["answer"][:1]) for s, ex in zip(texts, examples)])
    groups = reward.reshape(4, 4)
    want = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, ddof=1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(rows["advantages"], want.reshape(-1), rtol=1e-5, atol=1e-6)
    assert stats["reward"] == pytest.approx(reward.mean())
    # the mask covers each completion: prompt tokens and padding are not learned
    assert all(int(m.sum()) >= 1 for m in rows["mask"])
    t.close()


@pytest.mark.slow  # two un-jitted gradients and a rollout: over 3 s
def test_one_update_per_rollout_needs_no_separate_sampling_logprobs(tmp_path):
    """With num_iterations == 1 the sampling log-probs are the loss's own (stop-gradient):
    the gradient equals the one taken against log-probs of a separate forward pass."""
    import jax

    from cairn import nn
    from cairn.llm._grpo import _policy_loss

    one, two = _config(steps=1, lora=None), _config(steps=1, lora=None, num_iterations=2)
    t = llm.GRPOTrainer(tiny_chat_model(), TOK, _prompts(8), first_letter, one, tmp_path)
    rows, _ = t._rollouts(np.arange(4))
    assert "old_logprobs" not in rows  # no forward pass spent on them
    model = t.trainable.model
    with_old = {**rows, "old_logprobs": np.asarray(t._logprobs(model, rows["inputs"], rows["targets"], 1.0, t._start))}
    g1 = nn.grad(lambda m: _policy_loss(one, t._start)(m, m, rows)[0])(model)
    g2 = nn.grad(lambda m: _policy_loss(two, t._start)(m, m, with_old)[0])(model)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert any(np.abs(np.asarray(a)).max() > 0 for a in jax.tree.leaves(g1))
    t.close()


def _log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("tied", [pytest.param(False, marks=pytest.mark.slow), True])  # CI budget: one in the default run
def test_window_logits_equal_the_full_logits_sliced(tied):
    """The vocabulary projection from ``start`` on gives the full model's logits there (tied
    embeddings and a final soft cap included)."""
    import dataclasses

    import jax.numpy as jnp

    from cairn import nn
    from cairn.llm._grpo import window_logits

    cfg = dataclasses.replace(tiny_chat_model().config, tie_word_embeddings=tied, final_logit_softcapping=5.0 if tied else None)
    model = llm.CausalLM(cfg, rngs=nn.Rngs(3))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 11)), jnp.int32)
    full = np.asarray(model(ids))
    for start in (0, 1, 7):
        np.testing.assert_allclose(np.asarray(window_logits(model, ids, start)), full[:, start:], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # 23 s: CI's 10-minute budget (the window itself is checked above in the default run)
def test_windowed_update_is_the_grpo_objective_of_the_full_rows(tmp_path):
    """The update scores log-probs from the shortest prompt's end on; its loss and gradient
    equal those of the full rows (start 0), and the loss equals the GRPO objective
    (seq-mean-token-mean of -A * ratio + beta * k3) evaluated in float64 NumPy."""
    import jax

    from cairn import nn
    from cairn.llm._grpo import _policy_loss

    cfg = _config(steps=1, lora=None, beta=0.1)
    t = llm.GRPOTrainer(tiny_chat_model(), TOK, _prompts(8), first_letter, cfg, tmp_path)
    rows, _ = t._rollouts(np.arange(4))
    s, model = t._start, t.trainable.model
    assert s > 0 and rows["targets"].shape[1] == rows["inputs"].shape[1] - s
    noise = np.random.default_rng(1).normal(0.0, 0.3, rows["mask"].shape).astype(np.float32)
    rows["ref_logprobs"] = rows["ref_logprobs"] + noise  # a reference away from the policy: KL > 0
    pad = lambda x, fill: np.concatenate([np.full((x.shape[0], s), fill, x.dtype), x], 1)  # noqa: E731
    full = {**rows, "targets": np.concatenate([rows["inputs"][:, 1:s + 1], rows["targets"]], 1),
            "mask": pad(rows["mask"], 0.0), "ref_logprobs": pad(rows["ref_logprobs"], 0.0)}
    lw, cw, _ = _policy_loss(cfg, s)(model, model, rows)
    lf, cf, _ = _policy_loss(cfg)(model, model, full)
    gw = nn.grad(lambda m: _policy_loss(cfg, s)(m, m, rows)[0])(model)
    gf = nn.grad(lambda m: _policy_loss(cfg)(m, m, full)[0])(model)
    assert float(cw) == float(cf)
    np.testing.assert_allclose(float(lw), float(lf), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(gw), jax.tree.leaves(gf)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert any(np.abs(np.asarray(a)).max() > 0 for a in jax.tree.leaves(gw))
    # float64 NumPy: ratio 1 at the first update, k3 = exp(ref - lp) - (ref - lp) - 1
    logp = _log_softmax64(np.asarray(model(rows["inputs"]))[:, s:] / cfg.temperature)
    lp = np.take_along_axis(logp, rows["targets"][..., None].astype(np.int64), -1)[..., 0]
    d = rows["ref_logprobs"].astype(np.float64) - lp
    per_token = -rows["advantages"].astype(np.float64)[:, None] + cfg.beta * (np.exp(d) - d - 1.0)
    m = rows["mask"].astype(np.float64)
    want = np.sum((per_token * m).sum(1) / np.maximum(m.sum(1), 1.0))
    np.testing.assert_allclose(float(lw), want, rtol=1e-4, atol=1e-5)
    t.close()


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_first_update_is_at_ratio_one_with_zero_kl(tmp_path):
    t = llm.GRPOTrainer(tiny_chat_model(), TOK, _prompts(16), first_letter, _config(steps=1), tmp_path)
    out = t.train()
    t.close()
    # seq-mean-token-mean with every ratio 1: -mean_i(A_i), and advantages sum to 0 per group
    assert out["loss"] == pytest.approx(0.0, abs=1e-6)
    assert out["kl"] == pytest.approx(0.0, abs=1e-7) and out["clip_fraction"] == 0.0


@pytest.mark.slow  # several trainers compiled: kept out of the 10-minute default suite
def test_resume_is_bit_identical(tmp_path):
    prompts = _prompts(24)
    a = llm.GRPOTrainer(tiny_chat_model(), TOK, prompts, first_letter, _config(steps=3), tmp_path / "a")
    a.train()
    a.close()
    b = llm.GRPOTrainer(tiny_chat_model(), TOK, prompts, first_letter, _config(steps=3), tmp_path / "b")
    b.train(stop_after=2)
    b.close()
    b = llm.GRPOTrainer(tiny_chat_model(), TOK, prompts, first_letter, _config(steps=3), tmp_path / "b")
    assert b.step == 2
    b.train()
    b.close()
    ra, rb = llm.read_metrics(tmp_path / "a"), llm.read_metrics(tmp_path / "b")
    assert [r["reward"] for r in ra] == [r["reward"] for r in rb]
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]


def test_bad_reward_functions_are_named(tmp_path):
    t = llm.GRPOTrainer(tiny_chat_model(), TOK, _prompts(8), exact, _config(steps=1), tmp_path)

    def short(prompts, completions, examples):
        return [1.0]

    def nan(prompts, completions, examples):
        return [float("nan")] * len(completions)

    t.reward_fns, t.reward_weights = [short], [1.0]
    with pytest.raises(ValueError, match=r"reward function short returned shape \(1,\) for 2 completions"):
        t.rewards(["a", "b"], ["x", "y"], [{}, {}])
    t.reward_fns = [nan]
    with pytest.raises(ValueError, match="reward function nan returned nan for completion 0"):
        t.rewards(["a", "b"], ["x", "y"], [{}, {}])
    t.close()
    with pytest.raises(ValueError, match="num_generations must be an integer >= 2"):
        llm.GRPOConfig(steps=1, num_generations=1)
    with pytest.raises(ValueError, match="prompt 0: expected"):
        llm.GRPOTrainer(tiny_chat_model(), TOK, [{"question": "x"}], exact, _config(), tmp_path / "c")
    long = [{"prompt": "ab", "answer": "bc"}, {"prompt": "a" * 2046, "answer": "b"}]
    with pytest.raises(ValueError, match="prompt 1: 2046 tokens plus max_new_tokens=4 exceed the model's context of 2048"):
        llm.GRPOTrainer(tiny_chat_model(), TOK, long, exact, _config(), tmp_path / "d")


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_a_reward_function_that_raises_names_itself_and_keeps_the_checkpoints(tmp_path):
    calls = []

    def flaky(prompts, completions, examples):
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("answer")
        return [0.0] * len(completions)

    t = llm.GRPOTrainer(tiny_chat_model(), TOK, _prompts(16), flaky, _config(steps=4), tmp_path)
    with pytest.raises(RuntimeError, match=r"reward function flaky raised at step 3 \(KeyError: 'answer'\); the last "
                                           r"checkpoint is step 2"):
        t.train()
    t.close()
    assert llm.GRPOTrainer(tiny_chat_model(), TOK, _prompts(16), flaky, _config(steps=4), tmp_path).step == 2


@pytest.mark.slow  # ~60 s: SFT to a partial policy, then 50 batches of rollouts
def test_grpo_raises_the_reward_of_an_sft_policy(tmp_path):
    chats = successor_chats(400)
    model = tiny_chat_model(layers=2)
    sft = llm.SFTTrainer(model, TOK, chats[:300], llm.SFTConfig(steps=45, batch_size=16, seq_len=64, learning_rate=3e-3,
                                                                 lora=None, save_every=1000), tmp_path / "sft")
    sft.train()
    sft.close()
    prompts = _prompts(400)
    train, held = prompts[:300], prompts[300:364]
    g = llm.GRPOTrainer(model, TOK, train, exact, llm.GRPOConfig(
        steps=50, prompts_per_batch=16, num_generations=4, max_new_tokens=5, temperature=0.8, learning_rate=5e-4,
        beta=0.0, lora=None, num_iterations=2, save_every=1000), tmp_path / "grpo")
    before = g.evaluate(held, temperature=0.8, num_samples=4)
    g.train()
    after = g.evaluate(held, temperature=0.8, num_samples=4)
    g.close()
    rewards = [r["reward"] for r in llm.read_metrics(tmp_path / "grpo")]
    assert after >= before + 0.04, (before, after)
    assert np.mean(rewards[-10:]) > np.mean(rewards[:10]), rewards


def test_window_logits_of_a_lora_policy_equal_the_full_logits_sliced():
    """A LoRA policy (the model through its adapters' provider) also projects only from
    ``start``: its logits equal the full pass's (the gradient: the slow test below)."""
    import jax
    import jax.numpy as jnp

    from cairn import nn
    from cairn.llm._trainer import Trainable, window_logits

    model = tiny_chat_model(layers=2)
    t = Trainable(model, llm.LoraSettings(rank=4, alpha=8.0))
    nn.update(model, jax.tree.map(lambda x: x + 0.05, nn.state(model, nn.LoRAParam)))  # adapters away from zero
    ids = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (3, 11)), jnp.int32)
    full = np.asarray(t.runner()(ids))
    assert not np.allclose(full, np.asarray(model(ids)), atol=1e-3)  # the adapters count
    np.testing.assert_allclose(np.asarray(window_logits(t.runner(), ids, 6)), full[:, 6:], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # two un-jitted gradients through the LoRA provider: over 7 s
def test_window_gradient_of_a_lora_policy_equals_the_full_pass():
    """The adapters' gradient through the windowed logits equals the full pass's."""
    import jax
    import jax.numpy as jnp

    from cairn import nn
    from cairn.llm._trainer import Trainable, window_logits

    model = tiny_chat_model(layers=2)
    t = Trainable(model, llm.LoraSettings(rank=4, alpha=8.0))
    nn.update(model, jax.tree.map(lambda x: x + 0.05, nn.state(model, nn.LoRAParam)))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (3, 11)), jnp.int32)

    def loss(windowed):
        return lambda m: jnp.sum(jax.nn.log_softmax(window_logits(t.runner(m), ids, 6) if windowed
                                                    else t.runner(m)(ids)[:, 6:])[..., 2])

    gw, gf = nn.grad(loss(True), wrt=nn.LoRAParam)(model), nn.grad(loss(False), wrt=nn.LoRAParam)(model)
    for a, b in zip(jax.tree.leaves(gw), jax.tree.leaves(gf)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert any(np.abs(np.asarray(a)).max() > 0 for a in jax.tree.leaves(gw))
