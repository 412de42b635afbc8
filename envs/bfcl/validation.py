"""Stage 3b (docs/design.md §1.3): execution-based validation of a synthesized task.

A task is accepted when (1) it has >= min_calls ground-truth calls, each a safe call of the task's
tools (re-parsed and rebuilt by call_to_string), (2) every call succeeds when replayed from the
initial state in a fresh backend, (3) two replays reach the same final state (determinism), and (4)
the official BFCL multi-turn checker scores the ground truth itself as valid.
With an LLM configured, the controller then also runs the agent attempt plus judge of
docs/design.md §1.3 (`llm_explorer.attempt_and_judge`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from envs.bfcl.sandbox import Sandbox
from coevolve_jax.types import Task
from envs.bfcl.calls import ToolCallError, call_to_string, parse_call_string
from envs.bfcl.data import schemas_by_name, tool_schemas
from envs.bfcl.backends import score_calls
from envs.bfcl.execution import is_error_result


@dataclasses.dataclass
class ValidationResult:
  accepted: bool
  reason: str
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


def _safe_calls(task: Task) -> list[list[str]]:
  """Rebuilds every ground-truth call through parse + call_to_string. Raises ToolCallError."""
  schemas = schemas_by_name(tool_schemas(list(task.involved_classes)))
  return [
    [call_to_string(parse_call_string(c, task.involved_classes), schemas) for c in turn]
    for turn in task.ground_truth
  ]


def _replay(task: Task, turns: list[list[str]]) -> tuple[list[str], Any]:
  """Runs all calls in a fresh sandbox; returns ("call -> result" of failed calls, final public
  state)."""
  failed = []
  with Sandbox(task.initial_config, task.involved_classes, task.task_id) as sandbox:
    for call in (c for turn in turns for c in turn):
      _, result = sandbox.run(call)
      if result is None or is_error_result(result):
        failed.append(f"{call} -> {result}")
    return failed, sandbox.public_state()


def validate_task(task: Task, *, min_calls: int = 3) -> ValidationResult:
  """Execution-based acceptance of a task (see module docstring); never raises for a bad task."""
  n_calls = sum(len(t) for t in task.ground_truth)
  if n_calls < min_calls:
    return ValidationResult(False, f"too few calls: {n_calls} < {min_calls}", {"n_calls": n_calls})
  if len(task.turns) != len(task.ground_truth) or not all(task.turns):
    return ValidationResult(False, "turns and ground truth do not match", {})
  try:
    turns = _safe_calls(task)
  except (ToolCallError, KeyError) as e:
    return ValidationResult(False, f"unsafe or invalid ground-truth call: {e}", {})
  failed, state_a = _replay(task, turns)
  if failed:
    return ValidationResult(False, f"ground-truth call failed: {failed[0]}", {"failed": failed})
  _, state_b = _replay(task, turns)
  if state_a != state_b:
    return ValidationResult(False, "non-deterministic final state across two replays", {})
  check_task = dataclasses.replace(task, ground_truth=turns)
  reward, info = score_calls(check_task, [[turn] for turn in turns])
  if reward < 1.0:
    return ValidationResult(
      False, f"official checker rejects the ground truth: {info['checker']}", info
    )
  return ValidationResult(True, "ok", {"n_calls": n_calls, "n_turns": len(turns)})
