"""Stages 2-3 written once (paper Sec. 3.2-3.4): D0, the generated held-out set and a feedback
round as one skeleton over a benchmark's `Synthesizer` hooks.

    per context:  context (from a base task's state, or from a signal event and its summary)
                  -> explore (the real environment)  -> abstract (into tasks)
                  -> validate (execution, and an LLM agent's attempt plus the judge)

`initial_tasks` runs it over the states of a task list until N tasks are accepted (D0, paper
Sec. 3.4: no human-written task is used, the entries lend only their environment states);
`generated_eval_tasks` does the same over the held-out entries' states (the run's generated
held-out set); `synthesize_round` runs it once per selected signal event, with the stage-2
summary (`llm_jobs.summarize_with_llm`, or the benchmark's template) in between.

A spent LLM token budget ends D0 or the round before its next context: the context in progress
is finished (`TokenBudget.in_context`) and what was accepted is kept; the stop and the number of
contexts it skipped are recorded (`stopped`: `stop_record`) for feedback.jsonl and logged. An
unreachable endpoint (`EndpointUnreachable`) ends it at once; the context it cut is counted as
skipped. Nothing here touches the pool: the loop commits a round's result
(`rounds.commit_round`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from coevolve_jax.feedback import llm_jobs
from coevolve_jax.feedback.exploration import Exploration, ExplorationContext
from coevolve_jax.feedback.llm import BudgetExhausted, RoundStopped, TextLLM
from coevolve_jax.feedback.rounds import UNGUIDED, RoundResult
from coevolve_jax.feedback.signals import SignalEvent
from coevolve_jax.types import Task

log = logging.getLogger(__name__)
# (task id, the task, or None when it was not made or not accepted, why): one abstracted task.
Candidate = tuple[str, Task | None, str]
NO_TASK = "abstraction found no task in the exploration"
SKIPPED = "ok (validation skipped)"


class Synthesizer(Protocol):
  """A benchmark's hooks for stages 2-3 (one object per D0, generated set or round).

  Attributes:
    name: the explorer's name (provenance of the tasks).
    llm: the explorer LLM (summary, exploration, abstraction, judge), or None (programmatic).
    revisits: D0 may explore a base task's state again (a new exploration of the same state
      finds other tasks); False tries each base at most once.
    keeps_ids: the abstraction's task ids name the tasks' environments on disk (AppWorld's
      derived worlds), so D0 and the generated set keep them instead of numbering them.
  """

  name: str
  revisits: bool
  keeps_ids: bool

  @property
  def llm(self) -> TextLLM | None: ...  # read-only: an implementation's TextLLM or None fits

  def d0_bases(self, entries: Sequence[Task]) -> list[Task]:
    """The tasks whose environment states D0 (or the generated set) may explore."""
    ...

  def d0_context(self, base: Task, rng: np.random.Generator) -> ExplorationContext:
    """An unguided context on `base`'s state."""
    ...

  def plan_round(
    self, events: Sequence[SignalEvent], rng: np.random.Generator, round_idx: int
  ) -> list[SignalEvent]:
    """The order in which round `round_idx` explores its selected events (most benchmarks:
    as selected)."""
    ...

  def summary_template(self, event: SignalEvent) -> tuple[dict[str, Any], list[str]]:
    """The template context summary of a marked trajectory (keys `exploration.SUMMARY_KEYS`),
    used when there is no LLM or it fails, and the focus calls of the context."""
    ...

  def event_context(
    self,
    event: SignalEvent,
    summary: dict[str, Any],
    focus: list[str],
    rng: np.random.Generator,
  ) -> ExplorationContext:
    """The context of a round: the marked task's state under the event's signal."""
    ...

  def explore(
    self,
    context: ExplorationContext,
    rng: np.random.Generator,
    *,
    label: str,
    source: str,
    round_idx: int | None,
  ) -> Exploration:
    """Acts in the real environment for `context`. `label` names the context ("d0-00003",
    "syn-r2-0001"), `source` is the tasks' source ("explore", "explore_eval", "synth") and
    `round_idx` the round (None for D0 and the generated set).

    Raises:
      RoundStopped: the LLM's budget is spent or its endpoint unreachable.
    """
    ...

  def abstract(
    self,
    exploration: Exploration,
    context: ExplorationContext,
    *,
    label: str,
    source: str,
    round_idx: int | None,
  ) -> list[Candidate]:
    """The tasks the exploration supports ([] when none), with `source` and provenance set; a
    candidate that could not be made (a derivation error) comes back with task None.

    Raises:
      RoundStopped: the LLM's budget is spent or its endpoint unreachable.
    """
    ...

  def validate(self, task: Task) -> tuple[bool, str]:
    """(accepted, why) by execution and, with an LLM, the agent attempt and the judge (paper
    Sec. 3.3); records how in `task.provenance["validation"]`.

    Raises:
      RoundStopped: the LLM's budget is spent or its endpoint unreachable.
    """
    ...


def _validated(synth: Synthesizer, candidate: Candidate, validate: bool) -> Candidate:
  task_id, task, why = candidate
  if task is None:
    return candidate
  if not validate:  # the no-validation ablation (feedback.validate = False)
    task.provenance["validation"] = "skipped"
    return task_id, task, SKIPPED
  accepted, why = synth.validate(task)
  return task_id, task if accepted else None, why


def _explore_context(
  synth: Synthesizer,
  context: ExplorationContext,
  rng: np.random.Generator,
  label: str,
  source: str,
  round_idx: int | None,
  validate: bool,
  trace: list[dict[str, Any]] | None,
) -> tuple[bool, list[Candidate]]:
  """Explore -> abstract -> validate one context.

  Returns:
    (whether abstraction made any task, one candidate per abstracted task in order: the
    accepted task or None with why; [(label, None, NO_TASK)] when abstraction made none).
  """
  exploration = synth.explore(context, rng, label=label, source=source, round_idx=round_idx)
  if trace is not None:
    trace.extend(exploration.trace)
  candidates = synth.abstract(exploration, context, label=label, source=source, round_idx=round_idx)
  if not candidates:
    return False, [(label, None, NO_TASK)]
  return True, [_validated(synth, c, validate) for c in candidates]


def stop_record(e: RoundStopped, done: int, skipped: int, **extra: Any) -> dict[str, Any]:
  """What a stopped D0 or round records: "reason" ("token_budget" or "unreachable"), "message",
  the contexts finished ("contexts_done") and those not explored ("contexts_skipped")."""
  reason = "token_budget" if isinstance(e, BudgetExhausted) else "unreachable"
  return {
    "reason": reason,
    "message": str(e),
    "contexts_done": done,
    "contexts_skipped": skipped,
    **extra,
  }


def _next_context(synth: Synthesizer) -> None:
  """Raises RoundStopped when no further context may start (the LLM's budget is spent or its
  endpoint unreachable)."""
  if synth.llm is not None:
    synth.llm.budget.check()


def _in_context(synth: Synthesizer) -> contextlib.AbstractContextManager[None]:
  """The context in progress: a spent budget does not cut it (`TokenBudget.in_context`)."""
  return synth.llm.budget.in_context() if synth.llm is not None else contextlib.nullcontext()


def initial_tasks(
  synth: Synthesizer,
  entries: Sequence[Task],
  n: int,
  rng: np.random.Generator,
  *,
  prefix: str = "d0",
  source: str = "explore",
  max_attempts: int | None = None,
  token_limit: int = 0,
) -> tuple[list[Task], dict[str, Any]]:
  """D0 (paper Sec. 3.4): up to `n` validated tasks by unguided exploration of the entries'
  environment states (their questions and answers are never read).

  The bases (`synth.d0_bases`) are visited in one random order, again from the start when
  `synth.revisits`, for at most `max_attempts` contexts (default 3 n). D0 always validates
  (`feedback.validate` is the rounds' ablation).

  Args:
    prefix / source: accepted tasks are numbered "<prefix>-00000", ... in order of acceptance
      (unless `synth.keeps_ids`) and get `source` ("explore" for D0).
    token_limit: the LLM tokens D0 may spend (`explore.d0_tokens`; 0 = no cap); the LLM's
      round limit is back in force afterwards. A spent limit stops D0 before its next context.

  Returns:
    (accepted tasks, counts "attempted", "abstracted", "accepted", "rejected", and when D0
    stopped before `n` tasks or its attempts, "stopped" (`stop_record`, with "tasks_missing");
    with an LLM, "llm_usage" {"tokens", "requests"}).
  """
  if synth.llm is not None:
    synth.llm.budget.reset(limit=token_limit)
  counts: dict[str, Any] = {"attempted": 0, "abstracted": 0, "accepted": 0, "rejected": 0}
  bases = synth.d0_bases(entries)
  order = rng.permutation(len(bases))
  attempts = max_attempts or 3 * n
  if not synth.revisits:
    attempts = min(attempts, len(bases))
  out: list[Task] = []
  for attempt in range(attempts):
    if len(out) >= n or not len(bases):
      break
    base = bases[int(order[attempt % len(order)])]
    label = f"{prefix}-{len(out):05d}"
    try:
      _next_context(synth)
      with _in_context(synth):
        context = synth.d0_context(base, rng)
        made, results = _explore_context(synth, context, rng, label, source, None, True, None)
    except RoundStopped as e:
      counts["stopped"] = stop_record(
        e, counts["attempted"], attempts - attempt, tasks_missing=n - len(out)
      )
      log.warning(
        "%s: stopped after %d contexts with %d of %d tasks; %d contexts at most not explored: %s",
        prefix,
        counts["attempted"],
        len(out),
        n,
        attempts - attempt,
        e,
      )
      break
    counts["attempted"] += 1
    counts["abstracted"] += len(results) if made else 0
    for task_id, task, why in results:
      if task is None:
        counts["rejected"] += 1
        log.info("D0: rejected %s (state of %s): %s", task_id, base.task_id, why)
      elif len(out) < n:
        if not synth.keeps_ids:
          task.task_id = f"{prefix}-{len(out):05d}"
        out.append(task)
  counts["accepted"] = len(out)
  if synth.llm is not None:
    counts["llm_usage"] = synth.llm.budget.reset()  # the rounds' limit is back
  log.info("D0: %s", counts)
  return out, counts


def generated_eval_tasks(
  synth: Synthesizer,
  entries: Sequence[Task],
  n: int,
  rng: np.random.Generator,
  token_limit: int = 0,
) -> list[Task]:
  """The generated held-out set (`eval.generated_tasks`): D0's exploration over the held-out
  entries' states (only their states are read), ids "eval-gen-00000", ... (unless
  `synth.keeps_ids`), source "explore_eval", under D0's `token_limit`."""
  tasks, _ = initial_tasks(
    synth, entries, n, rng, prefix="eval-gen", source="explore_eval", token_limit=token_limit
  )
  return tasks


def _event_context(
  synth: Synthesizer, event: SignalEvent, rng: np.random.Generator
) -> ExplorationContext:
  """The stage-2 context of a marked trajectory: the template summary, replaced by the LLM's
  (paper Sec. 3.2) for a signal event when there is an LLM."""
  summary, focus = synth.summary_template(event)
  if synth.llm is not None and event.signal is not None:
    summary = llm_jobs.summarize_with_llm(
      synth.llm,
      event.task,
      event.signal,
      event.calls,
      event.reward,
      summary,
      event.observations,
    )
  return synth.event_context(event, summary, focus, rng)


def synthesize_round(
  synth: Synthesizer,
  events: Sequence[SignalEvent],
  rng: np.random.Generator,
  round_idx: int,
  *,
  validate: bool = True,
) -> RoundResult:
  """Stages 2-3 of one feedback round for already selected events (paper Sec. 3.2-3.3).

  Touches no shared state (safe in a worker thread). Each event: summary -> context ->
  exploration -> abstraction -> validation (skipped with `validate=False`, the ablation). The
  tasks of event k are labelled "syn-r<round>-<k>" (and "-1", "-2", ... when one context gives
  several) unless the benchmark names them. A spent LLM token budget ends the round early; what
  was accepted so far is kept.

  Returns:
    RoundResult: accepted tasks, the count of abstracted tasks, per-signal counts ("events",
    "synthesized", "validated"; "unguided" for contexts without a signal), rejections (id, why),
    the exploration trace, the LLM's usage and the wall seconds.
  """
  start = time.perf_counter()
  if synth.llm is not None:
    synth.llm.budget.reset()
  per_signal: dict[str, dict[str, int]] = {}
  tasks: list[Task] = []
  rejected: list[tuple[str, str]] = []
  trace: list[dict[str, Any]] = []
  synthesized = 0
  stopped: dict[str, Any] | None = None
  events = synth.plan_round(events, rng, round_idx)
  for k, event in enumerate(events):
    label = f"syn-r{round_idx}-{k:04d}"
    try:
      _next_context(synth)
      with _in_context(synth):
        context = _event_context(synth, event, rng)
        made, results = _explore_context(
          synth, context, rng, label, "synth", round_idx, validate, trace
        )
    except RoundStopped as e:
      stopped = stop_record(e, k, len(events) - k)
      log.warning(
        "feedback round %d stopped after %d of %d contexts (%d not explored): %s",
        round_idx,
        k,
        len(events),
        len(events) - k,
        e,
      )
      break
    counts = per_signal.setdefault(
      event.signal or UNGUIDED, {"events": 0, "synthesized": 0, "validated": 0}
    )
    counts["events"] += 1
    if not made:
      continue
    synthesized += len(results)
    counts["synthesized"] += len(results)
    for task_id, task, why in results:
      if task is None:
        rejected.append((task_id, why))
      else:
        counts["validated"] += 1
        tasks.append(task)
  return RoundResult(
    round_idx,
    tasks,
    synthesized,
    per_signal,
    rejected,
    trace,
    synth.llm.budget.reset() if synth.llm is not None else None,
    time.perf_counter() - start,
    stopped,
  )
