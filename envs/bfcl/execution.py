"""Execution of validated call strings on BFCL's real backends, cleanup, and the official checker.

BFCL caches backend instances in the globals of `multi_turn_utils`, keyed by
"{model_name}_{entry_id}_{class}_instance" (the checker adds "_eval" / "_ground_truth_eval" to the
model name). Every episode therefore uses its own unique model name (`new_model_name`), and
`cleanup(model_name)` deletes every global whose key starts with that name, so state never leaks
between episodes.

Everything here runs in-process and unbounded: it is what the worker processes of
`envs.bfcl.backends` run (`envs/bfcl/worker.py`). Episodes, sandboxes and the checker reach the
backends only through those workers, under a wall-time and memory bound per call;
`envs.bfcl.backends.score_calls` is the bounded entry point to the checker.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import uuid
from typing import Any

from coevolve_jax.types import Task
from envs.bfcl.data import import_bfcl

_UTILS = "bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils"
_CHECKER = "bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker"
_CLEANUP_LOCK = threading.Lock()
_IGNORED_ATTRS = ("_random", "_api_description")


def new_model_name(prefix: str = "cj") -> str:
  """A fresh model name (identifier characters only) for one episode or scoring run."""
  return f"{prefix}_{uuid.uuid4().hex}"


def _sanitize(name: str) -> str:
  return re.sub(r"[-./:]", "_", name)


def is_long_context(task: Task) -> bool:
  return bool(task.provenance.get("long_context")) or "long_context" in task.task_id


def execute_calls(
  calls: list[str], task: Task, model_name: str
) -> tuple[list[str], dict[str, Any]]:
  """Executes trusted call strings (built by call_to_string) on the episode's cached backend
  instances, in this process and without bounds (the worker processes of `envs.bfcl.backends`
  call this; everything else goes through them).

  Args:
    calls: call strings; each must come from `call_to_string` or trusted ground truth, never model
      text.
    task: supplies initial_config, involved_classes and the entry id.
    model_name: the episode's unique name (instances persist across calls until `cleanup`).

  Returns:
    (one result string per call, class name -> live backend instance).
  """
  utils = import_bfcl(_UTILS)
  return utils.execute_multi_turn_func_call(
    func_call_list=list(calls),
    initial_config=task.initial_config,
    involved_classes=list(task.involved_classes),
    model_name=model_name,
    test_entry_id=task.task_id,
    long_context=is_long_context(task),
  )


def is_error_result(result: str) -> bool:
  """True when a backend result reports an error ({"error": ...} or a raised exception)."""
  if result.startswith("Error during execution"):
    return True
  if result.startswith("{"):
    try:
      parsed = json.loads(result)
    except ValueError:
      return False
    return isinstance(parsed, dict) and "error" in parsed
  return False


def instance_state(instances: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """Deep copy of the public attributes of each backend instance (what the official state check
  compares)."""
  return {
    c: copy.deepcopy({k: v for k, v in vars(inst).items() if not k.startswith("_")})
    for c, inst in instances.items()
  }


def full_state(instances: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """Deep copy of every attribute of each backend instance except RNGs and docs (includes e.g. the
  file system's current directory)."""
  return {
    c: copy.deepcopy({k: v for k, v in vars(i).items() if k not in _IGNORED_ATTRS})
    for c, i in instances.items()
  }


def cached_keys(model_name: str) -> list[str]:
  """Global instance names in BFCL's cache that belong to `model_name` (incl. checker variants)."""
  prefix = _sanitize(model_name) + "_"
  return [
    k for k in list(vars(import_bfcl(_UTILS))) if k.startswith(prefix) and k.endswith("_instance")
  ]


def all_cached_keys() -> list[str]:
  """Every backend instance name in BFCL's cache, whatever its model name."""
  return [k for k in list(vars(import_bfcl(_UTILS))) if k.endswith("_instance")]


def cleanup(model_name: str) -> int:
  """Deletes every cached backend instance created under `model_name`; returns how many were
  deleted."""
  module_globals = vars(import_bfcl(_UTILS))
  with _CLEANUP_LOCK:
    keys = cached_keys(model_name)
    for k in keys:
      module_globals.pop(k, None)
  return len(keys)


def checker_entry(task: Task) -> dict[str, Any]:
  """The test entry dict the official multi_turn_checker expects."""
  return {
    "id": task.task_id,
    "initial_config": task.initial_config,
    "involved_classes": list(task.involved_classes),
  }


def check_calls(
  task: Task, calls_per_turn_per_step: list[list[list[str]]], model_name: str
) -> tuple[float, dict[str, Any]]:
  """`score_calls` in this process, without bounds (what a worker process runs)."""
  name = model_name
  info: dict[str, Any] = {"calls": calls_per_turn_per_step}
  if len(calls_per_turn_per_step) != len(task.ground_truth):
    info["checker"] = {
      "valid": False,
      "error_type": "multi_turn:force_terminated",
      "error_message": f"{len(calls_per_turn_per_step)} turns, expected {len(task.ground_truth)}",
    }
    return 0.0, info
  checker = import_bfcl(_CHECKER)
  steps = [[step for step in turn if step] for turn in calls_per_turn_per_step]
  try:
    result = checker.multi_turn_checker(
      steps, task.ground_truth, checker_entry(task), task.task_id.rsplit("_", 1)[0], name
    )
  except Exception as e:  # The checker asserts on mismatched instance sets; count as a failure.
    result = {"valid": False, "error_type": "checker_exception", "error_message": repr(e)}
  finally:
    cleanup(name)
  # Keep only JSON-friendly fields (details hold live backend objects).
  info["checker"] = {
    k: str(v) if k == "error_message" else v
    for k, v in result.items()
    if k in ("valid", "error_type", "error_message")
  }
  return (1.0 if result.get("valid") else 0.0), info
