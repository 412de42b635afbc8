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
sets.

The `llm` analyser is the paper's (Sec. 3.3): the explorer LLM writes a structured analysis of
each failure (`ANALYSIS_SYSTEM`: root-cause type and detail, critical step, transferable lesson,
retrieval query), the `candidates` earlier failures whose analyses share most words with it
(word Jaccard of the query and analysis against each library entry's analysis, or its
fingerprint for an entry the template analysed) are shown to the LLM, and it chooses the similar
ones with a similarity in [0, 1] (`RETRIEVE_SYSTEM`); the `top_k` it rates above 0 are boosted as
above. Its calls run on the primary process only (`distributed.on_primary`, every process then
applies the same boosts), `workers` failures at a time, and charge the explorer's token budget:
the budget of the feedback round period they fall in (the next round's start resets it; without
feedback rounds the loop resets it every `feedback.every` steps). A failure whose analysis or
choice cannot be had (budget spent, endpoint down, a reply that is not the JSON asked for) gets
the template's analysis or retrieval instead, counted in `aiw/llm_fallbacks`; the run goes on.

A task fails at a step when its group's mean reward is below `signals.success_threshold`. The
state (weights and the library) is JSON and saved in every checkpoint (`RunState.sampler`), so a
resumed run draws the same tasks; every process updates it from the same rollouts.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from coevolve_jax import distributed
from coevolve_jax.feedback.llm import LLMError, TextLLM, parse_json_reply
from coevolve_jax.types import Task, Trajectory

log = logging.getLogger(__name__)
ANALYSERS = ("template", "llm")
ROOT_CAUSES = (
  "wrong_tool",
  "wrong_arguments",
  "missing_step",
  "extra_step",
  "wrong_order",
  "format_error",
  "environment_error",
  "gave_up",
  "other",
)
ANALYSIS_SYSTEM = (
  "You analyse why a tool-using agent failed a task. Reply with one JSON object with the keys: "
  f"root_cause_type (one of: {', '.join(ROOT_CAUSES)}), root_cause_detail (one sentence), "
  "critical_step (the 0-based index, in the agent's calls, of the first call that went wrong; "
  "-1 if none did), lesson (one sentence another task could use), retrieval_query (a few words "
  "that would find failures like this one)."
)
RETRIEVE_SYSTEM = (
  "You match a failure of a tool-using agent with earlier failures. Given its analysis and "
  "numbered candidates, reply with one JSON object "
  '{"similar": [{"id": <candidate number>, "similarity": <number from 0 to 1>}, ...]} naming '
  "the candidates that failed for the same reason (most similar first; [] if none)."
)
OBS_CHARS = 200  # observation characters per call shown to the analyser
EPISODES_SHOWN = 2  # failed episodes of a group shown to the analyser
_WORD = re.compile(r"[a-z0-9_]+")


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
  candidates: int = 8
  workers: int = 4

  def __post_init__(self):
    if self.analyser not in ANALYSERS:
      raise ValueError(f"analyser must be one of {ANALYSERS}, got {self.analyser!r}")
    if self.candidates < 1 or self.workers < 1:
      raise ValueError("candidates and workers must be >= 1")
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

  def __init__(self, cfg: AIWConfig, llm: TextLLM | None = None):
    """Raises ValueError: the `llm` analyser without an LLM."""
    if cfg.analyser == "llm" and llm is None:
      raise ValueError(
        "role_agent.aiw.analyser='llm' needs the explorer LLM (explore.explorer is programmatic)"
      )
    self.cfg = cfg
    self.llm = llm if cfg.analyser == "llm" else None
    self.task_weights: dict[str, float] = {}  # task id -> weight (absent: 1)
    # {"task_id", "features", "step", and "analysis" from the llm analyser}, oldest first
    self.library: list[dict[str, Any]] = []
    self.steps = 0
    self._metrics: dict[str, float] = {}

  @staticmethod
  def settings(cfg) -> AIWConfig:
    """`role_agent.aiw.*` and `signals.success_threshold` of the run config (a ConfigDict or
    its JSON dict).

    Raises:
      ValueError: a setting out of range, or an unknown analyser.
    """
    aiw = cfg["role_agent"]["aiw"]
    return AIWConfig(
      boost_failure=float(aiw["boost_failure"]),
      boost_similar=float(aiw["boost_similar"]),
      top_k=int(aiw["top_k"]),
      history=int(aiw["history"]),
      decay=float(aiw["decay"]),
      min_weight=float(aiw["min_weight"]),
      success_threshold=float(cfg["signals"]["success_threshold"]),
      analyser=str(aiw["analyser"]),
      candidates=int(aiw.get("candidates", 8)),  # absent from runs made before the llm analyser
      workers=int(aiw.get("workers", 4)),
    )

  @classmethod
  def from_config(cls, cfg, llm: TextLLM | None = None) -> "AIWSampler":
    """From the run config (`settings`) and the explorer LLM (the `llm` analyser's).

    Raises:
      ValueError: a setting out of range, an unknown analyser, or the `llm` one without `llm`.
    """
    return cls(cls.settings(cfg), llm)

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
    failed = []  # (task, its failed episodes, fingerprint)
    for group, trajs in sorted(by_group.items()):
      task = tasks[group]
      if np.mean([t.reward for t in trajs]) >= cfg.success_threshold:
        continue
      episodes = [t for t in trajs if t.reward < cfg.success_threshold]
      failed.append((task, episodes, fingerprint(task, episodes)))
    found: list[dict[str, Any]] = [{} for _ in failed]  # the llm analyser's, per failure
    tokens = 0
    if self.llm is not None and failed:
      found, tokens = distributed.on_primary(lambda: self._analyse_all(failed))
    failures, similar, fallbacks = [], set(), 0
    for (task, _, features), got in zip(failed, found):
      self._boost(task.task_id, cfg.boost_failure)
      fallbacks += bool(got.get("fallback"))
      if got.get("similar") is not None:  # the LLM's choice: [task id, similarity]
        best = {task_id: float(sim) for task_id, sim in got["similar"]}
      else:
        best = {}  # other task id -> its most similar earlier failure
        for task_id, other in earlier:
          sim = jaccard(features, other)
          if task_id != task.task_id and sim > 0:
            best[task_id] = max(best.get(task_id, 0.0), sim)
      ranked = sorted(best.items(), key=lambda kv: (-kv[1], kv[0]))[: cfg.top_k]
      for task_id, sim in ranked:
        self._boost(task_id, cfg.boost_similar * sim)
        similar.add(task_id)
      entry = {"task_id": task.task_id, "features": sorted(features), "step": self.steps}
      if got.get("analysis") is not None:
        entry["analysis"] = got["analysis"]
      failures.append(entry)
    self.library = (self.library + failures)[-cfg.history :]
    self._metrics.update(
      {"aiw/failed_tasks": float(len(failures)), "aiw/boosted_similar": float(len(similar))}
    )
    if self.llm is not None:
      self._metrics.update({"aiw/llm_fallbacks": float(fallbacks), "aiw/llm_tokens": tokens})

  # ------------------------------------------------------------------ the llm analyser

  def _analyse_all(
    self, jobs: list[tuple[Task, list[Trajectory], frozenset[str]]]
  ) -> tuple[list[dict], int]:
    """(per failure, `_analyse`'s record, in the order of `jobs`; the tokens the LLM was
    charged for them all), `workers` failures at a time."""
    assert self.llm is not None
    used = self.llm.budget.used
    with concurrent.futures.ThreadPoolExecutor(self.cfg.workers) as pool:
      records = list(pool.map(lambda job: self._analyse(*job), jobs))
    return records, max(0, self.llm.budget.used - used)

  def _analyse(self, task: Task, episodes: list[Trajectory], features: frozenset[str]) -> dict:
    """The LLM's analysis of one failure and its choice of similar earlier failures: {"analysis":
    dict | None, "similar": [[task id, similarity], ...] | None (None: the template's
    retrieval), "fallback": why the template stood in, or ""}."""
    del features  # the template's, kept in the library by the caller
    assert self.llm is not None
    out: dict[str, Any] = {"analysis": None, "similar": None, "fallback": ""}
    try:
      reply = self.llm.complete(ANALYSIS_SYSTEM, failure_prompt(task, episodes), json_output=True)
      out["analysis"] = read_analysis(reply)
      earlier = [e for e in self.library if e["task_id"] != task.task_id]
      shown = candidates(out["analysis"], earlier, self.cfg.candidates)
      if shown:
        prompt = retrieval_prompt(out["analysis"], shown)
        reply = self.llm.complete(RETRIEVE_SYSTEM, prompt, json_output=True)
        out["similar"] = read_choice(reply, [e["task_id"] for e in shown])
      else:
        out["similar"] = []
    except LLMError as e:  # budget spent, endpoint down, a reply that is not what was asked
      out["fallback"] = f"{type(e).__name__}: {e}"[:300]
      log.warning("AIW: the template stands in for the LLM's analysis of %s: %s", task.task_id, e)
    return out

  def metrics(self) -> dict[str, float]:
    return dict(self._metrics)

  def _boost(self, task_id: str, amount: float) -> None:
    w = self.task_weights.get(task_id, 1.0) + amount
    self.task_weights[task_id] = max(self.cfg.min_weight, w)

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


def failure_prompt(task: Task, episodes: Sequence[Trajectory]) -> str:
  """What the analyser is shown of a failure: the task's queries and ground truth, and up to
  `EPISODES_SHOWN` failed episodes' calls with the start of each output, finish and reward."""
  lines = ["Task (user turns):"]
  lines += [f"  {i}. {q}" for i, q in enumerate(task.turns)]
  lines.append("Reference solution (calls per turn):")
  lines += [f"  turn {i}: {json.dumps(calls)}" for i, calls in enumerate(task.ground_truth)]
  for k, traj in enumerate(episodes[:EPISODES_SHOWN]):
    lines.append(f"Failed attempt {k} (reward {traj.reward:g}, ended: {traj.finish or '?'}, "
                 f"unparsable replies: {traj.parse_errors}):")  # fmt: skip
    index = 0
    for turn, (calls, outputs) in enumerate(zip(traj.calls, traj.observations)):
      for call, output in zip(calls, outputs):
        lines.append(f"  [{index}] turn {turn}: {call} -> {output[:OBS_CHARS]!r}")
        index += 1
    if not index:
      lines.append("  (no call executed)")
  return "\n".join(lines)


def read_analysis(reply: str) -> dict[str, Any]:
  """The analysis in `reply` (`ANALYSIS_SYSTEM`'s keys, each of its type; strings cut to 300
  characters).

  Raises:
    LLMError: not one JSON object with those keys and types, or an unknown root-cause type.
  """
  value = parse_json_reply(reply)
  text_keys = ("root_cause_type", "root_cause_detail", "lesson", "retrieval_query")
  if not isinstance(value, dict) or any(not isinstance(value.get(k), str) for k in text_keys):
    raise LLMError(f"analysis is not an object with string {text_keys}: {reply[:120]!r}")
  step = value.get("critical_step")
  if isinstance(step, bool) or not isinstance(step, int):
    raise LLMError(f"analysis critical_step is not an int: {step!r}")
  if value["root_cause_type"] not in ROOT_CAUSES:
    raise LLMError(f"analysis root_cause_type {value['root_cause_type']!r} not in {ROOT_CAUSES}")
  out: dict[str, Any] = {k: value[k][:300] for k in text_keys}
  out["critical_step"] = step
  return out


def _words(entry_or_analysis: dict[str, Any]) -> set[str]:
  """The words an analysis (or a library entry: its analysis, else its fingerprint) says."""
  analysis = entry_or_analysis.get("analysis", entry_or_analysis)
  if "root_cause_type" in analysis:
    text = " ".join(str(analysis[k]) for k in sorted(analysis))
  else:
    text = " ".join(entry_or_analysis.get("features", ()))
  return set(_WORD.findall(text.lower()))


def candidates(
  analysis: dict[str, Any], library: Sequence[dict[str, Any]], n: int
) -> list[dict[str, Any]]:
  """The `n` library entries whose words overlap the analysis's most (Jaccard; ties: the
  newer first), one per task (its newest failure)."""
  query = _words(analysis)
  newest: dict[str, tuple[int, dict[str, Any]]] = {}
  for i, entry in enumerate(library):
    newest[entry["task_id"]] = (i, entry)
  scored = []
  for i, entry in newest.values():
    words = _words(entry)
    union = len(query | words)
    scored.append((len(query & words) / union if union else 0.0, i, entry))
  scored.sort(key=lambda x: (-x[0], -x[1]))
  return [entry for _, _, entry in scored[:n]]


def retrieval_prompt(analysis: dict[str, Any], shown: Sequence[dict[str, Any]]) -> str:
  """The retrieval request: the new failure's analysis and the numbered candidates."""
  lines = ["New failure:", json.dumps(analysis, sort_keys=True), "Candidates:"]
  for i, entry in enumerate(shown):
    said = entry.get("analysis") or {"fingerprint": entry.get("features", [])[:30]}
    lines.append(f"  {i}. {json.dumps(said, sort_keys=True)}")
  return "\n".join(lines)


def read_choice(reply: str, task_ids: Sequence[str]) -> list[list[Any]]:
  """[[task id, similarity], ...] of the candidates `reply` chose (`RETRIEVE_SYSTEM`), those
  rated above 0, each task once (its highest rating).

  Raises:
    LLMError: not {"similar": [...]}, an id that is not a candidate's number, or a similarity
      that is not a number in [0, 1].
  """
  value = parse_json_reply(reply)
  if not isinstance(value, dict) or not isinstance(value.get("similar"), list):
    raise LLMError(f"choice is not an object with a list 'similar': {reply[:120]!r}")
  best: dict[str, float] = {}
  for item in value["similar"]:
    if not isinstance(item, dict):
      raise LLMError(f"choice item is not an object: {item!r}")
    idx, sim = item.get("id"), item.get("similarity")
    if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < len(task_ids):
      raise LLMError(f"choice id {idx!r} is not a candidate's number (0..{len(task_ids) - 1})")
    if isinstance(sim, bool) or not isinstance(sim, (int, float)) or not 0.0 <= sim <= 1.0:
      raise LLMError(f"choice similarity {sim!r} is not a number in [0, 1]")
    if sim > 0:
      best[task_ids[idx]] = max(best.get(task_ids[idx], 0.0), float(sim))
  return [[k, v] for k, v in best.items()]
