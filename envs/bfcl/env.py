"""BFCL multi-turn environment on the real (pure Python) backends shipped by bfcl-eval.

One `BfclEnv` is one episode of one Task: user turns are presented in order; the agent's tool calls
are validated and converted to call strings by us (`call_to_string`), executed on per-episode
backend instances, and the episode is scored at the end by the official `multi_turn_checker` (reward
1.0 / 0.0). The instances live in a worker process of a `BackendPool` (`envs.bfcl.backends`), where
every call runs under a wall-time and memory bound: a call over a bound gets an error observation,
has no effect and is not among the calls the checker replays, and the episode goes on. The calls of
one reply also share a wall-clock budget (`reply_wall_s`): those left when it is spent are not run
and get an error observation each, so one reply cannot stall its batch for long.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

from coevolve_jax.types import Action, StepResult, Task
from envs.base import truncate_observation
from envs.bfcl.calls import ToolCallError, call_to_string, parse_call_string
from envs.bfcl.data import (
  load_bfcl_tasks,
  schemas_by_name,
  split_tasks,
  tool_schemas,
  function_docs,
)
from envs.bfcl.backends import (
  BackendLost,
  BackendPool,
  BackendSession,
  CallOutcome,
  default_pool,
  score_calls,
)
from envs.bfcl.execution import new_model_name

__all__ = [
  "BfclEnv",
  "ToolCallError",
  "call_to_string",
  "load_bfcl_tasks",
  "make_env",
  "parse_call_string",
  "score_calls",
  "split_tasks",
  "tool_schemas",
  "SYSTEM_PROMPT",
]

SYSTEM_PROMPT = (
  "You are an assistant that completes the user's requests by calling the provided tools. "
  "Call tools as needed, one or more per reply; you will see their results. "
  "When the current request is fully done (or cannot be done with the tools), "
  "reply to the user in plain text without any tool call."
)
# BFCL's prompt when miss_func adds the held-out functions (constants.default_prompts).
ADDED_FUNCTIONS_PROMPT = "I have updated some more functions you can choose from. What about now?"
DEFAULT_MAX_OBS_CHARS = 8000
# Wall-clock seconds the calls of one reply share (configs/bfcl.py `bfcl.reply_wall_s`).
DEFAULT_REPLY_WALL_S = 20.0
MAX_STEPS_PER_TURN = 20  # BFCL's MAXIMUM_STEP_LIMIT.


class BfclEnv:
  """One isolated episode of a BFCL multi-turn task (implements `coevolve_jax.suite.Env`).

  Two loop semantics. Training (default): a reply that cannot be parsed gets an error observation
  and the turn goes on (a penalised step); the episode is force-terminated once a user turn has
  taken `max_steps_per_turn` model steps. Official (`official_loop=True`, BFCL's
  `base_handler.inference_multi_turn_*`): a reply that cannot be decoded ends the user turn, like
  a reply without calls; only steps that executed calls count, and the episode is
  force-terminated when that count exceeds `max_steps_per_turn` (MAXIMUM_STEP_LIMIT = 20).

  Attributes:
    tools: Qwen/OpenAI tool schemas offered now (miss_func tasks gain tools at later turns).
    system_prompt: a short instruction on the tool-use protocol.
    model_name: the unique name keying this episode's backend instances in BFCL's cache.
    calls: decoded call strings, [turn][step][call], as the official checker expects: the calls
      that ran (a call stopped at a bound of `backends` is left out; a step none of whose calls ran
      is left out).
    reply_wall_s: wall-clock seconds one reply's calls share (`BackendSession.execute`): once
      spent, the reply's remaining calls are not run and each gets an error observation saying so
      (they have no effect and are not in `calls`); the step and the episode go on.

  A step whose backend state cannot be rebuilt after its worker process was replaced (see
  `envs.bfcl.backends`) ends the episode: reward 0, checker error_type "env:backend_lost".
  """

  def __init__(
    self,
    task: Task,
    episode_id: str,
    *,
    max_obs_chars: int = DEFAULT_MAX_OBS_CHARS,
    max_obs_tokens: int = 0,
    tool_style: str = "full",
    max_steps_per_turn: int = MAX_STEPS_PER_TURN,
    official_loop: bool = False,
    backends: BackendPool | None = None,
    reply_wall_s: float = DEFAULT_REPLY_WALL_S,
  ):
    """Raises ValueError: a task without turns or ground truth per turn, or reply_wall_s not a
    finite number of seconds > 0."""
    if not task.turns or len(task.turns) != len(task.ground_truth):
      raise ValueError(f"task {task.task_id}: needs turns and one ground-truth list per turn")
    wall = reply_wall_s
    if isinstance(wall, bool) or not isinstance(wall, (int, float)) or not 0 < wall < math.inf:
      raise ValueError(f"reply_wall_s must be a finite number of seconds > 0, got {wall!r}")
    self.reply_wall_s = float(wall)
    self.task = task
    self.tool_style = tool_style
    self.max_obs_chars, self.max_obs_tokens = max_obs_chars, max_obs_tokens
    self.max_steps_per_turn = max_steps_per_turn
    self.official_loop = official_loop
    self.model_name = new_model_name("ep_" + re.sub(r"\W", "_", episode_id)[:40])
    self.tools = tool_schemas(
      task.involved_classes, tool_style, task.provenance.get("excluded_function", ())
    )
    self.system_prompt: str | None = SYSTEM_PROMPT
    self.calls: list[list[list[str]]] = []
    # Per user turn, per call that ran: the tool's output as the model saw it (context summaries).
    self.observations: list[list[str]] = []
    self.backends = backends or default_pool()
    self._session: BackendSession | None = None
    self._turn = -1
    self._steps = 0
    self._done = False

  def _user_message(self, turn: int) -> dict[str, str]:
    text = self.task.turns[turn]
    added = self.task.provenance.get("missed_function", {}).get(str(turn), [])
    if added:
      self.tools = self.tools + function_docs(added, self.task.involved_classes, self.tool_style)
      text = text or ADDED_FUNCTIONS_PROMPT
    return {"role": "user", "content": text}

  def reset(self) -> StepResult:
    """Starts (or restarts) the episode; returns the first user message.

    Raises:
      envs.bfcl.backends.BackendUnavailable: the backend pool is closed.
    """
    self.close()
    self._session = self.backends.session(self.task, self.model_name)
    self.tools = tool_schemas(
      self.task.involved_classes, self.tool_style, self.task.provenance.get("excluded_function", ())
    )
    self.calls, self._turn, self._steps, self._done = [[]], 0, 0, False
    self.observations = [[]]
    return StepResult(messages=[self._user_message(0)])

  def _cut(self, text: str) -> str:
    return truncate_observation(text, self.max_obs_chars, self.max_obs_tokens)

  def _tool_message(self, content: str) -> dict[str, str]:
    return {"role": "tool", "content": self._cut(content)}

  def _run_calls(self, action: Action) -> list[dict[str, str]]:
    """Validates and executes the action's calls; one tool message per call, in order."""
    schemas = schemas_by_name(self.tools)
    built: list[str | None] = []
    errors: dict[int, str] = {}
    for i, call in enumerate(action.tool_calls):
      try:
        built.append(call_to_string(call, schemas))
      except ToolCallError as e:
        built.append(None)
        errors[i] = f"Error: invalid tool call: {e}"
    valid = [c for c in built if c is not None]
    outcomes: list[CallOutcome] = []
    if valid:
      assert self._session is not None, "calls run between reset() and close()"
      outcomes = self._session.execute(valid, budget_s=self.reply_wall_s)
    ran = [c for c, o in zip(valid, outcomes) if o.ran]
    if ran:
      self.calls[self._turn].append(ran)
      shown = (self._cut(o.text) for o in outcomes if o.ran)
      self.observations[self._turn].extend(shown)
    results = iter(outcomes)
    return [
      self._tool_message(errors[i] if c is None else next(results).text)
      for i, c in enumerate(built)
    ]

  def _lost(self, error: BackendLost) -> StepResult:
    """Ends the episode whose backend state is gone (see the class docstring)."""
    return self._finish(
      [self._tool_message(f"Error: {error}")], forced="env:backend_lost", message=str(error)
    )

  def _finish(
    self, messages: list[dict[str, str]], forced: str | None = None, message: str = ""
  ) -> StepResult:
    self._done = True
    if forced:
      checker = {"valid": False, "error_type": forced}
      if message:
        checker["error_message"] = message
      info: dict[str, Any] = {"calls": self.calls, "checker": checker}
      reward = 0.0
    else:
      reward, info = score_calls(
        self.task, self.calls, self.model_name + "_score", pool=self.backends
      )
    info["per_turn_calls"] = [[c for step in turn for c in step] for turn in self.calls]
    info["per_turn_observations"] = [list(turn) for turn in self.observations]
    return StepResult(messages=messages, done=True, reward=reward, info=info)

  def step(self, action: Action) -> StepResult:
    """Applies one model step: tool results, the next user message, or the final scored result.

    Raises:
      RuntimeError: the episode is not started or already done.
      envs.bfcl.backends.BackendUnavailable: no backend worker process could be started.
    """
    if self._turn < 0 or self._done:
      raise RuntimeError("step() before reset() or after the episode ended")
    if self.official_loop:
      return self._official_step(action)
    self._steps += 1
    if action.error is not None:
      messages = [self._tool_message(f"Error: could not parse the tool call: {action.error}")]
    elif action.tool_calls:
      try:
        messages = self._run_calls(action)
      except BackendLost as e:
        return self._lost(e)
    else:
      return self._next_turn()
    if self._steps >= self.max_steps_per_turn:
      return self._finish(messages, forced="multi_turn:force_terminated")
    return StepResult(messages=messages)

  def _next_turn(self) -> StepResult:
    self._turn += 1
    self._steps = 0
    if self._turn >= len(self.task.turns):
      return self._finish([])
    self.calls.append([])
    self.observations.append([])
    return StepResult(messages=[self._user_message(self._turn)])

  def _official_step(self, action: Action) -> StepResult:
    """BFCL's loop: undecodable or call-free replies end the turn; > limit executed steps quit."""
    if action.error is not None or not action.tool_calls:
      return self._next_turn()
    try:
      messages = self._run_calls(action)
    except BackendLost as e:
      return self._lost(e)
    self._steps += 1
    if self._steps > self.max_steps_per_turn:
      return self._finish(messages, forced="multi_turn:force_terminated")
    return StepResult(messages=messages)

  def close(self) -> None:
    """Deletes every cached backend instance of this episode (its own and the checker's); never
    raises."""
    if self._session is not None:
      self._session.close()
      self._session = None

  def cached_instance_names(self) -> list[str]:
    """Names of this episode's instances still in BFCL's cache, in any worker process (for tests
    and leak checks)."""
    return self.backends.instance_names(self.model_name)


def make_env(
  task: Task,
  episode_id: str,
  *,
  max_obs_chars: int = DEFAULT_MAX_OBS_CHARS,
  max_obs_tokens: int = 0,
  tool_style: str = "full",
  max_steps_per_turn: int = MAX_STEPS_PER_TURN,
  official_loop: bool = False,
  backends: BackendPool | None = None,
  reply_wall_s: float = DEFAULT_REPLY_WALL_S,
) -> BfclEnv:
  """A fresh, isolated BfclEnv for one episode of `task` (call reset() first, close() at the
  end); its calls run in `backends` (None = `envs.bfcl.backends.default_pool()`), those of one
  reply within `reply_wall_s` seconds of wall clock (`BfclEnv`). Raises ValueError as `BfclEnv`."""
  return BfclEnv(
    task,
    episode_id,
    max_obs_chars=max_obs_chars,
    max_obs_tokens=max_obs_tokens,
    tool_style=tool_style,
    max_steps_per_turn=max_steps_per_turn,
    official_loop=official_loop,
    backends=backends,
    reply_wall_s=reply_wall_s,
  )


if TYPE_CHECKING:  # mypy checks BfclEnv against the Env protocol
  from coevolve_jax.suite import Env

  def _conforms(env: BfclEnv) -> Env:
    return env
