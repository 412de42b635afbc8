"""Types shared by every layer: tasks, tool calls, actions, environment steps and trajectories.

Environments (`envs/`), the agent loop, the task pool, the feedback rounds and the trainer all
speak these types; this module imports nothing from the project, so any layer may import it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import numpy as np


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


@dataclasses.dataclass
class Reply:
  """One model reply of a trajectory.

  Attributes:
    start / end: the reply's sampled token ids are `token_ids[start:end]` (loss mask 1; the
      id that ended the reply included).
    observation: the text the environment answered the reply with (its messages' contents,
      joined by blank lines); "" when the episode ended on this reply or no step followed.
    calls: the reply's parsed tool calls as `name(JSON arguments)` strings, in order (what it
      asked the environment to execute; empty for a call-free or unparsable reply).
    prediction: the next observation the reply predicted (Role-Agent's World-In-Agent,
      `wia.split_prediction`), or None where it made none (or WIA is off).
    parse_error: the reply's tool calls failed to parse (`Trajectory.parse_errors` counts
      these replies).
  """

  start: int
  end: int
  observation: str = ""
  calls: list[str] = dataclasses.field(default_factory=list)
  prediction: str | None = None
  parse_error: bool = False

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


# How an episode ends (`Trajectory.finish`, set by `agent.AgentRunner`): "done" (the environment
# ended it and scored it), "context" (its KV cache ran out), "max_model_steps" (the limit on model
# replies), "error" (the environment failed to start or to step). Only "done" carries the
# environment's reward; the others end with reward 0.
FINISHES = ("done", "context", "max_model_steps", "error")


@dataclasses.dataclass
class Trajectory:
  """One agent episode, token-in / token-out.

  `token_ids` are exactly the ids the model consumed and sampled, in order. `loss_mask[i]` is 1
  where token i was sampled by the policy (assistant text, tool calls and each reply's end-of-turn
  token) and 0 on system / user / tool-observation / template-header tokens. `logprobs[i]` is the
  sampler's log-prob of token i where loss_mask is 1 (0 elsewhere).

  `reward` is the outcome reward in [0, 1]; `step_rewards` (per model step) is reserved for process
  rewards and empty unless an environment or critic provides them. `replies` holds every model
  reply's token span and the observation that answered it, in order (`Reply`), so that a
  per-reply quantity (a process reward, a step advantage) can be spread over its tokens.

  `routing` (MoE policies; None otherwise) is [len(token_ids), L_moe, k] integer expert indices
  (int16): row i holds the top-k experts token i was routed to in each MoE layer when the rollout
  engine consumed it, -1 for tokens it never consumed (the last sampled token, ids appended
  after the episode's last forward). The trainer replays it so it scores every token under the
  experts it was sampled with (routing replay). 2 * L_moe * k bytes per token: 768 for
  Qwen3-30B-A3B (48 MoE layers, 8 experts per token), 25 MB for a 32k-token episode.
  """

  task_id: str
  group_id: int
  token_ids: list[int] = dataclasses.field(default_factory=list)
  loss_mask: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  prompt_len: int = 0
  reward: float = 0.0
  step_rewards: list[float] = dataclasses.field(default_factory=list)
  tool_names: list[str] = dataclasses.field(default_factory=list)
  calls: list[list[str]] = dataclasses.field(default_factory=list)
  # Per user turn, the output of each call in `calls` as the model saw it (environments that
  # record them; empty otherwise): the context summary's evidence (docs/design.md §1.2).
  observations: list[list[str]] = dataclasses.field(default_factory=list)
  finish: str = ""  # one of FINISHES: "done", "context", "max_model_steps", "error"
  model_steps: int = 0
  parse_errors: int = 0
  # Replies with at least one well-formed `<tool_call>` block (what a model that has learnt the
  # tool format writes; AppWorld's code replies count 0 here).
  tool_call_replies: int = 0
  info: dict[str, Any] = dataclasses.field(default_factory=dict)
  routing: np.ndarray | None = None
  replies: list[Reply] = dataclasses.field(default_factory=list)

  def digest(self) -> bytes:
    """8 bytes (BLAKE2b) of what the episode computed: its tokens and masks, the sampled
    log-probs, reward, step rewards, calls, observations and finish. Processes that ran the
    same episode agree on it (`distributed.check_agreement`)."""
    fields = (
      self.task_id,
      self.group_id,
      self.token_ids,
      self.loss_mask,
      [float(x) for x in self.logprobs],
      float(self.reward),
      [float(x) for x in self.step_rewards],
      self.calls,
      self.observations,
      self.finish,
    )
    text = json.dumps(fields, default=str, separators=(",", ":"))
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()

  def to_dict(self) -> dict[str, Any]:
    """The trajectory as JSON-serialisable values (`from_dict` rebuilds it exactly): how one
    process's episodes reach the others (`distributed.on_primary`). The routing record goes as
    nested lists with its dtype and shape."""
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    d["replies"] = [dataclasses.asdict(r) for r in self.replies]
    if self.routing is not None:
      r = self.routing
      d["routing"] = {"dtype": r.dtype.name, "shape": list(r.shape), "rows": r.tolist()}
    return d

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "Trajectory":
    """The trajectory `to_dict` gave (after a JSON round trip)."""
    d = dict(d)
    d["replies"] = [Reply(**r) for r in d.get("replies", [])]
    routing = d.get("routing")
    if routing is not None:
      d["routing"] = np.asarray(routing["rows"], routing["dtype"]).reshape(routing["shape"])
    return cls(**d)

  def set_routing(self, consumed: np.ndarray | None) -> None:
    """Sets `routing` from the routing record of the first n tokens ([n, L_moe, k], the tokens a
    rollout engine consumed, in order); the remaining rows are -1. None leaves no record.

    Raises:
      ValueError: a record of more rows than token ids, or not 3-dimensional.
    """
    if consumed is None:
      self.routing = None
      return
    consumed = np.asarray(consumed)
    if consumed.ndim != 3 or len(consumed) > len(self.token_ids):
      raise ValueError(
        f"routing record of shape {consumed.shape} for {len(self.token_ids)} token ids "
        f"(want [n <= {len(self.token_ids)}, L_moe, k])"
      )
    self.routing = np.full((len(self.token_ids), *consumed.shape[1:]), -1, consumed.dtype)
    self.routing[: len(consumed)] = consumed

  def extend(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
    self.token_ids.extend(ids)
    self.loss_mask.extend([1 if sampled else 0] * len(ids))
    self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

  @property
  def num_generated(self) -> int:
    return sum(self.loss_mask)
