"""The generic bookkeeping of a feedback round (paper Sec. 3.2-3.3): signal events, context
selection, a round's result and its commit to the task pool.

A round is split so that it can overlap training: `select_events` (main thread) picks the
contexts, `feedback.synthesis.synthesize_round` over the suite's hooks (any thread; reads only its
arguments) explores, abstracts and validates, and `commit_round` (main thread; the only step
that touches the pool) adds the accepted tasks. Nothing here knows a benchmark.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from coevolve_jax import errors
from coevolve_jax.feedback.pool import UNGUIDED, TaskPool
from coevolve_jax.metrics import write_atomic
from coevolve_jax.feedback.signals import KINDS, SignalEvent
from coevolve_jax.types import Task

log = logging.getLogger(__name__)


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
  stopped: dict[str, Any] | None = None  # a round stopped early (synthesis.stop_record)


MODES = ("signals", "random")  # how a round picks its contexts (feedback.mode)


def check_selection(kinds: tuple[str, ...], mode: str) -> None:
  """Raises ValueError unless `mode` is one of MODES and every kind is a signal kind (KINDS)."""
  if mode not in MODES:
    raise ValueError(f"feedback mode must be one of {MODES}, got {mode!r}")
  if unknown := set(kinds) - set(KINDS):
    raise ValueError(f"unknown signal kinds {sorted(unknown)} (known: {KINDS})")


def candidate_contexts(
  events: list[SignalEvent], rng: np.random.Generator, kinds: tuple[str, ...] = KINDS
) -> dict[str, list[SignalEvent]]:
  """Every signal-annotated trajectory of `kinds` is a candidate context (paper Sec. 3.2), one
  per (task, kind): of the trajectories of one task that fired one kind, one drawn uniformly
  represents it. Returns kind -> its candidates in random order (every kind of `kinds`)."""
  by_key: dict[tuple[str, str], list[SignalEvent]] = {}
  for e in events:
    if e.signal in kinds:
      by_key.setdefault((e.task.task_id, e.signal), []).append(e)
  out: dict[str, list[SignalEvent]] = {k: [] for k in kinds}
  for (_, kind), same in by_key.items():
    out[kind].append(same[int(rng.integers(len(same)))])
  return {k: [v[int(i)] for i in rng.permutation(len(v))] for k, v in out.items()}


def select_events(
  events: list[SignalEvent],
  rng: np.random.Generator,
  max_contexts: int,
  *,
  kinds: tuple[str, ...] = KINDS,
  mode: str = "signals",
  pool_tasks: Sequence[Task] = (),
) -> list[SignalEvent]:
  """The contexts of one round (paper Sec. 3.2): the candidate contexts (`candidate_contexts`:
  one per (task, kind)), all of them when `max_contexts` is 0 (the paper's reading), otherwise at
  most `max_contexts` balanced across kinds: taken in turn from each kind (forgetting, boundary,
  rare), so a kind with few candidates is not drowned by one with many; a kind that runs out
  leaves its turns to the others.

  Args:
    events: the signal events since the last round.
    max_contexts: the per-round budget (`feedback.max_contexts`; 0 = no limit).
    kinds: signal kinds used (the no-forgetting / no-boundary / no-rare ablations drop one).
    mode: "signals" (docs/design.md §1.2) or "random": random re-exploration, no signals;
      contexts are pool tasks drawn uniformly, explored unguided (signal None, no focus calls),
      as many as the signals mode would pick from the same events (the budget, or with 0 the
      number of candidates), so the ablation explores as much.
    pool_tasks: the pool's tasks (only read in "random" mode).

  Raises:
    ValueError: an unknown mode or kind, or a negative budget.
  """
  check_selection(kinds, mode)
  if max_contexts < 0:
    raise ValueError(f"max_contexts must be >= 0 (0 = all candidates), got {max_contexts}")
  candidates = candidate_contexts(events, rng, kinds)
  total = sum(map(len, candidates.values()))
  budget = total if max_contexts == 0 else min(max_contexts, total)
  if mode == "random":
    pool_tasks = list(pool_tasks)
    n = budget if max_contexts == 0 else max_contexts
    idx = rng.permutation(len(pool_tasks))[:n]
    return [SignalEvent(pool_tasks[int(i)], None, [[]], 0.0) for i in idx]
  chosen: list[SignalEvent] = []
  queues = [list(candidates[k]) for k in kinds]
  while len(chosen) < budget:
    for q in queues:
      if q and len(chosen) < budget:
        chosen.append(q.pop(0))
  return chosen


def signal_shares(events: list[SignalEvent]) -> dict[str, dict[str, float]]:
  """Per signal kind: the round's events (trajectories that fired it) and their share of all
  events, the figure of the paper's Fig. 4 (`feedback.jsonl`, TensorBoard `signals/share_*`)."""
  counts: dict[str, float] = {k: sum(e.signal == k for e in events) for k in KINDS}  # ints
  total = sum(counts.values())
  return {
    "events": counts,
    "shares": {k: (n / total if total else 0.0) for k, n in counts.items()},
  }


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
  stopped: dict[str, Any] | None = None  # when the round stopped early: synthesis.stop_record

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["tasks"] = [json.loads(t.to_json()) for t in self.tasks]
    return d

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> RoundResult:
    return cls(
      **{
        **d,
        "tasks": [Task.from_dict(t) for t in d["tasks"]],
        "rejected": [tuple(r) for r in d["rejected"]],
      }
    )


def events_digest(events: list[SignalEvent]) -> str:
  """A fingerprint of a round's selected contexts (what its synthesis was asked to explore)."""
  text = json.dumps([e.to_dict() for e in events], sort_keys=True, ensure_ascii=False)
  return hashlib.sha256(text.encode()).hexdigest()


class RoundJournal:
  """Each committed round's result on disk, so that a resumed run redoes it exactly.

  A round's synthesis may not repeat (an LLM explorer samples; a remote model changes), but its
  tasks join the pool under ids like `syn-r1-0002`. A run killed after a round's commit and before
  the next checkpoint resumes from that checkpoint and commits the round again: it then reuses
  the recorded result instead of synthesizing anew, so a task id never names two tasks. A record
  is used only for the same round with the same selected contexts (`events_digest`).

  Files: `<directory>/round-<idx>.json`, written atomically (temp file, fsync, rename).
  """

  def __init__(self, directory: str):
    self.directory = directory

  def _path(self, round_idx: int) -> str:
    return os.path.join(self.directory, f"round-{round_idx:05d}.json")

  def save(self, result: RoundResult, digest: str) -> None:
    """Records `result` for the round whose contexts have fingerprint `digest`.

    Raises:
      DiskFullError: the disk is full (no record is left half written).
    """
    with errors.writing(self.directory):
      os.makedirs(self.directory, exist_ok=True)
    record = {"events_digest": digest, "result": result.to_json()}
    write_atomic(self._path(result.round_idx), json.dumps(record, ensure_ascii=False), sync=True)

  def load(self, round_idx: int, digest: str) -> RoundResult | None:
    """The recorded result of round `round_idx`, if one exists for the same contexts."""
    try:
      with open(self._path(round_idx), encoding="utf-8") as f:
        record = json.load(f)
    except FileNotFoundError:
      return None
    except (OSError, ValueError) as e:  # a torn or unreadable record: synthesize again
      log.warning("round %d: ignoring the unreadable record %s (%s)", round_idx, f.name, e)
      return None
    if record.get("events_digest") != digest:
      log.warning(
        "round %d: the record's contexts differ from this run's; synthesizing again", round_idx
      )
      return None
    return RoundResult.from_json(record["result"])

  def clear(self) -> None:
    """Removes every record (a fresh start)."""
    if os.path.isdir(self.directory):
      for name in os.listdir(self.directory):
        if name.startswith("round-"):
          os.remove(os.path.join(self.directory, name))


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
    stopped=result.stopped,
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
