"""A fresh, isolated BFCL backend instance for exploration and validation (no user turns, no
checker).

Every Sandbox has its own unique model name and its own session in a worker process of a
`BackendPool` (`envs.bfcl.backends`), executes one safe call at a time under the pool's wall-time
and memory bound, and deletes its cached instances on close (use it as a context manager).
"""

from __future__ import annotations

from typing import Any

from coevolve_jax.types import Task, ToolCall
from envs.bfcl.backends import BackendPool, default_pool
from envs.bfcl.calls import ToolCallError, call_to_string
from envs.bfcl.data import schemas_by_name, tool_schemas
from envs.bfcl.execution import is_error_result, new_model_name


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

  Args:
    initial_config, involved_classes, task_id: the environment state (see `env_task`).
    pool: the `BackendPool` whose worker holds the instances (None = `default_pool()`).

  Attributes:
    tools: the full tool schemas of the involved classes (Qwen/OpenAI format).
    schemas: tool name -> "function" dict.

  Raises (from the constructor and every method but close):
    envs.bfcl.backends.BackendUnavailable: no worker process could be started, or the pool is
      closed.
    envs.bfcl.backends.BackendLost: the instances could not be rebuilt after their worker process
      was replaced.
  """

  def __init__(
    self,
    initial_config: dict[str, Any],
    involved_classes: list[str],
    task_id: str = "sandbox",
    pool: BackendPool | None = None,
  ):
    self.task = env_task(initial_config, involved_classes, task_id)
    self.tools = tool_schemas(list(involved_classes), "full")
    self.schemas = schemas_by_name(self.tools)
    self.model_name = new_model_name("sbx")
    self._session = (pool or default_pool()).session(self.task, self.model_name)
    try:
      self._session.open()
    except BaseException:
      self._session.close()
      raise

  def run(self, call: ToolCall | str) -> tuple[str, str | None]:
    """Executes one call; returns (call string, result), result None when the call is invalid.

    A call stopped at a bound of the pool (wall time, memory) returns ("", its "Error during
    execution: ..." text): it had no effect, like an invalid call. A string call must already be
    a trusted call string (built by call_to_string).
    """
    if isinstance(call, ToolCall):
      try:
        call = call_to_string(call, self.schemas)
      except ToolCallError:
        return "", None
    outcome = self._session.execute([call])[0]
    return (call if outcome.ran else ""), outcome.text

  def run_ok(self, call: ToolCall | str) -> tuple[str, str | None]:
    """Like run(), but the result is None when the call failed (error result or invalid call)."""
    text, result = self.run(call)
    return text, (None if result is None or is_error_result(result) else result)

  def public_state(self) -> dict[str, dict[str, Any]]:
    """The state the official checker compares (public attributes), copied."""
    return self._session.state("public")

  def full_state(self) -> dict[str, dict[str, Any]]:
    """All attributes except RNGs and docs (includes e.g. the current directory), copied."""
    return self._session.state("full")

  def close(self) -> None:
    """Deletes the sandbox's backend instances; never raises."""
    self._session.close()

  def __enter__(self) -> "Sandbox":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()
