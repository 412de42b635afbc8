"""BFCL's hooks for stages 2-3 (paper Sec. 3.2-3.3): a `feedback.synthesis.Synthesizer`.

Per context: the template summary (the LLM's replaces it, in the skeleton) -> an explorer on the
real backends (`ProgrammaticExplorer`, or `LLMExplorer` with an LLM) -> abstraction (the LLM's,
else the template's one task) -> validation (execution: replay, determinism and the official
checker; with an LLM also an agent attempt and the judge). D0 explores the environment states
(initial_config, involved_classes) of the training entries, never their questions or ground
truth; a round explores the marked task's state under its signal. The D0 and round skeletons are
`coevolve_jax.feedback.synthesis.initial_tasks` and `.synthesize_round`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from coevolve_jax.feedback import llm_jobs
from coevolve_jax.feedback.exploration import Exploration, ExplorationContext, Explorer
from coevolve_jax.feedback.llm import TextLLM
from coevolve_jax.feedback.signals import SignalEvent
from coevolve_jax.feedback.synthesis import Candidate
from coevolve_jax.types import Task
from envs.bfcl import llm_explorer
from envs.bfcl.abstraction import abstract_task
from envs.bfcl.explorer import ProgrammaticExplorer
from envs.bfcl.validation import validate_task

TRACE_CHARS = 400  # observation characters of a programmatic exploration's trace rows


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
    max_turns: user turns per abstracted task.
    rounds / steps_per_round: exploration runs per context and call attempts per run.
    judge: with an LLM, also let an agent attempt the task and an LLM judge it
      (docs/design.md §1.3).
    max_classes: if > 0, a D0 context explores at most this many of the entry's backend classes
      (chosen at random; the task then offers only those classes' tools, a shorter prompt).
    only_classes: if set, D0 explores only these backend classes (entries without any are
      skipped).
  """

  min_calls: int = 3
  max_calls: int = 8
  max_turns: int = 2
  rounds: int = 4
  steps_per_round: int = 12
  judge: bool = True
  max_classes: int = 0
  only_classes: tuple[str, ...] = ()


class BfclSynthesizer:
  """BFCL's `Synthesizer` (see the module docstring) for the explorer LLM `llm` (None:
  programmatic, template abstraction, validation by execution).

  Args:
    settings: the config's synthesis settings. llm: the explorer LLM or None.
    explorer: the explorer to act with (default `make_explorer(llm)`).
  """

  revisits = True  # a new exploration of the same entry's state finds other tasks
  keeps_ids = False

  def __init__(
    self, settings: SynthesisSettings, llm: TextLLM | None, explorer: Explorer | None = None
  ):
    self.settings, self.llm = settings, llm
    self.explorer = explorer if explorer is not None else make_explorer(llm)
    self.name = self.explorer.name

  def d0_bases(self, entries: Sequence[Task]) -> list[Task]:
    only = set(self.settings.only_classes)
    return [t for t in entries if not only or set(t.involved_classes) & only]

  def d0_context(self, base: Task, rng: np.random.Generator) -> ExplorationContext:
    s = self.settings
    classes = [c for c in base.involved_classes if not s.only_classes or c in s.only_classes]
    if s.max_classes and len(classes) > s.max_classes:
      classes = sorted(rng.choice(classes, size=s.max_classes, replace=False).tolist())
    return ExplorationContext(
      task_id=base.task_id,
      initial_config={k: v for k, v in base.initial_config.items() if k in classes},
      involved_classes=classes,
      rounds=s.rounds,
      steps_per_round=s.steps_per_round,
    )

  def plan_round(
    self, events: Sequence[SignalEvent], rng: np.random.Generator, round_idx: int
  ) -> list[SignalEvent]:
    del rng, round_idx
    return list(events)

  def summary_template(self, event: SignalEvent) -> tuple[dict[str, Any], list[str]]:
    return summarize_event(event)

  def event_context(
    self,
    event: SignalEvent,
    summary: dict[str, Any],
    focus: list[str],
    rng: np.random.Generator,
  ) -> ExplorationContext:
    del rng  # the marked task's whole state is explored
    return ExplorationContext(
      task_id=event.task.task_id,
      initial_config=event.task.initial_config,
      involved_classes=list(event.task.involved_classes),
      signal=event.signal,
      focus_calls=focus,
      summary=summary,
      rounds=self.settings.rounds,
      steps_per_round=self.settings.steps_per_round,
    )

  def explore(
    self,
    context: ExplorationContext,
    rng: np.random.Generator,
    *,
    label: str,
    source: str,
    round_idx: int | None,
  ) -> Exploration:
    del source, round_idx
    triplets = self.explorer.explore(context, rng)
    steps = self.explorer.trace or [
      {"run": t.run_id, "action": t.action, "observation": t.observation[:TRACE_CHARS], "ok": True}
      for t in triplets
    ]
    rows = [
      {"task_id": label, "parent": context.task_id, "signal": context.signal, **r} for r in steps
    ]
    return Exploration(triplets, rows)

  def abstract(
    self,
    exploration: Exploration,
    context: ExplorationContext,
    *,
    label: str,
    source: str,
    round_idx: int | None,
  ) -> list[Candidate]:
    """Every task the LLM abstracts (ids `label`, `label`-1, ...) when there is an LLM and it
    yields any, else the template's one task (or none)."""
    s, triplets = self.settings, exploration.triplets
    if self.llm is not None and triplets:
      choices = llm_jobs.abstract_with_llm(
        self.llm,
        triplets,
        context,
        min_calls=s.min_calls,
        max_calls=s.max_calls,
        max_turns=s.max_turns,
      )
      if choices:
        tasks = [
          self._llm_task(choice, context, label if j == 0 else f"{label}-{j}", source, round_idx)
          for j, choice in enumerate(choices)
        ]
        return [(t.task_id, t, "") for t in tasks]
    task = abstract_task(
      triplets,
      context,
      label,
      min_calls=s.min_calls,
      max_calls=s.max_calls,
      max_turns=s.max_turns,
      source=source,
      explorer_name=self.name,
      round_idx=round_idx,
    )
    if task is None:
      return []
    task.provenance["abstraction"] = "template"
    return [(task.task_id, task, "")]

  def _llm_task(
    self,
    choice: llm_jobs.AbstractionChoice,
    context: ExplorationContext,
    task_id: str,
    source: str,
    round_idx: int | None,
  ) -> Task:
    return Task(
      task_id=task_id,
      env="bfcl",
      turns=choice.turns,
      ground_truth=choice.calls,
      initial_config=context.initial_config,
      involved_classes=list(context.involved_classes),
      source=source,
      provenance={
        "signal": context.signal,
        "round": round_idx,
        "explorer": self.name,
        "parent_task_id": context.task_id,
        "run_id": choice.run_id,
        "abstraction": "llm",
        "description": choice.description,
        "completion": choice.completion,
      },
    )

  def validate(self, task: Task) -> tuple[bool, str]:
    """Acceptance (docs/design.md §1.3, plus an executable evaluator): the ground truth must
    replay, be deterministic and pass the official checker (`validate_task`); with an LLM and
    `settings.judge`, an agent attempt must then score 1.0 with the checker or be judged a
    success."""
    result = validate_task(task, min_calls=self.settings.min_calls)
    if not result.accepted:
      return False, result.reason
    if self.llm is not None and self.settings.judge:
      accepted, info = llm_explorer.attempt_and_judge(self.llm, task)
      task.provenance["validation"] = {
        "checker_reward": info["checker_reward"],
        "judge": info["judge"],
      }
      if not accepted:
        return False, f"judge rejected the attempt: {(info['judge'] or {}).get('reason', '')}"
    else:
      task.provenance["validation"] = "execution"
    return True, result.reason


if TYPE_CHECKING:  # mypy checks BfclSynthesizer against the Synthesizer protocol
  from coevolve_jax.feedback.synthesis import Synthesizer

  def _conforms(synthesizer: BfclSynthesizer) -> Synthesizer:
    return synthesizer
