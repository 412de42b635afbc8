"""LLM-driven stages of the feedback loop (docs/design.md §1.2-1.3), for any `TextLLM` (Gemini
or local).

* `summarize_with_llm`: condenses a marked trajectory into the JSON context of docs/design.md §1.2.
* `LLMExplorer`: acts in fresh real backends, one call per step, under the signal's guidance text.
* `abstract_with_llm`: every task the exploration supports (paper Fig. 12): per task, call
  sequences from one exploration run, one user query per phase (turn), a description and a
  completion criterion (the calls stay the executed ones, so each task keeps an executable
  evaluator).
* `attempt_and_judge`: the validation of docs/design.md §1.3: an agent attempts the query with
  the ground-truth calls as hints; accepted when the official checker gives reward 1 or the LLM
  judge says success.

Model-written calls never reach `eval`: every reply is parsed as JSON into a `ToolCall`, checked
against the tool schema and rebuilt by `call_to_string` before BFCL executes it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from typing import Any

import numpy as np

from envs.bfcl.explorer import SUMMARY_KEYS, ExplorationContext, Triplet
from coevolve_jax.feedback.llm import (
  EndpointUnreachable,
  LLMError,
  RoundStopped,
  TextLLM,
  parse_json_reply,
)
from envs.bfcl.sandbox import Sandbox
from coevolve_jax.types import Task, ToolCall
from envs.bfcl.data import compact_description
from envs.bfcl.execution import score_calls

log = logging.getLogger(__name__)
_OBS_CHARS = 400  # observation characters shown to the LLM per step

EXPLORER_SYSTEM = (
  "You explore a software environment through its tools to discover realistic tasks an "
  "assistant could be asked to do. Reply with exactly one JSON object and nothing else: "
  '{"name": "<tool name>", "arguments": {...}} to make one call, or {"stop": true} when the '
  "objectives are covered."
)
SUMMARY_SYSTEM = (
  "You analyse an agent's trajectory in a tool environment. Reply with one JSON object with the "
  "keys: summary (string), failure_cause (string), instability_pattern (string), focus_pattern "
  "(list of tool names), exploration_objectives (list of strings), do_not_repeat (list of "
  "strings)."
)
ABSTRACT_SYSTEM = (
  "You turn an exploration log into training tasks: every distinct task the log supports, each "
  "from one run, with as many steps as the evidence allows. Reply with one JSON object: "
  '{"tasks": [{"run_id": <int>, "turns": [{"query": "<the user request of this phase, natural '
  'and self-contained>", "steps": [<step indices of that run that fulfil it, in order>]}, ...], '
  '"description": "<what the task exercises>", "completion": "<how to tell the task is '
  'done>"}, ...]}. A task has one turn per phase of the exploration (at most {max_turns}), '
  "{min_calls} to {max_calls} steps in all, in increasing order across its turns, and solves "
  "its queries from the initial state."
)
JUDGE_SYSTEM = (
  "You judge whether an agent's attempt fulfils a task. Compare the attempt with the reference "
  "solution: the same APIs, the parameters, the order, and the final result. Reply with one "
  'JSON object: {"success": true|false, "reason": "<one sentence>"}.'
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


def summarize_with_llm(
  llm: TextLLM,
  task: Task,
  signal: str,
  calls: list[list[str]],
  reward: float,
  fallback: dict[str, Any],
  observations: list[list[str]] = (),
) -> dict[str, Any]:
  """The docs/design.md §1.2 context for one marked trajectory, by `llm`; `fallback` if it fails.

  The prompt holds the task, the signal, the reward, the reference calls and the agent's steps:
  per user turn each call with the environment's output (paper Fig. 11's trajectory evidence;
  `observations`, cut to _OBS_CHARS each; a call without a recorded output shows none).

  Returns:
    dict with SUMMARY_KEYS plus "by": "llm" or "template".

  Raises:
    RoundStopped: the round's token budget is spent or its endpoint unreachable (the caller stops
      the round).
  """
  prompt = json.dumps(
    {
      "signal": signal,
      "task": task.turns,
      "reward": reward,
      "agent_steps": [
        [
          {"call": c, "observation": o[:_OBS_CHARS]} if o is not None else {"call": c}
          for c, o in itertools.zip_longest(turn, obs[: len(turn)])
        ]
        for turn, obs in itertools.zip_longest(
          calls, list(observations)[: len(calls)], fillvalue=[]
        )
      ],
      "reference_calls": task.ground_truth,
    },
    ensure_ascii=False,
  )
  try:
    data = parse_json_reply(llm.complete(SUMMARY_SYSTEM, prompt, json_output=True))
  except RoundStopped:
    raise
  except LLMError as e:
    log.warning("context summary by LLM failed (%s); using the template summary", e)
    return {**fallback, "by": "template"}
  if not isinstance(data, dict):
    return {**fallback, "by": "template"}
  out = {k: data.get(k, fallback.get(k)) for k in SUMMARY_KEYS}
  return {**out, "by": "llm"}


def parse_call_reply(text: str) -> ToolCall | None:
  """A ToolCall from an explorer reply, or None for {"stop": true}.

  Raises:
    LLMError: the reply is not a JSON object with a string "name" and an object "arguments", or
      one of its objects repeats a key.
  """
  data = parse_json_reply(text, unique_keys=True)
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
          EXPLORER_SYSTEM, self._prompt(context, tools, history, earlier, step), json_output=True
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
        observation = result if ok else "Error: invalid call or the tool returned an error"
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
        if ok:
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


@dataclasses.dataclass
class AbstractionChoice:
  """One abstracted task: its run, per user turn the query and the executed calls (or code
  steps), what it exercises and how to tell it is done; `steps` are the chosen step indices of
  the run (all turns, in order) and `raw` the task object as the LLM wrote it (AppWorld reads
  its "answer_step")."""

  run_id: int
  turns: list[str]
  calls: list[list[str]]
  description: str
  completion: str
  steps: list[int] = dataclasses.field(default_factory=list)
  raw: dict[str, Any] = dataclasses.field(default_factory=dict)


def _choice(
  item: Any, runs: dict[int, list[Triplet]], *, min_calls: int, max_calls: int, max_turns: int
) -> AbstractionChoice:
  """One task of an abstraction reply, checked against the log.

  Accepts {"run_id", "turns": [{"query", "steps"}], "description", "completion"} and the
  one-turn form {"run_id", "steps", "query", ...}.

  Raises:
    KeyError, TypeError, ValueError: a malformed task, a step outside its run, steps not
      increasing, an empty query or turn, too few or too many calls or turns.
  """
  run = runs[int(item["run_id"])]
  turns = item.get("turns")
  if turns is None:
    turns = [{"query": item["query"], "steps": item["steps"]}]
  if not isinstance(turns, list) or not 1 <= len(turns) <= max_turns:
    raise ValueError(f"{len(turns) if isinstance(turns, list) else turns!r} turns")
  queries = [str(t["query"]).strip() for t in turns]
  steps = [[int(i) for i in t["steps"]] for t in turns]
  flat = [i for turn in steps for i in turn]
  if not all(queries) or not all(steps):
    raise ValueError("a turn without a query or without steps")
  if not min_calls <= len(flat) <= max_calls:
    raise ValueError(f"{len(flat)} steps, want {min_calls}..{max_calls}")
  if flat != sorted(set(flat)) or any(not 0 <= i < len(run) for i in flat):
    raise ValueError(f"steps {flat} of a run of {len(run)}")
  return AbstractionChoice(
    int(item["run_id"]),
    queries,
    [[run[i].action for i in turn] for turn in steps],
    str(item.get("description", "")),
    str(item.get("completion", "")),
    flat,
    dict(item),
  )


def abstract_with_llm(
  llm: TextLLM,
  triplets: list[Triplet],
  context: ExplorationContext,
  *,
  min_calls: int,
  max_calls: int,
  max_turns: int = 8,
  max_tasks: int = 8,
  system: str = ABSTRACT_SYSTEM,
  obs_chars: int = _OBS_CHARS,
) -> list[AbstractionChoice]:
  """Asks the LLM for every task the exploration supports (paper Sec. 3.3, Fig. 12).

  The chosen calls are the executed ones (by index), never text the LLM wrote, so each task's
  ground truth stays executable. Unusable tasks of a reply (out-of-range or unordered steps,
  empty queries, too few or many calls or turns) are dropped, as are repeats of an earlier
  task's calls; at most `max_tasks` are kept. Returns [] when nothing is usable, the reply is
  not JSON, or on an LLM error other than a spent budget. `system` is the instruction (with
  {min_calls}, {max_calls}, {max_turns} filled in; AppWorld passes its own); the log shows
  `obs_chars` characters of each observation.

  Raises:
    RoundStopped: the round's token budget is spent or its endpoint unreachable.
  """
  runs: dict[int, list[Triplet]] = {}
  for t in triplets:
    runs.setdefault(t.run_id, []).append(t)
  log_text = "\n".join(
    f"run {r} step {i}: {t.action} -> {t.observation[:obs_chars]}"
    for r, ts in sorted(runs.items())
    for i, t in enumerate(ts)
  )
  prompt = (
    f"Signal: {context.signal}\nContext: {json.dumps(context.summary, ensure_ascii=False)}"
    f"\nAt most {max_calls} steps.\nExploration log:\n{log_text}"
  )
  system = (
    system.replace("{min_calls}", str(min_calls))
    .replace("{max_calls}", str(max_calls))
    .replace("{max_turns}", str(max_turns))
  )
  try:
    data = parse_json_reply(llm.complete(system, prompt, json_output=True))
  except RoundStopped:
    raise
  except LLMError as e:
    log.info("LLM abstraction unusable (%s)", e)
    return []
  items = data.get("tasks", [data]) if isinstance(data, dict) else data
  if not isinstance(items, list):
    items = []
  out: list[AbstractionChoice] = []
  for item in items:
    try:
      choice = _choice(item, runs, min_calls=min_calls, max_calls=max_calls, max_turns=max_turns)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
      log.info("LLM abstraction: task rejected (%s): %r", e, item)
      continue
    if all(choice.calls != c.calls for c in out) and len(out) < max_tasks:
      out.append(choice)
  return out


def attempt_and_judge(llm: TextLLM, task: Task, max_steps: int = 12) -> tuple[bool, dict[str, Any]]:
  """Validation (docs/design.md §1.3): an LLM agent attempts `task` with its calls as hints, then
  is judged.

  The agent acts turn by turn in a fresh backend (one JSON call per step, {"stop": true} ends the
  turn). Accepted when the official BFCL checker scores the attempt 1.0, else when the LLM judge
  says success after comparing APIs, parameters, order and final result with the ground truth
  (paper Fig. 13: the judge sees the task with its completion criterion, the attempt's calls and
  the attempt's final observation).

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
          call = parse_call_reply(llm.complete(EXPLORER_SYSTEM, prompt, json_output=True))
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
  prompt = json.dumps(
    {
      "query": task.turns,
      "completion": task.provenance.get("completion", ""),
      "reference_calls": task.ground_truth,
      "attempt_calls": attempt,
      "final_observation": final_observation,
      "checker": check.get("checker"),
    },
    ensure_ascii=False,
    default=str,
  )
  try:
    verdict = parse_json_reply(llm.complete(JUDGE_SYSTEM, prompt, json_output=True))
  except RoundStopped:
    raise
  except LLMError as e:
    info["judge"] = {"success": False, "reason": f"judge failed: {e}"}
    return False, info
  success = isinstance(verdict, dict) and verdict.get("success") is True
  info["judge"] = {
    "success": success,
    "reason": str(verdict.get("reason", "")) if isinstance(verdict, dict) else "",
  }
  return success, info
