"""The Cairn reference recipe: train a small decoder-only LM end to end.

    python examples/lm/train.py                         # default config (config.toml)
    python examples/lm/train.py --set train.steps=200   # override any key
    python examples/lm/train.py --resume                # continue from the latest checkpoint
    python examples/lm/train.py --overwrite             # delete run.dir's checkpoints, start afresh
    python examples/lm/train.py --profile               # also trace steps 10..14: run.dir/profile/

A run directory that already holds checkpoints is never trained into silently: without
--resume or --overwrite the script stops at once (exit code 2) naming the directory.
--resume on a run that already reached train.steps changes nothing and says so; a resumed
run's report and loss curve cover every step since the start (the loss history is saved
with each checkpoint).

Preemption: on SIGTERM the run saves the step it is at (model, optimizer, data position)
at the next step boundary, waits for the commit and exits with status 75
(cairn.checkpoint.PREEMPTION_EXIT_CODE); started again with the same settings, it resumes
from that step by itself (no --resume needed), e.g. under a supervisor:

    until python examples/lm/train.py; [ $? -ne 75 ] && break; done

The report covers every run and gives the goodput fraction over all of them.

Multi-host: start one process per host with --coordinator HOST:PORT --num-processes N
--process-id I (JAX's own distributed runtime); the same config then shards data and
model over every device of every process.

The tokenizer is a byte-level BPE the job trains on its own corpus (lm_tokenizer), saved in
run.dir/tokenizer. After pretraining (a run that reached train.steps) the later stages run
in the same process, each handing over to the next through a Hugging Face checkpoint
(lm_posttrain): save_pretrained into run.dir/hf/pretrained, SFT with LoRA on chat-formatted
problems from from_pretrained of it (run.dir/hf/sft), GRPO with the exact-answer reward from
that (run.dir/hf/grpo); then the production steps (lm_production): the last stage's model is
quantized (w8, w4 GPTQ), scored by greedy generation, exported with its tokenizer and chat
template into run.dir/serving and served by cairn-serve in a subprocess, asked through
/generate_stream, tritonclient's /infer and the openai client's chat completions, load-tested
and stopped. `--set posttrain.enabled=false quant.enabled=false serve.enabled=false` stops
after pretraining. A SIGTERM during SFT or GRPO exits 75 at the stage's next checkpoint, and
the same command resumes the stage from it; during quantize, export or serve it exits 75 at
the step's next boundary (the server stopped first), and the same command does the step again.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time
import warnings

START_TIME = time.time()  # the process's start, for the goodput record (imports count as start-up)

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import lm_cli  # noqa: E402  (beside this file: the path above; no JAX)
import lm_config  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return lm_cli.make_parser(__doc__).parse_args(argv)


def _load_config(args: argparse.Namespace) -> lm_config.Config | None:
    """The config, its notes printed (e.g. a warm-up fitted to a short run); None after a
    config error, which is printed."""
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always", lm_config.ConfigWarning)
        try:
            cfg = lm_config.load_config(args.config, args.set)
        except lm_config.ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return None
    for note in notes:
        print(f"note: {note.message}", file=sys.stderr)
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = _load_config(args)
    if cfg is None:
        return 2
    # before JAX is imported or anything is read: a run directory already in use stops at once
    refusal = lm_cli.run_dir_refusal(pathlib.Path(cfg.run.dir), resume=args.resume, overwrite=args.overwrite)
    if refusal is not None and args.process_id == 0:
        print(f"error: {refusal}", file=sys.stderr)
    if refusal is not None:
        return 2
    try:
        profile = lm_cli.profile_window(args, cfg.train.steps)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import jax

    if args.coordinator:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    import lm_production
    import lm_report
    import lm_train

    hook = functools.partial(lm_production.after_training, quiet=args.quiet)
    try:
        report = lm_train.train(cfg, resume=args.resume, stop_after=args.stop_after, quiet=args.quiet,
                                overwrite=args.overwrite, after_training=hook, profile=profile,
                                start_time=START_TIME)
    except lm_config.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except lm_train.RunDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if jax.process_index() == 0:
        if report.get("already_finished"):
            print(lm_cli.finished_message(report))
        print(lm_report.format_report(report))
        if report.get("serving", {}).get("try"):
            print(lm_report.format_try_it(report["serving"]))
    if "production_error" in report:
        print(f"error after training: {report['production_error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
