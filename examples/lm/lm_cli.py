"""The recipe's command line and its run-directory check, without JAX.

`train.py` parses its arguments here, and `nox -s demo` asks the same question as
`train.py` (does the run directory already hold checkpoints?) through `preflight` before
it installs anything, so a second `nox -s demo` stops in a second, not after a minute of
reinstalling. Only the standard library and `lm_config` are imported.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import warnings

import lm_config

HERE = pathlib.Path(__file__).resolve().parent
# how a user starts the recipe, for the advice in messages: `nox -s demo` sets it to
# "nox -s demo --", so its advice reads `nox -s demo -- --resume` as the user types it there
COMMAND_ENV = "CAIRN_LM_COMMAND"
DIRECT_COMMAND = "python examples/lm/train.py"


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
    p.add_argument("--coordinator", default=os.environ.get("CAIRN_COORDINATOR"), help="host:port of process 0")
    p.add_argument("--num-processes", type=int, default=int(os.environ.get("CAIRN_NUM_PROCESSES", "1")))
    p.add_argument("--process-id", type=int, default=int(os.environ.get("CAIRN_PROCESS_ID", "0")))
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


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


def run_dir_refusal(run_dir: pathlib.Path, *, resume: bool, overwrite: bool, cmd: str | None = None) -> str | None:
    """Why the recipe must not start in ``run_dir`` with these flags, or None when it may.

    It may not when both `resume` and `overwrite` are asked, or when ``run_dir`` already
    holds checkpoints and neither is: the message names the directory and the three ways
    on, written for ``cmd`` (default `command()`), e.g. ``nox -s demo -- --resume``.
    """
    cmd = cmd or command()
    if resume and overwrite:
        return "--resume and --overwrite contradict each other: choose one"
    found = existing_checkpoints(run_dir)
    if not found or resume or overwrite:
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
