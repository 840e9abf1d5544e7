"""When a manager saves, and which saved steps it keeps, as composable policies
(Orbax's ``ocp.checkpoint_managers`` names).

A *save decision policy* answers ``should_save(step, previous_steps, context)``;
``CheckpointManagerOptions(save_decision_policy=...)`` then replaces the interval rules
(``save_interval_steps``, ``save_on_steps``, ``should_save_fn``). A *preservation policy*
answers ``should_preserve(checkpoints)`` with one bool per committed step;
``CheckpointManagerOptions(preservation_policy=...)`` then replaces ``max_to_keep``,
``best_fn``, ``keep_period`` and ``keep_time_interval``. Either way the manager still
saves only steps newer than every committed one, and always keeps the newest step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DecisionContext:
    """What a save decision policy may look at besides the step numbers.

    Args:
      is_saving_in_progress: a background save is still running.
      last_save_time: ``time.monotonic()`` when the manager's last save began, or ``None``.
    """

    is_saving_in_progress: bool = False
    last_save_time: float | None = None


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed step, as a preservation policy sees it.

    Args:
      step: the step number.
      time: when its save was called (seconds since the epoch), or ``None``.
      metrics: the metrics saved with it, or ``None``.
    """

    step: int
    time: float | None = None
    metrics: dict[str, Any] | None = None


# --- save decisions ---
class SaveDecisionPolicy:
    """Base of save decision policies: subclass and define :meth:`should_save`."""

    def should_save(self, step: int, previous_steps: Sequence[int], context: DecisionContext) -> bool:
        """Whether to save ``step``.

        Args:
          step: the step asked about.
          previous_steps: the committed steps, ascending.
          context: see :class:`DecisionContext`.
        """
        raise NotImplementedError


@dataclass(frozen=True)
class FixedIntervalPolicy(SaveDecisionPolicy):
    """Save every multiple of ``interval``.

    Args:
      interval: steps between saves (>= 1).
    """

    interval: int

    def __post_init__(self) -> None:
        if not (isinstance(self.interval, int) and self.interval >= 1):
            raise ValueError(f"FixedIntervalPolicy interval must be an int >= 1, got {self.interval!r}")

    def should_save(self, step: int, previous_steps: Sequence[int], context: DecisionContext) -> bool:
        """True at multiples of ``interval`` (see :class:`SaveDecisionPolicy`).

        Args:
          step: the step asked about.
          previous_steps: the committed steps, ascending.
          context: see :class:`DecisionContext`.
        """
        return step % self.interval == 0


@dataclass(frozen=True)
class SpecificStepsPolicy(SaveDecisionPolicy):
    """Save exactly the given steps.

    Args:
      steps: the steps to save.
    """

    steps: Sequence[int] = ()

    def should_save(self, step: int, previous_steps: Sequence[int], context: DecisionContext) -> bool:
        """True for the listed steps (see :class:`SaveDecisionPolicy`).

        Args:
          step: the step asked about.
          previous_steps: the committed steps, ascending.
          context: see :class:`DecisionContext`.
        """
        return step in set(self.steps)


@dataclass(frozen=True)
class InitialSavePolicy(SaveDecisionPolicy):
    """Save the first step of a directory with no committed step."""

    def should_save(self, step: int, previous_steps: Sequence[int], context: DecisionContext) -> bool:
        """True when nothing is committed yet (see :class:`SaveDecisionPolicy`).

        Args:
          step: the step asked about.
          previous_steps: the committed steps, ascending.
          context: see :class:`DecisionContext`.
        """
        return not previous_steps


@dataclass(frozen=True)
class ContinuousCheckpointingPolicy(SaveDecisionPolicy):
    """Save whenever the previous save has finished (and, if given, at least
    ``minimum_interval_secs`` after it began): as often as the storage allows.

    Args:
      minimum_interval_secs: least seconds between the starts of two saves, or ``None``.
    """

    minimum_interval_secs: float | None = None

    def should_save(self, step: int, previous_steps: Sequence[int], context: DecisionContext) -> bool:
        """True when no save runs and the interval has passed (see :class:`SaveDecisionPolicy`).

        Args:
          step: the step asked about.
          previous_steps: the committed steps, ascending.
          context: see :class:`DecisionContext`.
        """
        if context.is_saving_in_progress:
            return False
        if self.minimum_interval_secs is None or context.last_save_time is None:
            return True
        return time.monotonic() - context.last_save_time >= self.minimum_interval_secs


@dataclass(frozen=True)
class AnySavePolicy(SaveDecisionPolicy):
    """Save when any of ``policies`` says so.

    Args:
      policies: the policies asked.
    """

    policies: Sequence[SaveDecisionPolicy] = field(default_factory=tuple)

    def should_save(self, step: int, previous_steps: Sequence[int], context: DecisionContext) -> bool:
        """True if any policy says so (see :class:`SaveDecisionPolicy`).

        Args:
          step: the step asked about.
          previous_steps: the committed steps, ascending.
          context: see :class:`DecisionContext`.
        """
        return any(p.should_save(step, previous_steps, context) for p in self.policies)


# --- preservation ---
class PreservationPolicy:
    """Base of preservation policies: subclass and define :meth:`should_preserve`."""

    def should_preserve(self, checkpoints: Sequence[CheckpointInfo]) -> list[bool]:
        """One bool per checkpoint (ascending steps): keep it?

        Args:
          checkpoints: the committed steps, ascending.
        """
        raise NotImplementedError


@dataclass(frozen=True)
class LatestN(PreservationPolicy):
    """Keep the ``n`` newest steps.

    Args:
      n: how many (``None``: all).
    """

    n: int | None = None

    def should_preserve(self, checkpoints: Sequence[CheckpointInfo]) -> list[bool]:
        """One bool per checkpoint (see :class:`PreservationPolicy`).

        Args:
          checkpoints: the committed steps, ascending.
        """
        if self.n is None:
            return [True] * len(checkpoints)
        return [i >= len(checkpoints) - self.n for i in range(len(checkpoints))]


@dataclass(frozen=True)
class EveryNSteps(PreservationPolicy):
    """Keep every multiple of ``interval_steps``.

    Args:
      interval_steps: the period in steps (>= 1).
    """

    interval_steps: int

    def __post_init__(self) -> None:
        if not (isinstance(self.interval_steps, int) and self.interval_steps >= 1):
            raise ValueError(f"EveryNSteps interval_steps must be an int >= 1, got {self.interval_steps!r}")

    def should_preserve(self, checkpoints: Sequence[CheckpointInfo]) -> list[bool]:
        """One bool per checkpoint (see :class:`PreservationPolicy`).

        Args:
          checkpoints: the committed steps, ascending.
        """
        return [c.step % self.interval_steps == 0 for c in checkpoints]


@dataclass(frozen=True)
class EveryNSeconds(PreservationPolicy):
    """Keep the first step of every ``interval_secs`` window, by save time.

    Args:
      interval_secs: the window in seconds.
    """

    interval_secs: float

    def should_preserve(self, checkpoints: Sequence[CheckpointInfo]) -> list[bool]:
        """One bool per checkpoint (see :class:`PreservationPolicy`).

        Args:
          checkpoints: the committed steps, ascending.
        """
        out, last = [], None
        for c in checkpoints:
            keep = c.time is not None and (last is None or c.time - last >= self.interval_secs)
            if keep:
                last = c.time
            out.append(keep)
        return out


@dataclass(frozen=True)
class CustomSteps(PreservationPolicy):
    """Keep the given steps.

    Args:
      steps: the steps to keep.
    """

    steps: Sequence[int] = ()

    def should_preserve(self, checkpoints: Sequence[CheckpointInfo]) -> list[bool]:
        """One bool per checkpoint (see :class:`PreservationPolicy`).

        Args:
          checkpoints: the committed steps, ascending.
        """
        wanted = set(self.steps)
        return [c.step in wanted for c in checkpoints]


@dataclass(frozen=True)
class BestN(PreservationPolicy):
    """Keep the ``n`` steps with the largest ``get_metric_fn(metrics)`` (the smallest with
    ``reverse=True``); steps saved without metrics are kept if
    ``keep_checkpoints_without_metrics``.

    Args:
      get_metric_fn: maps a step's metrics dict to a number.
      reverse: keep the smallest values instead of the largest.
      n: how many to keep (``None``: all steps with metrics).
      keep_checkpoints_without_metrics: keep steps saved without metrics.
    """

    get_metric_fn: Callable[[dict[str, Any]], float]
    reverse: bool = False
    n: int | None = None
    keep_checkpoints_without_metrics: bool = True

    def should_preserve(self, checkpoints: Sequence[CheckpointInfo]) -> list[bool]:
        """One bool per checkpoint (see :class:`PreservationPolicy`).

        Args:
          checkpoints: the committed steps, ascending.
        """
        scored = [(float(self.get_metric_fn(c.metrics)), c.step) for c in checkpoints if c.metrics is not None]
        # best first; among equal values the newer step first
        scored.sort(key=lambda vs: (vs[0] if self.reverse else -vs[0], -vs[1]))
        best = {s for _, s in (scored if self.n is None else scored[: self.n])}
        return [c.step in best if c.metrics is not None else self.keep_checkpoints_without_metrics for c in checkpoints]


@dataclass(frozen=True)
class AnyPreservationPolicy(PreservationPolicy):
    """Keep a step any of ``policies`` keeps.

    Args:
      policies: the policies asked.
    """

    policies: Sequence[PreservationPolicy] = field(default_factory=tuple)

    def should_preserve(self, checkpoints: Sequence[CheckpointInfo]) -> list[bool]:
        """One bool per checkpoint (see :class:`PreservationPolicy`).

        Args:
          checkpoints: the committed steps, ascending.
        """
        out = [False] * len(checkpoints)
        for p in self.policies:
            out = [a or b for a, b in zip(out, p.should_preserve(checkpoints), strict=True)]
        return out
