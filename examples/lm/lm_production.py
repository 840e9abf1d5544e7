"""The production steps after training: quantize, score by generation, export, serve, load-test.

``after_training(setup, model, eval_texts, report)`` is lm_train.train()'s hook. It adds to
``report``:

- ``generation``: held-out exact match of the float model by greedy generation through the
  KV cache (not teacher forcing), and for every ``quant.methods`` variant, with its
  parameter bytes and quantization time (``report["quant"]``);
- ``serving``: the exported repository, the server's start-up time, a tritonclient
  ``/infer`` check, and per ``serve.concurrency`` level the served exact match, tokens/s,
  time to first token and p50/p99 latency; the served answers are compared one by one with
  the in-process answers of the same variant (``differing_answers`` must be 0); every
  request's latency and time to first token and the machine's load per level (the latency
  plot ``serving_latency.png``); ``try``: a request to try on the served model
  (``lm_report.format_try_it`` prints how).

The steps are skipped, with the reason in ``report["production_skipped"]``, in multi-process
runs, for data sources other than the synthetic addition task (whose answers can be checked),
and when both ``quant`` and ``serve`` are disabled. A step that fails leaves its error in
``report["production_error"]`` (the training report is still written; train.py exits 1).

Preemption: a ``SIGTERM`` from the end of pretraining on is recorded
(``lm_posttrain.Preemption``); the post-training stages stop at their next checkpoint, and
quantize, export and serve at their next boundary (after a variant is quantized or scored,
after the export, between the server's checks and load levels: the server is stopped first).
Then ``run.dir/PREEMPTED.json`` names the stage and the job exits 75. These three steps keep
nothing between runs (``serving/`` is exported afresh), so the same command again restores
pretraining's last checkpoint, skips or resumes the post-training stages, and does the
interrupted step and those after it again, with the same results.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import lm_generate
import lm_posttrain
import lm_quant
import lm_serve
import lm_task

from cairn import llm


def skip_reason(cfg: Any) -> str | None:
    """Why the production steps do not run for this config/process layout, or None."""
    if jax.process_count() > 1:
        return "multi-process run: quantize/export/serve run single-process (serve the checkpoint separately)"
    if cfg.data.source != "synthetic":
        return f"data.source = {cfg.data.source!r}: generation is scored on the synthetic addition task only"
    if not cfg.quant.enabled and not cfg.serve.enabled and not cfg.posttrain.enabled:
        return "posttrain.enabled, quant.enabled and serve.enabled are all false"
    return None


def _log(quiet: bool, msg: str) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _no_check(stage: str) -> None:
    return None


def quantize_and_score(cfg: Any, model: llm.CausalLM, eval_texts: list[str], quiet: bool, tok: Any = None,
                       codec: Any = None, chat: Any = None,
                       check: Callable[[str], None] = _no_check) -> tuple[dict, int, dict]:
    """Build every variant and score it by greedy generation; (variants, max_length, report
    entries). ``tok``/``codec``: the run's tokenizer (default bytes); ``chat``: score chat prompts;
    ``check(stage)``: called at each boundary (leaves on a preemption notice)."""
    length = lm_generate.max_length(cfg)
    t0 = time.perf_counter()
    variants = lm_quant.build_variants(cfg, model, tok)
    quant_s = time.perf_counter() - t0
    check("quantize")
    scores: dict[str, Any] = {}
    for name, v in variants.items():
        t1 = time.perf_counter()
        lm_quant.score(v, eval_texts, cfg.serve.max_new_tokens, length, max(cfg.serve.num_slots, 64), codec, chat)
        scores[name] = {"exact_match": v.exact_match, "param_bytes": v.param_bytes,
                        "quantize_s": v.quantize_s, "generate_s": time.perf_counter() - t1}
        _log(quiet, f"generation: {name:8s} held-out exact match {v.exact_match:.2%} "
                    f"({v.param_bytes / 2**10:,.0f} KiB of parameters)")
        check("quantize")
    entries = {"generation": {"examples": len(eval_texts), "max_new_tokens": cfg.serve.max_new_tokens,
                              "max_length": length, "variants": scores, "prompts": "chat" if chat is not None else "plain"},
               "quant": {"methods": list(cfg.quant.methods) if cfg.quant.enabled else [], "seconds": quant_s,
                         "tile_size": cfg.quant.tile_size, "calibration_batches": cfg.quant.calibration_batches}}
    return variants, length, entries


def serve_and_measure(cfg: Any, run_dir: Any, variants: dict, length: int, eval_texts: list[str],
                      quiet: bool, tok: Any = None, codec: Any = None, chat: Any = None,
                      check: Callable[[str], None] = _no_check) -> dict[str, Any]:
    """Export ``serve.models``, start cairn-serve, query it at each concurrency; the serving report.

    ``tok``/``codec``: the run's tokenizer (exported with the model); ``chat``: the prompts
    are the problems' chat form, also asked through the ``openai`` client; ``check(stage)``:
    called at each boundary (a preemption leaves through it, the server stopped on the way).
    """
    s = cfg.serve
    repo = run_dir / "serving"
    _log(quiet, f"serving: exporting {', '.join(s.models)} to {repo}")
    out = lm_serve.export_repository(variants, s.models, length, repo, num_slots=s.num_slots, prefill_batch=s.prefill_batch,
                                     tokenizer=tok, block_size=s.block_size if s.kv_layout == "paged" else None)
    check("export")
    _log(quiet, f"serving: exported {', '.join(s.models)} in {out['export_s']:.1f} s; starting cairn-serve")
    prompts, _ = zip(*(lm_generate.chat_prompt(chat, t) if chat is not None else lm_generate.problem_prompt(t, codec)
                              for t in eval_texts))
    with lm_serve.ServerProcess(repo, timeout=s.startup_timeout) as server:
        out["startup_s"] = server.startup_s
        _log(quiet, f"serving: cairn-serve ready on port {server.port} after {server.startup_s:.1f} s")
        check("serve")
        assert server.port is not None
        for name in s.models:
            out["models"][name].update(_measure_model(server, name, variants[name], length, list(prompts),
                                                      list(eval_texts), cfg, quiet, codec, chat is not None, check))
        out["exit_code"] = server.stop()
    out["latency_plot"] = str(run_dir / "serving_latency.png")  # lm_report.write_report draws it
    first = s.models[0]
    text = eval_texts[0]
    out["try"] = {"model": lm_serve.model_name(first), "prompt": text.split("=", 1)[0] + "=",
                  "expected": text.split("=", 1)[1], "answer": variants[first].answers[0],
                  "max_tokens": s.max_new_tokens}
    if chat is not None:
        out["try"]["messages"] = lm_task.chat_messages(text, False)
    return out


def _measure_model(server: Any, name: str, variant: lm_quant.Variant, length: int, prompts: list, texts: list[str],
                   cfg: Any, quiet: bool, codec: Any = None, chat: bool = False,
                   check: Callable[[str], None] = _no_check) -> dict[str, Any]:
    s, port = cfg.serve, server.port
    expected = [t.split("=", 1)[1] for t in texts]
    gen_model = lm_serve.model_name(name)
    nxt, client = lm_serve.infer_next_token(port, f"{gen_model}_next_token", prompts[:8], length)
    first = [t[0] for t in lm_generate.greedy(variant.model, prompts[:8], 1, length, 8)]
    infer_ok = [int(t) for t in nxt] == first
    # plain /generate calls first: they also warm the engine (its first chunks compile) before the timed levels
    answers = lm_serve.generate_all(port, gen_model, prompts, s.max_new_tokens, max(s.concurrency), codec)
    served = sum(a == e for a, e in zip(answers, expected)) / len(expected)
    check("serve")
    levels = []
    for c in s.concurrency:
        lv = lm_serve.load_test(port, gen_model, prompts, s.max_new_tokens, c, codec)
        answers = lv.pop("answers")
        lv["exact_match"] = sum(a == e for a, e in zip(answers, expected)) / len(expected)
        lv["differing_answers"] = sum(a != b for a, b in zip(answers, variant.answers))
        levels.append(lv)
        _log(quiet, f"serving: {name} c={c:<3d} exact match {lv['exact_match']:.2%} "
                    f"({lv['differing_answers']} differ from in-process), {lv['tokens_per_s']:,.0f} tok/s, "
                    f"TTFT p50 {lv['ttft_p50_ms']:.1f} ms, latency p50 {lv['latency_p50_ms']:.1f} / "
                    f"p99 {lv['latency_p99_ms']:.1f} ms")
        check("serve")
    out = {"infer_next_token_matches": infer_ok, "infer_client": client, "levels": levels, "served_exact_match": served,
           "inprocess_exact_match": variant.exact_match,
           "differing_answers": sum(a != b for a, b in zip(answers, variant.answers))}
    if chat:
        out["openai"] = _openai_checks(port, gen_model, variant, texts, cfg, quiet)
        check("serve")
    out["prefix_cache"] = lm_serve.prefix_cache_stats(server, gen_model)
    if out["prefix_cache"]:
        _log(quiet, f"serving: {name} prefix-cache hit rate {out['prefix_cache']['prefix_cache_hit_rate']:.2%} "
                    f"({out['prefix_cache'].get('prefix_cache_hit_tokens', 0):,} of "
                    f"{out['prefix_cache'].get('prefix_cache_query_tokens', 0):,} prompt tokens)")
    return out


def _openai_checks(port: int, model: str, variant: lm_quant.Variant, texts: list[str], cfg: Any,
                   quiet: bool) -> dict[str, Any]:
    """Every held-out problem through the official ``openai`` client's chat completions (and
    ``serve.openai_streamed`` of them streamed): answers against the in-process ones."""
    s = cfg.serve
    expected = [t.split("=", 1)[1] for t in texts]
    convs = [lm_task.chat_messages(t, False) for t in texts]
    out: dict[str, Any] = {}
    for mode, n in (("chat", len(convs)), ("chat_stream", min(len(convs), s.openai_streamed))):
        if n == 0:
            continue
        t0 = time.perf_counter()
        got = lm_serve.openai_chat(port, model, convs[:n], s.max_new_tokens, max(s.concurrency), stream=mode != "chat")
        got = [g.strip() for g in got]
        out[mode] = {"requests": n, "seconds": time.perf_counter() - t0,
                     "exact_match": sum(g == e for g, e in zip(got, expected)) / n,
                     "differing_answers": sum(g != a for g, a in zip(got, variant.answers))}
        _log(quiet, f"serving: {variant.name} openai client {mode.replace('_', ' ')}: {n} requests, exact match "
                    f"{out[mode]['exact_match']:.2%}, {out[mode]['differing_answers']} differ from in-process")
    return out


def after_training(setup: Any, model: llm.CausalLM, eval_texts: list[str], report: dict, *, quiet: bool = False) -> None:
    """lm_train.train()'s hook: post-training (lm_posttrain: hand-over through a Hugging Face
    checkpoint, SFT, GRPO), then the production steps on the last stage's model, their
    results written into ``report``."""
    cfg = setup.cfg
    reason = skip_reason(cfg)
    if reason is not None:
        report["production_skipped"] = reason
        return
    t0 = time.perf_counter()
    with lm_posttrain.Preemption() as notice:  # a SIGTERM: exit 75 at the next boundary (module docstring)
        _stages(setup, model, eval_texts, report, quiet, notice, t0)
    report["production_s"] = time.perf_counter() - t0
    report["end_to_end_s"] = report["wall_s"] + report["production_s"]


def _stages(setup: Any, model: llm.CausalLM, eval_texts: list[str], report: dict, quiet: bool,
            notice: lm_posttrain.Preemption, t0: float) -> None:
    """Post-training, quantize, export, serve (as configured), their entries into ``report``;
    an error is recorded there (``production_error``), a preemption leaves (exit 75)."""
    cfg = setup.cfg
    tok, codec, chat = setup.tokenizer, setup.codec, None

    def check(stage: str) -> None:
        notice.stop_here(setup.run_dir, stage, cfg.train.steps)

    try:
        if cfg.posttrain.enabled:
            model, tok, report["posttrain"] = lm_posttrain.run(cfg, setup.run_dir, model, tok, eval_texts, quiet, notice)
            chat = tok
            report["posttrain_s"] = time.perf_counter() - t0
        if not cfg.quant.enabled and not cfg.serve.enabled:
            return
        variants, length, entries = quantize_and_score(cfg, model, eval_texts, quiet, tok, codec, chat, check)
        report.update(entries)
        if cfg.serve.enabled:
            report["serving"] = serve_and_measure(cfg, setup.run_dir, variants, length, eval_texts, quiet, tok, codec,
                                                  chat, check)
    except Exception as e:  # the training report is still written; train.py exits 1
        traceback.print_exc(file=sys.stderr)
        report["production_error"] = f"{type(e).__name__}: {e}"
