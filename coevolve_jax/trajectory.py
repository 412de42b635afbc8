"""The trajectory: one episode's token ids, loss mask, sampler log-probs and outcome."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Trajectory:
  """One agent episode, token-in / token-out.

  `token_ids` are exactly the ids the model consumed and sampled, in order. `loss_mask[i]` is 1
  where token i was sampled by the policy (assistant text, tool calls and each reply's end-of-turn
  token) and 0 on system / user / tool-observation / template-header tokens. `logprobs[i]` is the
  sampler's log-prob of token i where loss_mask is 1 (0 elsewhere).

  `reward` is the outcome reward in [0, 1]; `step_rewards` (per model step) is reserved for process
  rewards and empty unless an environment or critic provides them.
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
  finish: str = ""  # "done", "context" (ran out of cache), "max_model_steps", "error"
  model_steps: int = 0
  parse_errors: int = 0
  info: dict[str, Any] = dataclasses.field(default_factory=dict)

  def extend(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
    self.token_ids.extend(ids)
    self.loss_mask.extend([1 if sampled else 0] * len(ids))
    self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

  @property
  def num_generated(self) -> int:
    return sum(self.loss_mask)
