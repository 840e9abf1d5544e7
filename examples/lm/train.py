"""The Cairn reference recipe: train a small decoder-only LM end to end.

    python examples/lm/train.py                         # default config (config.toml)
    python examples/lm/train.py --set train.steps=200   # override any key
    python examples/lm/train.py --resume                # continue from the latest checkpoint
    python examples/lm/train.py --overwrite             # delete run.dir's checkpoints, start afresh

A run directory that already holds checkpoints is never trained into silently: without
--resume or --overwrite the script stops at once (exit code 2) naming the directory.

Multi-host: start one process per host with --coordinator HOST:PORT --num-processes N
--process-id I (JAX's own distributed runtime); the same config then shards data and
model over every device of every process.

After training (a run that reached train.steps), the production steps run in the same
process (lm_production): the model is quantized (w8, w4 GPTQ/AWQ), scored by greedy
generation, exported through cairn.serving into run.dir/serving and served by cairn-serve
in a subprocess, which is load-tested and stopped; `--set quant.enabled=false
serve.enabled=false` skips them.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(HERE / "config.toml"), help="TOML config file")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override config keys, e.g. train.steps=100")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in run.dir")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the checkpoints already in run.dir and start afresh")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this step (simulates an interruption)")
    p.add_argument("--coordinator", default=os.environ.get("CAIRN_COORDINATOR"), help="host:port of process 0")
    p.add_argument("--num-processes", type=int, default=int(os.environ.get("CAIRN_NUM_PROCESSES", "1")))
    p.add_argument("--process-id", type=int, default=int(os.environ.get("CAIRN_PROCESS_ID", "0")))
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import lm_config

    try:
        cfg = lm_config.load_config(args.config, args.set)
    except lm_config.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
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
                                overwrite=args.overwrite, after_training=hook)
    except lm_config.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except lm_train.RunDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if jax.process_index() == 0:
        print(lm_report.format_report(report))
    if "production_error" in report:
        print(f"error after training: {report['production_error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
