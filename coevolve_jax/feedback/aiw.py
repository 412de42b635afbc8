"""Role-Agent's Agent-In-World (AIW) as a task sampler: failed tasks, and earlier failed tasks
whose failure looks alike, are drawn more often.

Role-Agent (Wang et al., arXiv 2606.10917, Sec. 3.3; its released code's defaults): when task i
fails, w_i += `boost_failure` (0.15); the `top_k` (3) earlier failed tasks most similar to this
failure (similarity > 0) get w_j += `boost_similar` (0.35) x similarity; weights start at 1,
never fall below `min_weight` (1e-3), and the library of failures keeps the last `history` (512).
Added here: `decay` pulls every weight towards 1 before each step's boosts (w <- 1 + decay
(w - 1)); 1, the default, is the code's behaviour (no decay).

The analyser is the `template` fingerprint (no LLM): a failure is described by the set of
  - `tool:NAME`, every function the task's ground truth or the episodes called,
  - `seq:A>B`, consecutive calls the episodes made (the call sequence),
  - `depart:EXPECTED>GOT`, the first call where an episode left the ground truth (per user turn,
    by function name; `END` where one sequence ended first),
  - `error:NAME` for a call whose output reports an error, `error:parse` for replies that did
    not parse, `finish:WHY` for an episode that did not end by the environment,
over the group's failed episodes, and two failures are as similar as the Jaccard index of their
sets. The paper's LLM-written analysis (root cause, critical step, lesson, retrieval query) is
not implemented (`role_agent.aiw.analyser` accepts "template" only).

A task fails at a step when its group's mean reward is below `signals.success_threshold`. The
state (weights and the library) is JSON and saved in every checkpoint (`RunState.sampler`), so a
resumed run draws the same tasks; every process updates it from the same rollouts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from coevolve_jax.types import Task, Trajectory

ANALYSERS = ("template",)


def _name(call: str) -> str:
  """The function name of a call string ("cd(folder='x')" -> "cd")."""
  return call.split("(", 1)[0].strip()


def fingerprint(task: Task, failed: Sequence[Trajectory]) -> frozenset[str]:
  """The template analyser's description of a failure of `task` (module docstring): a set of
  feature strings over its failed episodes `failed`."""
  out: set[str] = set()
  for turn in task.ground_truth:
    out.update(f"tool:{_name(c)}" for c in turn)
  for traj in failed:
    names = [[_name(c) for c in turn] for turn in traj.calls]
    for turn in names:
      out.update(f"tool:{n}" for n in turn)
      out.update(f"seq:{a}>{b}" for a, b in zip(turn, turn[1:]))
    for truth, got in zip(task.ground_truth, names + [[]] * len(task.ground_truth)):
      expected = [_name(c) for c in truth]
      if expected != got:
        i = next((i for i, (e, g) in enumerate(zip(expected, got)) if e != g), None)
        i = min(len(expected), len(got)) if i is None else i
        e = expected[i] if i < len(expected) else "END"
        g = got[i] if i < len(got) else "END"
        out.add(f"depart:{e}>{g}")
        break
    for calls, outputs in zip(traj.calls, traj.observations):
      out.update(f"error:{_name(c)}" for c, o in zip(calls, outputs) if "error" in o.lower())
    if traj.parse_errors:
      out.add("error:parse")
    if traj.finish and traj.finish != "done":
      out.add(f"finish:{traj.finish}")
  return frozenset(out)


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
  """|a & b| / |a | b| (0 for two empty sets)."""
  union = len(a | b)
  return len(a & b) / union if union else 0.0


@dataclasses.dataclass
class AIWConfig:
  """`role_agent.aiw.*` (module docstring for each)."""

  boost_failure: float = 0.15
  boost_similar: float = 0.35
  top_k: int = 3
  history: int = 512
  decay: float = 1.0
  min_weight: float = 1e-3
  success_threshold: float = 0.5
  analyser: str = "template"

  def __post_init__(self):
    if self.analyser not in ANALYSERS:
      raise ValueError(f"analyser must be one of {ANALYSERS}, got {self.analyser!r}")
    if self.boost_failure < 0 or self.boost_similar < 0:
      raise ValueError("boosts must be >= 0")
    if self.top_k < 0 or self.history < 1:
      raise ValueError("top_k must be >= 0 and history >= 1")
    if not 0.0 <= self.decay <= 1.0:
      raise ValueError(f"decay must be in [0, 1], got {self.decay}")
    if self.min_weight <= 0:
      raise ValueError("min_weight must be > 0")


class AIWSampler:
  """The AIW task sampler (`feedback.sampler.TaskSampler`; module docstring)."""

  name = "aiw"

  def __init__(self, cfg: AIWConfig):
    self.cfg = cfg
    self.task_weights: dict[str, float] = {}  # task id -> weight (absent: 1)
    self.library: list[dict[str, Any]] = []  # {"task_id", "features", "step"}, oldest first
    self.steps = 0
    self._metrics: dict[str, float] = {}

  @classmethod
  def from_config(cls, cfg) -> "AIWSampler":
    """From the run config (`role_agent.aiw.*`, `signals.success_threshold`; a ConfigDict or
    its JSON dict).

    Raises:
      ValueError: a setting out of range, or an unknown analyser.
    """
    aiw = cfg["role_agent"]["aiw"]
    return cls(
      AIWConfig(
        boost_failure=float(aiw["boost_failure"]),
        boost_similar=float(aiw["boost_similar"]),
        top_k=int(aiw["top_k"]),
        history=int(aiw["history"]),
        decay=float(aiw["decay"]),
        min_weight=float(aiw["min_weight"]),
        success_threshold=float(cfg["signals"]["success_threshold"]),
        analyser=str(aiw["analyser"]),
      )
    )

  def weights(self, tasks: Sequence[Task]) -> np.ndarray | None:
    w = np.array([self.task_weights.get(t.task_id, 1.0) for t in tasks], np.float64)
    p = w / w.sum()
    entropy = -float(np.sum(p * np.log(p)))
    self._metrics["aiw/weight_entropy"] = entropy / math.log(len(w)) if len(w) > 1 else 1.0
    self._metrics["aiw/max_weight"] = float(w.max())
    return w

  def observe(self, tasks: Sequence[Task], trajectories: Sequence[Trajectory]) -> None:
    """Decays the weights, then boosts each task whose group failed and the `top_k` earlier
    failures most like it (the library as it was before this step), then adds this step's
    failures to the library."""
    cfg = self.cfg
    self.steps += 1
    if cfg.decay < 1.0:
      self.task_weights = {k: 1.0 + cfg.decay * (w - 1.0) for k, w in self.task_weights.items()}
    by_group: dict[int, list[Trajectory]] = {}
    for traj in trajectories:
      by_group.setdefault(traj.group_id, []).append(traj)
    earlier = [(e["task_id"], frozenset(e["features"])) for e in self.library]
    failures, similar = [], set()
    for group, trajs in sorted(by_group.items()):
      task = tasks[group]
      if np.mean([t.reward for t in trajs]) >= cfg.success_threshold:
        continue
      features = fingerprint(task, [t for t in trajs if t.reward < cfg.success_threshold])
      self._boost(task.task_id, cfg.boost_failure)
      best: dict[str, float] = {}  # other task id -> its most similar earlier failure
      for task_id, other in earlier:
        sim = jaccard(features, other)
        if task_id != task.task_id and sim > 0:
          best[task_id] = max(best.get(task_id, 0.0), sim)
      ranked = sorted(best.items(), key=lambda kv: (-kv[1], kv[0]))[: cfg.top_k]
      for task_id, sim in ranked:
        self._boost(task_id, cfg.boost_similar * sim)
        similar.add(task_id)
      failures.append({"task_id": task.task_id, "features": sorted(features), "step": self.steps})
    self.library = (self.library + failures)[-cfg.history :]
    self._metrics.update(
      {"aiw/failed_tasks": float(len(failures)), "aiw/boosted_similar": float(len(similar))}
    )

  def _boost(self, task_id: str, amount: float) -> None:
    w = self.task_weights.get(task_id, 1.0) + amount
    self.task_weights[task_id] = max(self.cfg.min_weight, w)

  def metrics(self) -> dict[str, float]:
    return dict(self._metrics)

  def state_dict(self) -> dict[str, Any]:
    return {
      "task_weights": dict(self.task_weights),
      "library": [dict(e) for e in self.library],
      "steps": self.steps,
    }

  def load_state_dict(self, state: dict[str, Any]) -> None:
    self.task_weights = {k: float(v) for k, v in state.get("task_weights", {}).items()}
    self.library = [dict(e) for e in state.get("library", [])]
    self.steps = int(state.get("steps", 0))
