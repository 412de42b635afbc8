"""Types shared by every environment, the agent loop and the task pool.

Environments are plain Python (no JAX). The agent loop drives them as:

    env = make_env(task, episode_id)          # a fresh, isolated instance per episode
    result = env.reset()                      # StepResult with the first user message
    while not result.done:
        result = env.step(Action(...))        # tool results, or the next user message
    result.reward                             # set on the final StepResult
    env.close()                               # frees per-episode state
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One parsed tool call: a tool name and JSON-literal keyword arguments."""

  name: str
  arguments: dict[str, Any]


@dataclasses.dataclass
class Action:
  """What the agent did in one model step.

  `tool_calls` empty and `error` None means the reply had no tool call: the user turn ends.
  `error` set means the reply could not be parsed (malformed JSON, unknown tool, reply cut at the
  token limit, ...): the environment answers with an error observation and the turn goes on.
  """

  tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)
  error: str | None = None
  text: str = ""


@dataclasses.dataclass
class StepResult:
  """Messages to append to the conversation (chat dicts with `role` and `content`), and the outcome.

  `reward` is the episode's outcome reward in [0, 1], meaningful when `done` is True.
  `step_rewards` leaves room for process (per-step) rewards; empty when the environment gives none.
  """

  messages: list[dict[str, str]]
  done: bool = False
  reward: float = 0.0
  info: dict[str, Any] = dataclasses.field(default_factory=dict)
  step_rewards: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Task:
  """A training or evaluation task with an executable evaluator.

  Attributes:
    task_id: unique id, e.g. "multi_turn_base_12" or "syn-r2-000017".
    env: environment name, e.g. "bfcl".
    turns: the user query of each user turn, in order.
    ground_truth: per user turn, the ground-truth call strings (e.g. "cd(folder='document')"); the
      environment's evaluator compares the final state and outputs against these.
    initial_config: the environment's initial state (BFCL: class name -> scenario dict).
    involved_classes: BFCL backend classes the task uses.
    source: "bfcl" (benchmark data), "explore" (D0, unguided exploration) or "synth" (feedback
      round).
    provenance: free-form: signal, round, explorer, parent task id, ...
  """

  task_id: str
  env: str
  turns: list[str]
  ground_truth: list[list[str]]
  initial_config: dict[str, Any] = dataclasses.field(default_factory=dict)
  involved_classes: list[str] = dataclasses.field(default_factory=list)
  source: str = "bfcl"
  provenance: dict[str, Any] = dataclasses.field(default_factory=dict)

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), sort_keys=True)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "Task":
    return cls(**d)

  @classmethod
  def from_json(cls, s: str) -> "Task":
    return cls.from_dict(json.loads(s))


class Env(Protocol):
  """An episode of one task. Implementations must not share state between instances."""

  # Tool schemas, Qwen/OpenAI style {"type": "function", "function": {...}}.
  tools: list[dict[str, Any]]
  system_prompt: str | None

  def reset(self) -> StepResult: ...

  def step(self, action: Action) -> StepResult: ...

  def close(self) -> None: ...
