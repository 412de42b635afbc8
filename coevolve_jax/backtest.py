"""Backtests: replay an intervention over a run's logged rollouts, without training.

EvoTrainer (arXiv 2606.03108, Sec. 3.2) checks a proposed change to the training harness on the
rollouts already logged before it spends a training run on it: does a different group filter
revive dead groups or throw away successes, does a threshold change which signals fire? Here an
*intervention* is a set of config overrides (dotted field -> value) and a backtest replays the
run's `rollouts.jsonl` (`diagnostics.rollout_log = True`) step by step under the run's own config
(`config.json`, the baseline) and under the overridden one, with the loop's own code: the GRPO
advantage (`grpo.compute_advantages`, CoEvolve paper Eq. 1) with `train.drop_from_loss`, the
signal tracker (`feedback.signals.SignalTracker`) and the feedback clock (`feedback.every`,
`feedback.kinds`).

Only fields whose effect the logged rollouts determine can be replayed (`REPLAYABLE`); a change
of the policy's inputs or objective (the learning rate, sampling, the model) needs new rollouts,
that is a training branch (`coevolve_jax.gate`).

    python -m coevolve_jax.cli.backtest --workdir runs/x --set 'train.drop_from_loss=["context"]'
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import ml_collections
import numpy as np

from coevolve_jax import config as run_config
from coevolve_jax import grpo
from coevolve_jax.feedback.signals import KINDS, RolloutRecord, SignalTracker
from coevolve_jax.types import FINISHES

ROLLOUT_LOG = "rollouts.jsonl"
# Fields newer than some runs' config.json, which an override may add.
OPTIONAL = frozenset({"train.drop_dead_groups"})
# The fields a backtest can change: what turns logged rewards, finishes and tool names into
# advantages, signal events and feedback rounds.
REPLAYABLE = frozenset(
  {
    "signals.window",
    "signals.rare_theta_percent",
    "signals.rare_min_total",
    "signals.pattern",
    "signals.success_threshold",
    "signals.forgetting",
    "signals.rare_count",
    "signals.rare_min_count",
    "train.drop_from_loss",
    "train.drop_dead_groups",
    "train.scale_by_std",
    "train.adv_eps",
    "feedback.enabled",
    "feedback.every",
    "feedback.kinds",
  }
)


_ROW_TYPES: dict[str, type | tuple[type, ...]] = {
  "task_id": str,
  "group": int,
  "reward": (int, float),
  "finish": str,
  "tool_names": list,
}


def load_rollouts(
  path: str, rows_per_step: int | None = None
) -> tuple[dict[int, list[dict[str, Any]]], list[str]]:
  """rollouts.jsonl's rows by step (ascending), each step's rows in episode order, and notes
  on what was left out.

  A line that is not JSON (a write cut by a kill) is left out, and so is every step whose rows
  are not `rows_per_step` (the run's tasks_per_step x group_size: a step the cut line belonged
  to would replay with part of its groups); each is named in the notes. Blank lines are skipped.

  Raises:
    FileNotFoundError: no log there (the run had `diagnostics.rollout_log = False`).
    ValueError: the path is not a file, no step is left, or a row of the wrong shape (a field
      missing or of another type: not a log this code wrote).
  """
  if not os.path.exists(path):
    raise FileNotFoundError(
      f"{path}: no rollout log; run with diagnostics.rollout_log = True to record one"
    )
  if not os.path.isfile(path):
    raise ValueError(f"{path} is not a file")
  steps: dict[int, list[dict[str, Any]]] = {}
  notes: list[str] = []
  with open(path, encoding="utf-8", errors="replace") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except ValueError:
        notes.append(f"{path}:{n}: not JSON (a write cut by a kill): left out")
        continue
      bad = (
        [
          k
          for k, t in _ROW_TYPES.items()
          if not isinstance(row.get(k), t) or isinstance(row.get(k), bool)
        ]
        if isinstance(row, dict)
        else ["a JSON object"]
      )
      if bad or not isinstance(row.get("step"), int):
        raise ValueError(
          f"{path}:{n}: not a rollout row (want {sorted(_ROW_TYPES)} and step; bad: {bad})"
        )
      steps.setdefault(row["step"], []).append(row)
  if rows_per_step is not None:
    for step in [s for s, rows in steps.items() if len(rows) != rows_per_step]:
      notes.append(f"step {step}: {len(steps.pop(step))} rows, not {rows_per_step}: left out")
  if not steps:
    raise ValueError(f"{path}: no whole step logged" + (f" ({'; '.join(notes)})" if notes else ""))
  return dict(sorted(steps.items())), notes


@dataclasses.dataclass
class Replay:
  """What one config makes of the logged rollouts.

  Attributes:
    steps / episodes / groups: what was replayed.
    kept: episodes in the loss (not dropped by `train.drop_from_loss`).
    successes: episodes with reward >= `signals.success_threshold`; successes_kept: of them, kept.
    dead_groups: groups whose kept rewards are all equal (zero advantage: no gradient).
    rank_violations: within-group pairs (i, j) with reward_i > reward_j but advantage_i <
      advantage_j (a change that ranks a worse episode above a better one).
    events: signal events fired per kind (KINDS).
    rounds: feedback rounds started (after every `feedback.every`-th step, when enabled).
    round_events: per kind, the events those rounds select from (kinds in `feedback.kinds`).
    dead: per step, the [G] dead-group mask (for the pairwise comparison).
    kept_mask: per step, the [N] kept mask.
  """

  steps: int = 0
  episodes: int = 0
  groups: int = 0
  kept: int = 0
  successes: int = 0
  successes_kept: int = 0
  dead_groups: int = 0
  rank_violations: int = 0
  events: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
  rounds: int = 0
  round_events: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
  dead: dict[int, np.ndarray] = dataclasses.field(default_factory=dict, repr=False)
  kept_mask: dict[int, np.ndarray] = dataclasses.field(default_factory=dict, repr=False)


def _rank_violations(rewards: np.ndarray, adv: np.ndarray, groups: list[np.ndarray]) -> int:
  n = 0
  for idx in groups:
    r, a = rewards[idx], adv[idx]
    n += int(np.sum((r[:, None] > r[None, :]) & (a[:, None] < a[None, :])))
  return n


def replay(cfg: Any, steps: Mapping[int, list[dict[str, Any]]]) -> Replay:
  """Replays the logged steps under `cfg` (a run config; only `REPLAYABLE` fields are read).

  Raises:
    ValueError: a signals setting the tracker refuses.
  """
  tracker = SignalTracker.from_config(cfg.signals)
  drop, drop_dead = tuple(cfg.train.drop_from_loss), bool(cfg.train.get("drop_dead_groups"))
  threshold = float(cfg.signals.success_threshold)
  kinds = set(cfg.feedback.kinds)
  out = Replay()
  since_round = dict.fromkeys(KINDS, 0)
  for step, rows in steps.items():
    rewards = np.array([r["reward"] for r in rows], np.float32)
    group_ids = np.array([r["group"] for r in rows])
    finishes = [r["finish"] for r in rows]
    groups = [np.flatnonzero(group_ids == g) for g in np.unique(group_ids)]
    # Dead before the group filter (the diagnostics' reading); the loss rows as the loop keeps them.
    dead = grpo.dead_rows(rewards, group_ids, grpo.loss_rows(finishes, rewards, group_ids, drop))
    dead = dead[[g[0] for g in groups]]
    keep = grpo.loss_rows(finishes, rewards, group_ids, drop, drop_dead)
    adv = grpo.compute_advantages(
      rewards, group_ids, cfg.train.adv_eps, cfg.train.scale_by_std, keep_n=keep
    )
    records = [
      RolloutRecord(r["task_id"], r["group"], r["reward"], list(r["tool_names"]), i)
      for i, r in enumerate(rows)
    ]
    for s in tracker.update(records):
      out.events[s.kind] += 1
      since_round[s.kind] += 1
    success = rewards >= threshold
    out.steps += 1
    out.episodes += len(rows)
    out.groups += len(groups)
    out.kept += int(keep.sum())
    out.successes += int(success.sum())
    out.successes_kept += int((success & keep).sum())
    out.dead_groups += int(dead.sum())
    out.rank_violations += _rank_violations(rewards, np.asarray(adv), groups)
    out.dead[step], out.kept_mask[step] = dead, keep
    if cfg.feedback.enabled and step % int(cfg.feedback.every) == 0:
      out.rounds += 1
      for k in KINDS:
        out.round_events[k] += since_round[k] if k in kinds else 0
      since_round = dict.fromkeys(KINDS, 0)
  return out


@dataclasses.dataclass
class Report:
  """A backtest: the baseline's and the intervention's replays and what changed between them.

  Attributes:
    overrides: the intervention (dotted field -> value).
    baseline / intervention: `Replay`s.
    revived: groups dead under the baseline that the intervention gives a gradient.
    killed: groups the other way round.
    successes_filtered: successful episodes (reward >= the baseline's success threshold) kept
      by the baseline and dropped from the loss by the intervention.
  """

  overrides: dict[str, Any]
  baseline: Replay
  intervention: Replay
  revived: int
  killed: int
  successes_filtered: int
  notes: list[str] = dataclasses.field(default_factory=list)

  def rows(self) -> list[tuple[str, Any, Any]]:
    """(figure, baseline, intervention) for the table."""
    b, i = self.baseline, self.intervention
    out: list[tuple[str, Any, Any]] = [
      ("episodes in the loss", b.kept, i.kept),
      ("successes", b.successes, i.successes),
      ("successes in the loss", b.successes_kept, i.successes_kept),
      ("dead groups", b.dead_groups, i.dead_groups),
      ("rank-order violations", b.rank_violations, i.rank_violations),
      ("feedback rounds", b.rounds, i.rounds),
    ]
    out += [(f"events: {k}", b.events[k], i.events[k]) for k in KINDS]
    out += [(f"round events: {k}", b.round_events[k], i.round_events[k]) for k in KINDS]
    return out

  def table(self) -> str:
    """The report as a text table, with the pairwise counts under it."""
    b = self.baseline
    head = (
      f"backtest of {json.dumps(self.overrides, sort_keys=True)} over {b.steps} logged steps "
      f"({b.episodes} episodes, {b.groups} groups)"
    )
    lines = [head, f"{'figure':<26}{'baseline':>10}{'intervention':>14}{'change':>9}"]
    for name, x, y in self.rows():
      lines.append(f"{name:<26}{x:>10}{y:>14}{y - x:>+9}")
    lines.append(f"dead groups revived: {self.revived}; groups killed: {self.killed}")
    lines.append(f"successes filtered out of the loss: {self.successes_filtered}")
    lines.extend(f"note: {n}" for n in self.notes)
    return "\n".join(lines)

  def to_dict(self) -> dict[str, Any]:
    return {
      "overrides": self.overrides,
      "figures": {name: [x, y] for name, x, y in self.rows()},
      "revived": self.revived,
      "killed": self.killed,
      "successes_filtered": self.successes_filtered,
      "notes": self.notes,
    }


def set_fields(cfg: ml_collections.ConfigDict, overrides: Mapping[str, Any]):
  """A copy of `cfg` with `overrides` (dotted field -> value) set; lists become tuples, as the
  configs write them.

  Raises:
    ValueError: a field the config does not have (but `OPTIONAL`), or a value of another type
      than the field's (ml_collections' type checks, and no bool for a number or the reverse).
  """
  out = ml_collections.ConfigDict(cfg.to_dict())
  for key, value in overrides.items():
    node: Any = out
    *parents, leaf = str(key).split(".")
    for part in parents:
      node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
    if not isinstance(node, ml_collections.ConfigDict) or (
      leaf not in node and key not in OPTIONAL
    ):
      raise ValueError(f"{key}: the config has no such field")
    value = tuple(value) if isinstance(value, list) else value
    old = node.get(leaf)
    if isinstance(value, bool) != isinstance(old, bool) and old is not None:
      raise ValueError(f"{key}: want a value like {old!r}, got {value!r}")
    try:
      node[leaf] = value
    except (TypeError, ValueError) as e:
      raise ValueError(f"{key}: want a value like {old!r}, got {value!r} ({e})") from None
  return out


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: Mapping[str, Any]):
  """`set_fields` for a backtest: only `REPLAYABLE` fields, checked as the run's config checks
  them.

  Raises:
    ValueError: a field outside `REPLAYABLE` (it needs new rollouts), or a value the run's
      config checks refuse (the message starts with the field).
  """
  out = set_fields(cfg, overrides)  # an unknown field or a wrong type first
  if bad := sorted(set(overrides) - REPLAYABLE):
    raise ValueError(
      f"{bad} cannot be replayed from logged rollouts (they change the rollouts themselves: "
      "train branches with python -m coevolve_jax.cli.gate); a backtest changes "
      f"{sorted(REPLAYABLE)}"
    )
  _check(out)
  return out


def _check(cfg: Any) -> None:
  """The run config's checks of the `REPLAYABLE` fields (`config.validate` checks the whole
  config, which may name a model folder this machine lacks)."""
  try:
    SignalTracker.from_config(cfg.signals)
  except ValueError as e:  # the tracker names its argument: "window must be ..."
    raise ValueError(f"signals.{e}") from None
  drop, droppable = cfg.train.drop_from_loss, tuple(f for f in FINISHES if f != "done")
  if not isinstance(drop, tuple) or not all(f in droppable for f in drop):
    run_config.fail("train.drop_from_loss", f"must be a tuple of finishes from {droppable}", drop)
  for group, field in (
    ("train", "scale_by_std"),
    ("train", "drop_dead_groups"),
    ("feedback", "enabled"),
  ):
    value = cfg[group].get(field, False)  # drop_dead_groups: absent from runs before it existed
    if not isinstance(value, bool):
      run_config.fail(f"{group}.{field}", "must be a bool", value)
  run_config.number(cfg, "train.adv_eps", lo=0.0)
  run_config.int_at_least(cfg, "feedback.every", 1)
  kinds = cfg.feedback.kinds
  if not isinstance(kinds, tuple) or not set(kinds) <= set(KINDS):
    run_config.fail("feedback.kinds", f"must be a tuple of signal kinds from {KINDS}", kinds)


def run_config_of(
  workdir: str, defaults: ml_collections.ConfigDict | None = None
) -> ml_collections.ConfigDict:
  """The config a run was made with (its workdir's config.json), lists as tuples. With
  `defaults` (the run's config file as loaded now), config.json's values are laid over it, so
  groups and fields newer than the run (e.g. `diagnostics`) take their defaults.

  Raises:
    FileNotFoundError: no config.json (not a run's workdir).
  """
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{workdir}: no config.json there (not a run's folder)")
  with open(path, encoding="utf-8") as f:
    try:
      raw = json.load(f)
    except ValueError as e:
      raise ValueError(f"{path} is damaged: {e}") from None
  if not isinstance(raw, dict) or not all(
    isinstance(raw.get(g), dict) for g in ("signals", "train")
  ):
    raise ValueError(f"{path} is not a run's config (a JSON object with its config groups)")

  def tuples(x):
    if isinstance(x, dict):
      return {k: tuples(v) for k, v in x.items()}
    return tuple(tuples(v) for v in x) if isinstance(x, list) else x

  def over(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
      out[k] = over(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out

  made = tuples(raw)
  return ml_collections.ConfigDict(made if defaults is None else over(defaults.to_dict(), made))


def backtest(
  workdir: str, overrides: Mapping[str, Any], *, cfg: ml_collections.ConfigDict | None = None
) -> Report:
  """Replays `<workdir>/rollouts.jsonl` under the run's config and under `overrides`.

  Args:
    workdir: a run's workdir with a rollout log.
    overrides: the intervention: dotted `REPLAYABLE` fields -> values (JSON values; lists for
      tuples).
    cfg: the baseline config (default: the workdir's config.json).
  Returns:
    The `Report`.
  Raises:
    FileNotFoundError, ValueError: `load_rollouts`'s and `apply_overrides`'s.
  """
  base = run_config_of(workdir) if cfg is None else cfg
  changed = apply_overrides(base, overrides)
  per_step = base.rollout.tasks_per_step * base.rollout.group_size
  steps, notes = load_rollouts(os.path.join(workdir, ROLLOUT_LOG), per_step)
  b, i = replay(base, steps), replay(changed, steps)
  revived = sum(int(np.sum(b.dead[s] & ~i.dead[s])) for s in steps)
  killed = sum(int(np.sum(~b.dead[s] & i.dead[s])) for s in steps)
  threshold = float(base.signals.success_threshold)
  filtered = 0
  for s, rows in steps.items():
    success = np.array([r["reward"] >= threshold for r in rows], bool)
    filtered += int(np.sum(success & b.kept_mask[s] & ~i.kept_mask[s]))
  return Report(dict(overrides), b, i, revived, killed, filtered, notes)
