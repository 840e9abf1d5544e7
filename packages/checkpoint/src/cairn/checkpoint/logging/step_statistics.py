"""What a checkpoint manager reports about each save and restore (Orbax's
``ocp.logging.step_statistics``): plain dataclasses of times (seconds since the epoch) and
durations (seconds), ``None`` where not measured."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SaveStepStatistics:
    """One save of a ``CheckpointManager``.

    Args:
      step: the step saved.
      event_type: ``"save"``.
      directory: the manager's directory.
      reached_preemption: whether the step was saved because a preemption was noticed.
      preemption_received_at: when the preemption notice arrived (``None``: none).
      synchronous: whether the save finished before ``save`` returned.
      wait_for_prev_start_time: when waiting for the previous save began.
      wait_for_prev_duration_secs: how long that wait took.
      time_between_consecutive_saves_sec: seconds since the previous save of this manager.
      checkpointer_blocking_start_time: when the blocking part of the write began.
      checkpointer_blocking_duration_secs: how long the caller was blocked by it.
      get_old_steps_start_time: when reading the saved steps began.
      get_old_steps_duration_secs: how long reading them took.
      checkpoint_manager_blocking_start_time: when ``save`` was called.
      checkpoint_manager_blocking_duration_secs: how long ``save`` blocked the caller.
    """

    step: int | None = None
    event_type: str | None = "save"
    directory: str | None = None
    reached_preemption: bool | None = False
    preemption_received_at: float | None = None
    synchronous: bool | None = False
    wait_for_prev_start_time: float | None = None
    wait_for_prev_duration_secs: float | None = None
    time_between_consecutive_saves_sec: float | None = None
    checkpointer_blocking_start_time: float | None = None
    checkpointer_blocking_duration_secs: float | None = None
    get_old_steps_start_time: float | None = None
    get_old_steps_duration_secs: float | None = None
    checkpoint_manager_blocking_start_time: float | None = None
    checkpoint_manager_blocking_duration_secs: float | None = None


@dataclass
class RestoreStepStatistics:
    """One restore of a ``CheckpointManager``.

    Args:
      step: the step restored.
      event_type: ``"restore"``.
      directory: the manager's directory.
      checkpointer_start_time: when reading the items began.
      checkpointer_duration_secs: how long reading them took.
      checkpoint_manager_start_time: when ``restore`` was called.
      checkpoint_manager_duration_secs: how long ``restore`` took in all.
    """

    step: int | None = None
    event_type: str | None = "restore"
    directory: str | None = None
    checkpointer_start_time: float | None = None
    checkpointer_duration_secs: float | None = None
    checkpoint_manager_start_time: float | None = None
    checkpoint_manager_duration_secs: float | None = None
