"""The explorer LLM's three jobs in stages 2-3 (paper Sec. 3.2-3.3, Figs. 11-13), for any
benchmark and any `TextLLM` (Gemini, an OpenAI-compatible endpoint, a local model).

* `summarize_with_llm`: condenses a marked trajectory into the JSON context of paper Fig. 11
  (keys `exploration.SUMMARY_KEYS`).
* `abstract_with_llm`: every task an exploration log supports (paper Fig. 12): per task, steps
  chosen by index from one run (the executed actions, never text the LLM rewrites, so each task
  keeps an executable evaluator), one user query per phase (turn), a description and a
  completion criterion. `ABSTRACT_SYSTEM` is the multi-turn instruction; a benchmark may pass its
  own (AppWorld's code steps).
* `judge`: the verdict of validation (paper Fig. 13): does an attempt fulfil the task, compared
  with the reference solution (APIs, parameters, order, final result)?

A spent token budget or an unreachable endpoint raises `RoundStopped` from every job (the caller
ends D0 or the round); any other LLM failure falls back (template summary, no task, a rejection).
Every reply is read by `parse_json_reply`, under the rules of the policy's tool calls: a reply
that repeats a key, holds NaN or Infinity, or a number of too many digits is such a failure
(`LLMError`, counted in `llm.refused_count`), never a value chosen by a guess.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from collections.abc import Sequence
from typing import Any

from coevolve_jax.feedback.exploration import SUMMARY_KEYS, ExplorationContext, Triplet
from coevolve_jax.feedback.llm import LLMError, RoundStopped, TextLLM, parse_json_reply
from coevolve_jax.types import Task

log = logging.getLogger(__name__)
OBS_CHARS = 400  # observation characters shown to the LLM per step (summary, abstraction log)

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


def cut_middle(text: str, chars: int) -> str:
  """`text` if it has at most `chars` characters, else its first and last `chars` / 2 around a
  marker saying how many were cut: an error printed after a long output stays in view."""
  if len(text) <= chars:
    return text
  tail = chars // 2
  head = chars - tail
  return f"{text[:head]}\n... [{len(text) - chars} characters cut] ...\n{text[len(text) - tail :]}"


def summarize_with_llm(
  llm: TextLLM,
  task: Task,
  signal: str,
  calls: list[list[str]],
  reward: float,
  fallback: dict[str, Any],
  observations: Sequence[Sequence[str]] = (),
) -> dict[str, Any]:
  """The context summary of one marked trajectory (paper Sec. 3.2), by `llm`; `fallback` if it
  fails.

  The prompt holds the task, the signal, the reward, the reference calls and the agent's steps:
  per user turn each call with the environment's output (paper Fig. 11's trajectory evidence;
  `observations`, each cut to OBS_CHARS characters by `cut_middle`, its start and its end, so
  that a traceback after a long output is kept; a call without a recorded output shows none).

  Returns:
    dict with SUMMARY_KEYS plus "by": "llm" or "template".

  Raises:
    RoundStopped: the round's token budget is spent or its endpoint unreachable (the caller stops
      the round).
  """
  unrecorded: list[str] = []  # the observations of a turn past the recorded ones
  prompt = json.dumps(
    {
      "signal": signal,
      "task": task.turns,
      "reward": reward,
      "agent_steps": [
        [
          {"call": c, "observation": cut_middle(o, OBS_CHARS)} if o is not None else {"call": c}
          for c, o in itertools.zip_longest(turn, obs[: len(turn)])
        ]
        for turn, obs in itertools.zip_longest(
          calls, list(observations)[: len(calls)], fillvalue=unrecorded
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


@dataclasses.dataclass
class AbstractionChoice:
  """One abstracted task: its run, per user turn the query and the executed actions (calls or
  code steps), what it exercises and how to tell it is done; `steps` are the chosen step indices
  of the run (all turns, in order) and `raw` the task object as the LLM wrote it (AppWorld reads
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
  obs_chars: int = OBS_CHARS,
) -> list[AbstractionChoice]:
  """Asks the LLM for every task the exploration supports (paper Sec. 3.3, Fig. 12).

  The chosen actions are the executed ones (by index), never text the LLM wrote, so each task's
  ground truth stays executable. Unusable tasks of a reply (out-of-range or unordered steps,
  empty queries, too few or many calls or turns) are dropped, as are repeats of an earlier
  task's calls; at most `max_tasks` are kept. Returns [] when nothing is usable, the reply is
  not JSON, or on an LLM error other than a spent budget. `system` is the instruction (with
  {min_calls}, {max_calls}, {max_turns} filled in); the log shows `obs_chars` characters of each
  observation.

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


def judge(llm: TextLLM, evidence: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
  """The LLM judge of validation (paper Sec. 3.3, Fig. 13).

  Args:
    llm: the judge.
    evidence: what the judge compares, as the benchmark gathers it: the query, the completion
      criterion, the reference solution, the attempt and its final observation (JSON; values
      that are not JSON are shown as text).

  Returns:
    (success, {"success": bool, "reason": str}); a reply that is not a verdict, or an LLM error
    other than a spent budget, is a rejection with the reason.

  Raises:
    RoundStopped: the round's token budget is spent or its endpoint unreachable.
  """
  prompt = json.dumps(evidence, ensure_ascii=False, default=str)
  try:
    verdict = parse_json_reply(llm.complete(JUDGE_SYSTEM, prompt, json_output=True))
  except RoundStopped:
    raise
  except LLMError as e:
    return False, {"success": False, "reason": f"judge failed: {e}"}
  success = isinstance(verdict, dict) and verdict.get("success") is True
  reason = str(verdict.get("reason", "")) if isinstance(verdict, dict) else ""
  return success, {"success": success, "reason": reason}
