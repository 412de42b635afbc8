"""The test kit: the one tiny Qwen of the tests, and the scripted fakes several tests share.

A plain module (no pytest in it): test files import it as `kit` (tests/ is on sys.path under
pytest, and is the script's folder for a child run as `python tests/<file>.py`); conftest.py
exposes the parts that read best as fixtures.

  tiny_config(**overrides)  the tiny Qwen3 config; every test's shape is this plus its overrides
  tiny_model(seed, ...)     Qwen(tiny_config(...), rngs=nnx.Rngs(seed))
  ScriptedEngine            slots that replay scripted replies, keyed by an episode's first prompt
  RunOnEngine               one slot: scripted replies, each run on with filler until stopped
  FakeChat                  character-code chat: ids are the text's characters' codes
  IdChat                    id-level chat for tiny models: a prompt is its user turn's id list
  StepEnv                   an environment that answers every reply with a tool observation

The models are imported when a function is called, so importing the kit does not load them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from coevolve_jax.rollout.slots import StepsByGenerate
from coevolve_jax.types import Action, StepResult

if TYPE_CHECKING:
  from coevolve_jax.models import Qwen, QwenConfig

# The default tiny Qwen3: 2 layers of width 64, GQA 4:2 (head_dim 16), MLP 128, 512 tokens.
TINY_SHAPE = dict(
  vocab_size=512,
  hidden_size=64,
  intermediate_size=128,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
)


def tiny_config(**overrides) -> QwenConfig:
  """The tests' tiny Qwen config: `TINY_SHAPE` with `overrides` (any QwenConfig field)."""
  from coevolve_jax.models import QwenConfig  # noqa: PLC0415

  return QwenConfig(**{**TINY_SHAPE, **overrides})


def tiny_model(seed: int = 0, **overrides) -> Qwen:
  """`Qwen(tiny_config(**overrides), rngs=nnx.Rngs(seed))`."""
  from flax import nnx  # noqa: PLC0415

  from coevolve_jax.models import Qwen  # noqa: PLC0415

  return Qwen(tiny_config(**overrides), rngs=nnx.Rngs(seed))


# ---------------------------------------------------------------------------------------------
# Scripted engines (the `SlotEngine` interface, decode steps by `StepsByGenerate`).
# ---------------------------------------------------------------------------------------------


class ScriptedEngine(StepsByGenerate):
  """Decode slots that replay a fixed list of replies (token ids) per episode, in order."""

  def __init__(self, scripts_by_prompt_prefix, num_slots=3, cache_len=100_000):
    self.scripts = scripts_by_prompt_prefix  # first prompt token ids (tuple) -> list of replies
    self.num_slots, self.cache_len = num_slots, cache_len
    self.pos = [0] * num_slots
    self.queue: list[list[int]] = [[] for _ in range(num_slots)]
    self.replies: list[list[list[int]]] = [[] for _ in range(num_slots)]
    self.fed: list[list[int]] = [[] for _ in range(num_slots)]

  def reset_slot(self, slot):
    self.pos[slot], self.fed[slot], self.queue[slot] = 0, [], []

  def room(self, slot):
    return self.cache_len - self.pos[slot]

  def prefill_many(self, requests, sampling):
    return [self._prefill(slot, ids) for slot, ids, _ in requests]

  def _prefill(self, slot, ids):
    if not self.fed[slot]:
      self.replies[slot] = [list(r) for r in self.scripts[tuple(ids)]]
    self.fed[slot] += ids
    self.pos[slot] += len(ids)
    self.queue[slot] = self.replies[slot].pop(0)
    return self.queue[slot].pop(0), -0.5

  def generate(self, active, rng, sampling):
    toks = np.zeros(self.num_slots, np.int32)
    for s in np.flatnonzero(active):
      toks[s] = self.queue[s].pop(0)
      self.pos[s] += 1
    return toks, np.full(self.num_slots, -0.5, np.float32)

  def routing(self, slot):
    return None  # no model, no experts


class RunOnEngine(StepsByGenerate):
  """One slot; per reply, the scripted ids, then filler ("x") for as long as it is asked: a reply
  the loop does not stop runs on to the token limit."""

  num_slots = 1

  def __init__(self, replies, filler):
    self.replies, self.filler, self.queue, self.fed = [list(r) for r in replies], filler, [], []

  def reset_slot(self, slot):
    pass

  def room(self, slot):
    return 100_000

  def prefill_many(self, requests, sampling):
    ((_, ids, _),) = requests
    self.fed.append(list(ids))
    self.queue = self.replies.pop(0)
    return [(self.queue.pop(0), -0.25)]

  def generate(self, active, rng, sampling):
    tok = self.queue.pop(0) if self.queue else self.filler
    return np.array([tok], np.int32), np.array([-0.25], np.float32)

  def routing(self, slot):
    return None  # no model, no experts


# ---------------------------------------------------------------------------------------------
# Chats (the `ChatFormat` interface) and environments.
# ---------------------------------------------------------------------------------------------


class FakeChat:
  """Token ids are the text's characters' codes; every reply is one token plus the stop id."""

  im_end_id = 0

  def prompt_ids(self, messages, tools):
    return [ord(c) for c in messages[-1]["content"]]

  def continuation_ids(self, messages):
    return [1, 2]

  def assistant_text(self, content, tool_calls=()):
    return content

  def assistant_ids(self, content, tool_calls=()):
    return self.encode(content)

  def parse_tool_calls(self, text, truncated=False):
    return Action(text=text)

  def encode(self, text):
    return [ord(c) for c in text]

  def decode(self, ids):
    return "".join(chr(i) for i in ids)


class IdChat:
  """Token ids are the tiny model's vocabulary itself: a prompt is its user turn's id list, a
  continuation after an environment step is fixed ids, a reply stops at 0 or the token limit."""

  im_end_id = 0

  def prompt_ids(self, messages, tools):
    return list(messages[-1]["content"])

  def continuation_ids(self, messages):
    return [1, 2, 3, 4, 5, 6]

  def assistant_text(self, content, tool_calls=()):
    return content

  def assistant_ids(self, content, tool_calls=()):
    return self.encode(content)

  def parse_tool_calls(self, text, truncated=False):
    return Action(text=text)

  def encode(self, text):
    return [ord(c) % 64 for c in text]

  def decode(self, ids):
    return " ".join(map(str, ids))


class StepEnv:
  """Every reply gets a tool observation; the episode ends after `steps` replies."""

  system_prompt, tools = None, []
  observations: list[list[str]] = []  # no outputs kept (`Env.observations`)

  def __init__(self, task, steps=2):
    self.task, self.steps, self.calls = task, steps, [[]]

  def reset(self):
    return StepResult(messages=[{"role": "user", "content": self.task.turns[0]}])

  def step(self, action):
    self.steps -= 1
    return StepResult(messages=[{"role": "tool", "content": "ok"}], done=self.steps == 0)

  def close(self):
    pass
