"""The generic bookkeeping of a feedback round (paper Sec. 3.2-3.3): signal events, context
selection, a round's result and its commit to the task pool.

A round is split so that it can overlap training: `select_events` (main thread) picks the
contexts, a suite's `synthesize_round` (any thread; reads only its arguments) explores, abstracts
and validates, and `commit_round` (main thread; the only step that touches the pool) adds the
accepted tasks. Nothing here knows a benchmark: suites under `envs/` implement the synthesis.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from coevolve_jax.feedback.pool import TaskPool
from coevolve_jax.feedback.signals import KINDS, SignalEvent
from coevolve_jax.types import Task

log = logging.getLogger(__name__)
UNGUIDED = "unguided"  # per-signal key of contexts without a signal (random re-exploration)


@dataclasses.dataclass
class FeedbackReport:
  synthesized: int
  accepted: int
  dropped: list[tuple[str, str, str | None]]
  pass_rate: float
  per_signal: dict[str, dict[str, int]]
  rejected: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (task_id, reason)
  llm_usage: dict[str, int] | None = None  # {"tokens", "requests"} of the round's LLM calls
  eval_similarity: dict[str, float] = dataclasses.field(default_factory=dict)  # added id -> max


MODES = ("signals", "random")  # how a round picks its contexts (feedback.mode)


def check_selection(kinds: tuple[str, ...], mode: str) -> None:
  """Raises ValueError unless `mode` is one of MODES and every kind is a signal kind (KINDS)."""
  if mode not in MODES:
    raise ValueError(f"feedback mode must be one of {MODES}, got {mode!r}")
  if unknown := set(kinds) - set(KINDS):
    raise ValueError(f"unknown signal kinds {sorted(unknown)} (known: {KINDS})")


def select_events(
  events: list[SignalEvent],
  rng: np.random.Generator,
  max_contexts: int,
  *,
  kinds: tuple[str, ...] = KINDS,
  mode: str = "signals",
  pool_tasks: list[Task] = (),
) -> list[SignalEvent]:
  """The contexts of one round: up to `max_contexts` events, drawn uniformly without replacement.

  Args:
    events: the signal events since the last round.
    kinds: signal kinds used (the no-forgetting / no-boundary / no-rare ablations drop one).
    mode: "signals" (docs/design.md §1.2) or "random": random re-exploration, no signals;
      contexts are pool tasks drawn uniformly, explored unguided (signal None, no focus calls).
    pool_tasks: the pool's tasks (only read in "random" mode).

  Raises:
    ValueError: an unknown mode or kind.
  """
  check_selection(kinds, mode)
  if mode == "random":
    pool_tasks = list(pool_tasks)
    idx = rng.permutation(len(pool_tasks))[:max_contexts]
    return [SignalEvent(pool_tasks[int(i)], None, [[]], 0.0) for i in idx]
  usable = [e for e in events if e.signal in kinds]
  return [usable[int(i)] for i in rng.permutation(len(usable))[:max_contexts]]


@dataclasses.dataclass
class RoundResult:
  """A feedback round's synthesized and validated tasks, before they meet the pool."""

  round_idx: int
  tasks: list[Task]
  synthesized: int
  per_signal: dict[str, dict[str, int]]
  rejected: list[tuple[str, str]]
  trace: list[dict[str, Any]]
  llm_usage: dict[str, int] | None = None
  wall_s: float = 0.0


def commit_round(result: RoundResult, pool: TaskPool, eval_tasks: list[Task]) -> FeedbackReport:
  """Adds a round's validated tasks to the pool (dropping duplicates of the evaluation split and
  of the pool, logged) and reports the round."""
  report = pool.add(result.tasks, eval_tasks=eval_tasks)
  dropped_ids = {d[0] for d in report.dropped}
  per_signal = {k: {**v, "accepted": 0} for k, v in result.per_signal.items()}
  for task in result.tasks:
    if task.task_id not in dropped_ids:
      per_signal[task.provenance["signal"] or UNGUIDED]["accepted"] += 1
  out = FeedbackReport(
    synthesized=result.synthesized,
    accepted=report.added,
    dropped=report.dropped,
    pass_rate=(len(result.tasks) / result.synthesized) if result.synthesized else 0.0,
    per_signal=per_signal,
    rejected=result.rejected,
    llm_usage=result.llm_usage,
    eval_similarity=report.eval_similarity,
  )
  log.info(
    "feedback round %d: synthesized %d, accepted %d, dropped %d, pass rate %.2f",
    result.round_idx,
    out.synthesized,
    out.accepted,
    len(out.dropped),
    out.pass_rate,
  )
  return out
