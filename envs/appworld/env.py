"""AppWorld episodes: the agent writes Python, the world (an AppWorld server) executes it.

One `AppWorldEnv` is one episode of one AppWorld task on one server of a `ServerPool`:
  reset()  -> POST /initialize; the first user message is the task instruction and supervisor.
  step(a)  -> the first ```python block of the reply's visible text (never its <think> reasoning)
              goes to POST /execute; AppWorld's safety guard is on (unsafe syntax is refused,
              os.system & co. are null-patched); the printed output or traceback, truncated to
              `max_obs_chars`, is the next user message. The episode ends when the agent calls
              `apis.supervisor.complete_task(...)` (POST /task_completed is true) or after
              `max_steps` replies; then POST /evaluate grades the end state with the task's own
              evaluation code: reward 1.0/0.0 (`reward="binary"`, TGC) or passed/total tests
              (`reward="pass_fraction"`).
What an episode records (the `Env` protocol's `calls` / `observations`, read by the agent loop
into `Trajectory.calls` / `.observations` and from there into signal events and the stage-2
summary): one call per code step, the step's code, and per call the output as the model saw it
(truncated like the next user message; a reply without a code block runs nothing and records
nothing). The APIs a step's code names (`api_names`, in textual order) are that step's tool
names: every StepResult of a reply carries them in `info["tool_names"]`, and the agent loop
appends them to `Trajectory.tool_names`, the action pattern the rare signal counts (AppWorld's
actions are code, not `<tool_call>` blocks, so the loop's parser finds no tool names in them).
The model's code only ever runs inside the AppWorld server process, never in ours.
A server that fails (timeout, connection lost, process died) raises `ServerError` from reset/step;
the agent loop ends that episode as an error and `close()` hands the server back to be restarted.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from envs.appworld.server import AppWorldServer, ServerError, ServerPool
from coevolve_jax.types import Action, StepResult, Task
from envs.base import truncate_observation

__all__ = [
  "AppWorldEnv",
  "SYSTEM_PROMPT",
  "TOOL_NAMES",
  "api_names",
  "extract_code",
  "rows_to_tasks",
  "task_from_row",
]

REWARD_MODES = ("binary", "pass_fraction")
SYSTEM_PROMPT = """\
You are an autonomous agent that completes a supervisor's task by writing Python code that is \
run in a world of apps (simple_note, todoist, spotify, gmail, venmo, amazon, splitwise, phone, \
file_system, supervisor, api_docs). Reply with exactly one ```python code block per message; you \
will see its printed output. Call the apps through the `apis` object, e.g. \
`print(apis.api_docs.show_api_descriptions(app_name="simple_note"))`, \
`print(apis.api_docs.show_api_doc(app_name="simple_note", api_name="login"))`. Account passwords \
are in `apis.supervisor.show_account_passwords()`. When the task is done, call \
`apis.supervisor.complete_task(answer=...)` (pass the answer only if the task asks a question)."""

_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
_CODE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
_API_CALL = re.compile(r"apis\.(\w+)\.(\w+)")
# The StepResult.info key of a step's tool names (the agent loop's `Trajectory.tool_names`).
TOOL_NAMES = "tool_names"


def api_names(code: str) -> list[str]:
  """The `<app>.<api>` names `code` calls through `apis`, in textual order, repeats kept
  (`apis.simple_note.login(...)` -> "simple_note.login"): what it names, run or not."""
  return [f"{app}.{api}" for app, api in _API_CALL.findall(code)]


def code_reply(code: str) -> str:
  """The assistant reply that runs `code`: one fenced python block."""
  return f"```python\n{code.rstrip()}\n```"


def extract_code(text: str) -> str | None:
  """The first fenced code block (```python or bare ```) outside <think>...</think>, or None."""
  visible = _THINK.sub("", text)
  match = _CODE.search(visible)
  if match is None or not match.group(1).strip():
    return None
  return match.group(1).strip()


def task_from_row(row: dict[str, Any], source: str = "appworld") -> Task:
  """A project Task for one AppWorld task (a coevolve_tasks.jsonl row, or {task_id, instruction}).

  `turns` holds the instruction; `ground_truth` is empty (AppWorld grades end states with the
  task's evaluation code, there are no reference call strings); `initial_config` holds the AppWorld
  task id, scenario, split and, for generated worlds, the solution code (warm-start, validation).
  """
  return Task(
    task_id=row["task_id"],
    env="appworld",
    turns=[row["instruction"]],
    ground_truth=[[]],
    initial_config={
      "appworld_task_id": row["task_id"],
      "scenario": row.get("scenario", row["task_id"].split("_")[0]),
      "split": row.get("split", ""),
      "solution": row.get("solution", ""),
    },
    involved_classes=list(row.get("apps", [])),
    source=source,
    provenance={k: row[k] for k in ("template", "seed", "difficulty") if k in row},
  )


def rows_to_tasks(rows: list[dict[str, Any]], split: str) -> list[Task]:
  return [task_from_row(r) for r in rows if r.get("split") == split]


class AppWorldEnv:
  """One episode of one AppWorld task (implements `coevolve_jax.suite.Env`).

  Args:
    task: a Task from `task_from_row` (its initial_config names the AppWorld task id).
    pool: the servers; one is held from reset() to close().
    experiment: prefix of AppWorld's experiment name (outputs under <root>/experiments/outputs);
      the server's port is appended so concurrent episodes of one task never share outputs.
    max_steps: model replies before the episode ends.
    fail_over_limit: an episode that reaches `max_steps` without calling complete_task scores
      0 (the paper's rule), instead of being graded on its end state.
    max_obs_chars: execution output shown to the model, in characters.
    max_obs_tokens: if > 0, the output is cut to this many Qwen tokens instead.
    reward: "binary" (1.0 iff every evaluation test passes) or "pass_fraction".
    exec_timeout_s: AppWorld's own limit per code execution, in seconds (a timed-out execution is
      an observation, not an error); each HTTP request allows this plus `pool.timeout_s`.
  """

  tools: list[dict[str, Any]] = []
  system_prompt: str | None = SYSTEM_PROMPT

  def __init__(
    self,
    task: Task,
    pool: ServerPool,
    experiment: str = "coevolve",
    max_steps: int = 10,
    max_obs_chars: int = 4000,
    max_obs_tokens: int = 0,
    fail_over_limit: bool = False,
    reward: str = "binary",
    exec_timeout_s: int = 20,
  ):
    if reward not in REWARD_MODES:
      raise ValueError(f"reward must be one of {REWARD_MODES}, got {reward!r}")
    self.task, self.pool, self.experiment = task, pool, experiment
    self.max_steps, self.max_obs_chars, self.reward_mode = max_steps, max_obs_chars, reward
    self.max_obs_tokens, self.fail_over_limit = max_obs_tokens, fail_over_limit
    self.exec_timeout_s = int(exec_timeout_s)
    self.aw_id = task.initial_config.get("appworld_task_id", task.task_id)
    self.server: AppWorldServer | None = None
    self.failed = False
    self.steps = 0
    self.code: list[str] = []
    # The `Env` protocol's record, one user turn (the instruction): per model step the code it
    # ran ([] for a reply without a code block), and per code step its output as the model saw
    # it. Signal events and the stage-2 summary read them (the trajectory's calls and
    # observations); the rare signal reads the APIs instead (`info[TOOL_NAMES]`).
    self.calls: list[list[list[str]]] = [[]]
    self.observations: list[list[str]] = [[]]

  def _call(self, method: str, **payload: Any) -> Any:
    assert self.server is not None
    try:
      return self.server.call(
        method, timeout_s=self.exec_timeout_s + self.pool.timeout_s, task_id=self.aw_id, **payload
      )
    except ServerError:
      self.failed = True
      raise

  def reset(self) -> StepResult:
    self.server = self.pool.acquire()
    out = self._call(
      "initialize",
      experiment_name=f"{self.experiment}-{self.server.port}",
      timeout_seconds=self.exec_timeout_s,
      raise_on_unsafe_syntax=True,
      null_patch_unsafe_execution=True,
    )
    sup = out["supervisor"]
    message = (
      f"{out['instruction']}\n\nI am your supervisor: {sup['first_name']} "
      f"{sup['last_name']}, email {sup['email']}, phone {sup['phone_number']}."
    )
    return StepResult(messages=[{"role": "user", "content": message}])

  def step(self, action: Action) -> StepResult:
    """Runs the reply's first code block; the result's `info[TOOL_NAMES]` lists the APIs it
    names ([] without a block). Raises ServerError when the server fails."""
    self.steps += 1
    code = extract_code(action.text)
    names: list[str] = []
    if code is None:
      shown = (
        "No code was run: reply with one ```python code block (call "
        "apis.supervisor.complete_task(...) when the task is done)."
      )
      self.calls[0].append([])
    else:
      self.code.append(code)
      names = api_names(code)
      self.calls[0].append([code])
      output = str(self._call("execute", code=code))
      shown = truncate_observation(output, self.max_obs_chars, self.max_obs_tokens)
      self.observations[0].append(shown)
      if self._call("task_completed"):
        return self._grade("completed", names)
    if self.steps >= self.max_steps:
      return self._grade("max_steps", names)
    return StepResult(messages=[{"role": "user", "content": shown}], info={TOOL_NAMES: names})

  def _grade(self, how: str, names: list[str]) -> StepResult:
    """The final StepResult: POST /evaluate's reward, and in `info` how the episode ended, the
    test counts, the task's scenario and split, the calls and observations per user turn, and
    the last step's tool names (`names`)."""
    report = self._call("evaluate", suppress_errors=True)
    passed, total = len(report.get("passes", [])), int(report.get("num_tests") or 0)
    success = bool(report.get("success"))
    reward = float(success) if self.reward_mode == "binary" else (passed / total if total else 0.0)
    if how == "max_steps" and self.fail_over_limit:
      reward = 0.0  # over the step limit = failure, whatever the end state
    info = {
      "end": how,
      "success": success,
      "passed": passed,
      "num_tests": total,
      "scenario": self.task.initial_config.get("scenario", ""),
      "split": self.task.initial_config.get("split", ""),
      "per_turn_calls": [[c for step in turn for c in step] for turn in self.calls],
      "per_turn_observations": [list(turn) for turn in self.observations],
      TOOL_NAMES: names,
    }
    return StepResult(messages=[], done=True, reward=reward, info=info)

  def close(self) -> None:
    """Closes the world and hands the server back (restarted when it failed); never raises."""
    server, self.server = self.server, None
    if server is None:
      return
    if not self.failed:
      try:
        server.call("close", timeout_s=self.pool.timeout_s, task_id=self.aw_id)
      except ServerError:
        self.failed = True
    self.pool.release(server, failed=self.failed)


if TYPE_CHECKING:  # mypy checks AppWorldEnv against the Env protocol
  from coevolve_jax.suite import Env

  def _conforms(env: AppWorldEnv) -> Env:
    return env
