"""Signal extraction from a step's rollouts (docs/design.md §1.1): forgetting, boundary, rare.

Plain Python, host side. One `SignalTracker` lives for the whole run; `update` is called once per
training step with that step's rollout records and returns the fired signals. Its state goes into
checkpoints through `state_dict` / `load_state_dict` (JSON-serialisable).

Semantics (threshold t = `success_threshold`, 0.5 by default; paper Sec. 3.1, where the text
leaves a choice the option is named and the default is the closer reading):

* forgetting: a trajectory of the current step with score < t fires when its task was rolled out
  within the last `window` training iterations (steps s - W .. s - 1; W counts iterations, not
  visits) and one of those earlier rollouts scored >= t. `forgetting="rollout"` (default, the
  paper's "previously solved at least once") keeps, per task and visit, the best rollout score;
  `forgetting="visit_mean"` keeps the visit's mean score instead (a task solved 2/8, then 0/8,
  then fires under "rollout" and not under "visit_mean"). The current visit is recorded after
  its trajectories are judged, so a task's first visit never fires.
* boundary: all K rollouts of a task at this step are marked when at least one score is > t and at
  least one is < t (strict: a score of exactly t counts as neither). Rollouts are grouped by
  `task_id` (all groups of the same task at this step together).
* rare: each trajectory maps to patterns: `pattern="tool_sequence"` gives one pattern, the ordered
  tuple of tool names it called (the empty tuple when it called none); `pattern="ngram:N"` gives
  the set of distinct contiguous N-grams of that sequence (the whole sequence when it is shorter
  than N, so a short or empty trajectory still has one pattern). c_p counts, cumulatively over
  training, the tasks whose trajectories showed pattern p (`rare_count="tasks"`, default: each
  task counts once per pattern) or the trajectories that did (`rare_count="trajectories"`;
  repeats within one trajectory count once either way); N = sum_p c_p. A step's trajectories are
  judged against the counts of the earlier steps, then counted: a trajectory of task tau fires
  when N >= `rare_min_total` and one of its patterns p has 0 < c_p / N < theta / 100 and recurs:
  the tasks that showed p, tau included (or the trajectories, this one included) number at least
  `rare_min_count` (default 2). So a pattern seen for the first time never fires, and with task
  counting neither does a task's own solution repeated by its own rollouts: with many tasks each
  solution's share is below theta, and counted per trajectory every solved task's rollouts fired
  "rare" (scripts/simulate_signals.py: a third of all events, more than forgetting). Rare is a
  behaviour several tasks show that is still a small part of all (task, pattern) pairs.

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

_STATE_VERSION = 2  # 1: history of visit means without their steps
FORGETTING_MODES = ("rollout", "visit_mean")
RARE_COUNTS = ("tasks", "trajectories")


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
  """A marked trajectory: its task, the signal kind, the agent's calls per turn, its reward in
  [0, 1], and per turn the output of each call (where the environment records them)."""

  task: Task
  signal: str | None
  calls: list[list[str]]
  reward: float
  observations: list[list[str]] = dataclasses.field(default_factory=list)

  def to_dict(self) -> dict[str, Any]:
    """A JSON-serialisable form (checkpoints keep the events of the round to come)."""
    return {
      "task": json.loads(self.task.to_json()),
      "signal": self.signal,
      "calls": self.calls,
      "reward": self.reward,
      "observations": self.observations,
    }

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> SignalEvent:
    return cls(
      Task.from_dict(d["task"]), d["signal"], d["calls"], d["reward"], d.get("observations", [])
    )


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


def _check_records(records: Sequence[RolloutRecord]) -> None:
  """Checks a step's records before anything is changed.

  Raises:
    ValueError: a score outside [0, 1] or NaN; a repeated trajectory_index.
  """
  seen: set[int] = set()
  for r in records:
    s = float(r.score)
    if math.isnan(s) or not 0.0 <= s <= 1.0:
      raise ValueError(f"score must be in [0, 1], got {r.score!r} (task {r.task_id})")
    if r.trajectory_index in seen:
      raise ValueError(f"trajectory_index {r.trajectory_index} appears twice")
    seen.add(r.trajectory_index)


class SignalTracker:
  """Keeps per-task score histories and pattern counts; turns each step's rollouts into signals.

  Args:
    window: W, the training iterations a task's earlier scores count for forgetting (>= 1).
    rare_theta_percent: theta; a pattern is rare when its share of all counts is < theta / 100.
    rare_min_total: N_min; no rare signal fires before the total count N reaches it.
    pattern: "tool_sequence" (default) or "ngram:N".
    success_threshold: t, the 0.5 of docs/design.md §1.1.
    forgetting: "rollout" (default) or "visit_mean": what an earlier visit's score is.
    rare_min_count: a pattern fires only once this many tasks (or trajectories, with
      `rare_count="trajectories"`), the judged one included, showed it (>= 1; counting
      trajectories, 1 and 2 agree: a pattern needs an earlier count to have a share at all).
    rare_count: "tasks" (default) or "trajectories": what c_p counts.

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
    forgetting: str = "rollout",
    rare_min_count: int = 2,
    rare_count: str = "tasks",
  ):
    if window < 1:
      raise ValueError(f"window must be >= 1, got {window}")
    if not 0.0 <= rare_theta_percent <= 100.0:
      raise ValueError(f"rare_theta_percent must be in [0, 100], got {rare_theta_percent}")
    if rare_min_total < 0:
      raise ValueError(f"rare_min_total must be >= 0, got {rare_min_total}")
    if not 0.0 <= success_threshold <= 1.0:
      raise ValueError(f"success_threshold must be in [0, 1], got {success_threshold}")
    if forgetting not in FORGETTING_MODES:
      raise ValueError(f"forgetting must be one of {FORGETTING_MODES}, got {forgetting!r}")
    if rare_min_count < 1:
      raise ValueError(f"rare_min_count must be >= 1, got {rare_min_count}")
    self.forgetting = forgetting
    self.rare_min_count = int(rare_min_count)
    if rare_count not in RARE_COUNTS:
      raise ValueError(f"rare_count must be one of {RARE_COUNTS}, got {rare_count!r}")
    self.rare_count = rare_count
    self.window = int(window)
    self.rare_theta_percent = float(rare_theta_percent)
    self.rare_min_total = int(rare_min_total)
    self.pattern = pattern
    self._ngram = _parse_pattern(pattern)
    self.success_threshold = float(success_threshold)
    # task -> [(step, visit score)] of its visits within the last `window` steps, oldest first
    self.history: dict[str, list[tuple[int, float]]] = {}
    self.pattern_counts: collections.Counter[str] = collections.Counter()
    self.total = 0  # N = sum of pattern_counts
    self.pattern_tasks: dict[str, set[str]] = {}  # rare_count="tasks": the tasks behind c_p
    self.counts: dict[str, int] = {k: 0 for k in KINDS}  # signals fired so far, per kind
    self.steps = 0

  @classmethod
  def from_config(cls, signals_cfg: Any) -> SignalTracker:
    """A tracker from the `signals` config group (window, rare_theta_percent, rare_min_total,
    pattern, success_threshold, forgetting, rare_min_count, rare_count), built by keyword."""
    return cls(
      window=signals_cfg.window,
      rare_theta_percent=signals_cfg.rare_theta_percent,
      rare_min_total=signals_cfg.rare_min_total,
      pattern=signals_cfg.pattern,
      success_threshold=signals_cfg.success_threshold,
      forgetting=signals_cfg.forgetting,
      rare_min_count=signals_cfg.rare_min_count,
      rare_count=signals_cfg.rare_count,
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
    _check_records(records)
    by_task: dict[str, list[RolloutRecord]] = {}
    for r in records:
      by_task.setdefault(r.task_id, []).append(r)
    forgetting = self._forgetting(records, by_task)
    boundary = self._boundary(records, by_task)
    # Rare: judge against the earlier steps' counts, then count this step's patterns.
    keys = [self.patterns(r.tool_names) for r in records]
    rare = self._rare(records, keys)
    self._count_patterns(records, keys)

    signals = forgetting + boundary + rare
    for s in signals:
      self.counts[s.kind] += 1
    self.steps += 1
    return signals

  def _forgetting(
    self, records: list[RolloutRecord], by_task: dict[str, list[RolloutRecord]]
  ) -> list[Signal]:
    """Forgetting signals of a step's records, judged against the earlier visits of the last W
    steps; then records this step's visit of each task in `history`."""
    t = self.success_threshold
    step, oldest = self.steps, self.steps - self.window
    self.history = {
      k: kept for k, h in self.history.items() if (kept := [(s, v) for s, v in h if s >= oldest])
    }
    for task_id in by_task:
      self.history.setdefault(task_id, [])
    forgetting = [
      Signal(FORGETTING, r.task_id, r.trajectory_index)
      for r in records
      if r.score < t and any(v >= t for _, v in self.history[r.task_id])
    ]
    for task_id, rs in by_task.items():
      scores = [float(r.score) for r in rs]
      visit = max(scores) if self.forgetting == "rollout" else sum(scores) / len(scores)
      self.history[task_id].append((step, visit))
    return forgetting

  def _boundary(
    self, records: list[RolloutRecord], by_task: dict[str, list[RolloutRecord]]
  ) -> list[Signal]:
    """Boundary signals of a step's records: a mixed group marks all of its rollouts."""
    t = self.success_threshold
    mixed = {
      task_id
      for task_id, rs in by_task.items()
      if any(r.score > t for r in rs) and any(r.score < t for r in rs)
    }
    return [Signal(BOUNDARY, r.task_id, r.trajectory_index) for r in records if r.task_id in mixed]

  def _rare(self, records: list[RolloutRecord], keys: list[list[str]]) -> list[Signal]:
    """Rare signals of a step's records (`keys`: each record's pattern keys), judged against the
    counts of the earlier steps; changes nothing."""
    if self.total < max(self.rare_min_total, 1):
      return []
    by_tasks = self.rare_count == "tasks"
    limit = self.rare_theta_percent / 100.0

    def is_rare(k: str, task_id: str) -> bool:
      c = self.pattern_counts.get(k, 0)
      if by_tasks:
        recurs = len(self.pattern_tasks.get(k, set()) | {task_id})
      else:
        recurs = c + 1
      return 0 < c and c / self.total < limit and recurs >= self.rare_min_count

    return [
      Signal(RARE, r.task_id, r.trajectory_index)
      for r, ks in zip(records, keys, strict=True)
      if any(is_rare(k, r.task_id) for k in ks)
    ]

  def _count_patterns(self, records: list[RolloutRecord], keys: list[list[str]]) -> None:
    """Adds a step's pattern keys (`keys`: each record's) to the counts c_p and N: with
    `rare_count="tasks"` each pattern once per task, else once per trajectory."""
    by_tasks = self.rare_count == "tasks"
    for r, ks in zip(records, keys, strict=True):
      if by_tasks:
        ks = [k for k in ks if r.task_id not in self.pattern_tasks.setdefault(k, set())]
        for k in ks:
          self.pattern_tasks[k].add(r.task_id)
      self.pattern_counts.update(ks)
      self.total += len(ks)

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
      events.append(SignalEvent(tasks[tr.group_id], s.kind, tr.calls, tr.reward, tr.observations))
    return events

  # ------------------------------------------------------------------ checkpointing

  def config(self) -> dict[str, Any]:
    return {
      "window": self.window,
      "rare_theta_percent": self.rare_theta_percent,
      "rare_min_total": self.rare_min_total,
      "pattern": self.pattern,
      "success_threshold": self.success_threshold,
      "forgetting": self.forgetting,
      "rare_min_count": self.rare_min_count,
      "rare_count": self.rare_count,
    }

  def state_dict(self) -> dict[str, Any]:
    """A JSON-serialisable snapshot of the tracker (config, histories, counts)."""
    return {
      "version": _STATE_VERSION,
      "config": self.config(),
      "history": {k: [[s, v] for s, v in h] for k, h in self.history.items()},
      "pattern_counts": dict(self.pattern_counts),
      "total": self.total,
      "pattern_tasks": {k: sorted(v) for k, v in self.pattern_tasks.items()},
      "counts": dict(self.counts),
      "steps": self.steps,
    }

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores a `state_dict` snapshot; the tracker's own thresholds are kept.

    Scores older than this tracker's window are dropped at the next `update`. A version-1
    snapshot (visit means without their steps) is read as visits at consecutive last steps.

    Raises:
      ValueError: an unknown version, or the snapshot used another pattern spec (its counts would
        mean something else).
    """
    version = state.get("version")
    if version not in (1, _STATE_VERSION):
      raise ValueError(f"unknown signal state version {version!r}")
    pattern = state.get("config", {}).get("pattern", self.pattern)
    if pattern != self.pattern:
      raise ValueError(f"state was built with pattern={pattern!r}, tracker uses {self.pattern!r}")
    steps = int(state.get("steps", 0))
    if version == 1:
      self.history = {
        k: [(steps - len(v) + i, float(x)) for i, x in enumerate(v)]
        for k, v in state["history"].items()
      }
    else:
      self.history = {k: [(int(s), float(x)) for s, x in v] for k, v in state["history"].items()}
    self.pattern_counts = collections.Counter(
      {k: int(v) for k, v in state["pattern_counts"].items()}
    )
    self.total = int(state["total"])
    self.pattern_tasks = {k: set(v) for k, v in state.get("pattern_tasks", {}).items()}
    self.counts = {k: int(state["counts"].get(k, 0)) for k in KINDS}
    self.steps = steps
