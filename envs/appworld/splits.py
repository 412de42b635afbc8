"""The official AppWorld data's layout on disk: split names and what is missing from a data root.

Read by the suite's set-up check and by the client's check of servers started by hand; plain
Python, no AppWorld import.
"""

from __future__ import annotations

import os


def split_names(value: str) -> list[str]:
  """The split names of `appworld.eval_split`: one name, or several separated by commas
  ("test_normal,test_challenge")."""
  return [name.strip() for name in str(value).split(",") if name.strip()]


def _first_task_id(split_file: str) -> str | None:
  with open(split_file, encoding="utf-8") as f:
    for line in f:
      if line.strip():
        return line.strip().split(":")[0]  # appworld.task.remove_tag
  return None


def data_errors(data_root: str, splits: list[str]) -> list[str]:
  """Problems with the official AppWorld data under `data_root` (empty when it looks usable)."""
  step = "run step 4 (appworld download data)"
  if not data_root:
    return [f"no AppWorld data root: set APPWORLD_ROOT or --config.appworld.data_root, and {step}"]
  data = os.path.join(data_root, "data")
  if not os.path.isdir(data):
    return [f"no AppWorld data folder at {data}: {step}"]
  tasks = os.path.join(data, "tasks")
  if not os.path.isdir(tasks):
    return [f"no task folder at {tasks}: {step}"]
  errors = []
  for split in dict.fromkeys(splits):
    split_file = os.path.join(data, "datasets", f"{split}.txt")
    if not os.path.isfile(split_file):
      errors.append(
        f"no split file {split_file} (known splits: train, dev, test_normal, "
        f"test_challenge): {step}"
      )
      continue
    task_id = _first_task_id(split_file)
    if task_id is None:
      errors.append(f"split file {split_file} lists no task ids: {step}")
      continue
    specs = os.path.join(tasks, task_id, "specs.json")
    if not os.path.isfile(specs):
      errors.append(f"task {task_id} of split {split!r} has no {specs}: {step}")
  return errors
