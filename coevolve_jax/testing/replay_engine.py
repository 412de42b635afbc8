"""A policy in the engine's slot interface (`rollout.slots.SlotEngine`) that replays each task's
ground-truth calls.

Used by `python -m envs.bfcl.evaluate --policy=ground_truth` (a check of the evaluation
harness itself: template, parsing, execution, checker) and by the tests. No model runs: the
agent loop is driven unchanged with scripted token ids.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from coevolve_jax.rollout.slots import StepsByGenerate
from coevolve_jax.types import Task, ToolCall

if TYPE_CHECKING:  # annotations only: the evaluation CLI imports this before JAX
  import jax

  from coevolve_jax.chat import ChatFormat
  from coevolve_jax.rollout.sampling import SamplingParams


class ReplayEngine(StepsByGenerate):
  """A `SlotEngine` whose policy replies with each task's ground-truth calls.

  Per user turn it emits one reply per ground-truth call (`<tool_call>` JSON via the chat
  template's own formatting; several calls per reply only where a turn has more than
  `max_steps_per_turn`), then a closing reply without calls, which ends the turn. The episode
  is identified by its first prompt (token ids), so the agent loop is used unchanged.

  Args:
    tasks: the tasks that will be run.
    chat: the chat format (`ChatFormat`; `prompt_ids`, `assistant_text`, `encode`, `im_end_id`
      are used).
    make_env: `(task, episode_id) -> Env`, to render each task's first prompt.
    num_slots: decode slots offered to the agent loop.
    cache_len: tokens per slot.
    parse_call: `(call string, involved classes) -> ToolCall`, the benchmark's parser of its
      ground-truth call strings (BFCL: `envs.bfcl.parse_call_string`).
    max_steps_per_turn: executed steps the environment allows per user turn (BFCL: 20,
      `envs.bfcl.MAX_STEPS_PER_TURN`); a turn with more calls packs several into one reply.
  Raises:
    Whatever `parse_call` raises for a ground-truth call string it refuses (BFCL: ToolCallError
    for a call that is not a plain literal call).
  """

  CLOSING_REPLY = "Done."

  def __init__(
    self,
    tasks: Sequence[Task],
    chat: ChatFormat,
    make_env,
    num_slots: int = 8,
    cache_len: int = 1 << 20,
    *,
    parse_call: Callable[[str, list[str]], ToolCall],
    max_steps_per_turn: int,
  ):
    self.num_slots, self.cache_len = num_slots, cache_len
    self._parse_call, self._max_steps_per_turn = parse_call, max_steps_per_turn
    self._scripts: dict[tuple[int, ...], list[list[list[int]]]] = collections.defaultdict(list)
    for task in tasks:
      env = make_env(task, "replay_probe")
      try:
        first = env.reset()
        system = [{"role": "system", "content": env.system_prompt}] if env.system_prompt else []
        prompt = chat.prompt_ids(system + first.messages, env.tools)
      finally:
        env.close()
      self._scripts[tuple(prompt)].append(self._replies(task, chat))
    self._closing = chat.encode(self.CLOSING_REPLY) + [chat.im_end_id]
    self._pos = [0] * num_slots
    self._queue: list[list[int]] = [[] for _ in range(num_slots)]
    self._replies_left: list[list[list[int]]] = [[] for _ in range(num_slots)]

  def _replies(self, task: Task, chat: ChatFormat) -> list[list[int]]:
    replies = []
    for turn in task.ground_truth:
      calls = [self._parse_call(c, task.involved_classes) for c in turn]
      # One call per reply, unless the turn has more calls than the loop allows steps: then
      # consecutive calls share a reply (a few BFCL long_context turns have 34 calls).
      per_reply = -(-len(calls) // self._max_steps_per_turn) if calls else 1
      for i in range(0, len(calls), per_reply):
        text = chat.assistant_text(
          "", [{"name": c.name, "arguments": c.arguments} for c in calls[i : i + per_reply]]
        )
        replies.append(chat.encode(text) + [chat.im_end_id])
      replies.append(chat.encode(self.CLOSING_REPLY) + [chat.im_end_id])
    return replies

  def reset_slot(self, slot: int) -> None:
    """Frees `slot`; its next prefill must be a task's first prompt."""
    self._pos[slot], self._queue[slot], self._replies_left[slot] = 0, [], []

  def room(self, slot: int) -> int:
    """Tokens still free in `slot` (of `cache_len`)."""
    return self.cache_len - self._pos[slot]

  def prefill_many(
    self, requests: Sequence[tuple[int, Sequence[int], jax.Array]], sampling: SamplingParams
  ) -> list[tuple[int, float]]:
    """`prefill` of each request in order; keys and sampling are not used.

    Returns:
      (first token of the slot's next scripted reply, log-prob 0.0) per request.
    Raises:
      IndexError: a first prompt (slot at position 0) that matches no task left to replay.
    """
    return [self.prefill(slot, ids, rng, sampling) for slot, ids, rng in requests]

  def prefill(self, slot: int, ids: Sequence[int], rng, sampling) -> tuple[int, float]:
    """Consumes `ids` into `slot` and starts its next reply (the closing reply once the script
    is used up); a slot at position 0 takes the script of the task whose first prompt is `ids`.
    """
    del rng, sampling
    if self._pos[slot] == 0:
      self._replies_left[slot] = list(self._scripts[tuple(ids)].pop(0))
    self._pos[slot] += len(ids)
    # Past the end of the script (the loop wants more replies): reply without calls.
    left = self._replies_left[slot]
    self._queue[slot] = list(left.pop(0) if left else self._closing)
    return self._queue[slot].pop(0), 0.0

  def generate(
    self, active: np.ndarray, rng: jax.Array, sampling: SamplingParams
  ) -> tuple[np.ndarray, np.ndarray]:
    """The next scripted token of every active slot ([B] int32) and log-probs 0.0 ([B] float32)."""
    del rng, sampling
    toks = np.zeros(self.num_slots, np.int32)
    for s in np.flatnonzero(active):
      toks[s] = self._queue[s].pop(0)
      self._pos[s] += 1
    return toks, np.zeros(self.num_slots, np.float32)

  def routing(self, slot: int) -> None:
    """No model, so no routing record."""
    del slot

  def load_params(self, model) -> None:
    """No weights: replaying ignores the model (kept so it can stand in where weights reload)."""
    del model


if TYPE_CHECKING:  # mypy checks ReplayEngine against the SlotEngine protocol
  from coevolve_jax.rollout.slots import SlotEngine

  def _conforms(engine: ReplayEngine) -> SlotEngine:
    return engine
