"""Signal extraction from a step's rollouts (docs/design.md §1.1): forgetting, boundary, rare.

Plain Python, host side. One `SignalTracker` lives for the whole run; `update` is called once per
training step with that step's rollout records and returns the fired signals. Its state goes into
checkpoints through `state_dict` / `load_state_dict` (JSON-serialisable).

Semantics (threshold t = `success_threshold`, 0.5 by default):

* forgetting: every task keeps the scores of its last `window` visits (a visit = one training step
  in which the task was rolled out). A trajectory of the current step with score < t fires when
  some score in that history (earlier steps only) is >= t. After all current trajectories are
  judged against the earlier history, the visit's score, i.e. the mean score of the task's
  rollouts at this step, is appended (the oldest one drops out past `window`). A task's first visit
  never fires.
* boundary: all K rollouts of a task at this step are marked when at least one score is > t and at
  least one is < t (strict: a score of exactly t counts as neither). Rollouts are grouped by
  `task_id` (all groups of the same task at this step together).
* rare: each trajectory maps to patterns: `pattern="tool_sequence"` gives one pattern, the ordered
  tuple of tool names it called (the empty tuple when it called none); `pattern="ngram:N"` gives
  the set of distinct contiguous N-grams of that sequence (the whole sequence when it is shorter
  than N, so a short or empty trajectory still has one pattern). Counts c_p are cumulative over
  training; N = sum_p c_p. Order within a step: all of this step's patterns are counted first,
  then every trajectory of the step is judged, so c_p >= 1 for its own patterns. Once
  N >= `rare_min_total`, a trajectory fires when one of its patterns has 0 < c_p / N < theta / 100.
  With n-grams a trajectory adds 1 to each distinct n-gram it contains (repeats within one
  trajectory count once).

All three kinds can mark the same trajectory; each is reported separately. Signals come back
ordered by kind (forgetting, boundary, rare) and, within a kind, in the order of the records.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

from coevolve_jax.types import Task, Trajectory

FORGETTING = "forgetting"
BOUNDARY = "boundary"
RARE = "rare"
KINDS = (FORGETTING, BOUNDARY, RARE)

_STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class RolloutRecord:
  """What the signal tracker needs from one finished trajectory.

  Attributes:
    task_id: the task's id.
    group_id: the GRPO group the trajectory belongs to (str or int; informational here).
    score: outcome score in [0, 1] (1 success, 0 failure with binary rewards).
    tool_names: names of the tools the trajectory called, in call order.
    trajectory_index: the trajectory's index in the step's batch (returned in `Signal`).
  """

  task_id: str
  group_id: str | int
  score: float
  tool_names: Sequence[str]
  trajectory_index: int


@dataclasses.dataclass
class SignalEvent:
  """A marked trajectory: its task, the signal kind, the agent's calls per turn, and its reward in
  [0, 1]."""

  task: Task
  signal: str | None
  calls: list[list[str]]
  reward: float

  def to_dict(self) -> dict[str, Any]:
    """A JSON-serialisable form (checkpoints keep the events of the round to come)."""
    return {
      "task": json.loads(self.task.to_json()),
      "signal": self.signal,
      "calls": self.calls,
      "reward": self.reward,
    }

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> SignalEvent:
    return cls(Task.from_dict(d["task"]), d["signal"], d["calls"], d["reward"])


@dataclasses.dataclass(frozen=True)
class Signal:
  """One fired signal: `kind` in KINDS, for the trajectory `trajectory_index` of task `task_id`."""

  kind: str
  task_id: str
  trajectory_index: int


def _parse_pattern(pattern: str) -> int | None:
  """Returns None for "tool_sequence" or N for "ngram:N".

  Raises:
    ValueError: an unknown pattern spec or N < 1.
  """
  if pattern == "tool_sequence":
    return None
  if pattern.startswith("ngram:"):
    try:
      n = int(pattern.split(":", 1)[1])
    except ValueError:
      n = 0
    if n >= 1:
      return n
  raise ValueError(f"pattern must be 'tool_sequence' or 'ngram:N' with N >= 1, got {pattern!r}")


class SignalTracker:
  """Keeps per-task score histories and pattern counts; turns each step's rollouts into signals.

  Args:
    window: W, number of earlier visit scores kept per task for forgetting (>= 1).
    rare_theta_percent: theta; a pattern is rare when its share of all counts is < theta / 100.
    rare_min_total: N_min; no rare signal fires before the total count N reaches it.
    pattern: "tool_sequence" (default) or "ngram:N".
    success_threshold: t, the 0.5 of docs/design.md §1.1.

  Raises:
    ValueError: invalid arguments.
  """

  def __init__(
    self,
    window: int = 5,
    rare_theta_percent: float = 5.0,
    rare_min_total: int = 50,
    pattern: str = "tool_sequence",
    success_threshold: float = 0.5,
  ):
    if window < 1:
      raise ValueError(f"window must be >= 1, got {window}")
    if not 0.0 <= rare_theta_percent <= 100.0:
      raise ValueError(f"rare_theta_percent must be in [0, 100], got {rare_theta_percent}")
    if rare_min_total < 0:
      raise ValueError(f"rare_min_total must be >= 0, got {rare_min_total}")
    if not 0.0 <= success_threshold <= 1.0:
      raise ValueError(f"success_threshold must be in [0, 1], got {success_threshold}")
    self.window = int(window)
    self.rare_theta_percent = float(rare_theta_percent)
    self.rare_min_total = int(rare_min_total)
    self.pattern = pattern
    self._ngram = _parse_pattern(pattern)
    self.success_threshold = float(success_threshold)
    self.history: dict[str, collections.deque[float]] = {}
    self.pattern_counts: collections.Counter[str] = collections.Counter()
    self.total = 0  # N = sum of pattern_counts
    self.counts: dict[str, int] = {k: 0 for k in KINDS}  # signals fired so far, per kind
    self.steps = 0

  @classmethod
  def from_config(cls, signals_cfg: Any) -> SignalTracker:
    """A tracker from the `signals` config group (window, rare_theta_percent, rare_min_total,
    pattern, success_threshold), built by keyword."""
    return cls(
      window=signals_cfg.window,
      rare_theta_percent=signals_cfg.rare_theta_percent,
      rare_min_total=signals_cfg.rare_min_total,
      pattern=signals_cfg.pattern,
      success_threshold=signals_cfg.success_threshold,
    )

  # ------------------------------------------------------------------ patterns

  def patterns(self, tool_names: Sequence[str]) -> list[str]:
    """The pattern keys of a trajectory (JSON strings of tool-name lists), distinct, in order."""
    names = [str(n) for n in tool_names]
    if self._ngram is None or len(names) <= self._ngram:
      grams = [names]
    else:
      n = self._ngram
      grams = [names[i : i + n] for i in range(len(names) - n + 1)]
    keys = [json.dumps(g, ensure_ascii=False) for g in grams]
    return list(dict.fromkeys(keys))

  def share(self, key: str) -> float:
    """c_p / N for a pattern key (0 when N is 0)."""
    return self.pattern_counts.get(key, 0) / self.total if self.total else 0.0

  # ------------------------------------------------------------------ update

  def update(self, records: Iterable[RolloutRecord]) -> list[Signal]:
    """Processes one training step's rollouts and returns the signals they fire.

    Args:
      records: the step's finished trajectories (any order; several tasks, several per task).

    Returns:
      list of Signal, ordered by kind then record order.

    Raises:
      ValueError: a score outside [0, 1] or NaN; a repeated trajectory_index. State is unchanged
        when this raises.
    """
    records = list(records)
    seen: set[int] = set()
    for r in records:
      s = float(r.score)
      if math.isnan(s) or not 0.0 <= s <= 1.0:
        raise ValueError(f"score must be in [0, 1], got {r.score!r} (task {r.task_id})")
      if r.trajectory_index in seen:
        raise ValueError(f"trajectory_index {r.trajectory_index} appears twice")
      seen.add(r.trajectory_index)

    t = self.success_threshold
    by_task: dict[str, list[RolloutRecord]] = {}
    for r in records:
      by_task.setdefault(r.task_id, []).append(r)

    # Forgetting: judge against earlier visits only, then record this visit's mean.
    forgetting = []
    for r in records:
      hist = self.history.get(r.task_id)
      if r.score < t and hist is not None and any(h >= t for h in hist):
        forgetting.append(Signal(FORGETTING, r.task_id, r.trajectory_index))
    for task_id, rs in by_task.items():
      hist = self.history.setdefault(task_id, collections.deque(maxlen=self.window))
      hist.append(sum(float(r.score) for r in rs) / len(rs))

    # Boundary: a mixed group marks all of its rollouts.
    mixed = {
      task_id
      for task_id, rs in by_task.items()
      if any(r.score > t for r in rs) and any(r.score < t for r in rs)
    }
    boundary = [
      Signal(BOUNDARY, r.task_id, r.trajectory_index) for r in records if r.task_id in mixed
    ]

    # Rare: count this step's patterns first, then judge.
    keys = [self.patterns(r.tool_names) for r in records]
    for ks in keys:
      self.pattern_counts.update(ks)
      self.total += len(ks)
    rare = []
    if self.total >= self.rare_min_total and self.total > 0:
      limit = self.rare_theta_percent / 100.0
      for r, ks in zip(records, keys, strict=True):
        if any(0.0 < self.pattern_counts[k] / self.total < limit for k in ks):
          rare.append(Signal(RARE, r.task_id, r.trajectory_index))

    signals = forgetting + boundary + rare
    for s in signals:
      self.counts[s.kind] += 1
    self.steps += 1
    return signals

  def observe(self, trajectories: Sequence[Trajectory], tasks: Sequence[Task]) -> list[SignalEvent]:
    """One training step's trajectories -> the signal events they fire (`update`'s order).

    Args:
      trajectories: the step's finished trajectories; `trajectory.group_id` indexes `tasks`.
      tasks: the step's tasks, one per GRPO group.

    Returns:
      One SignalEvent per fired signal: the trajectory's task, the kind, its calls and reward.

    Raises:
      ValueError: as `update`.
    """
    records = [
      RolloutRecord(t.task_id, t.group_id, t.reward, t.tool_names, i)
      for i, t in enumerate(trajectories)
    ]
    events = []
    for s in self.update(records):
      tr = trajectories[s.trajectory_index]
      events.append(SignalEvent(tasks[tr.group_id], s.kind, tr.calls, tr.reward))
    return events

  # ------------------------------------------------------------------ checkpointing

  def config(self) -> dict[str, Any]:
    return {
      "window": self.window,
      "rare_theta_percent": self.rare_theta_percent,
      "rare_min_total": self.rare_min_total,
      "pattern": self.pattern,
      "success_threshold": self.success_threshold,
    }

  def state_dict(self) -> dict[str, Any]:
    """A JSON-serialisable snapshot of the tracker (config, histories, counts)."""
    return {
      "version": _STATE_VERSION,
      "config": self.config(),
      "history": {k: list(v) for k, v in self.history.items()},
      "pattern_counts": dict(self.pattern_counts),
      "total": self.total,
      "counts": dict(self.counts),
      "steps": self.steps,
    }

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores a `state_dict` snapshot; the tracker's own thresholds are kept.

    Histories longer than this tracker's window keep their most recent scores.

    Raises:
      ValueError: an unknown version, or the snapshot used another pattern spec (its counts would
        mean something else).
    """
    if state.get("version") != _STATE_VERSION:
      raise ValueError(f"unknown signal state version {state.get('version')!r}")
    pattern = state.get("config", {}).get("pattern", self.pattern)
    if pattern != self.pattern:
      raise ValueError(f"state was built with pattern={pattern!r}, tracker uses {self.pattern!r}")
    self.history = {
      k: collections.deque((float(x) for x in v), maxlen=self.window)
      for k, v in state["history"].items()
    }
    self.pattern_counts = collections.Counter(
      {k: int(v) for k, v in state["pattern_counts"].items()}
    )
    self.total = int(state["total"])
    self.counts = {k: int(state["counts"].get(k, 0)) for k in KINDS}
    self.steps = int(state.get("steps", 0))
