"""BFCL synthesis (paper Sec. 3.2-3.3): D0 by unguided exploration, and one signal-driven round.

Per context: context summary (LLM, else template) -> explorer -> abstraction (LLM, else template)
-> validation (execution, plus agent attempt and LLM judge when an LLM is configured). The round's
accepted tasks go back to the loop as a `RoundResult`; `coevolve_jax.feedback.rounds.commit_round`
adds them to the pool (which drops duplicates of the evaluation split and of the pool). Only
environment states (initial_config, involved_classes) of the training entries are used for D0,
never their questions or ground truth.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any

import numpy as np

from coevolve_jax.feedback.llm import RoundStopped, TextLLM
from coevolve_jax.feedback.pool import TaskPool
from coevolve_jax.feedback.rounds import (
  UNGUIDED,
  FeedbackReport,
  RoundResult,
  SignalEvent,
  commit_round,
  select_events,
)
from coevolve_jax.types import Task
from envs.bfcl import llm_explorer
from envs.bfcl.abstraction import abstract_task
from envs.bfcl.explorer import ExplorationContext, Explorer, ProgrammaticExplorer
from envs.bfcl.validation import validate_task

log = logging.getLogger(__name__)


def make_explorer(llm: TextLLM | None) -> Explorer:
  """The LLM explorer for `llm`, or the programmatic one when there is no LLM."""
  return ProgrammaticExplorer() if llm is None else llm_explorer.LLMExplorer(llm)


def summarize_event(event: SignalEvent) -> tuple[dict[str, Any], list[str]]:
  """Template context summary (docs/design.md §1.2 keys) and the focus calls for one event."""
  agent_calls = [c for turn in event.calls for c in turn]
  truth = [c for turn in event.task.ground_truth for c in turn]
  if event.signal is None:  # random re-exploration: unguided, no focus
    focus = []
  elif event.signal == "rare" or (event.signal == "boundary" and event.reward >= 0.5):
    focus = agent_calls
  else:
    focus = truth
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


@dataclasses.dataclass(frozen=True)
class SynthesisSettings:
  """How one context becomes a task (docs/design.md §1.2-1.3); every field is a config value.

  Attributes:
    min_calls / max_calls: bounds on a task's ground-truth length (calls).
    max_turns: user turns per template-abstracted task.
    rounds / steps_per_round: exploration runs per context and call attempts per run.
    validate: validation by execution (and judge); False only for the no-validation ablation.
    judge: with an LLM, also let an agent attempt the task and an LLM judge it
      (docs/design.md §1.3).
  """

  min_calls: int = 3
  max_calls: int = 8
  max_turns: int = 2
  rounds: int = 4
  steps_per_round: int = 12
  validate: bool = True
  judge: bool = True


def _abstract(triplets, context, task_id, source, round_idx, explorer_name, s, llm) -> list[Task]:
  """Every task the LLM abstracts from the exploration when `llm` is given and it yields any
  (ids `task_id`, `task_id`-1, ...), else the template's one task (or none)."""
  if llm is not None and triplets:
    choices = llm_explorer.abstract_with_llm(
      llm, triplets, context, min_calls=s.min_calls, max_calls=s.max_calls, max_turns=s.max_turns
    )
    if choices:
      return [
        Task(
          task_id=task_id if j == 0 else f"{task_id}-{j}",
          env="bfcl",
          turns=choice.turns,
          ground_truth=choice.calls,
          initial_config=context.initial_config,
          involved_classes=list(context.involved_classes),
          source=source,
          provenance={
            "signal": context.signal,
            "round": round_idx,
            "explorer": explorer_name,
            "parent_task_id": context.task_id,
            "run_id": choice.run_id,
            "abstraction": "llm",
            "description": choice.description,
            "completion": choice.completion,
          },
        )
        for j, choice in enumerate(choices)
      ]
  task = abstract_task(
    triplets,
    context,
    task_id,
    min_calls=s.min_calls,
    max_calls=s.max_calls,
    max_turns=s.max_turns,
    source=source,
    explorer_name=explorer_name,
    round_idx=round_idx,
  )
  if task is None:
    return []
  task.provenance["abstraction"] = "template"
  return [task]


def _explore_one(
  context: ExplorationContext,
  explorer: Explorer,
  rng: np.random.Generator,
  task_id: str,
  source: str,
  round_idx: int | None,
  settings: SynthesisSettings,
  llm: TextLLM | None = None,
  trace: list[dict[str, Any]] | None = None,
) -> tuple[list[tuple[Task | None, str]], bool]:
  """Explore -> abstract -> validate one context.

  Acceptance (docs/design.md §1.3, plus an executable evaluator): the ground truth must replay, be
  deterministic and pass the official checker (`validate_task`); with an LLM and
  `settings.judge`, an agent attempt must then score 1.0 with the checker or be judged a success.

  Returns:
    ([(accepted task or None, reason)] for every abstracted task, in order, or [(None, why)]
    when abstraction found none; whether any task was abstracted).

  Raises:
    RoundStopped: the LLM's token budget ran out or its endpoint is unreachable (the caller ends
      the round).
  """
  triplets = explorer.explore(context, rng)
  if trace is not None:
    steps = explorer.trace or [
      {"run": t.run_id, "action": t.action, "observation": t.observation[:400], "ok": True}
      for t in triplets
    ]
    trace.extend(
      {"task_id": task_id, "parent": context.task_id, "signal": context.signal, **r} for r in steps
    )
  tasks = _abstract(triplets, context, task_id, source, round_idx, explorer.name, settings, llm)
  if not tasks:
    return [(None, "abstraction found no run with enough successful calls")], False
  return [_validate_one(task, settings, llm) for task in tasks], True


def _validate_one(
  task: Task, settings: SynthesisSettings, llm: TextLLM | None
) -> tuple[Task | None, str]:
  """(the task, why) when it passes validation (see `_explore_one`), else (None, why not)."""
  if not settings.validate:
    task.provenance["validation"] = "skipped"
    return task, "ok (validation skipped)"
  result = validate_task(task, min_calls=settings.min_calls)
  if not result.accepted:
    return None, result.reason
  if llm is not None and settings.judge:
    accepted, info = llm_explorer.attempt_and_judge(llm, task)
    task.provenance["validation"] = {
      "checker_reward": info["checker_reward"],
      "judge": info["judge"],
    }
    if not accepted:
      return None, f"judge rejected the attempt: {(info['judge'] or {}).get('reason', '')}"
  else:
    task.provenance["validation"] = "execution"
  return task, result.reason


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
  llm: TextLLM | None = None,
) -> list[Task]:
  """D0: up to `n` validated tasks by unguided exploration over the entries' environment states.

  Args:
    env_tasks: training entries; only initial_config and involved_classes are read.
    n: tasks wanted. max_attempts: contexts tried at most (default 3 * n).
    max_classes: if set, each context explores at most this many of the entry's backend classes
      (chosen at random; the task then offers only those classes' tools, a shorter prompt).
    only_classes: if set, explore only these backend classes (entries without any are skipped).
    counts: if given, filled with "attempted", "abstracted", "accepted", "rejected".
    llm: if given, abstraction and judge by this LLM (docs/design.md §1.3); else template +
      execution.

  Returns:
    Accepted tasks with ids "d0-00000", ... and source "explore".
  """
  settings = SynthesisSettings(min_calls, max_calls, max_turns, rounds, steps_per_round)
  if llm is not None:
    llm.budget.reset()  # D0 gets one round's token budget
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
    try:
      results, made = _explore_one(
        context, explorer, rng, f"d0-{len(out):05d}", "explore", None, settings, llm
      )
    except RoundStopped as e:
      log.warning("D0: stopped early: %s", e)
      break
    counts["attempted"] += 1
    counts["abstracted"] += len(results) if made else 0
    for task, reason in results:
      if task is None:
        counts["rejected"] += 1
        log.info("D0: rejected a task from %s: %s", base.task_id, reason)
      elif len(out) < n:  # ids stay d0-00000, d0-00001, ... in order of acceptance
        task.task_id = f"d0-{len(out):05d}"
        out.append(task)
  counts["accepted"] = len(out)
  log.info("D0: %s", counts)
  return out


def synthesize_round(
  events: list[SignalEvent],
  explorer: Explorer,
  rng: np.random.Generator,
  round_idx: int,
  settings: SynthesisSettings,
  llm: TextLLM | None = None,
) -> RoundResult:
  """Stages 2-3 for already selected events; touches no shared state (safe in a worker thread).

  Each event: context summary (LLM or template) -> exploration -> abstraction -> validation. A
  spent LLM token budget ends the round early; what was accepted so far is kept.
  """
  start = time.perf_counter()
  if llm is not None:
    llm.budget.reset()
  per_signal: dict[str, dict[str, int]] = collections.defaultdict(
    lambda: {"events": 0, "synthesized": 0, "validated": 0}
  )
  tasks, rejected, trace, synthesized = [], [], [], 0
  for k, event in enumerate(events):
    task_id = f"syn-r{round_idx}-{k:04d}"
    try:
      summary, focus = summarize_event(event)
      if llm is not None and event.signal is not None:
        summary = llm_explorer.summarize_with_llm(
          llm, event.task, event.signal, event.calls, event.reward, summary, event.observations
        )
      context = ExplorationContext(
        task_id=event.task.task_id,
        initial_config=event.task.initial_config,
        involved_classes=list(event.task.involved_classes),
        signal=event.signal,
        focus_calls=focus,
        summary=summary,
        rounds=settings.rounds,
        steps_per_round=settings.steps_per_round,
      )
      results, made = _explore_one(
        context, explorer, rng, task_id, "synth", round_idx, settings, llm, trace
      )
    except RoundStopped as e:
      log.warning(
        "feedback round %d stopped after %d of %d contexts: %s", round_idx, k, len(events), e
      )
      break
    counts = per_signal[event.signal or UNGUIDED]
    counts["events"] += 1
    if not made:
      continue
    synthesized += len(results)
    counts["synthesized"] += len(results)
    for j, (task, reason) in enumerate(results):  # ids task_id, task_id-1, ... (`_abstract`)
      if task is None:
        rejected.append((task_id if j == 0 else f"{task_id}-{j}", reason))
      else:
        counts["validated"] += 1
        tasks.append(task)
  return RoundResult(
    round_idx,
    tasks,
    synthesized,
    dict(per_signal),
    rejected,
    trace,
    llm.budget.reset() if llm is not None else None,
    time.perf_counter() - start,
  )


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
  llm: TextLLM | None = None,
) -> FeedbackReport:
  """One feedback round in the calling thread: select -> synthesize -> commit to `pool`.

  Returns:
    FeedbackReport: synthesized (abstracted tasks), accepted (added to the pool), dropped (pool
    dedup), pass_rate (validation pass rate of synthesized tasks), per_signal counts, rejected
    (validation).
  """
  chosen = select_events(events, rng, max_contexts)
  settings = SynthesisSettings(min_calls, max_calls, max_turns, rounds, steps_per_round)
  return commit_round(
    synthesize_round(chosen, explorer, rng, round_idx, settings, llm), pool, eval_tasks
  )
