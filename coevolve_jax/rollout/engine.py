"""KV-cached inference engine over decode slots (the shape of JetStream's `Engine` contract).

A decode state holds `B` slots sharing one KV cache `[B, S, K, H]` per layer. `prefill` runs a
request's prompt (or the continuation of a multi-turn conversation) into one slot and samples its
first token; `generate` advances every slot by one token. Both are jitted once per shape: prompts
are cut into power-of-two chunks so that few shapes exist.

Invariant per slot: cache indices [0, next_pos) hold keys of tokens already consumed; `tokens[b]`
is the last sampled token, not yet in the cache. Nothing is written at index >= S: the host checks
`room(slot)` before asking for more.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from coevolve_jax.models.qwen import KVCache, Qwen
from coevolve_jax.rollout.sampling import SamplingParams, sample


class DecodeState(NamedTuple):
  cache: KVCache  # per layer [B, S, K, H]
  next_pos: jax.Array  # [B] int32: cache index for the next token
  tokens: jax.Array  # [B] int32: last sampled token per slot


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "kv_len"),
                   donate_argnames=("state",))
def _prefill(graphdef, params, state: DecodeState, slot, chunk_t, true_len, rng, sampling, kv_len):
  model = nnx.merge(graphdef, params)
  start = state.next_pos[slot]
  t = chunk_t.shape[0]
  one = lambda c: jax.lax.dynamic_slice_in_dim(c, slot, 1, axis=0)  # noqa: E731
  cache = KVCache(tuple(map(one, state.cache.k)), tuple(map(one, state.cache.v)))
  positions = (start + jnp.arange(t, dtype=jnp.int32))[None]
  hidden, cache = model.decode(chunk_t[None], positions, cache, start[None], kv_len)
  last = jax.lax.dynamic_index_in_dim(hidden[0], true_len - 1, axis=0, keepdims=False)
  tok, logp = sample(model.logits(last[None]), rng, sampling)
  put = lambda full, part: jax.lax.dynamic_update_slice_in_dim(full, part, slot, axis=0)  # noqa
  new_cache = KVCache(tuple(map(put, state.cache.k, cache.k)),
                      tuple(map(put, state.cache.v, cache.v)))
  state = DecodeState(new_cache, state.next_pos.at[slot].add(true_len),
                      state.tokens.at[slot].set(tok[0]))
  return state, tok[0], logp[0]


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "kv_len"),
                   donate_argnames=("state",))
def _generate(graphdef, params, state: DecodeState, active_b, rng, sampling, kv_len):
  model = nnx.merge(graphdef, params)
  s = state.cache.k[0].shape[1]
  write = jnp.minimum(state.next_pos, s - 1)  # inactive slots may sit at S; never write past it
  hidden, cache = model.decode(state.tokens[:, None], write[:, None], state.cache, write,
                               kv_len)
  tok, logp = sample(model.logits(hidden[:, 0]), rng, sampling)
  tok = jnp.where(active_b, tok, state.tokens)
  next_pos = jnp.where(active_b, state.next_pos + 1, state.next_pos)
  return DecodeState(cache, next_pos, tok), tok, logp


def _chunks(n: int, start: int, cache_len: int, min_chunk: int = 16,
            max_chunk: int = 512) -> list[int]:
  """Power-of-two chunk sizes covering n tokens from `start` without passing `cache_len`.

  Chunks are at most `max_chunk` long, so a long prompt is padded by less than one chunk (a single
  power-of-two chunk would pad 2049 tokens to 4096) and few shapes are compiled.
  """
  sizes = []
  while n > 0:
    size = min(max_chunk, max(min_chunk, 1 << (n - 1).bit_length()))
    while start + size > cache_len and size > 1:
      size //= 2
    take = min(size, n)
    sizes.append(size)
    n -= take
    start += take
  return sizes


def _kv_bucket(n: int, cache_len: int, minimum: int = 256) -> int:
  """Smallest power of two >= n (at least `minimum`), capped at the cache length."""
  return min(cache_len, max(minimum, 1 << max(0, (n - 1).bit_length())))


class Engine:
  """Decode slots over a KV cache for one model.

  Args:
    model: a Qwen model (its parameters are read at each call through `params`).
    num_slots: max concurrent decodes B.
    cache_len: S, tokens per slot (prompt + all turns).
  """

  def __init__(self, model: Qwen, num_slots: int, cache_len: int, dtype=jnp.float32):
    self.graphdef, self.params = nnx.split(model)
    self.config = model.config
    self.num_slots = num_slots
    self.cache_len = cache_len
    self.dtype = dtype
    self.state = self.init_decode_state()
    # Host mirror of state.next_pos: room checks and kv buckets need no device round trip.
    self._pos = np.zeros((num_slots,), np.int64)

  @property
  def max_concurrent_decodes(self) -> int:
    return self.num_slots

  def load_params(self, model: Qwen) -> None:
    """Points the engine at new weights (after a training step)."""
    self.graphdef, self.params = nnx.split(model)

  def init_decode_state(self) -> DecodeState:
    cache = KVCache.zeros(self.config, self.num_slots, self.cache_len, self.dtype)
    # Two distinct buffers: the state is donated, and one buffer donated twice is an error.
    return DecodeState(cache, jnp.zeros((self.num_slots,), jnp.int32),
                       jnp.zeros((self.num_slots,), jnp.int32))

  def reset_slot(self, slot: int) -> None:
    """Frees a slot: its next request starts at cache index 0."""
    self.state = self.state._replace(next_pos=self.state.next_pos.at[slot].set(0))
    self._pos[slot] = 0

  def position(self, slot: int) -> int:
    """Cache index the slot's next token will be written at (tokens consumed so far)."""
    return int(self._pos[slot])

  def room(self, slot: int) -> int:
    """Cache entries still free in `slot` (the pending sampled token needs one of them)."""
    return self.cache_len - self.position(slot)

  def prefill(self, slot: int, token_ids: list[int], rng: jax.Array,
              sampling: SamplingParams) -> tuple[int, float]:
    """Appends `token_ids` to the slot's cache and samples the next token.

    Raises:
      ValueError: empty input, or more tokens than the slot has room for.
    Returns:
      (first sampled token id, its log-prob).
    """
    if not token_ids:
      raise ValueError("prefill needs at least one token")
    start = self.position(slot)
    if start + len(token_ids) > self.cache_len:
      raise ValueError(
        f"slot {slot}: {start} + {len(token_ids)} tokens exceed cache {self.cache_len}"
      )
    ids = np.asarray(token_ids, np.int32)
    offset = 0
    sizes = _chunks(len(ids), start, self.cache_len)
    # One key-length bucket for all chunks of this call: a long prompt compiles one shape
    # (max_chunk, bucket) rather than one per bucket it passes through.
    kv_len = _kv_bucket(start + len(ids) + sizes[-1], self.cache_len)
    for size in sizes:
      part = ids[offset:offset + size]
      true_len = len(part)
      padded = np.zeros((size,), np.int32)
      padded[:true_len] = part
      rng, sub = jax.random.split(rng)
      self.state, tok, logp = _prefill(self.graphdef, self.params, self.state, jnp.int32(slot),
                                       jnp.asarray(padded), jnp.int32(true_len), sub, sampling,
                                       kv_len)
      offset += true_len
      self._pos[slot] += true_len
    return int(tok), float(logp)

  def generate(self, active: np.ndarray, rng: jax.Array,
               sampling: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """One decode step for every slot; only `active` ([B] bool) slots advance.

    `rng` is one key for the step, or [B] keys (one per slot: see `sample`).

    Each active slot writes its pending token at cache index `position(slot)` and samples the next.

    Returns:
      (tokens [B] int32, logprobs [B] float32) as numpy; inactive slots repeat their last token.
    Raises:
      ValueError: an active slot has no room left (its write would land past the cache); callers
        end such a request with finish reason "length" instead.
    """
    active = np.asarray(active, bool)
    if active.shape != (self.num_slots,):
      raise ValueError(f"active must have shape ({self.num_slots},), got {active.shape}")
    full = np.flatnonzero(active & (self._pos >= self.cache_len))
    if full.size:
      raise ValueError(f"slots {full.tolist()} are full (cache {self.cache_len}); end them first")
    kv_len = _kv_bucket(int(self._pos[active].max(initial=0)) + 1, self.cache_len)
    self.state, tok, logp = _generate(self.graphdef, self.params, self.state,
                                      jnp.asarray(active), rng, sampling, kv_len)
    self._pos[active] += 1
    return np.asarray(tok), np.asarray(logp)
