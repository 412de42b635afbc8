"""AppWorld task sets (official splits or generated worlds) and AppWorld's goal-completion metrics.

Official data (`appworld download data`, on a machine with internet) and the offline world builder
(envs/appworld/world.py) share one layout under an AppWorld root:
  data/datasets/<split>.txt       one task id per line, optionally `id:tag` (the tag is dropped)
  data/tasks/<task_id>/specs.json  the instruction (and supervisor, datetime, db_version)
Official splits: train (90 tasks), dev (57), test_normal (168), test_challenge (417).

Metrics, as AppWorld defines them (appworld/evaluator.py, `Metric._compute_metrics`):
  TGC, task goal completion: percentage of tasks whose every evaluation test passes;
  SGC, scenario goal completion: percentage of scenarios (task id `<scenario>_<n>`) all of whose
  tasks pass. Both are rounded as AppWorld rounds them (mean to 4 decimals, then percent to 1).
An evaluation over several splits (the paper's Table 1 reports test_normal and test_challenge
apart) gets both figures per split (`split_goal_completion`).
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Mapping

from envs.appworld.env import task_from_row
from coevolve_jax.types import Task

__all__ = [
  "BLEND",
  "OFFICIAL_SPLITS",
  "goal_completion",
  "load_split",
  "scenario_of",
  "split_goal_completion",
]

OFFICIAL_SPLITS = ("train", "dev", "test_normal", "test_challenge")
BLEND = "blend"  # the key prefix of the figures over several splits together


def scenario_of(task_id: str) -> str:
  """AppWorld's scenario (generator) id of a task id: `abc1234_2` -> `abc1234`.

  Raises ValueError for ids not of the form `<scenario>_<n>` (AppWorld asserts the same).
  """
  task_id = task_id.split(":")[0]
  if task_id.count("_") != 1:
    raise ValueError(f"AppWorld task ids look like <scenario>_<n>, got {task_id!r}")
  return task_id.split("_")[0]


def load_split(root: str, split: str) -> list[Task]:
  """The tasks of `split` under the AppWorld root `root`, in file order.

  Raises:
    FileNotFoundError: no split file, or a listed task has no specs.json (the message names the
      path and `appworld download data`).
  """
  path = os.path.join(root, "data", "datasets", f"{split}.txt")
  if not os.path.isfile(path):
    raise FileNotFoundError(
      f"no AppWorld split file {path} (splits: {', '.join(OFFICIAL_SPLITS)}"
      "); run `appworld download data` or build worlds offline"
    )
  with open(path, encoding="utf-8") as f:
    ids = [line.strip().split(":")[0] for line in f if line.strip()]
  tasks = []
  for task_id in ids:
    specs = os.path.join(root, "data", "tasks", task_id, "specs.json")
    if not os.path.isfile(specs):
      raise FileNotFoundError(
        f"task {task_id} of split {split!r} has no {specs}; the data under "
        f"{root} is incomplete (run `appworld download data` again)"
      )
    with open(specs, encoding="utf-8") as f:
      instruction = json.load(f)["instruction"]
    tasks.append(
      task_from_row(
        {
          "task_id": task_id,
          "instruction": instruction,
          "scenario": scenario_of(task_id),
          "split": split,
        }
      )
    )
  return tasks


def goal_completion(success: Mapping[str, bool]) -> dict[str, float]:
  """{"tgc": percent, "sgc": percent, "tasks": n, "scenarios": m} from task id -> all tests passed.

  Empty input gives 0.0 for both, as AppWorld's `average` does.
  """
  by_scenario: dict[str, list[float]] = collections.defaultdict(list)
  for task_id, ok in success.items():
    by_scenario[scenario_of(task_id)].append(float(bool(ok)))
  scores = [s for group in by_scenario.values() for s in group]
  strict = [min(group) for group in by_scenario.values()]

  def percent(values: list[float]) -> float:
    mean = round(sum(values) / len(values), 4) if values else 0.0
    return round(100 * mean, 1)

  return {
    "tgc": percent(scores),
    "sgc": percent(strict),
    "tasks": len(scores),
    "scenarios": len(by_scenario),
  }


def split_goal_completion(
  success: Mapping[str, bool], split_of: Mapping[str, str]
) -> dict[str, float]:
  """`goal_completion` per split, flat: "<split>/tgc", "<split>/sgc", "<split>/tasks",
  "<split>/scenarios" for every split named in `split_of` (task id -> split; a task it does not
  name, or names as "", has no split figures), in order of first appearance.

  Over one split (or none named) the figures of all tasks are also given as "tgc", "sgc",
  "tasks", "scenarios". Over several they are given only as "blend/tgc", ...: a mix of splits
  that the paper never reports, so nothing reads it as one split's figure.
  """
  groups: dict[str, dict[str, bool]] = {}
  for task_id, ok in success.items():
    groups.setdefault(split_of.get(task_id, ""), {})[task_id] = ok
  out: dict[str, float] = {}
  for split, group in groups.items():
    if split:
      out.update({f"{split}/{k}": v for k, v in goal_completion(group).items()})
  overall = goal_completion(success)
  prefix = f"{BLEND}/" if len(groups) > 1 else ""
  out.update({f"{prefix}{k}": v for k, v in overall.items()})
  return out
