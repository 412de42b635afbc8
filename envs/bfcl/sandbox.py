"""A fresh, isolated BFCL backend instance for exploration and validation (no user turns, no
checker).

Wraps envs.bfcl.execution: every Sandbox has its own unique model name, executes one safe call at a
time and deletes its cached instances on close (use it as a context manager).
"""

from __future__ import annotations

import copy
from typing import Any

from coevolve_jax.types import Task, ToolCall
from envs.bfcl.calls import ToolCallError, call_to_string
from envs.bfcl.data import schemas_by_name, tool_schemas
from envs.bfcl.execution import (
  cleanup,
  execute_calls,
  instance_state,
  is_error_result,
  new_model_name,
)

_IGNORED_ATTRS = ("_random", "_api_description")


def env_task(
  initial_config: dict[str, Any], involved_classes: list[str], task_id: str = "sandbox"
) -> Task:
  """A turn-less Task carrying only an environment state (what exploration may use of training
  entries)."""
  return Task(
    task_id=task_id,
    env="bfcl",
    turns=[],
    ground_truth=[],
    initial_config=initial_config,
    involved_classes=list(involved_classes),
    source="env_state",
  )


class Sandbox:
  """Executes validated calls on fresh backends for one environment state.

  Attributes:
    tools: the full tool schemas of the involved classes (Qwen/OpenAI format).
    schemas: tool name -> "function" dict.
  """

  def __init__(
    self, initial_config: dict[str, Any], involved_classes: list[str], task_id: str = "sandbox"
  ):
    self.task = env_task(initial_config, involved_classes, task_id)
    self.tools = tool_schemas(list(involved_classes), "full")
    self.schemas = schemas_by_name(self.tools)
    self.model_name = new_model_name("sbx")
    self.instances: dict[str, Any] = execute_calls([], self.task, self.model_name)[1]

  def run(self, call: ToolCall | str) -> tuple[str, str | None]:
    """Executes one call; returns (call string, result), result None when the call is invalid.

    A string call must already be a trusted call string (built by call_to_string).
    """
    if isinstance(call, ToolCall):
      try:
        call = call_to_string(call, self.schemas)
      except ToolCallError:
        return "", None
    results, self.instances = execute_calls([call], self.task, self.model_name)
    return call, results[0]

  def run_ok(self, call: ToolCall | str) -> tuple[str, str | None]:
    """Like run(), but the result is None when the call failed (error result or invalid call)."""
    text, result = self.run(call)
    return text, (None if result is None or is_error_result(result) else result)

  def public_state(self) -> dict[str, dict[str, Any]]:
    """The state the official checker compares (public attributes), deep-copied."""
    return instance_state(self.instances)

  def full_state(self) -> dict[str, dict[str, Any]]:
    """All attributes except RNGs and docs (includes e.g. the current directory), deep-copied."""
    return {
      c: copy.deepcopy({k: v for k, v in vars(i).items() if k not in _IGNORED_ATTRS})
      for c, i in self.instances.items()
    }

  def close(self) -> None:
    cleanup(self.model_name)

  def __enter__(self) -> "Sandbox":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()
