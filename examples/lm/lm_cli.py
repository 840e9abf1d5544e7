"""The recipe's command line and its run-directory check, without JAX.

`train.py` parses its arguments here, and `nox -s demo` asks the same question as
`train.py` (does the run directory already hold checkpoints?) through `preflight` before
it installs anything, so a second `nox -s demo` stops in a second, not after a minute of
reinstalling. Only the standard library and `lm_config` are imported.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import warnings

import lm_config

HERE = pathlib.Path(__file__).resolve().parent
# how a user starts the recipe, for the advice in messages: `nox -s demo` sets it to
# "nox -s demo --", so its advice reads `nox -s demo -- --resume` as the user types it there
COMMAND_ENV = "CAIRN_LM_COMMAND"
DIRECT_COMMAND = "python examples/lm/train.py"
# written into run.dir by a run that stopped on a preemption notice (exit status 75) after its
# checkpoint was committed: the next start into run.dir resumes without --resume
PREEMPTED_FILE = "PREEMPTED.json"
# what the stages write into run.dir besides checkpoints/ (--overwrite deletes them too): the
# tokenizer, the Hugging Face hand-overs, the post-training runs
STAGE_DIRS = ("tokenizer", "hf", "sft", "grpo")


def make_parser(description: str | None = None, *, strict: bool = True) -> argparse.ArgumentParser:
    """`train.py`'s arguments (``description``: its help text). ``strict=False``: no
    ``--help``, and a bad argument raises `argparse.ArgumentError` instead of exiting."""
    p = argparse.ArgumentParser(prog="train.py", description=description, add_help=strict, exit_on_error=strict,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(HERE / "config.toml"), help="TOML config file")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override config keys, e.g. train.steps=100")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in run.dir")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the checkpoints already in run.dir and start afresh")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this step (simulates an interruption)")
    p.add_argument("--profile", action="store_true",
                   help="trace steps --profile-start .. + --profile-steps - 1 with jax.profiler; writes "
                        "run.dir/profile/profile_summary.json (per-module times, roofline, memory) and the trace")
    p.add_argument("--profile-start", type=int, default=None, metavar="N",
                   help="first step traced (default: 10, or the middle of a shorter run)")
    p.add_argument("--profile-steps", type=int, default=5, metavar="M", help="steps traced (default 5)")
    p.add_argument("--coordinator", default=os.environ.get("CAIRN_COORDINATOR"), help="host:port of process 0")
    p.add_argument("--num-processes", type=int, default=int(os.environ.get("CAIRN_NUM_PROCESSES", "1")))
    p.add_argument("--process-id", type=int, default=int(os.environ.get("CAIRN_PROCESS_ID", "0")))
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def profile_window(args: argparse.Namespace, train_steps: int) -> tuple[int, int] | None:
    """``(first step, number of steps)`` that ``--profile`` traces, or None without it.

    The default first step is 10 (compilation and warm-up are over by then), moved earlier
    so that the window ends by ``train_steps`` in a short run (but never before step 2: step
    1 compiles). Raises ValueError naming the flag when the window does not fit.
    """
    if not args.profile:
        return None
    num = args.profile_steps
    if num < 1:
        raise ValueError(f"--profile-steps must be >= 1, got {num}")
    start = args.profile_start if args.profile_start is not None else min(10, max(2, train_steps - num + 1))
    if start < 1 or start + num - 1 > train_steps:
        raise ValueError(f"--profile traces steps {start}..{start + num - 1}, which is not within the run's steps "
                         f"1..{train_steps} (train.steps): choose --profile-start and --profile-steps to fit")
    return start, num


def command() -> str:
    """How the user started the recipe: ``$CAIRN_LM_COMMAND``, else `DIRECT_COMMAND`."""
    return os.environ.get(COMMAND_ENV) or DIRECT_COMMAND


def existing_checkpoints(run_dir: pathlib.Path) -> list[str]:
    """Names under `run_dir/checkpoints` that a run leaves there (step folders, committed or not).

    Read from the directory alone: opening a checkpoint manager has side effects, and this
    check must run before any work does.
    """
    ckpt_dir = pathlib.Path(run_dir) / "checkpoints"
    if not ckpt_dir.is_dir():
        return []
    return sorted(p.name for p in ckpt_dir.iterdir() if p.name.split(".")[0].isdigit())


def preempted_step(run_dir: pathlib.Path) -> int | None:
    """The step at which the run in ``run_dir`` stopped on a preemption notice, when that run
    can resume: ``run_dir/PREEMPTED.json`` names the step and ``run_dir/checkpoints`` holds
    a committed step at least as new (a resumed run may have saved newer ones since).
    None otherwise. Read from the directory alone, without JAX (`nox -s demo` asks too).
    """
    try:
        step = json.loads((pathlib.Path(run_dir) / PREEMPTED_FILE).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(step, int):
        return None
    ckpt_dir = pathlib.Path(run_dir) / "checkpoints"
    committed = [int(n) for n in existing_checkpoints(run_dir) if n.isdigit() and (ckpt_dir / n / "COMMIT").exists()]
    return step if committed and max(committed) >= step else None


def run_dir_refusal(run_dir: pathlib.Path, *, resume: bool, overwrite: bool, cmd: str | None = None) -> str | None:
    """Why the recipe must not start in ``run_dir`` with these flags, or None when it may.

    It may not when both `resume` and `overwrite` are asked, or when ``run_dir`` already
    holds checkpoints and neither is, unless the run there stopped on a preemption notice
    (`preempted_step`: it resumes by itself): the message names the directory and the three ways
    on, written for ``cmd`` (default `command()`), e.g. ``nox -s demo -- --resume``.
    """
    cmd = cmd or command()
    if resume and overwrite:
        return "--resume and --overwrite contradict each other: choose one"
    found = existing_checkpoints(run_dir)
    if not found or resume or overwrite or preempted_step(run_dir) is not None:
        return None
    shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
    return (
        f"run directory {run_dir} already holds checkpoints ({pathlib.Path(run_dir) / 'checkpoints'}: {shown}). "
        f"Choose one: `{cmd} --resume` to continue from the latest of them, another run directory "
        f"(`{cmd} --set run.dir=\"...\"`), or `{cmd} --overwrite` to delete them and start afresh."
    )


def preflight(argv: list[str], cmd: str | None = None) -> str | None:
    """The run-directory check of `train.py` for its command line ``argv``, before anything
    is installed or imported: the message to stop with, or None to go on.

    The run directory is resolved as `train.py` resolves it (``--config`` and ``--set``
    over the defaults). A config error is returned too (``config error: ...``); ``--help``
    and a command line that does not parse are left to `train.py`, which prints its usage.
    """
    if "-h" in argv or "--help" in argv:
        return None  # train.py prints its help
    try:
        args, _ = make_parser(strict=False).parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit):
        return None
    try:
        with warnings.catch_warnings():  # notes on the config are train.py's to print
            warnings.simplefilter("ignore", lm_config.ConfigWarning)
            cfg = lm_config.load_config(args.config, args.set)
    except lm_config.ConfigError as e:
        return f"config error: {e}"
    return run_dir_refusal(pathlib.Path(cfg.run.dir), resume=args.resume, overwrite=args.overwrite, cmd=cmd)


def finished_message(report: dict, cmd: str | None = None) -> str:
    """What `--resume` on a run that already reached ``train.steps`` says (it changed nothing)."""
    cmd = cmd or command()
    run_dir, done = pathlib.Path(report["run_dir"]), report["already_finished"]
    return (
        f"run directory {run_dir} already finished: its latest checkpoint is step {done['step']} "
        f"(train.steps = {done['train_steps']}), so --resume has nothing to do; nothing was "
        f"trained or rewritten. Its report is {run_dir / 'metrics.json'} and {run_dir / 'loss_curve.png'}. "
        f"To train again: `{cmd} --overwrite`, or another run directory (`{cmd} --set run.dir=\"...\"`)."
    )
