"""Training hooks: plug-ins that see every GRPO step (as levanter's callbacks).

A hook gets each step's `StepRecord` (its tasks, trajectories, rewards, advantages, signal events
and the metrics so far) after the update, may add metrics to the step's row, and keeps state of
its own that is saved with every checkpoint and restored on resume, so a diagnostic is a class,
not loop code. A hook that writes files brings them back to the restored step in `on_resume`
(the loop's own logs do the same), and writes only from the primary process
(`metrics.append_lines` does).

`build_hooks(cfg, workdir)` gives the run's hooks (`train.hooks`, names of `HOOKS`): by default
the group log (groups.jsonl, read by scripts/ablations.py's per-signal accounting).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from coevolve_jax.feedback.pool import origin
from coevolve_jax.feedback.signals import SignalEvent
from coevolve_jax.metrics import append_lines, truncate_jsonl
from coevolve_jax.types import Task, Trajectory


@dataclasses.dataclass
class StepRecord:
  """What one GRPO step computed, as hooks see it.

  Attributes:
    step: the step (1-based).
    tasks: the step's tasks; group g's rollouts are the trajectories with `group_id == g`.
    trajectories: the N rollouts, in order.
    rewards: [N] float32 outcome rewards. keep: [N] bool, False where `train.drop_from_loss`
      left a rollout out of the loss.
    advantages: [N] (per trajectory) or [N, P] (per target token) float32, as trained on.
    events: the signal events the step's rollouts fired.
    metrics: the step's metrics so far (train/*, reward/*, rollout/*, signals/*).
    eval_tasks: the run's held-out evaluation split (what training data must not leak).
  """

  step: int
  tasks: list[Task]
  trajectories: list[Trajectory]
  rewards: np.ndarray
  keep: np.ndarray
  advantages: np.ndarray
  events: list[SignalEvent]
  metrics: dict[str, Any]
  eval_tasks: list[Task] = dataclasses.field(default_factory=list)


class TrainingHook(Protocol):
  """A plug-in of the GRPO loop (see the module docstring).

  Attributes:
    name: unique among the run's hooks; keys the hook's state in the checkpoint.
  """

  name: str

  def on_step(self, record: StepRecord) -> dict[str, Any]:
    """Sees one step; returns metrics to add to the step's row ({} for none)."""
    ...

  def state_dict(self) -> dict[str, Any]:
    """JSON-serialisable state, saved with every checkpoint."""
    ...

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores `state_dict()`'s value on resume."""
    ...

  def on_resume(self, step: int) -> None:
    """Brings the hook's own files back to `step` (-1: a fresh start) before the run goes on."""
    ...


class JsonlLog:
  """The base of a hook that appends step-keyed rows to a JSON-lines file (`path`) and keeps no
  other state: nothing to checkpoint, the file cut back to the restored step on resume (as
  metrics.jsonl is)."""

  path: str

  def state_dict(self) -> dict[str, Any]:
    return {}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    del state

  def on_resume(self, step: int) -> None:
    truncate_jsonl(self.path, step)


class GroupLog(JsonlLog):
  """groups.jsonl: one row per GRPO group and step with the task, its origin ("d0" or
  "synth:<signal>"), the group's rewards and the signals it fired (scripts/ablations.py: did a
  boundary task's group turn from mixed to solved? did a forgotten task recover?)."""

  name = "group_log"

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, "groups.jsonl")

  def on_step(self, record: StepRecord) -> dict[str, Any]:
    fired: dict[str, set[str]] = {}
    for e in record.events:
      assert e.signal is not None  # the detectors' events (None marks a random-mode context)
      fired.setdefault(e.task.task_id, set()).add(e.signal)
    rows = []
    for g, task in enumerate(record.tasks):
      row = {
        "step": record.step,
        "task_id": task.task_id,
        "origin": origin(task),
        "rewards": [t.reward for t in record.trajectories if t.group_id == g],
        "fired": sorted(fired.get(task.task_id, ())),
      }
      rows.append(json.dumps(row))
    append_lines(self.path, rows)
    return {}


# Hook name (`train.hooks`) -> its factory, called with the run config and the workdir. A hook
# of one's own: a class with the `TrainingHook` members, registered here under a new name.
HOOKS: dict[str, Callable[[Any, str], TrainingHook]] = {
  "group_log": lambda cfg, workdir: GroupLog(workdir),
}


def check_hooks(names: Sequence[str]) -> None:
  """Raises ValueError unless `names` are distinct registered hook names."""
  if unknown := [n for n in names if n not in HOOKS]:
    raise ValueError(f"unknown training hooks {unknown} (known: {sorted(HOOKS)})")
  if len(set(names)) < len(names):
    raise ValueError(f"a training hook is listed twice: {list(names)}")


def build_hooks(cfg: Any, workdir: str) -> list[TrainingHook]:
  """The run's hooks (`train.hooks`), in the order they see a step.

  Raises:
    ValueError: an unknown or repeated name.
  """
  names = tuple(cfg.train.hooks)
  check_hooks(names)
  return [HOOKS[name](cfg, workdir) for name in names]


def run_hooks(hooks: Sequence[TrainingHook], record: StepRecord) -> dict[str, Any]:
  """Every hook's `on_step`, in order; their metrics merged (a later hook's win)."""
  out: dict[str, Any] = {}
  for hook in hooks:
    out.update(hook.on_step(record))
  return out


if TYPE_CHECKING:  # mypy checks GroupLog against the TrainingHook protocol

  def _conforms(hook: GroupLog) -> TrainingHook:
    return hook
