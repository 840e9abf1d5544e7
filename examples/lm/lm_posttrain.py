"""The stages after pretraining, handed over through Hugging Face checkpoints.

1. ``handover``: the pretrained model goes out with ``cairn.llm.save_pretrained`` (sharded
   safetensors, ``config.json``) and the run's tokenizer with its chat template
   (``Tokenizer.save_pretrained``) into ``run.dir/hf/pretrained``;
2. SFT: ``from_pretrained`` of that directory (as a user with a downloaded model would start),
   ``cairn.llm.SFTTrainer`` with LoRA on chat-formatted problems (``lm_task.chat_messages``:
   system prompt, question, answer), the adapters merged (``merge_lora``) and saved to
   ``run.dir/hf/sft``;
3. GRPO: ``from_pretrained`` of ``hf/sft``, ``cairn.llm.GRPOTrainer`` with LoRA and the task's
   reward (1 for the exact answer, else 0), merged and saved to ``run.dir/hf/grpo``, which the
   production steps (quantize, export, serve) load.

After each stage the held-out problems are answered by greedy generation (``cairn.llm.generate``
through the KV cache) and scored by exact match. Each trainer keeps its run in
``run.dir/sft`` / ``run.dir/grpo`` (checkpoints, ``metrics.jsonl``, ``loss.png``), and a
finished stage leaves ``stage.json`` (its report) there, so a second start skips it.

Preemption: a ``SIGTERM`` during a stage lets the trainer run to its next checkpoint (at
most ``posttrain.save_every`` steps), waits for the commit, writes ``run.dir/PREEMPTED.json``
and exits with status 75; the same command again resumes the stage from that checkpoint
(the trainers restore the adapters, optimizer and data position: bit-identical). The
`Preemption` notice also covers the production steps after these stages (lm_production),
which stop at their boundaries and are done again on the next start.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import signal
import sys
import time
from typing import Any

import jax.numpy as jnp
import lm_generate
import lm_task

from cairn import checkpoint as ckpt
from cairn import llm


class Preemption:
    """Records a ``SIGTERM`` from the end of pretraining to the end of the production steps
    (the trainers' checkpoint managers chain their own handlers to this one); a context
    manager that puts the earlier handler back. The stages ask `stop_here` at their
    boundaries."""

    def __init__(self) -> None:
        self.noticed = False
        self._previous: Any = None

    def __enter__(self) -> Preemption:
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: no notice can be recorded
            self._previous = None
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.noticed = True

    def __exit__(self, *_: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def stop_here(self, run_dir: pathlib.Path, stage: str, train_steps: int) -> None:
        """After a notice: ``PREEMPTED.json`` naming ``stage`` (a step without a checkpoint of
        its own: quantize, export, serve; the next start redoes it) and exit 75."""
        if self.noticed:
            _mark_preempted(run_dir, stage, None, train_steps)


def _log(quiet: bool, msg: str) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def hf_dir(run_dir: pathlib.Path, stage: str) -> pathlib.Path:
    return pathlib.Path(run_dir) / "hf" / stage


def save_hf(model: llm.CausalLM, tok: llm.Tokenizer, path: pathlib.Path, shard_size: str) -> list[str]:
    """``save_pretrained`` of the model and the tokenizer into ``path``, whole or absent (written
    beside it, then renamed): the files written."""
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    files = llm.save_pretrained(model, tmp, max_shard_size=shard_size)
    tok.save_pretrained(tmp)
    if path.exists():
        shutil.rmtree(path)
    tmp.replace(path)
    return sorted(pathlib.Path(f).name for f in files)


def load_hf(path: pathlib.Path) -> tuple[llm.CausalLM, llm.Tokenizer]:
    """The model (float32) and the tokenizer of a Hugging Face directory, as a user loads them."""
    return llm.from_pretrained(path, dtype=jnp.float32), llm.Tokenizer.from_pretrained(path)


def handover(model: llm.CausalLM, tok: llm.Tokenizer, run_dir: pathlib.Path, shard_size: str) -> dict:
    """The pretrained model and tokenizer into ``run.dir/hf/pretrained``; what was written."""
    path = hf_dir(run_dir, "pretrained")
    t0 = time.perf_counter()
    files = save_hf(model, tok, path, shard_size)
    shards = [f for f in files if f.endswith(".safetensors")]
    return {"path": str(path), "files": files, "shards": len(shards), "save_s": time.perf_counter() - t0}


def _stage_done(run_dir: pathlib.Path, stage: str) -> dict | None:
    """A finished stage's report (its ``stage.json`` and its Hugging Face directory), marked
    as skipped, else None."""
    try:
        report = json.loads((pathlib.Path(run_dir) / stage / "stage.json").read_text())
    except (OSError, ValueError):
        return None
    if not (hf_dir(run_dir, stage) / "config.json").is_file():
        return None
    return {**report, "skipped": "finished by an earlier run"}


def _train(trainer: Any, steps: int, every: int, stage: str, run_dir: pathlib.Path, notice: Preemption,
           train_steps: int) -> None:
    """``trainer.train()`` in pieces that end at its checkpoints; after a ``SIGTERM`` the piece
    running finishes (its checkpoint committed), then PREEMPTED.json and exit 75."""
    while trainer.step < steps:
        trainer.train(stop_after=min(steps, (trainer.step // every + 1) * every))
        if notice.noticed and trainer.step < steps:
            trainer.close()
            _mark_preempted(run_dir, stage, trainer.step, train_steps)


def _mark_preempted(run_dir: pathlib.Path, stage: str, step: int | None, train_steps: int) -> None:
    """``PREEMPTED.json`` (step ``train_steps``: pretraining's last, committed) and exit 75.
    ``step``: the stage's committed checkpoint; None for a stage without checkpoints, which
    the next start does again."""
    import lm_cli

    marker = pathlib.Path(run_dir) / lm_cli.PREEMPTED_FILE
    marker.write_text(json.dumps({"step": train_steps, "stage": stage, "stage_step": step, "time": time.time(),
                                  "exit_code": ckpt.PREEMPTION_EXIT_CODE}))
    if step is None:
        where = (f"preempted during {stage}: the stages before it are saved in {pathlib.Path(run_dir)} and "
                 f"{stage} is done again on the next start")
        how = "to do it again"
    else:
        where = f"preempted: {stage} step {step} is committed in {pathlib.Path(run_dir) / stage / 'checkpoints'}"
        how = "to resume from it"
    print(f"{where}; exiting with status {ckpt.PREEMPTION_EXIT_CODE}. Start `{lm_cli.command()}` with the same "
          f"settings again {how} (no --resume needed).", file=sys.stderr, flush=True)
    raise SystemExit(ckpt.PREEMPTION_EXIT_CODE)


def _lora(cfg: Any) -> llm.LoraSettings:
    p = cfg.posttrain
    return llm.LoraSettings(rank=p.lora_rank, alpha=p.lora_alpha, target_modules="all-linear", seed=cfg.run.seed)


def train_texts(cfg: Any) -> list[str]:
    """The post-training problems: the first ``posttrain.num_train`` of the training split."""
    return lm_task.make_problems(cfg.posttrain.num_train, cfg.data.max_digits, cfg.run.seed, held_out=False)


def score(cfg: Any, model: Any, tok: llm.Tokenizer, eval_texts: list[str]) -> tuple[float, list[str]]:
    """Held-out exact match of ``model`` on the chat form of ``eval_texts`` by greedy generation."""
    import lm_tokenizer

    return lm_generate.exact_match(model, eval_texts, cfg.serve.max_new_tokens, lm_generate.max_length(cfg),
                                   batch=128, codec=lm_tokenizer.Codec.of(tok), chat=tok)


def _finish(cfg: Any, run_dir: pathlib.Path, stage: str, trainer: Any, tok: llm.Tokenizer, eval_texts: list[str],
            keys: tuple[str, ...], t0: float) -> dict:
    """Merge the adapters, score, plot, save the Hugging Face directory and the stage's report."""
    merged = llm.merge_lora(trainer.runner())
    trainer.close()
    acc, _ = score(cfg, merged, tok, eval_texts)
    plot = llm.plot_metrics(run_dir / stage, keys)
    files = save_hf(merged, tok, hf_dir(run_dir, stage), cfg.posttrain.hf_shard_size)
    metrics = llm.read_metrics(run_dir / stage)
    report = {"heldout_exact_match": acc, "steps": trainer.step, "hf_dir": str(hf_dir(run_dir, stage)),
              "hf_files": files, "loss_plot": plot, "seconds": time.perf_counter() - t0,
              "curve": [[m["step"], m.get("loss")] for m in metrics],
              "rewards": [[m["step"], m["reward"]] for m in metrics if m.get("reward") is not None],
              # GRPO: the share of groups whose samples' rewards differ (the others give no advantage)
              "groups_nonzero_std": [[m["step"], m["groups_nonzero_std"]] for m in metrics
                                     if m.get("groups_nonzero_std") is not None],
              "last": metrics[-1] if metrics else {}}
    (run_dir / stage / "stage.json").write_text(json.dumps(report, indent=1))
    return report


def sft(cfg: Any, run_dir: pathlib.Path, eval_texts: list[str], notice: Preemption, quiet: bool) -> dict:
    """SFT with LoRA from ``hf/pretrained`` to ``hf/sft`` (module docstring); its report."""
    if (done := _stage_done(run_dir, "sft")) is not None:
        return done
    t0 = time.perf_counter()
    p = cfg.posttrain
    model, tok = load_hf(hf_dir(run_dir, "pretrained"))
    before, _ = score(cfg, model, tok, eval_texts)
    chats = [{"messages": lm_task.chat_messages(t)} for t in train_texts(cfg)]
    config = llm.SFTConfig(steps=p.sft_steps, batch_size=p.sft_batch_size, seq_len=cfg.data.seq_len,
                           learning_rate=p.sft_learning_rate, warmup_steps=max(1, p.sft_steps // 10),
                           lora=_lora(cfg), save_every=p.save_every, log_every=1, seed=cfg.run.seed)
    trainer = llm.SFTTrainer(model, tok, chats, config, run_dir / "sft")
    resumed = trainer.step
    _log(quiet, f"sft: LoRA rank {p.lora_rank} on {len(chats)} chat examples, {p.sft_steps} steps"
                + (f" (resumed from step {resumed})" if resumed else "") + f"; before: exact match {before:.2%}")
    _train(trainer, p.sft_steps, p.save_every, "sft", run_dir, notice, cfg.train.steps)
    report = _finish(cfg, run_dir, "sft", trainer, tok, eval_texts, ("loss",), t0)
    report.update(heldout_exact_match_before=before, resumed_from=resumed or None)
    (run_dir / "sft" / "stage.json").write_text(json.dumps(report, indent=1))
    _log(quiet, f"sft: held-out exact match {before:.2%} -> {report['heldout_exact_match']:.2%} (chat prompts, "
                f"greedy generation); saved {hf_dir(run_dir, 'sft')}")
    return report


def exact_answer(prompts: list[Any], completions: list[str], examples: list[dict]) -> list[float]:
    """The task's reward: 1.0 for the exact answer (surrounding whitespace ignored), else 0.0."""
    return [float(c.strip() == ex["answer"]) for c, ex in zip(completions, examples, strict=True)]


def grpo(cfg: Any, run_dir: pathlib.Path, eval_texts: list[str], notice: Preemption, quiet: bool) -> dict:
    """GRPO with LoRA and `exact_answer` from ``hf/sft`` to ``hf/grpo``; its report."""
    if (done := _stage_done(run_dir, "grpo")) is not None:
        return done
    t0 = time.perf_counter()
    p = cfg.posttrain
    model, tok = load_hf(hf_dir(run_dir, "sft"))
    prompts = [{"prompt": lm_task.chat_messages(t, False), "answer": t.split("=", 1)[1]} for t in train_texts(cfg)]
    config = llm.GRPOConfig(steps=p.grpo_steps, prompts_per_batch=p.grpo_prompts, num_generations=p.grpo_generations,
                            max_new_tokens=cfg.serve.max_new_tokens, temperature=p.grpo_temperature,
                            learning_rate=p.grpo_learning_rate, warmup_steps=max(1, p.grpo_steps // 10),
                            beta=p.grpo_beta, lora=_lora(cfg),
                            save_every=p.save_every, seed=cfg.run.seed)
    trainer = llm.GRPOTrainer(model, tok, prompts, exact_answer, config, run_dir / "grpo")
    resumed = trainer.step
    _log(quiet, f"grpo: LoRA rank {p.lora_rank}, {p.grpo_steps} steps of {p.grpo_prompts} prompts x "
                f"{p.grpo_generations} samples, reward: exact answer" + (f" (resumed from step {resumed})" if resumed else ""))
    _train(trainer, p.grpo_steps, p.save_every, "grpo", run_dir, notice, cfg.train.steps)
    report = _finish(cfg, run_dir, "grpo", trainer, tok, eval_texts, ("loss", "reward"), t0)
    report["resumed_from"] = resumed or None
    (run_dir / "grpo" / "stage.json").write_text(json.dumps(report, indent=1))
    _log(quiet, f"grpo: held-out exact match {report['heldout_exact_match']:.2%}; saved {hf_dir(run_dir, 'grpo')}")
    return report


def check_context(cfg: Any, tok: llm.Tokenizer) -> None:
    """Raise ValueError naming ``data.seq_len`` when the longest chat prompt of the task plus
    ``serve.max_new_tokens`` does not fit the trained context (SFT would cut the answers off)."""
    digits = cfg.data.max_digits
    widest = f"{'9' * digits}+{'9' * digits}={'8' + '9' * (digits - 1) + '1'}"
    need = len(tok.apply_chat_template(lm_task.chat_messages(widest, False), tokenize=True)) + cfg.serve.max_new_tokens
    if need > cfg.data.seq_len:
        raise ValueError(f"config key 'data.seq_len': {cfg.data.seq_len} positions cannot hold a chat prompt of "
                         f"{need - cfg.serve.max_new_tokens} tokens plus serve.max_new_tokens = {cfg.serve.max_new_tokens}; "
                         f"use data.seq_len >= {need} or posttrain.enabled = false")


def run(cfg: Any, run_dir: pathlib.Path, model: llm.CausalLM, tok: llm.Tokenizer, eval_texts: list[str],
        quiet: bool, notice: Preemption) -> tuple[llm.CausalLM, llm.Tokenizer, dict]:
    """Hand over, SFT, GRPO (module docstring): the final model and tokenizer, loaded with
    ``from_pretrained`` from the last stage's directory, and the report entries. ``notice``:
    the `Preemption` (entered) the stages stop on."""
    run_dir = pathlib.Path(run_dir)
    evals = eval_texts[: cfg.posttrain.num_eval]
    check_context(cfg, tok)
    out: dict[str, Any] = {"handover": handover(model, tok, run_dir, cfg.posttrain.hf_shard_size)}
    _log(quiet, f"handover: save_pretrained -> {out['handover']['path']} ({out['handover']['shards']} shards); "
                "the next stage starts from from_pretrained of it")
    notice.stop_here(run_dir, "handover", cfg.train.steps)
    out["sft"] = sft(cfg, run_dir, evals, notice, quiet)
    out["grpo"] = grpo(cfg, run_dir, evals, notice, quiet)
    out["examples"] = len(evals)
    final, final_tok = load_hf(hf_dir(run_dir, "grpo"))
    return final, final_tok, out
