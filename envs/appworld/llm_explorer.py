"""The LLM stages of the feedback loop on AppWorld (paper Sec. 3.2-3.3, Figs. 11-13), for any
`TextLLM` (Gemini, an OpenAI-compatible endpoint, a local model).

* `AppWorldLLMExplorer`: acts in a live world of a base task, one ```python block per step, run
  by the AppWorld server with its safety guard on; the explorer learns the apps through
  `apis.api_docs` as an agent does. Steps that ran without a traceback come back as Triplets
  (code, printed output, run id). The base task's instruction is never shown: exploration is
  unguided (D0) or guided by a signal context, never by a human-written task.
* `abstract_tasks`: every task the exploration supports, as code steps chosen by index from one
  run (the executed code, never code the LLM rewrites), a query, the step whose printed output
  answers it (or none), a description and a completion criterion. `derive_spec` turns a choice
  into what `envs/appworld/world.py derive_task` needs: it runs the steps in a copy of the base
  world, takes the answer from what the answer step printed there (not from the LLM), completes
  the task, and records the answer and the database changes as the task's evaluation, so
  AppWorld's own evaluator grades it.
* `attempt_and_judge`: validation: an LLM agent attempts the derived task with the reference
  solution as hints in a fresh episode; accepted on a positive environment reward, else when the
  LLM judge (`coevolve_jax.feedback.llm_jobs.judge`), shown the task, its completion criterion,
  the attempt and its final observation, says success.

Model-written code only ever runs inside an AppWorld server process, never in ours.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from coevolve_jax.feedback import llm_jobs
from coevolve_jax.feedback.exploration import ExplorationContext, Triplet
from coevolve_jax.feedback.llm import EndpointUnreachable, LLMError, RoundStopped, TextLLM
from coevolve_jax.feedback.llm_jobs import AbstractionChoice, abstract_with_llm
from coevolve_jax.types import Action, Task
from envs.appworld.env import SYSTEM_PROMPT, AppWorldEnv, code_reply, extract_code

log = logging.getLogger(__name__)

OBS_CHARS = 1500  # characters of each observation shown to the LLM
FAILED = "Execution failed"  # how AppWorld's execute output starts when the code raised

EXPLORER_SYSTEM = """\
You explore the apps of an AppWorld world on behalf of its supervisor, to discover realistic \
tasks the supervisor could ask an assistant to do. In each reply, first reason briefly about \
what to try next and why, then give exactly one ```python code block, your action; it runs in \
the world and you see what it prints. Use the apps through the `apis` object: \
learn them with `apis.api_docs.show_app_descriptions()`, \
`apis.api_docs.show_api_descriptions(app_name=...)` and \
`apis.api_docs.show_api_doc(app_name=..., api_name=...)`; account passwords are in \
`apis.supervisor.show_account_passwords()`. Variables persist between steps. Print what you \
find. Never call apis.supervisor.complete_task. Reply with the single word STOP, without code, \
when the objectives are covered."""

ABSTRACT_SYSTEM = """\
You turn an exploration log of an AppWorld world into training tasks: every distinct task the \
log supports, each from one run, with as many steps as the evidence allows. Reply with one JSON \
object: {"tasks": [{"run_id": <int>, "steps": [<indices of that run's code steps that, run in \
order from the initial state, do the task>], "query": "<the supervisor's request, natural and \
self-contained, without hints about the code>", "answer_step": <the index of the chosen step \
whose printed output is the answer to the request, or null when the task only changes the \
world>, "description": "<what the task exercises>", "completion": "<how to tell the task is \
done>"}, ...]}. A task uses {min_calls} to {max_calls} steps in increasing order, one request \
({max_turns} turn), and must either ask a question one of its steps prints the answer to or \
change the world."""

ATTEMPT_PROMPT = """\
{instruction}

Hints (a known solution):
```python
{hints}
```
Your steps so far, each with its output:
{history}
Reply with the next ```python code block; call apis.supervisor.complete_task(answer=...) \
(the answer only if the request asks a question) when the request is done."""


def _supervisor_line(first_message: str) -> str:
  """The supervisor sentence of an episode's first message (not the task's instruction)."""
  return first_message.rsplit("\n\n", 1)[-1]


def derive_spec(choice: AbstractionChoice, task_id: str, base_task_id: str) -> dict[str, Any]:
  """The `envs/appworld/world.py derive_task` spec of an abstracted task: its code steps in
  order and the position among them of the step whose printed output is the answer (None for a
  task that only changes the world).

  Raises:
    ValueError: "answer_step" is given but is not one of the chosen steps.
  """
  answer_step = choice.raw.get("answer_step")
  position = None
  if answer_step is not None:
    if not isinstance(answer_step, int) or answer_step not in choice.steps:
      raise ValueError(f"answer_step {answer_step!r} is not one of the steps {choice.steps}")
    position = choice.steps.index(answer_step)
  return {
    "task_id": task_id,
    "base_task_id": base_task_id,
    "instruction": choice.turns[0],
    "steps": [code for turn in choice.calls for code in turn],
    "answer_step": position,
  }


class AppWorldLLMExplorer:
  """An explorer (`feedback.exploration.Explorer`) over AppWorld worlds, driven by a TextLLM.

  Each of `context.rounds` runs is a fresh episode of the base task
  (`context.initial_config["appworld_task_id"]`) on a server of the suite's pool; each of its
  `context.steps_per_round` steps asks the LLM for one code block given the guidance, the context
  summary, the supervisor and the run so far. `trace` records every step (run, step, action,
  observation, ok). An LLM failure ends its run; a spent budget ends the exploration; an
  unreachable endpoint ends the round (re-raised).

  Args:
    llm: the model. make_env: Task -> AppWorldEnv with at least `steps_per_round` + 1 replies
      (the suite's episode factory). name: provenance name (default: the llm's name).
  """

  def __init__(
    self, llm: TextLLM, make_env: Callable[[Task, int], AppWorldEnv], name: str | None = None
  ):
    self.llm, self.make_env = llm, make_env
    self.name = name or llm.name
    self.trace: list[dict[str, Any]] = []

  def _prompt(self, context, supervisor, history, earlier, step) -> str:
    parts = [
      f"Guidance: {context.guidance}",
      f"Context: {json.dumps(context.summary, ensure_ascii=False)}",
      f"Focus APIs: {json.dumps(context.focus_calls)}",
      f"The world's supervisor: {supervisor}",
    ]
    if earlier:
      parts.append(
        "Code of earlier runs (do not simply repeat it):\n" + "\n---\n".join(earlier[-8:])
      )
    if history:
      parts.append(
        "This run so far:\n"
        + "\n".join(
          f"step {i}:\n{code}\n-> {obs[:OBS_CHARS]}" for i, (code, obs) in enumerate(history)
        )
      )
    parts.append(f"Step {step + 1} of {context.steps_per_round}: reply with the next code block.")
    return "\n\n".join(parts)

  def _run(self, context: ExplorationContext, run_id: int, earlier: list[str]) -> list[Triplet]:
    base = Task(
      task_id=context.task_id,
      env="appworld",
      turns=[""],
      ground_truth=[[]],
      initial_config=dict(context.initial_config),
    )
    env = self.make_env(base, context.steps_per_round + 1)
    out: list[Triplet] = []
    history: list[tuple[str, str]] = []
    try:
      supervisor = _supervisor_line(env.reset().messages[0]["content"])
      for step in range(context.steps_per_round):
        reply = self.llm.complete(
          EXPLORER_SYSTEM, self._prompt(context, supervisor, history, earlier, step)
        )
        code = extract_code(reply)
        if code is None:
          if reply.strip().upper().startswith("STOP"):
            break
          observation, ok = "No code block: reply with one ```python block, or STOP.", False
        elif "complete_task" in code:
          observation, ok = "Not run: exploration never completes the task.", False
        else:
          result = env.step(Action(text=code_reply(code)))
          if result.done:  # the world ended the episode (it cannot be explored further)
            break
          observation = result.messages[0]["content"]
          ok = not observation.startswith(FAILED)
        action = code if code is not None else reply[:200]
        self.trace.append(
          {
            "run": run_id,
            "step": step,
            "action": action,
            "observation": observation[:OBS_CHARS],
            "ok": ok,
          }
        )
        history.append((action, observation))
        if ok:
          assert code is not None  # only code that ran is ok
          out.append(Triplet(code, observation, run_id))
    finally:
      env.close()
    return out

  def explore(self, context: ExplorationContext, rng: np.random.Generator) -> list[Triplet]:
    """Runs `context.rounds` runs; returns the triplets of the steps that ran without error."""
    del rng  # the LLM samples
    self.trace = []
    out: list[Triplet] = []
    for run_id in range(context.rounds):
      try:
        out.extend(self._run(context, run_id, [t.action for t in out]))
      except EndpointUnreachable:
        raise
      except RoundStopped as e:
        log.info("AppWorld exploration of %s stopped: %s", context.task_id, e)
        break
      except LLMError as e:
        log.warning("AppWorld exploration run %d of %s ended: %s", run_id, context.task_id, e)
        self.trace.append(
          {"run": run_id, "step": -1, "action": "", "observation": str(e), "ok": False}
        )
    return out


def abstract_tasks(
  llm: TextLLM,
  triplets: list[Triplet],
  context: ExplorationContext,
  *,
  min_calls: int,
  max_calls: int,
  max_tasks: int = 8,
) -> list[AbstractionChoice]:
  """`feedback.llm_jobs.abstract_with_llm` with AppWorld's instruction: one-request tasks of code
  steps chosen by index, each with the answer its steps printed (or None).

  Raises:
    RoundStopped: the round's token budget is spent or its endpoint unreachable.
  """
  return abstract_with_llm(
    llm,
    triplets,
    context,
    min_calls=min_calls,
    max_calls=max_calls,
    max_turns=1,
    max_tasks=max_tasks,
    system=ABSTRACT_SYSTEM,
    obs_chars=OBS_CHARS,
  )


def attempt_and_judge(
  llm: TextLLM, task: Task, make_env: Callable[[Task, int], AppWorldEnv], max_steps: int = 10
) -> tuple[bool, dict[str, Any]]:
  """Validation (paper Sec. 3.3, Fig. 13): an LLM agent attempts `task` (a derived task, graded
  by its own evaluation code) with its reference solution as hints.

  Accepted when the episode's reward is positive (the environment's evaluator), else when the LLM
  judge, given the request, the completion criterion, the reference solution, the attempt's code
  and its final observation, says success.

  Returns:
    (accepted, info with "reward", "judge" ({success, reason} or None), "attempt" (code steps)).

  Raises:
    RoundStopped: the round's token budget is spent or its endpoint unreachable.
  """
  env = make_env(task, max_steps)
  attempt: list[str] = []
  history: list[str] = []
  reward, final_observation = 0.0, ""
  try:
    instruction = env.reset().messages[0]["content"]
    for _ in range(max_steps):
      prompt = ATTEMPT_PROMPT.format(
        instruction=instruction,
        hints=task.initial_config.get("solution", "").rstrip(),
        history="\n".join(history) or "(none)",
      )
      try:
        reply = llm.complete(SYSTEM_PROMPT, prompt)
      except RoundStopped:
        raise
      except LLMError as e:
        history.append(f"<unusable reply: {e}>")
        continue
      code = extract_code(reply)
      if code is not None:
        attempt.append(code)
      result = env.step(Action(text=reply))
      if result.done:
        reward = float(result.reward)
        final_observation = json.dumps(
          {k: result.info.get(k) for k in ("end", "passed", "num_tests")}
        )
        break
      final_observation = result.messages[0]["content"]
      history.append(f"{code or reply[:200]}\n-> {final_observation[:OBS_CHARS]}")
  finally:
    env.close()
  info: dict[str, Any] = {"reward": reward, "judge": None, "attempt": attempt}
  if reward > 0:
    return True, info
  success, info["judge"] = llm_jobs.judge(
    llm,
    {
      "query": task.turns,
      "description": task.provenance.get("description", ""),
      "completion": task.provenance.get("completion", ""),
      "reference_solution": task.initial_config.get("solution", ""),
      "attempt_code": attempt,
      "final_observation": final_observation[:OBS_CHARS],
    },
  )
  return success, info


if TYPE_CHECKING:  # mypy checks AppWorldLLMExplorer against the Explorer protocol
  from coevolve_jax.feedback.exploration import Explorer

  def _conforms(explorer: AppWorldLLMExplorer) -> Explorer:
    return explorer
