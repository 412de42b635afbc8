"""The LLM-driven stages of the feedback loop on BFCL (docs/design.md §1.2-1.3), for any
`TextLLM` (Gemini, an OpenAI-compatible endpoint, a local model).

* `LLMExplorer`: acts in fresh real backends, one call per step, under the signal's guidance text.
* `attempt_and_judge`: the validation of docs/design.md §1.3: an agent attempts the query with
  the ground-truth calls as hints; accepted when the official checker gives reward 1 or the LLM
  judge (`coevolve_jax.feedback.llm_jobs.judge`) says success.

The summary and the abstraction are the benchmark-independent jobs of
`coevolve_jax.feedback.llm_jobs`. Model-written calls never reach `eval`: every reply is parsed as
JSON into a `ToolCall`, checked against the tool schema and rebuilt by `call_to_string` before
BFCL executes it.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from coevolve_jax.feedback import llm_jobs
from coevolve_jax.feedback.exploration import ExplorationContext, Triplet
from coevolve_jax.feedback.llm import EndpointUnreachable, LLMError, RoundStopped, TextLLM
from coevolve_jax.feedback.llm import parse_json_reply
from coevolve_jax.feedback.llm_jobs import OBS_CHARS as _OBS_CHARS
from coevolve_jax.types import Task, ToolCall
from envs.bfcl.backends import score_calls
from envs.bfcl.data import compact_description
from envs.bfcl.sandbox import Sandbox

log = logging.getLogger(__name__)

EXPLORER_SYSTEM = (
  "You explore a software environment through its tools to discover realistic tasks an "
  "assistant could be asked to do. First reason briefly about what to try next and why, then "
  "end your reply with exactly one JSON object, your action: "
  '{"name": "<tool name>", "arguments": {...}} to make one call, or {"stop": true} when the '
  "objectives are covered."
)


def tools_text(schemas: dict[str, dict[str, Any]]) -> str:
  """One line per tool: name(param: type, ...) - first sentence of its description."""
  lines = []
  for name, fn in sorted(schemas.items()):
    props = (fn.get("parameters") or {}).get("properties") or {}
    required = set((fn.get("parameters") or {}).get("required") or [])
    params = ", ".join(
      f"{p}{'' if p in required else '?'}: {s.get('type', 'any')}" for p, s in props.items()
    )
    lines.append(f"- {name}({params}) - {compact_description(fn.get('description', ''))}")
  return "\n".join(lines)


def parse_call_reply(text: str) -> ToolCall | None:
  """A ToolCall from an explorer reply, or None for {"stop": true}: the reply's last JSON object
  (the explorer reasons first, then gives one action: paper Fig. 9).

  Raises:
    LLMError: the reply is not a JSON object with a string "name" and an object "arguments", or
      one of its objects repeats a key.
  """
  data = parse_json_reply(text, last=True)  # reasoning first, then the one action (Fig. 9)
  if isinstance(data, dict) and data.get("stop") is True:
    return None
  if (
    not isinstance(data, dict)
    or not isinstance(data.get("name"), str)
    or not isinstance(data.get("arguments", {}), dict)
  ):
    raise LLMError(f"reply is not a call object: {text[:120]!r}")
  return ToolCall(data["name"], dict(data.get("arguments", {})))


class LLMExplorer:
  """Explorer (envs.bfcl.explorer.Explorer) driven by a TextLLM.

  Each of `context.rounds` runs starts in a fresh backend; each of its `steps_per_round` steps asks
  the LLM for one call given the guidance, the context summary, the tools and the run so far.
  Every attempt (valid or not) is appended to `trace` as {"run", "step", "action", "observation",
  "ok"}; successful calls come back as Triplets. An LLM failure ends the run (a spent token budget
  ends the exploration); what was found so far is kept.

  Args:
    llm: the model. name: provenance name (default: the llm's name).
  """

  def __init__(self, llm: TextLLM, name: str | None = None):
    self.llm = llm
    self.name = name or llm.name
    self.trace: list[dict[str, Any]] = []

  def _prompt(
    self,
    context: ExplorationContext,
    tools: str,
    history: list[tuple[str, str]],
    earlier: list[str],
    step: int,
  ) -> str:
    parts = [
      f"Guidance: {context.guidance}",
      f"Context: {json.dumps(context.summary, ensure_ascii=False)}",
      f"Focus calls: {json.dumps(context.focus_calls, ensure_ascii=False)}",
      f"Tools:\n{tools}",
    ]
    if earlier:
      parts.append("Calls of earlier runs (do not simply repeat them): " + "; ".join(earlier[-20:]))
    if history:
      parts.append(
        "This run so far:\n"
        + "\n".join(f"{i}. {a} -> {o[:_OBS_CHARS]}" for i, (a, o) in enumerate(history))
      )
    parts.append(f"Step {step + 1} of {context.steps_per_round}: reply with the next call.")
    return "\n\n".join(parts)

  def _run(self, context: ExplorationContext, run_id: int, earlier: list[str]) -> list[Triplet]:
    out: list[Triplet] = []
    history: list[tuple[str, str]] = []
    with Sandbox(context.initial_config, context.involved_classes, context.task_id) as sandbox:
      tools = tools_text(sandbox.schemas)
      for step in range(context.steps_per_round):
        reply = self.llm.complete(
          EXPLORER_SYSTEM, self._prompt(context, tools, history, earlier, step)
        )
        try:
          call = parse_call_reply(reply)
        except LLMError as e:
          self.trace.append(
            {"run": run_id, "step": step, "action": reply[:200], "observation": str(e), "ok": False}
          )
          history.append((reply[:200], f"Error: {e}"))
          continue
        if call is None:
          break
        text, result = sandbox.run_ok(call)
        ok = result is not None
        shown = text or f"{call.name}(<invalid arguments>)"
        observation = (
          result if result is not None else "Error: invalid call or the tool returned an error"
        )
        self.trace.append(
          {
            "run": run_id,
            "step": step,
            "action": shown,
            "observation": observation[:_OBS_CHARS],
            "ok": ok,
          }
        )
        history.append((shown, observation))
        if result is not None:  # ok
          out.append(Triplet(text, result, run_id))
    return out

  def explore(self, context: ExplorationContext, rng: np.random.Generator) -> list[Triplet]:
    """Runs `context.rounds` runs; returns the successful triplets (rng unused: the LLM samples)."""
    del rng
    self.trace = []
    out: list[Triplet] = []
    for run_id in range(context.rounds):
      try:
        out.extend(self._run(context, run_id, [t.action for t in out]))
      except EndpointUnreachable:
        raise  # the round stops: no later context would reach it either
      except RoundStopped as e:
        log.info("exploration of %s stopped: %s", context.task_id, e)
        break
      except LLMError as e:
        log.warning("exploration run %d of %s ended: %s", run_id, context.task_id, e)
        self.trace.append(
          {"run": run_id, "step": -1, "action": "", "observation": str(e), "ok": False}
        )
    return out


def attempt_and_judge(llm: TextLLM, task: Task, max_steps: int = 12) -> tuple[bool, dict[str, Any]]:
  """Validation (docs/design.md §1.3): an LLM agent attempts `task` with its calls as hints, then
  is judged.

  The agent acts turn by turn in a fresh backend (one JSON call per step, {"stop": true} ends the
  turn). Accepted when the official BFCL checker scores the attempt 1.0, else when the LLM judge
  says success after comparing APIs, parameters, order and final result with the ground truth
  (paper Fig. 13: the judge sees the task, its description and completion criterion, the
  attempt's calls and the attempt's final observation).

  Returns:
    (accepted, info with "checker_reward", "judge" ({success, reason} or None), "attempt").

  Raises:
    RoundStopped: the round's token budget is spent or its endpoint unreachable.
  """
  attempt: list[list[list[str]]] = []
  final_observation = ""  # the environment's last output in the attempt (what the judge sees)
  with Sandbox(task.initial_config, task.involved_classes, task.task_id) as sandbox:
    tools = tools_text(sandbox.schemas)
    for query, hints in zip(task.turns, task.ground_truth, strict=True):
      steps: list[list[str]] = []
      history: list[str] = []
      for _ in range(max_steps):
        prompt = (
          f"Tools:\n{tools}\n\nUser request: {query}\nHints (a known solution): "
          f"{json.dumps(hints)}\nYour calls so far: {json.dumps(history)}\n"
          'Reply with the next call, or {"stop": true} when the request is done.'
        )
        try:
          call = parse_call_reply(llm.complete(EXPLORER_SYSTEM, prompt))
        except RoundStopped:
          raise
        except LLMError as e:
          history.append(f"<unusable reply: {e}>")
          continue
        if call is None:
          break
        text, result = sandbox.run(call)
        history.append(f"{text or call.name} -> {(result or 'invalid call')[:_OBS_CHARS]}")
        final_observation = (result or "invalid call")[:_OBS_CHARS]
        if text:
          steps.append([text])
      attempt.append(steps)
  reward, check = score_calls(task, attempt)
  info: dict[str, Any] = {"checker_reward": reward, "judge": None, "attempt": attempt}
  if reward >= 1.0:
    return True, info
  success, info["judge"] = llm_jobs.judge(
    llm,
    {
      "query": task.turns,
      "description": task.provenance.get("description", ""),
      "completion": task.provenance.get("completion", ""),
      "reference_calls": task.ground_truth,
      "attempt_calls": attempt,
      "final_observation": final_observation,
      "checker": check.get("checker"),
    },
  )
  return success, info


if TYPE_CHECKING:  # mypy checks LLMExplorer against the Explorer protocol
  from coevolve_jax.feedback.exploration import Explorer

  def _conforms(explorer: LLMExplorer) -> Explorer:
    return explorer
