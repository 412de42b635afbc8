"""`generate`: completions for a list of prompts, with continuous batching over decode slots.

The entry point for code that wants samples rather than slots: it owns an `Engine`, inserts
prompts into free slots, advances all busy slots one token per step and frees a slot as soon as its
request ends (stop token, token limit or end of the cache), so short and long requests share the
batch without waiting for each other.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from coevolve_jax.models.qwen import Qwen
from coevolve_jax.rollout.engine import Engine, check_token_ids
from coevolve_jax.rollout.sampling import SamplingParams
from coevolve_jax.rollout.slots import SlotEngine, slot_order

FINISH_STOP = "stop"  # a stop token was sampled (it is the last token of the completion)
FINISH_LENGTH = "length"  # max_new_tokens reached, or the slot's KV cache is full


@dataclasses.dataclass
class Completion:
  """One request's output.

  Attributes:
    token_ids: sampled ids, in order, including the stop token when finish_reason is "stop".
    logprobs: float per sampled id, under the distribution it was drawn from (natural log).
    finish_reason: "stop" or "length".
    routing: the engine's routing record of the request (`Engine.routing`): [len(prompt) +
      len(token_ids) - 1, L_moe, k] expert indices of every token the engine consumed (the prompt,
      then each sampled id but the last), for routing replay when the completion is scored; None
      for a dense model or an engine that does not record routing.
  """

  token_ids: list[int]
  logprobs: list[float]
  finish_reason: str
  routing: np.ndarray | None = None


def generate(
  model: Qwen | Engine,
  prompts: Sequence[Sequence[int]],
  sampling: SamplingParams,
  *,
  max_new_tokens: int = 256,
  stop_ids: Iterable[int] = (),
  rng: jax.Array | None = None,
  num_slots: int = 8,
  cache_len: int | None = None,
  decode_steps: int = 1,
) -> list[Completion]:
  """Samples a completion for each prompt; returns them in prompt order.

  Args:
    model: a Qwen model (an engine with `num_slots` x `cache_len` is built for it) or an existing
      `Engine` (its slots are reset and reused; `num_slots` and `cache_len` are then ignored).
    prompts: token-id lists, each non-empty.
    sampling: temperature / top-k / top-p (temperature 0 = greedy).
    max_new_tokens: most tokens sampled per request (>= 1).
    stop_ids: ids that end a request (kept as its last token).
    rng: PRNG key for sampling (default key 0). Request i samples with fold_in(rng, i), token by
      token, so its completion does not depend on the slot count or on the other requests.
    num_slots: concurrent requests when an engine is built here.
    cache_len: KV cache length per slot when built here (default: longest prompt +
      max_new_tokens, rounded up to a multiple of 128).
    decode_steps: K, decode steps per device call (`Engine.generate_steps`: stop ids, token
      limits and cache room checked on the device, one copy to the host per call). The
      completions are the same for every K, bit for bit; K > 1 only removes K - 1 host round
      trips per K tokens. 1 = one device call per token (of the same compiled step).
  Returns:
    One `Completion` per prompt. A request whose cache fills up ends with "length"; nothing is
    written past the end of the cache.
  Raises:
    ValueError: an empty prompt, a token id that is not an integer in [0, vocab_size),
      max_new_tokens or decode_steps < 1, or a prompt that leaves no room in the cache for a
      single sampled token (checked for all prompts before any work is done).
  """
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if decode_steps < 1:
    raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
  vocab = model.config.vocab_size
  prompts = [check_token_ids(p, vocab, f"prompt {i}").tolist() for i, p in enumerate(prompts)]
  for i, p in enumerate(prompts):
    if not p:
      raise ValueError(f"prompt {i} is empty")
  if isinstance(model, Engine):
    engine = model
  else:
    longest = max((len(p) for p in prompts), default=1)
    if cache_len is None:
      cache_len = -(-(longest + max_new_tokens) // 128) * 128
    engine = Engine(model, min(num_slots, max(1, len(prompts))), cache_len)
  for i, p in enumerate(prompts):
    if len(p) >= engine.cache_len:
      raise ValueError(
        f"prompt {i} has {len(p)} tokens; the cache holds {engine.cache_len} and "
        f"needs room for at least one more"
      )
  return _Batcher(engine, sampling, max_new_tokens, frozenset(stop_ids), decode_steps).run(
    prompts, jax.random.key(0) if rng is None else rng
  )


def decode_tokens(
  engine: SlotEngine,
  active,
  keys,
  counts,
  limits,
  stop_ids,
  sampling: SamplingParams,
  max_steps: int,
) -> tuple[np.ndarray, np.ndarray]:
  """The next tokens of the active slots, as the batcher and the agent loop decode them: every
  call goes through `generate_steps`, K = 1 included, so one compiled step serves every K and the
  tokens and log-probs are the same bit for bit whatever K a run uses (the single-step
  `Engine.generate` is another XLA program, whose fusions can round the logits differently in the
  last bit, enough to flip a sampled token at a boundary of the inverse CDF).

  Returns:
    (tokens [n, B] int32, log-probs [n, B] float32), n >= 1 the steps taken.
  """
  return engine.generate_steps(active, keys, counts, limits, stop_ids, sampling, max_steps)


class _Batcher:
  """Continuous batching of independent requests over an engine's slots."""

  def __init__(
    self,
    engine: Engine,
    sampling: SamplingParams,
    max_new_tokens: int,
    stop_ids: frozenset[int],
    decode_steps: int = 1,
  ):
    self.engine, self.sampling = engine, sampling
    self.max_new_tokens, self.stop_ids = max_new_tokens, stop_ids
    self.decode_steps = decode_steps

  def run(self, prompts: Sequence[Sequence[int]], rng: jax.Array) -> list[Completion]:
    out: list[Completion | None] = [None] * len(prompts)
    pending = collections.deque(enumerate(prompts))
    free = slot_order(self.engine)[::-1]  # popped from the end: the order's first first
    busy: dict[int, tuple[int, Completion]] = {}  # slot -> (request index, partial completion)
    keys = jax.random.split(rng, self.engine.num_slots)  # per slot: its request's key
    while pending or busy:
      inserts = []  # (slot, request index, prompt, request key): prefilled in one batch
      while pending and free:
        index, prompt = pending.popleft()
        slot = free.pop()
        self.engine.reset_slot(slot)
        inserts.append((slot, index, prompt, jax.random.fold_in(rng, index)))
      if inserts:
        keys = keys.at[jnp.asarray([x[0] for x in inserts])].set(jnp.stack([x[3] for x in inserts]))
        firsts = self.engine.prefill_many(
          [(slot, prompt, jax.random.fold_in(key, 0)) for slot, _, prompt, key in inserts],
          self.sampling,
        )
        for (slot, index, _, _), (tok, logp) in zip(inserts, firsts):
          busy[slot] = (index, Completion([], [], ""))
          self._append(busy, free, out, slot, tok, logp)
      if not busy:
        continue
      active = np.zeros((self.engine.num_slots,), bool)
      counts = np.zeros((self.engine.num_slots,), np.int32)
      limits = np.zeros((self.engine.num_slots,), np.int32)
      room = {slot: self.engine.room(slot) for slot in busy}  # before the call
      for slot, (_, comp) in busy.items():
        active[slot], counts[slot] = True, len(comp.token_ids)
        # `_append`'s length rules as a count: the token limit, or the pending token's write at
        # the cache's last index.
        limits[slot] = min(self.max_new_tokens - counts[slot], room[slot])
      k = 1 if pending and free else self.decode_steps  # a freed slot takes a request next step
      tokens, logprobs = decode_tokens(
        self.engine, active, keys, counts, limits, self.stop_ids, self.sampling, k
      )
      slots = list(busy)
      for j in range(len(tokens)):  # every slot finishes at the last step, if at all
        for slot in slots:
          if slot not in busy:
            raise RuntimeError(f"slot {slot} finished before the engine's last step")
          tok, logp = int(tokens[j, slot]), float(logprobs[j, slot])
          self._append(busy, free, out, slot, tok, logp, room[slot] - j - 1)
    return out  # type: ignore[return-value]

  def _append(self, busy, free, out, slot: int, tok: int, logp: float, room=None) -> None:
    """Records a sampled token; ends the request on a stop id, the token limit or a full cache
    (`room`: the slot's room after this token's step; default the engine's now)."""
    index, comp = busy[slot]
    comp.token_ids.append(tok)
    comp.logprobs.append(logp)
    room = self.engine.room(slot) if room is None else room
    if tok in self.stop_ids:
      comp.finish_reason = FINISH_STOP
    elif len(comp.token_ids) >= self.max_new_tokens or room <= 0:
      # room 0: the pending token would be written at index cache_len, which does not exist.
      comp.finish_reason = FINISH_LENGTH
    else:
      return
    comp.routing = self.engine.routing(slot)
    out[index] = comp
    del busy[slot]
    free.append(slot)
