"""SFTTrainer and its data: completion-only masks checked token by token, packing that keeps
examples apart (logits equal to each example alone), gradient accumulation equal to one big
batch, the loss against a float64 NumPy reference, LoRA/QLoRA/full training that learns a
chat task, and bit-identical resume."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from llm_testlib import CHAT_PIECES, chat_tokenizer, successor_chats, tiny_chat_model

from cairn import llm, nn, optim
from cairn.core_array import QArray

ID = {p: i for i, p in enumerate(CHAT_PIECES)}
TOK = chat_tokenizer()


def _ids(text: str) -> list[int]:
    """Token ids of a string of pieces written out (one letter per token)."""
    out, i = [], 0
    while i < len(text):
        piece = next(p for p in sorted(CHAT_PIECES, key=len, reverse=True) if text.startswith(p, i))
        out.append(ID[piece])
        i += len(piece)
    return out


def test_chat_example_masks_exactly_the_assistant_turns():
    ex = {"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "bc"},
                       {"role": "user", "content": "xy"}, {"role": "assistant", "content": "yz"}]}
    row = llm.sft_example(TOK, ex, 64)
    ids = _ids("<|user|>ab\n<|assistant|>bc</s><|user|>xy\n<|assistant|>yz</s>")
    # the assistant's text and its end token are learned; "<|assistant|>" is part of the prompt
    learn = [0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]
    np.testing.assert_array_equal(row["inputs"], ids[:-1])
    np.testing.assert_array_equal(row["targets"], ids[1:])
    np.testing.assert_array_equal(row["weights"], np.asarray(learn[1:], np.float32))


def test_generation_blocks_of_the_template_set_the_mask():
    template = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}\n{% else %}"
                "<|assistant|>{% generation %}{{ m['content'] }}{% endgeneration %}</s>{% endif %}{% endfor %}")
    tok = chat_tokenizer(template)
    row = llm.sft_example(tok, {"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "bc"}]}, 64)
    # only the text inside {% generation %}: "bc", not the end token
    np.testing.assert_array_equal(row["weights"], np.asarray([0, 0, 0, 0, 1, 1, 0], np.float32))


def test_prompt_completion_examples_text_and_conversational():
    row = llm.sft_example(TOK, {"prompt": "ab", "completion": "cd"}, 64)
    np.testing.assert_array_equal(np.r_[row["inputs"][:1], row["targets"]], _ids("abcd</s>"))
    np.testing.assert_array_equal(row["weights"], [0, 1, 1, 1])
    conv = llm.sft_example(TOK, {"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                            {"role": "user", "content": "c"}],
                                 "completion": [{"role": "assistant", "content": "d"}]}, 64)
    # the earlier assistant turn belongs to the prompt: only "d</s>" is learned
    assert conv["weights"].sum() == 2 and conv["weights"][-2:].tolist() == [1, 1]


def test_long_examples_are_cut_at_seq_len():
    row = llm.sft_example(TOK, {"prompt": "ab", "completion": "cdefghij"}, 5)
    assert len(row["inputs"]) == 5 and row["targets"].tolist() == _ids("bcdef")


@pytest.mark.parametrize("example, match", [
    ({"text": "ab"}, "expected the key 'messages', or 'prompt' and 'completion'"),
    ({"messages": [{"role": "user", "content": "ab"}]}, "no assistant message"),
    ({"messages": []}, "non-empty list"),
    ({"prompt": "ab", "completion": [{"role": "assistant", "content": "b"}]}, "both be strings or both be message lists"),
    ("ab", "expected a dict"),
])
def test_bad_examples_are_named(example, match):
    with pytest.raises(ValueError, match=f"example 7: .*{match}"):
        llm.sft_example(TOK, example, 16, where="example 7")


def test_a_template_that_rewrites_earlier_turns_is_refused():
    # drops every assistant turn but the last from the history (as reasoning templates do)
    template = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}\n{% elif loop.last %}"
                "<|assistant|>{{ m['content'] }}</s>{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    ex = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                       {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
    with pytest.raises(ValueError, match="does not render the conversation up to message 1 as a prefix"):
        llm.sft_example(chat_tokenizer(template), ex, 64)


def test_packed_examples_give_the_logits_they_give_alone():
    model = tiny_chat_model()
    a, b = _ids("<|user|>abc\n<|assistant|>bcd</s>"), _ids("<|user|>zz\n<|assistant|>aa</s>")
    packed = jnp.asarray([a + b])
    seg = jnp.asarray([[1] * len(a) + [2] * len(b)])
    pos = jnp.asarray([list(range(len(a))) + list(range(len(b)))])
    fwd = nn.jit(lambda m, ids, pos=None, seg=None: m(ids, positions=pos, segment_ids=seg))
    got = np.asarray(fwd(model, packed, pos, seg))[0]
    np.testing.assert_allclose(got[: len(a)], np.asarray(fwd(model, jnp.asarray([a])))[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[len(a):], np.asarray(fwd(model, jnp.asarray([b])))[0], rtol=1e-5, atol=1e-5)
    # without segment ids the second example sees the first: different logits
    assert not np.allclose(np.asarray(fwd(model, packed, pos))[0, len(a):], got[len(a):], atol=1e-4)
    with pytest.raises(ValueError, match="segment_ids must be"):
        model(packed, segment_ids=seg[:, :3])


def test_dataset_batches_have_the_documented_layout():
    it = iter(llm.sft_dataset(successor_chats(40), TOK, seq_len=32, batch_size=4, packing=True))
    batch = next(it)
    assert set(batch) == {"inputs", "targets", "weights", "segment_ids", "positions"}
    assert all(v.shape == (4, 32) for v in batch.values())
    real = batch["segment_ids"] > 0
    np.testing.assert_array_equal(batch["inputs"][:, 1:][real[:, 1:] & (batch["segment_ids"][:, 1:] == batch["segment_ids"][:, :-1])],
                                  batch["targets"][:, :-1][real[:, 1:] & (batch["segment_ids"][:, 1:] == batch["segment_ids"][:, :-1])])
    assert (batch["weights"][~real] == 0).all() and batch["weights"].sum() > 0
    padded = next(iter(llm.sft_dataset(successor_chats(8), TOK, seq_len=16, batch_size=2, packing=False)))
    assert set(np.unique(padded["segment_ids"])) <= {0, 1}


def _config(**kw) -> llm.SFTConfig:
    base = dict(steps=4, batch_size=4, seq_len=32, learning_rate=1e-2, log_every=1, save_every=2, max_grad_norm=None,
                lora=llm.LoraSettings(rank=4, alpha=8.0))
    return llm.SFTConfig(**{**base, **kw})


def _trainable(trainer) -> dict:
    return {str(k): np.asarray(v[...]) for k, v in nn.state(trainer.trainable.model, trainer.trainable.wrt).flat_state().items()}


def test_the_step_loss_is_the_mean_nll_of_completion_tokens_float64(tmp_path):
    trainer = llm.SFTTrainer(tiny_chat_model(), TOK, successor_chats(20), _config(steps=1), tmp_path)
    batch = next(iter(llm.sft_dataset(successor_chats(20), TOK, seq_len=32, batch_size=4, seed=0)))
    logits = np.asarray(trainer.runner()(jnp.asarray(batch["inputs"]), positions=jnp.asarray(batch["positions"]),
                                         segment_ids=jnp.asarray(batch["segment_ids"])), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    want = (nll * batch["weights"]).sum() / batch["weights"].sum()
    frozen = {str(k): np.asarray(v[...]) for k, v in nn.state(trainer.trainable.model, nn.Param).flat_state().items()
              if "lora" not in str(k)}
    out = trainer.train()
    np.testing.assert_allclose(out["loss"], want, rtol=1e-5)
    # LoRA: the base stays bit for bit
    for k, v in nn.state(trainer.trainable.model, nn.Param).flat_state().items():
        if "lora" not in str(k):
            np.testing.assert_array_equal(np.asarray(v[...]), frozen[str(k)])
    assert out["completion_tokens"] == batch["weights"].sum()
    trainer.close()


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    # plain SGD: the update is the gradient itself (Adam would amplify float noise in tiny gradients)
    data, sgd = successor_chats(64), optim.sgd(1.0)
    one = llm.SFTTrainer(tiny_chat_model(), TOK, data, _config(steps=1, batch_size=4, packing=False), tmp_path / "a",
                         optimizer=sgd)
    acc = llm.SFTTrainer(tiny_chat_model(), TOK, data, _config(steps=1, batch_size=2, grad_accum_steps=2, packing=False),
                         tmp_path / "b", optimizer=sgd)
    start = _trainable(one)
    one.train(), acc.train()
    a, b = _trainable(one), _trainable(acc)
    assert any(not np.array_equal(a[k], start[k]) for k in a)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-7, err_msg=k)
    one.close(), acc.close()


@pytest.mark.parametrize("lora", [pytest.param(None, marks=pytest.mark.slow), llm.LoraSettings(rank=4, alpha=8.0)],
                         ids=["full", "lora"])
@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_resume_is_bit_identical(tmp_path, lora):
    data = successor_chats(48)
    straight = llm.SFTTrainer(tiny_chat_model(), TOK, data, _config(steps=4, lora=lora), tmp_path / "straight")
    straight.train()
    straight.close()
    first = llm.SFTTrainer(tiny_chat_model(), TOK, data, _config(steps=4, lora=lora), tmp_path / "resumed")
    first.train(stop_after=3)  # as if preempted after step 3 (checkpoints at 2 and 3)
    first.close()
    second = llm.SFTTrainer(tiny_chat_model(), TOK, data, _config(steps=4, lora=lora), tmp_path / "resumed")
    assert second.step == 3
    second.train()
    second.close()
    a, b = _trainable(straight), _trainable(second)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)
    lines = lambda d: [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert [r["loss"] for r in lines("resumed")] == [r["loss"] for r in lines("straight")]
    assert [r["step"] for r in lines("resumed")] == [1, 2, 3, 4]


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_resume_refuses_another_config_or_base(tmp_path):
    data = successor_chats(16)
    t = llm.SFTTrainer(tiny_chat_model(), TOK, data, _config(steps=2), tmp_path)
    t.train()
    t.close()
    with pytest.raises(ValueError, match=r"another trainer config \(differs in \['learning_rate', 'steps'\]\)"):
        llm.SFTTrainer(tiny_chat_model(), TOK, data, _config(steps=3, learning_rate=5e-3), tmp_path)
    with pytest.raises(ValueError, match="trained adapters on another base model"):
        llm.SFTTrainer(tiny_chat_model(seed=1), TOK, data, _config(steps=2), tmp_path)


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_qlora_keeps_the_base_quantized_and_trains_the_adapters(tmp_path):
    model = tiny_chat_model()
    t = llm.SFTTrainer(model, TOK, successor_chats(16), _config(steps=2, lora=llm.LoraSettings(rank=4, alpha=8.0,
                                                                                          weight_qtype="nf4")), tmp_path)
    kernel = model.layers[0].attn.q.kernel[...]
    assert isinstance(kernel, QArray) and kernel.qtype == "nf4"
    before = np.asarray(kernel.qvalue).copy()
    lora_b = np.asarray(model.layers[0].attn.q.lora["lora_b"][...]).copy()
    t.train()
    t.close()
    after = model.layers[0].attn.q.kernel[...]
    assert isinstance(after, QArray) and np.array_equal(np.asarray(after.qvalue), before)
    assert not np.array_equal(np.asarray(model.layers[0].attn.q.lora["lora_b"][...]), lora_b)
    merged = llm.merge_lora(t.runner())
    assert not isinstance(merged.layers[0].attn.q.kernel[...], QArray)


@pytest.mark.slow  # ~30 s: 60 optimizer steps and two rounds of generation
def test_sft_with_lora_teaches_the_chat_task(tmp_path):
    data = successor_chats(660)
    train, held = data[:600], data[600:]
    t = llm.SFTTrainer(tiny_chat_model(layers=2), TOK, train, llm.SFTConfig(
        steps=80, batch_size=16, seq_len=64, learning_rate=3e-3, log_every=10, save_every=1000,
        lora=llm.LoraSettings(rank=8, alpha=16.0)), tmp_path)
    before = t.exact_match(held, 8)
    t.train()
    after = t.exact_match(held, 8)
    t.close()
    assert before <= 0.05 and after >= 0.9, (before, after)
    assert llm.plot_metrics(tmp_path).endswith("loss.png")
    losses = [r["loss"] for r in llm.read_metrics(tmp_path)]
    assert losses[-1] < losses[0]


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="SFTConfig.batch_size must be a positive integer"):
        llm.SFTConfig(steps=3, batch_size=0)
    with pytest.raises(TypeError, match="config must be an SFTConfig"):
        llm.SFTTrainer(tiny_chat_model(), TOK, [], {"steps": 3}, "/nonexistent")
