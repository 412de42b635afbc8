"""Run diagnostics: a health report of every GRPO step, alert rules, and the rollout log.

EvoTrainer (arXiv 2606.03108, Sec. 3.1 "diagnostics") reads each evaluation step's rollouts for
what makes a GRPO run go wrong before its score shows it: groups whose rewards are all equal
(they give GRPO no gradient), solutions that stop differing within a group, sampled log-probs
near 0 (entropy collapse), episodes that grow longer (turn inflation), parse failures and
environment errors, and training data that leaks the evaluation. Here each is a named
*diagnostic*, a function of one step (`hooks.StepRecord`) that returns figures; the run's
`Diagnostics` hook computes the ones `diagnostics.names` lists after every step, writes them as
`diag/<key>` in metrics.jsonl (and so TensorBoard), and checks the alert rules
(`diagnostics.alerts`): an alert that starts firing prints one console line and sets
`alert/<figure>` to 1 in the rows while it holds.

A diagnostic of one's own, in a few lines, in a module the run imports (`diagnostics.modules`,
e.g. "mypkg.my_diagnostics"), then listed in `diagnostics.names`::

    import numpy as np
    from coevolve_jax import diagnostics

    @diagnostics.register("long_replies")
    def long_replies(record, settings):
      n = [r.end - r.start for t in record.trajectories for r in t.replies]
      return {"long_reply_share": float(np.mean([x > 512 for x in n])) if n else 0.0}

The rollout log (`diagnostics.rollout_log`, off by default) writes one JSON row per episode to
`<workdir>/rollouts.jsonl` (task, origin, group, reward, calls, finish, parse errors, ...), the
input of `coevolve_jax.backtest` and of offline analysis; it stops at `rollout_log_max_mb`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import operator
import os
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tqdm

from coevolve_jax import distributed, grpo
from coevolve_jax.feedback.pool import minhash, origin, task_text
from coevolve_jax.feedback.signals import KINDS
from coevolve_jax.hooks import JsonlLog, StepRecord
from coevolve_jax.metrics import append_lines
from coevolve_jax.types import Task, Trajectory

if TYPE_CHECKING:
  from coevolve_jax.hooks import TrainingHook


@dataclasses.dataclass(frozen=True)
class Settings:
  """What the diagnostics read besides the step (`diagnostics.*`, `signals.success_threshold`).

  Attributes:
    success_threshold: a reward >= this counts as solved.
    leak_similarity: MinHash Jaccard (0-1) of a training task's text to an evaluation task's
      at or above which the task counts as a leak (the pool refuses >= `pool.near_dup_threshold`
      at its door; this looks at what reaches training, D0 included).
    min_answer_chars: the shortest evaluation answer (a ground-truth call string, or a quoted
      string argument of one) searched for in the training episodes' observations.
  """

  success_threshold: float = 0.5
  leak_similarity: float = 0.7
  min_answer_chars: int = 12

  @classmethod
  def from_config(cls, cfg: Any) -> "Settings":
    d = cfg.diagnostics
    return cls(
      success_threshold=float(cfg.signals.success_threshold),
      leak_similarity=float(d.leak_similarity),
      min_answer_chars=int(d.min_answer_chars),
    )


Diagnostic = Callable[[StepRecord, Settings], dict[str, float]]
_REGISTRY: dict[str, Diagnostic] = {}


def register(name: str) -> Callable[[Diagnostic], Diagnostic]:
  """Decorator: registers `fn(record: StepRecord, settings: Settings) -> {key: float}` under
  `name` (its figures are logged as `diag/<key>`) and returns fn unchanged.

  Raises:
    ValueError: a name that is not a non-empty str, or one already registered.
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f"a diagnostic's name must be a non-empty str, got {name!r}")

  def wrap(fn: Diagnostic) -> Diagnostic:
    if name in _REGISTRY:
      raise ValueError(f"diagnostic {name!r} is already registered ({_REGISTRY[name]})")
    _REGISTRY[name] = fn
    return fn

  return wrap


def names() -> tuple[str, ...]:
  """The registered diagnostics' names, in registration order."""
  return tuple(_REGISTRY)


def import_modules(modules: Sequence[str]) -> None:
  """Imports `diagnostics.modules` (their `register` calls add diagnostics).

  Raises:
    ValueError: a module that cannot be imported (the ImportError's message).
  """
  for name in modules:
    try:
      importlib.import_module(name)
    except ImportError as e:
      raise ValueError(f"cannot import {name!r}: {e}") from None


def check_names(selected: Sequence[str]) -> None:
  """Raises ValueError unless `selected` are distinct registered diagnostics."""
  if unknown := [n for n in selected if n not in _REGISTRY]:
    raise ValueError(f"unknown diagnostics {unknown} (known: {list(names())})")
  if len(set(selected)) < len(selected):
    raise ValueError(f"a diagnostic is listed twice: {list(selected)}")


def compute(
  record: StepRecord, settings: Settings, selected: Sequence[str] | None = None
) -> dict[str, float]:
  """The `selected` diagnostics (default: every registered one) of one step, keys `diag/<key>`.

  Raises:
    ValueError: an unknown name.
  """
  if isinstance(selected, str):
    raise ValueError(f"selected: a sequence of diagnostic names, got the str {selected!r}")
  selected = names() if selected is None else tuple(selected)
  check_names(selected)
  out: dict[str, float] = {}
  for name in selected:
    out.update({f"diag/{k}": float(v) for k, v in _REGISTRY[name](record, settings).items()})
  return out


def _groups(record: StepRecord) -> list[np.ndarray]:
  """Per group (in task order), the indices of its rollouts."""
  ids = np.array([t.group_id for t in record.trajectories])
  return [np.flatnonzero(ids == g) for g in range(len(record.tasks))]


@register("reward_spread")
def reward_spread(record: StepRecord, settings: Settings) -> dict[str, float]:
  """reward_std: mean over groups of the rewards' standard deviation; dead_groups: the share of
  groups with no reward spread among their kept rollouts (`grpo.dead_rows`), split into
  dead_solved (all >= the success threshold) and dead_failed (all below)."""
  groups = [g for g in _groups(record) if len(g)]
  if not groups:
    return {}
  r = np.asarray(record.rewards, np.float64)
  ids = np.array([t.group_id for t in record.trajectories])
  keep = np.asarray(record.keep, bool)
  dead = grpo.dead_rows(r, ids, keep)[[g[0] for g in groups]]
  kept = [r[g[keep[g]]] for g in groups]
  solved = np.array([len(k) > 0 and bool(np.all(k >= settings.success_threshold)) for k in kept])
  return {
    "reward_std": float(np.mean([r[g].std() for g in groups])),
    "dead_groups": float(dead.mean()),
    "dead_solved": float((dead & solved).mean()),
    "dead_failed": float((dead & ~solved).mean()),
  }


@register("diversity")
def diversity(record: StepRecord, settings: Settings) -> dict[str, float]:
  """solution_diversity: mean over groups of (distinct call sequences - 1) / (rollouts - 1), 0
  when every rollout of a group made the same calls, 1 when all differ (groups of one left
  out)."""
  del settings
  shares = []
  for g in _groups(record):
    if len(g) > 1:
      seqs = {json.dumps(record.trajectories[i].calls) for i in g}
      shares.append((len(seqs) - 1) / (len(g) - 1))
  return {"solution_diversity": float(np.mean(shares))} if shares else {}


@register("logprob")
def logprob(record: StepRecord, settings: Settings) -> dict[str, float]:
  """sampled_logprob: the mean log-prob (nats) the sampler gave its own tokens, over every
  sampled token of the step; near 0 means the policy samples almost deterministically (entropy
  collapse)."""
  del settings
  total, n = 0.0, 0
  for t in record.trajectories:
    mask = np.asarray(t.loss_mask, bool)
    if mask.any():
      total += float(np.asarray(t.logprobs, np.float64)[mask].sum())
      n += int(mask.sum())
  return {"sampled_logprob": total / n} if n else {}


@register("length")
def length(record: StepRecord, settings: Settings) -> dict[str, float]:
  """turns_per_episode (model replies) and tokens_per_episode (sampled tokens), means over the
  step's rollouts; the hook adds `<key>_vs_start` against the run's first steps (inflation)."""
  del settings
  trajs = record.trajectories
  if not trajs:
    return {}
  return {
    "turns_per_episode": float(np.mean([t.model_steps for t in trajs])),
    "tokens_per_episode": float(np.mean([t.num_generated for t in trajs])),
  }


@register("errors")
def error_rates(record: StepRecord, settings: Settings) -> dict[str, float]:
  """parse_error_rate: unparsable replies / replies; error_rate: the share of episodes the
  environment failed (finish "error"); truncation_rate: the share cut by the KV cache or the
  reply limit (finish "context" or "max_model_steps")."""
  del settings
  trajs = record.trajectories
  if not trajs:
    return {}
  replies = sum(t.model_steps for t in trajs)
  finishes = [t.finish for t in trajs]
  return {
    "parse_error_rate": sum(t.parse_errors for t in trajs) / replies if replies else 0.0,
    "error_rate": finishes.count("error") / len(trajs),
    "truncation_rate": (finishes.count("context") + finishes.count("max_model_steps")) / len(trajs),
  }


@register("signals")
def signal_shares(record: StepRecord, settings: Settings) -> dict[str, float]:
  """origin/<origin>: the share of the step's groups whose task came from D0 ("d0") or from a
  feedback round's signal ("synth_<signal>"; `pool.origin`'s "synth:<signal>", whose colon a
  TensorBoard tag cannot hold); signal/<kind>: the share of the step's signal
  events of each kind (when any fired)."""
  del settings
  out: dict[str, float] = {}
  if record.tasks:
    origins = [origin(t) for t in record.tasks]
    share = {o: origins.count(o) / len(origins) for o in sorted(set(origins))}
    out.update({f"origin/{o.replace(':', '_')}": v for o, v in share.items()})  # TensorBoard tags
  if record.events:
    kinds = [e.signal for e in record.events]
    out.update({f"signal/{k}": kinds.count(k) / len(kinds) for k in KINDS})
  return out


_QUOTED = re.compile(r"'([^']*)'|\"([^\"]*)\"")


def eval_answers(task: Task, min_chars: int) -> list[str]:
  """What a training observation must not contain of an evaluation task: each ground-truth call
  with arguments, and each quoted string argument of one that the task does not give away
  itself (absent from its user turns and initial state), at least `min_chars` long. Calls
  without arguments ('list_users()') and values the task states or starts from are what any
  episode may see; shorter strings (as 'document') are too common to mean a leak."""
  given = " ".join(task.turns) + json.dumps(task.initial_config, default=str)
  out = []
  for call in (c for turn in task.ground_truth for c in turn):
    if not call.rstrip().endswith("()"):
      out.append(call)
    out.extend(v for v in (a or b for a, b in _QUOTED.findall(call)) if v not in given)
  return sorted({s for s in out if len(s) >= min_chars})


class _EvalIndex:
  """MinHashes and answers of one evaluation split, rebuilt only when the split changes."""

  def __init__(self):
    self.key: tuple | None = None

  def get(self, tasks: Sequence[Task], settings: Settings):
    key = (tuple(t.task_id for t in tasks), settings.min_answer_chars)
    if key != self.key:
      self.hashes = [minhash(task_text(t)) for t in tasks]
      self.answers = {
        a: t.task_id for t in tasks for a in eval_answers(t, settings.min_answer_chars)
      }
      self.key = key
    return self.hashes, self.answers


_EVAL_INDEX = _EvalIndex()


def observation_texts(t: Trajectory) -> list[str]:
  """Every text the environment answered an episode with (its replies' observations and the
  recorded call outputs)."""
  texts = [r.observation for r in t.replies if r.observation]
  texts.extend(o for turn in t.observations for o in turn if isinstance(o, str))
  return texts


def leaks(
  record: StepRecord, settings: Settings
) -> tuple[dict[str, float], list[tuple[str, str, str]]]:
  """The leak detectors' figures and what they found: (task id, kind, evaluation task id) per
  finding, kind "near_eval" (a training task this close to an evaluation task) or
  "answer_in_observation" (an episode's observation holds an evaluation answer)."""
  if not record.eval_tasks:
    return {}, []
  hashes, answers = _EVAL_INDEX.get(record.eval_tasks, settings)
  found: list[tuple[str, str, str]] = []
  best = 0.0
  for task in record.tasks:
    sims = [minhash(task_text(task)).jaccard(h) for h in hashes]
    i = int(np.argmax(sims))
    best = max(best, sims[i])
    if sims[i] >= settings.leak_similarity:
      found.append((task.task_id, "near_eval", record.eval_tasks[i].task_id))
  leaked = 0
  for t in record.trajectories:
    text = "\n".join(observation_texts(t))
    for call in sorted({c for turn in t.calls for c in turn}, key=len, reverse=True):
      text = text.replace(call, "")  # the episode's own calls echoed back are no leak
    hit = next((a for a in answers if a in text), None)
    if hit is not None:
      leaked += 1
      found.append((t.task_id, "answer_in_observation", answers[hit]))
  figures = {
    "eval_similarity_max": best,
    "leak_near_eval": float(sum(f[1] == "near_eval" for f in found)),
    "leak_answer_in_observation": float(leaked),
  }
  return figures, found


@register("leaks")
def leak_figures(record: StepRecord, settings: Settings) -> dict[str, float]:
  """eval_similarity_max: the highest MinHash Jaccard of a step's task to an evaluation task;
  leak_near_eval: the step's tasks at or above `leak_similarity`; leak_answer_in_observation:
  the episodes whose observations contain an evaluation answer (`eval_answers`). Empty when the
  run has no evaluation split."""
  return leaks(record, settings)[0]


# ------------------------------------------------------------------ alert rules

_OPS: dict[str, Callable[[float, float], bool]] = {
  ">=": operator.ge,
  "<=": operator.le,
  ">": operator.gt,
  "<": operator.lt,
  "==": operator.eq,
}
_RULE = re.compile(r"^\s*([\w/.:-]+)\s*(>=|<=|==|>|<)\s*(\S+)\s*(?:for\s+(\d+))?\s*$")


@dataclasses.dataclass(frozen=True)
class AlertRule:
  """`"<figure> <op> <threshold> [for <steps>]"`, e.g. "dead_groups >= 0.8 for 3": fires when
  the figure (`diag/<figure>`, or any metric key of the step's row with a "/", e.g.
  "train/kl") meets the comparison on `steps` consecutive steps (default 1)."""

  figure: str
  op: str
  threshold: float
  steps: int = 1

  @classmethod
  def parse(cls, text: str) -> "AlertRule":
    """Raises ValueError for text that is not `figure op number [for N]` (op one of >=, <=, >,
    <, ==; N >= 1)."""
    m = _RULE.match(text) if isinstance(text, str) else None
    if m is None:
      raise ValueError(
        f"alert rule {text!r}: want '<figure> <op> <number> [for <steps>]', e.g. "
        "'dead_groups >= 0.8 for 3' (op one of >=, <=, >, <, ==)"
      )
    try:
      threshold = float(m.group(3))
    except ValueError:
      raise ValueError(f"alert rule {text!r}: {m.group(3)!r} is not a number") from None
    steps = int(m.group(4) or 1)
    if steps < 1 or not math.isfinite(threshold):
      raise ValueError(f"alert rule {text!r}: want a finite threshold and at least 1 step")
    return cls(m.group(1), m.group(2), threshold, steps)

  @property
  def key(self) -> str:
    """The metric key the figure is read from."""
    return self.figure if "/" in self.figure else f"diag/{self.figure}"

  def holds(self, row: dict[str, Any]) -> bool | None:
    """Whether the step's row meets the comparison; None where the row lacks the figure."""
    v = row.get(self.key)
    if not isinstance(v, (int, float)) or isinstance(v, bool):
      return None
    return _OPS[self.op](float(v), self.threshold)

  def __str__(self) -> str:
    return f"{self.figure} {self.op} {self.threshold:g}" + (
      f" for {self.steps}" if self.steps > 1 else ""
    )


def parse_rules(texts: Sequence[str]) -> list[AlertRule]:
  """Raises ValueError for a malformed rule or two rules on one figure (their alert/<figure>
  metrics would collide)."""
  rules = [AlertRule.parse(t) for t in texts]
  figures = [r.figure for r in rules]
  if len(set(figures)) < len(figures):
    raise ValueError(f"two alert rules on one figure: {list(texts)}")
  return rules


def read_skills(path: str) -> list[dict[str, Any]]:
  """The skill records of a skills file (`coevolve_jax.gate`; [] when there is none); torn
  lines and lines that are not JSON objects skipped.

  Raises:
    OSError: the path cannot be read (a folder, no permission).
  """
  if not path or not os.path.exists(path):
    return []
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        record = json.loads(line)
      except ValueError:
        continue
      if isinstance(record, dict):
        out.append(record)
  return out


class Diagnostics:
  """The training hook that runs the diagnostics and alert rules after every step (see the
  module docstring). State (checkpointed): the first `baseline_steps` steps' figures, which
  `<figure>_vs_start` divides by, and each rule's run of consecutive steps that met it. With a
  skills file (`diagnostics.skills`, written by `coevolve_jax.gate`), an alert that starts also
  names every intervention promoted for its figure, one line each."""

  name = "diagnostics"

  def __init__(self, cfg: Any):
    d = cfg.diagnostics
    import_modules(tuple(d.get("modules", ())))
    self.settings = Settings.from_config(cfg)
    self.selected = tuple(d.names)
    self.rules = parse_rules(tuple(d.alerts))
    self.relative = tuple(d.relative)
    self.baseline_steps = int(d.baseline_steps)
    self.baseline: dict[str, list[float]] = {}
    self.runs: dict[str, int] = {}
    self.checked = False  # the rules' figures looked for in the first row this process sees
    # Interventions a gate promoted (diagnostics.skills): named when an alert on their figure
    # starts.
    self.skills = [r for r in read_skills(d.skills) if r.get("decision") == "promoted"]

  def on_step(self, record: StepRecord) -> dict[str, Any]:
    # The leak detectors run once, here, for their figures and their findings both.
    others = tuple(n for n in self.selected if n != "leaks")
    out: dict[str, Any] = compute(record, self.settings, others)
    if "leaks" in self.selected:
      figures, found = leaks(record, self.settings)
      out.update({f"diag/{k}": v for k, v in figures.items()})
      if found:  # what leaked, for the row: [task id, kind, evaluation task id], the first 10
        out["leaks"] = [list(f) for f in found[:10]]
    for fig in self.relative:
      v = out.get(f"diag/{fig}")
      if v is None:
        continue
      seen = self.baseline.setdefault(fig, [])
      if len(seen) < self.baseline_steps:
        seen.append(v)
      start = float(np.mean(seen))
      out[f"diag/{fig}_vs_start"] = v / start if start else 1.0
    row = {**record.metrics, **out}
    if not self.checked:  # once: a rule or ratio on a figure no step reports never fires
      self.checked = True
      absent = [str(r) for r in self.rules if r.holds(row) is None]
      absent += [f"relative {f}" for f in self.relative if f"diag/{f}" not in out]
      if absent and distributed.is_primary():
        tqdm.tqdm.write(
          f"warning: diagnostics: step {record.step}'s row has no figure for {absent} (a name "
          "misspelt, or a diagnostic not in diagnostics.names?)"
        )
    fired = []
    for rule in self.rules:
      held = rule.holds(row)
      if held is None:
        continue
      self.runs[rule.figure] = self.runs.get(rule.figure, 0) + 1 if held else 0
      run = self.runs[rule.figure]
      if run >= rule.steps:
        out[f"alert/{rule.figure}"] = 1
        fired.append(str(rule))
        if run == rule.steps and distributed.is_primary():  # one line when it starts firing
          v = row[rule.key]
          tqdm.tqdm.write(f"alert (step {record.step}): {rule} (now {v:.4g})")
          for skill in self.skills:
            if skill.get("expected", {}).get("figure") == rule.key:
              tqdm.tqdm.write(
                f"  skill: {json.dumps(skill.get('intervention'), sort_keys=True)} was promoted "
                f"for {rule.figure} by the gate in {skill.get('gate')} ({skill.get('date')}): "
                f"{skill.get('reason')}"
              )
    if fired:
      out["alerts"] = fired
    return out

  def state_dict(self) -> dict[str, Any]:
    return {"baseline": self.baseline, "runs": self.runs}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    self.baseline = {k: [float(x) for x in v] for k, v in state.get("baseline", {}).items()}
    self.runs = {k: int(v) for k, v in state.get("runs", {}).items()}

  def on_resume(self, step: int) -> None:
    del step  # writes no file of its own (its figures are metrics.jsonl's)


# ------------------------------------------------------------------ the rollout log


def rollout_rows(record: StepRecord) -> list[dict[str, Any]]:
  """One JSON-serialisable row per episode of a step: what backtests and offline analysis read
  (`coevolve_jax.backtest.load_rollouts`)."""
  origins = [origin(t) for t in record.tasks]
  adv = np.asarray(record.advantages, np.float64)
  rows = []
  for i, t in enumerate(record.trajectories):
    a = adv[i] if adv.ndim == 1 else adv[i][np.asarray(adv[i]) != 0]
    mask = np.asarray(t.loss_mask, bool)
    lp = np.asarray(t.logprobs, np.float64)[mask] if mask.any() else np.zeros(0)
    rows.append(
      {
        "step": record.step,
        "task_id": t.task_id,
        "origin": origins[t.group_id],
        "group": t.group_id,
        "reward": float(t.reward),
        "kept": bool(record.keep[i]),
        "advantage": float(np.mean(a)) if np.size(a) else 0.0,
        "finish": t.finish,
        "model_steps": t.model_steps,
        "parse_errors": t.parse_errors,
        "tokens": t.num_generated,
        "sampled_logprob": float(lp.mean()) if lp.size else 0.0,
        "tool_names": list(t.tool_names),
        "calls": t.calls,
      }
    )
  return rows


class RolloutLog(JsonlLog):
  """rollouts.jsonl (`diagnostics.rollout_log`): `rollout_rows` of every step, appended; it
  stops growing at `rollout_log_max_mb` (one warning; `diag/rollout_log_full` 1 from then on)
  and is cut back to the restored step on resume, as metrics.jsonl is."""

  name = "rollout_log"

  def __init__(self, workdir: str, max_mb: float):
    self.path = os.path.join(workdir, "rollouts.jsonl")
    self.max_bytes = int(max_mb * 2**20)
    self.full = False

  def on_step(self, record: StepRecord) -> dict[str, Any]:
    if self.full:
      return {"diag/rollout_log_full": 1}
    lines = [json.dumps(r, sort_keys=True) for r in rollout_rows(record)]
    size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
    if size + sum(len(x) + 1 for x in lines) > self.max_bytes:
      self.full = True
      if distributed.is_primary():
        tqdm.tqdm.write(
          f"warning: {self.path} reached diagnostics.rollout_log_max_mb "
          f"({self.max_bytes / 2**20:g} MiB): no more rollouts are logged from step {record.step}"
        )
      return {"diag/rollout_log_full": 1}
    append_lines(self.path, lines)
    return {}

  def on_resume(self, step: int) -> None:
    super().on_resume(step)
    self.full = False  # measured again at the next step


def build(cfg: Any, workdir: str) -> list[TrainingHook]:
  """The hooks `diagnostics.*` asks for: `Diagnostics` (`enabled`), `RolloutLog`
  (`rollout_log`), in that order."""
  d = cfg.diagnostics
  out: list[TrainingHook] = []
  if d.enabled:
    out.append(Diagnostics(cfg))
  if d.rollout_log:
    out.append(RolloutLog(workdir, float(d.rollout_log_max_mb)))
  return out


if TYPE_CHECKING:  # mypy checks the hooks against the TrainingHook protocol

  def _conforms(a: Diagnostics, b: RolloutLog) -> list[TrainingHook]:
    return [a, b]
