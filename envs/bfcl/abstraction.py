"""Stage 3a (docs/design.md §1.3): abstract exploration triplets into an executable Task, by
template (no LLM).

Picks the longest successful run, reduces it to a minimal call sequence (drops calls that change no
state and whose output no later call uses; verified by replay, else the contiguous run is kept),
writes the user query from per-function phrase templates, and splits the calls into up to
`max_turns` user turns. The ground truth is the call strings per turn; the initial state comes from
the context.
"""

from __future__ import annotations

import ast
from typing import Any

from coevolve_jax.feedback.exploration import ExplorationContext, Triplet
from envs.bfcl.sandbox import Sandbox
from coevolve_jax.types import Task
from envs.bfcl.calls import ToolCallError, parse_call_string
from envs.bfcl.data import compact_description, schemas_by_name, tool_schemas

# Phrase templates for common tools; {arg} placeholders are filled with repr-quoted values.
PHRASES = {
  "cd": "go to the {folder} folder",
  "mkdir": "create a directory named {dir_name}",
  "touch": "create a file named {file_name}",
  "mv": "move {source} to {destination}",
  "cp": "copy {source} to {destination}",
  "cat": "show the contents of {file_name}",
  "rm": "remove {file_name}",
  "rmdir": "remove the directory {dir_name}",
  "echo": "write {content} into {file_name}",
  "sort": "sort the lines of {file_name}",
  "grep": "search {file_name} for {pattern}",
  "wc": "count the {mode} of {file_name}",
  "tail": "show the last lines of {file_name}",
  "diff": "compare {file_name1} with {file_name2}",
  "ls": "list the files in the current folder",
  "pwd": "tell me the current directory",
  "post_tweet": "post a tweet saying {content}",
  "comment": "comment {comment_content} on tweet {tweet_id}",
  "retweet": "retweet tweet {tweet_id}",
  "follow_user": "follow {username_to_follow}",
  "send_message": "send {message} to {receiver_id}",
}


def _fmt(value: Any) -> str:
  return repr(value) if isinstance(value, str) else str(value)


def describe_call(
  call_text: str, involved_classes: list[str], schemas: dict[str, dict[str, Any]]
) -> str:
  """A user-facing phrase for one call string (template, else "use <name> with k=v, ...")."""
  call = parse_call_string(call_text, involved_classes)
  args = {k: _fmt(v) for k, v in call.arguments.items()}
  template = PHRASES.get(call.name)
  if template:
    try:
      return template.format(**args)
    except (KeyError, IndexError):
      pass
  desc = compact_description(schemas.get(call.name, {}).get("description", "")).rstrip(".")
  arg_text = ", ".join(f"{k}={v}" for k, v in args.items())
  head = f"use {call.name}" + (f" ({desc[0].lower() + desc[1:]})" if desc else "")
  return head + (f" with {arg_text}" if arg_text else "")


def _used_later(observation: str, later_calls: list[str]) -> bool:
  """True when a later call passes a string argument (>= 3 chars) that appears in `observation`."""
  for text in later_calls:
    for node in ast.walk(ast.parse(text, mode="eval")):
      if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) >= 3:
        if node.value in observation:
          return True
  return False


def _replay(calls: list[str], context: ExplorationContext) -> tuple[bool, Any]:
  """Replays calls in a fresh sandbox: (all succeeded, final public state)."""
  with Sandbox(context.initial_config, context.involved_classes, context.task_id) as sandbox:
    ok = all(sandbox.run_ok(c)[1] is not None for c in calls)
    return ok, sandbox.public_state()


def minimal_sequence(run: list[Triplet], context: ExplorationContext) -> list[str]:
  """Drops calls that change no (full) state and whose output is unused later; verified by
  replay."""
  keep = []
  with Sandbox(context.initial_config, context.involved_classes, context.task_id) as sandbox:
    before = sandbox.full_state()
    for i, t in enumerate(run):
      _, result = sandbox.run_ok(t.action)
      after = sandbox.full_state()
      later = [u.action for u in run[i + 1 :]]
      if result is None or after != before or _used_later(result, later):
        keep.append(t.action)
      before = after
  full = [t.action for t in run]
  ok_min, state_min = _replay(keep, context)
  ok_full, state_full = _replay(full, context)
  return keep if ok_min and ok_full and state_min == state_full else full


def _split_turns(calls: list[str], max_turns: int) -> list[list[str]]:
  n = max(1, min(max_turns, len(calls)))
  size, extra = divmod(len(calls), n)
  out, start = [], 0
  for i in range(n):
    end = start + size + (1 if i < extra else 0)
    out.append(calls[start:end])
    start = end
  return out


def _query(
  calls: list[str], context: ExplorationContext, schemas: dict[str, dict[str, Any]]
) -> str:
  phrases = [describe_call(c, context.involved_classes, schemas) for c in calls]
  text = phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + ", then " + phrases[-1]
  return text[0].upper() + text[1:] + "."


def abstract_task(
  triplets: list[Triplet],
  context: ExplorationContext,
  task_id: str,
  *,
  min_calls: int = 3,
  max_calls: int = 8,
  max_turns: int = 1,
  source: str = "explore",
  explorer_name: str = "programmatic",
  round_idx: int | None = None,
) -> Task | None:
  """Builds a Task from one successful exploration run, or None when no run has >= min_calls calls.

  Args:
    triplets: successful (action, observation, run_id) steps of one context.
    context: supplies the initial state, signal and parent id.
    task_id: the new task's id.
    min_calls / max_calls: bounds on the ground-truth length (the minimal sequence is cut to
      max_calls; when it is shorter than min_calls the contiguous run's first max_calls calls are
      used).
    max_turns: split the calls into up to this many user turns.
    source: "explore" (D0) or "synth" (feedback round).
  """
  runs: dict[int, list[Triplet]] = {}
  for t in triplets:
    runs.setdefault(t.run_id, []).append(t)
  candidates = sorted(runs.items(), key=lambda kv: (-len(kv[1]), kv[0]))
  for run_id, run in candidates:
    if len(run) < min_calls:
      break
    try:
      calls = minimal_sequence(run, context)[
        :max_calls
      ]  # A prefix of a valid sequence stays valid.
    except (ToolCallError, SyntaxError):
      continue
    if len(calls) < min_calls:
      calls = [t.action for t in run[:max_calls]]
    schemas = schemas_by_name(tool_schemas(list(context.involved_classes)))
    turns = _split_turns(calls, max_turns)
    return Task(
      task_id=task_id,
      env="bfcl",
      turns=[_query(t, context, schemas) for t in turns],
      ground_truth=turns,
      initial_config=context.initial_config,
      involved_classes=list(context.involved_classes),
      source=source,
      provenance={
        "signal": context.signal,
        "round": round_idx,
        "explorer": explorer_name,
        "parent_task_id": context.task_id,
        "run_id": run_id,
        "exploration_calls": len(run),
      },
    )
  return None
