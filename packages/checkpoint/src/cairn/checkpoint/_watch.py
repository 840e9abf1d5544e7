"""Waiting for new checkpoints from another process (an evaluator next to a trainer).

``checkpoints_iterator(dir)`` yields each newest committed step as it appears;
``wait_for_new_checkpoint(dir)`` waits for one. While the caller holds a step, the step is
protected by a *snapshot*: ``<dir>/_SNAPSHOTS/<step name>`` gets hard links to the step's
files (committed files are never rewritten), so the trainer's retention may delete the step
without pulling the files from under the reader. The snapshot is released (removed) when
the caller asks for the next step or leaves the ``with`` block. Orbax's
``ocp.checkpoint_utils`` names.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

from cairn.checkpoint import _fs, _multihost
from cairn.checkpoint._step_names import StandardNameFormat

_log = logging.getLogger("cairn.checkpoint")

#: The folder under a checkpoint directory that holds the snapshots of steps being read.
_SNAPSHOTS = "_SNAPSHOTS"


def _name_format(step_prefix: str | None, step_format_fixed_length: int | None,
                 step_name_format: Any) -> StandardNameFormat:
    if step_name_format is None:
        return StandardNameFormat(step_prefix, step_format_fixed_length)
    if not isinstance(step_name_format, StandardNameFormat):
        raise TypeError(f"step_name_format must be ocp.step.standard_name_format(...), got {type(step_name_format).__name__}")
    return step_name_format


def committed_steps(directory: str | os.PathLike, step_prefix: str | None = None,
                    step_format_fixed_length: int | None = None, step_name_format: Any = None) -> list[int]:
    """The committed steps in ``directory`` (step folders with their ``COMMIT`` marker),
    ascending; folders still being written and other names are left out.

    Args:
      directory: a manager's directory (need not exist: ``[]``).
      step_prefix: the manager's ``step_prefix``.
      step_format_fixed_length: the manager's ``step_format_fixed_length``.
      step_name_format: an ``ocp.step.standard_name_format(...)`` instead of the two above.
    """
    directory = os.fspath(directory)
    pattern = _name_format(step_prefix, step_format_fixed_length, step_name_format).pattern()
    if not os.path.isdir(directory):
        return []
    steps = []
    for name in os.listdir(directory):
        m = pattern.fullmatch(name)
        if m is not None and _fs.is_committed(os.path.join(directory, name)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def get_snapshot_dir_from_step_dir(step_dir: str | os.PathLike, snapshot_dir: str | os.PathLike | None = None) -> str:
    """Where the snapshot of a step folder lives: ``<its parent>/_SNAPSHOTS/<its name>``.

    Args:
      step_dir: the step's folder.
      snapshot_dir: the snapshots' folder instead of ``<parent>/_SNAPSHOTS``.
    """
    step_dir = os.fspath(step_dir)
    base = os.fspath(snapshot_dir) if snapshot_dir is not None else os.path.join(os.path.dirname(step_dir), _SNAPSHOTS)
    return os.path.join(base, os.path.basename(step_dir))


def _snapshot(step_dir: str, snapshot_path: str) -> bool:
    """Hard-link the files of ``step_dir`` under ``snapshot_path`` (a copy where links are
    refused); ``False`` if the step vanished meanwhile."""
    if os.path.isdir(snapshot_path):
        return True
    tmp = f"{snapshot_path}.tmp-{os.getpid()}"
    try:
        shutil.copytree(step_dir, tmp, copy_function=_link_or_copy)
        os.replace(tmp, snapshot_path)
    except FileNotFoundError:  # retention removed the step while we linked it
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    return True


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _release(snapshot_path: str) -> None:
    shutil.rmtree(snapshot_path, ignore_errors=True)


def _wait(directory: str, names: StandardNameFormat, until_step: int | None, seconds_to_sleep: float,
          timeout: float | None, timeout_fn: Callable[[], bool] | None, snapshots: str) -> int:
    """Process 0 polls until a committed step >= ``until_step`` exists (snapshotting it) or
    the timeout ends the wait (-1); every process gets process 0's answer."""
    result = -1
    if _multihost.is_primary():
        stop = None if timeout is None else time.monotonic() + timeout
        while True:
            steps = committed_steps(directory, step_name_format=names)
            newest = steps[-1] if steps else None
            if newest is not None and (until_step is None or newest >= until_step):
                name = names.build_name(newest)
                if _snapshot(os.path.join(directory, name), os.path.join(snapshots, name)):
                    result = newest
                    break
                continue
            if stop is not None and time.monotonic() + seconds_to_sleep > stop and (timeout_fn is None or timeout_fn()):
                break
            time.sleep(seconds_to_sleep)
    if _multihost.process_count() > 1:
        result = int(_multihost.broadcast(f"cairn_wait_for_new_checkpoint_{directory}", str(result)))
    return result


@contextlib.contextmanager
def wait_for_new_checkpoint(
    checkpoint_dir: str | os.PathLike,
    *,
    until_step: int | None = None,
    seconds_to_sleep: float = 1,
    timeout: float | None = None,
    timeout_fn: Callable[[], bool] | None = None,
    step_prefix: str | None = None,
    step_format_fixed_length: int | None = None,
    step_name_format: Any = None,
    snapshot_dir: str | os.PathLike | None = None,
    **ignored: Any,
) -> Iterator[int]:
    """Wait for the newest committed step (>= ``until_step`` if given) and hold it while the
    ``with`` block runs; the block gets the step, or -1 if ``timeout`` seconds passed first.

    The step is snapshotted (see the module docstring) for the block, so a trainer's
    retention cannot delete its files meanwhile. With several ``jax.distributed`` processes,
    process 0 looks and every process gets its answer.

    Args:
      checkpoint_dir: the manager's directory (it may not exist yet).
      until_step: wait for a step at least this large (``None``: any step).
      seconds_to_sleep: seconds between looks.
      timeout: seconds to wait before giving up (``None``: forever).
      timeout_fn: called when ``timeout`` has passed; the wait ends only if it returns true.
      step_prefix: the manager's ``step_prefix``.
      step_format_fixed_length: the manager's ``step_format_fixed_length``.
      step_name_format: an ``ocp.step.standard_name_format(...)`` instead of the two above.
      snapshot_dir: where snapshots go (default ``<checkpoint_dir>/_SNAPSHOTS``).
      **ignored: Orbax's ``set_immutable`` and ``ignore_snapshot_errors``, accepted.

    Yields:
      The step, or -1.
    """
    directory = os.fspath(checkpoint_dir)
    names = _name_format(step_prefix, step_format_fixed_length, step_name_format)
    snapshots = os.fspath(snapshot_dir) if snapshot_dir is not None else os.path.join(directory, _SNAPSHOTS)
    step = _wait(directory, names, until_step, seconds_to_sleep, timeout, timeout_fn, snapshots)
    try:
        yield step
    finally:
        if step >= 0 and _multihost.is_primary():
            _release(os.path.join(snapshots, names.build_name(step)))


def checkpoints_iterator(
    checkpoint_dir: str | os.PathLike,
    *,
    min_interval_secs: float = 0,
    seconds_to_sleep: float = 1,
    timeout: float | None = None,
    timeout_fn: Callable[[], bool] | None = None,
    step_prefix: str | None = None,
    step_format_fixed_length: int | None = None,
    step_name_format: Any = None,
    snapshot_dir: str | os.PathLike | None = None,
    **ignored: Any,
) -> Iterator[int]:
    """Yield each newest committed step of ``checkpoint_dir`` as it appears (an evaluator's loop).

    After a step is yielded, the next one yielded is newer; steps saved while the caller
    worked are skipped except the newest. The step being handled is snapshotted (see the
    module docstring) until the caller asks for the next. Snapshots left by an earlier
    iterator that died are removed first. When ``timeout`` seconds pass without a new
    step the iterator ends, unless ``timeout_fn`` is given and returns false (it is asked
    again when the wait gives up: the wait ends on its first true answer, the iterator on
    the next).

    Args:
      checkpoint_dir: the manager's directory.
      min_interval_secs: at least this many seconds between two yields.
      seconds_to_sleep: seconds between looks.
      timeout: seconds to wait for each new step (``None``: forever).
      timeout_fn: called when ``timeout`` has passed; the iterator ends only if it returns true.
      step_prefix: the manager's ``step_prefix``.
      step_format_fixed_length: the manager's ``step_format_fixed_length``.
      step_name_format: an ``ocp.step.standard_name_format(...)`` instead of the two above.
      snapshot_dir: where snapshots go (default ``<checkpoint_dir>/_SNAPSHOTS``).
      **ignored: Orbax's ``set_immutable`` and ``ignore_snapshot_errors``, accepted.

    Yields:
      Step numbers, ascending.
    """
    directory = os.fspath(checkpoint_dir)
    snapshots = os.fspath(snapshot_dir) if snapshot_dir is not None else os.path.join(directory, _SNAPSHOTS)
    if _multihost.is_primary() and os.path.isdir(snapshots):
        for name in os.listdir(snapshots):
            _release(os.path.join(snapshots, name))
    last = None
    start = time.monotonic()
    while True:
        with wait_for_new_checkpoint(
            directory, until_step=None if last is None else last + 1, seconds_to_sleep=seconds_to_sleep,
            timeout=timeout, timeout_fn=timeout_fn, step_prefix=step_prefix,
            step_format_fixed_length=step_format_fixed_length, step_name_format=step_name_format,
            snapshot_dir=snapshots,
        ) as step:
            if step < 0:
                # the wait gave up: stop unless timeout_fn says more steps will come
                if timeout_fn is None or timeout_fn():
                    _log.info("cairn.checkpoint: no new checkpoint in %s within %s s; stopping", directory, timeout)
                    return
                continue
            last = step
            start = time.monotonic()
            yield step
        wait = min_interval_secs - (time.monotonic() - start)
        if wait > 0:
            time.sleep(wait)
