"""The feedback controller (SPEC 1.2-1.4): D0 by unguided exploration, and one signal-driven round.

Per context: template summary (no LLM) -> explorer -> abstraction -> validation -> pool.add (which
drops duplicates of the evaluation split and of the pool). Only environment states (initial_config,
involved_classes) of the training entries are used for D0, never their questions or ground truth.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

import numpy as np

from coevolve_jax.feedback.abstraction import abstract_task
from coevolve_jax.feedback.explorer import ExplorationContext, Explorer
from coevolve_jax.feedback.pool import TaskPool
from coevolve_jax.feedback.validation import validate_task
from envs.base import Task

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SignalEvent:
  """A marked trajectory: its task, the signal kind, the agent's calls per turn, and its reward in
  [0, 1]."""

  task: Task
  signal: str
  calls: list[list[str]]
  reward: float


@dataclasses.dataclass
class FeedbackReport:
  synthesized: int
  accepted: int
  dropped: list[tuple[str, str, str | None]]
  pass_rate: float
  per_signal: dict[str, dict[str, int]]
  rejected: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (task_id, reason)


def summarize_event(event: SignalEvent) -> tuple[dict[str, Any], list[str]]:
  """Template context summary (SPEC 1.2 keys) and the focus calls for one event."""
  agent_calls = [c for turn in event.calls for c in turn]
  truth = [c for turn in event.task.ground_truth for c in turn]
  focus = (
    agent_calls
    if event.signal == "rare" or (event.signal == "boundary" and event.reward >= 0.5)
    else truth
  )
  names = list(dict.fromkeys(c.split("(", 1)[0] for c in focus))
  summary = {
    "summary": f"{event.signal} signal on task {event.task.task_id} (reward {event.reward:.2f}); "
    f"the agent called {len(agent_calls)} tools.",
    "failure_cause": "unknown (template summary, no LLM)" if event.reward < 0.5 else "",
    "instability_pattern": event.signal if event.signal in ("boundary", "forgetting") else "",
    "focus_pattern": names,
    "exploration_objectives": [f"exercise {n} with varied arguments" for n in names],
    "do_not_repeat": [],
  }
  return summary, focus


def _explore_one(
  context: ExplorationContext,
  explorer: Explorer,
  rng: np.random.Generator,
  task_id: str,
  source: str,
  round_idx: int | None,
  min_calls: int,
  max_calls: int,
  max_turns: int,
) -> tuple[Task | None, str]:
  """Explore -> abstract -> validate one context; returns (accepted task or None, reason)."""
  triplets = explorer.explore(context, rng)
  task = abstract_task(
    triplets,
    context,
    task_id,
    min_calls=min_calls,
    max_calls=max_calls,
    max_turns=max_turns,
    source=source,
    explorer_name=explorer.name,
    round_idx=round_idx,
  )
  if task is None:
    return None, "abstraction found no run with enough successful calls"
  result = validate_task(task, min_calls=min_calls)
  return (task if result.accepted else None), result.reason


def build_initial_tasks(
  env_tasks: list[Task],
  n: int,
  explorer: Explorer,
  rng: np.random.Generator,
  *,
  min_calls: int = 3,
  max_calls: int = 8,
  max_turns: int = 2,
  rounds: int = 2,
  steps_per_round: int = 10,
  max_attempts: int | None = None,
  max_classes: int | None = None,
  only_classes: tuple[str, ...] = (),
  counts: dict[str, int] | None = None,
) -> list[Task]:
  """D0: up to `n` validated tasks by unguided exploration over the entries' environment states.

  Args:
    env_tasks: training entries; only initial_config and involved_classes are read.
    n: tasks wanted. max_attempts: contexts tried at most (default 3 * n).
    max_classes: if set, each context explores at most this many of the entry's backend classes
      (chosen at random; the task then offers only those classes' tools, a shorter prompt).
    only_classes: if set, explore only these backend classes (entries without any are skipped).
    counts: if given, filled with "attempted", "abstracted", "accepted", "rejected".

  Returns:
    Accepted tasks with ids "d0-00000", ... and source "explore".
  """
  counts = counts if counts is not None else {}
  counts.update(attempted=0, abstracted=0, accepted=0, rejected=0)
  out: list[Task] = []
  if only_classes:
    env_tasks = [t for t in env_tasks if set(t.involved_classes) & set(only_classes)]
  order = rng.permutation(len(env_tasks))
  for attempt in range(max_attempts or 3 * n):
    if len(out) >= n or not len(env_tasks):
      break
    base = env_tasks[int(order[attempt % len(order)])]
    classes = [c for c in base.involved_classes if not only_classes or c in only_classes]
    if max_classes and len(classes) > max_classes:
      classes = sorted(rng.choice(classes, size=max_classes, replace=False).tolist())
    config = {k: v for k, v in base.initial_config.items() if k in classes}
    context = ExplorationContext(
      task_id=base.task_id,
      initial_config=config,
      involved_classes=classes,
      rounds=rounds,
      steps_per_round=steps_per_round,
    )
    task, reason = _explore_one(
      context, explorer, rng, f"d0-{len(out):05d}", "explore", None, min_calls, max_calls, max_turns
    )
    counts["attempted"] += 1
    counts["abstracted"] += int(not reason.startswith("abstraction"))
    if task is None:
      counts["rejected"] += 1
      log.info("D0: rejected context from %s: %s", base.task_id, reason)
    else:
      out.append(task)
  counts["accepted"] = len(out)
  log.info("D0: %s", counts)
  return out


def run_feedback_round(
  events: list[SignalEvent],
  pool: TaskPool,
  explorer: Explorer,
  rng: np.random.Generator,
  round_idx: int,
  eval_tasks: list[Task],
  max_contexts: int,
  *,
  min_calls: int = 3,
  max_calls: int = 8,
  max_turns: int = 2,
  rounds: int = 4,
  steps_per_round: int = 12,
) -> FeedbackReport:
  """One feedback round: up to `max_contexts` events -> synthesized, validated tasks added to
  `pool`.

  Returns:
    FeedbackReport: synthesized (abstracted tasks), accepted (added to the pool), dropped (pool
    dedup), pass_rate (validation pass rate of synthesized tasks), per_signal counts, rejected
    (validation).
  """
  chosen = [events[int(i)] for i in rng.permutation(len(events))[:max_contexts]]
  per_signal: dict[str, dict[str, int]] = collections.defaultdict(
    lambda: {"events": 0, "synthesized": 0, "validated": 0, "accepted": 0}
  )
  valid_tasks, rejected, synthesized = [], [], 0
  for k, event in enumerate(chosen):
    summary, focus = summarize_event(event)
    context = ExplorationContext(
      task_id=event.task.task_id,
      initial_config=event.task.initial_config,
      involved_classes=list(event.task.involved_classes),
      signal=event.signal,
      focus_calls=focus,
      summary=summary,
      rounds=rounds,
      steps_per_round=steps_per_round,
    )
    task_id = f"syn-r{round_idx}-{k:04d}"
    task, reason = _explore_one(
      context, explorer, rng, task_id, "synth", round_idx, min_calls, max_calls, max_turns
    )
    counts = per_signal[event.signal]
    counts["events"] += 1
    made = not reason.startswith("abstraction")
    synthesized += int(made)
    counts["synthesized"] += int(made)
    if task is None:
      if made:
        rejected.append((task_id, reason))
      continue
    counts["validated"] += 1
    valid_tasks.append(task)
  report = pool.add(valid_tasks, eval_tasks=eval_tasks)
  dropped_ids = {d[0] for d in report.dropped}
  for task in valid_tasks:
    if task.task_id not in dropped_ids:
      per_signal[task.provenance["signal"]]["accepted"] += 1
  result = FeedbackReport(
    synthesized=synthesized,
    accepted=report.added,
    dropped=report.dropped,
    pass_rate=(len(valid_tasks) / synthesized) if synthesized else 0.0,
    per_signal=dict(per_signal),
    rejected=rejected,
  )
  log.info("feedback round %d: %s", round_idx, result)
  return result
