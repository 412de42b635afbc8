"""KV-cached inference engine over decode slots (the shape of JetStream's `Engine` contract).

A decode state holds `B` slots sharing one KV cache per layer (`KVCache`: B slots of S entries).
`prefill` runs a request's prompt (or the continuation of a multi-turn conversation) into one slot
and samples its first token; `generate` advances every slot by one token. Both are jitted once per
shape: prompts are cut into power-of-two chunks so that few shapes exist.

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
  cache: KVCache  # per layer: keys [B, K, H, S], values [B, K, S, H]
  next_pos: jax.Array  # [B] int32: cache index for the next token
  tokens: jax.Array  # [B] int32: last sampled token per slot


@functools.partial(
  jax.jit, static_argnames=("graphdef", "sampling", "kv_len"), donate_argnames=("state",)
)
def _prefill_rows(
  graphdef, params, state: DecodeState, slots_r, chunk_rt, true_len_r, keys_r, sampling, kv_len
):
  """One chunk into R slots at once. Rows may repeat a slot only as exact copies (padding)."""
  model = nnx.merge(graphdef, params)
  starts = state.next_pos[slots_r]
  t = chunk_rt.shape[1]
  take = lambda c: c[slots_r]  # noqa: E731
  cache = KVCache(tuple(map(take, state.cache.k)), tuple(map(take, state.cache.v)))
  positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
  hidden, cache = model.decode(chunk_rt, positions, cache, starts, kv_len)
  last = jnp.take_along_axis(hidden, (true_len_r - 1)[:, None, None], axis=1)[:, 0]
  tok, logp = sample(model.logits(last), keys_r, sampling)
  put = lambda full, part: full.at[slots_r].set(part)  # noqa: E731
  new_cache = KVCache(
    tuple(map(put, state.cache.k, cache.k)), tuple(map(put, state.cache.v, cache.v))
  )
  state = DecodeState(
    new_cache,
    state.next_pos.at[slots_r].set(starts + true_len_r),
    state.tokens.at[slots_r].set(tok),
  )
  return state, tok, logp


@functools.partial(
  jax.jit, static_argnames=("graphdef", "sampling", "kv_len"), donate_argnames=("state",)
)
def _generate(graphdef, params, state: DecodeState, active_b, rng, sampling, kv_len):
  model = nnx.merge(graphdef, params)
  s = state.cache.length
  write = jnp.minimum(state.next_pos, s - 1)  # inactive slots may sit at S; never write past it
  hidden, cache = model.decode(state.tokens[:, None], write[:, None], state.cache, write, kv_len)
  tok, logp = sample(model.logits(hidden[:, 0]), rng, sampling)
  tok = jnp.where(active_b, tok, state.tokens)
  next_pos = jnp.where(active_b, state.next_pos + 1, state.next_pos)
  return DecodeState(cache, next_pos, tok), tok, logp


MAX_PREFILL_CHUNK = 512  # longest prefill chunk (tokens); longer inputs take several


def _chunks(
  n: int, start: int, cache_len: int, min_chunk: int = 16, max_chunk: int = MAX_PREFILL_CHUNK
) -> list[int]:
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


# Smallest key-length bucket (cache entries a call attends to) of a decode step and of a prefill
# chunk. Decode steps share one shape until 256 tokens; a prefill chunk attends to no more than
# it needs: a fresh 128-token prompt to 128 keys, not 256, and its attention (most of a prefill
# after the matmuls: XLA:CPU runs the small batched products at a fraction of the matmul rate)
# costs half.
DECODE_MIN_KV = 256
PREFILL_MIN_KV = 16


def _kv_bucket(n: int, cache_len: int, minimum: int = DECODE_MIN_KV) -> int:
  """Smallest power of two >= n (at least `minimum`), capped at the cache length."""
  return min(cache_len, max(minimum, 1 << max(0, (n - 1).bit_length())))


def check_token_ids(ids, vocab_size: int, what: str) -> np.ndarray:
  """`ids` as an int32 array after checking they are integers in [0, vocab_size).

  An id outside the vocabulary would embed as NaN (or wrap around when negative), and NaN keys
  left in the cache poison every later request of the slot.

  Raises:
    ValueError: a non-integer id or one outside [0, vocab_size); the message starts with `what`.
  """
  arr = np.asarray(ids)
  if arr.size and arr.dtype.kind not in "iu":
    raise ValueError(f"{what}: token ids must be integers, got dtype {arr.dtype}")
  if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
    bad = arr[(arr < 0) | (arr >= vocab_size)]
    raise ValueError(f"{what}: token ids must lie in [0, {vocab_size}), got {bad[:5].tolist()}")
  return arr.astype(np.int32).reshape(-1)


class Engine:
  """Decode slots over a KV cache for one model.

  Args:
    model: a Qwen model (its parameters are read at each call through `params`).
    num_slots: max concurrent decodes B.
    cache_len: S, tokens per slot (prompt + all turns).
    dtype: KV cache dtype.
    max_prefill_tokens: most tokens (rows x chunk length) one prefill forward takes; a larger
      batch of prompts runs as several forwards (a single chunk longer than this still runs).
      On a 2-core CPU, 64 prompts of 128 tokens prefilled 10-15% faster as 8 forwards of 1024
      tokens than as one of 8192 (activations that fit the cache); accelerators may want more.
  Raises:
    ValueError: num_slots, cache_len or max_prefill_tokens below 1.
  """

  def __init__(
    self,
    model: Qwen,
    num_slots: int,
    cache_len: int,
    dtype=jnp.float32,
    max_prefill_tokens: int = 1024,
  ):
    if min(num_slots, cache_len, max_prefill_tokens) < 1:
      raise ValueError(
        f"num_slots ({num_slots}), cache_len ({cache_len}) and "
        f"max_prefill_tokens ({max_prefill_tokens}) must be >= 1"
      )
    self.graphdef, self.params = nnx.split(model)
    self.config = model.config
    self.num_slots = num_slots
    self.cache_len = cache_len
    self.max_prefill_tokens = max_prefill_tokens
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
    return DecodeState(
      cache, jnp.zeros((self.num_slots,), jnp.int32), jnp.zeros((self.num_slots,), jnp.int32)
    )

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

  def prefill(
    self, slot: int, token_ids: list[int], rng: jax.Array, sampling: SamplingParams
  ) -> tuple[int, float]:
    """Appends `token_ids` to the slot's cache and samples the next token with `rng`.

    Raises:
      ValueError: empty input, or more tokens than the slot has room for.
    Returns:
      (first sampled token id, its log-prob).
    """
    return self.prefill_many([(slot, token_ids, rng)], sampling)[0]

  def prefill_many(
    self, requests: list[tuple[int, list[int], jax.Array]], sampling: SamplingParams
  ) -> list[tuple[int, float]]:
    """`prefill` for several slots at once: one batched forward per chunk, not one per slot.

    Inputs are cut into chunks of at most MAX_PREFILL_CHUNK tokens. In each round every request
    with tokens left contributes its next chunk; the chunks are padded to a power-of-two length
    (the longest chunk's) and row count and run as one batch (several when they hold more than
    `max_prefill_tokens`). A slot too near the end of its cache for that length runs alone with
    a chunk that fits (`_chunks`). The next token is sampled after a request's last chunk with
    its own key, so a request's result does not depend on what it is batched with. Padding keys
    land at cache indices >= the slot's new position, which nothing attends to before they are
    overwritten.

    Args:
      requests: (slot, token ids, PRNG key) per request; slots distinct.
    Returns:
      (first sampled token id, its log-prob) per request, in order.
    Raises:
      ValueError: a slot outside [0, num_slots) or repeated, an empty input, a token id that is
        not an integer in [0, vocab_size), or more tokens than a slot has room for (checked for
        every request before any work is done).
    """
    if not requests:
      return []
    slots = [slot for slot, _, _ in requests]
    for slot in slots:  # a negative index would alias slot B - 1 on the device
      if not 0 <= slot < self.num_slots:
        raise ValueError(f"slot {slot} is outside [0, {self.num_slots})")
    if len(set(slots)) != len(slots):
      raise ValueError(f"prefill_many needs distinct slots, got {slots}")
    ids_list = []
    for slot, ids, _ in requests:
      ids_list.append(check_token_ids(ids, self.config.vocab_size, f"slot {slot}"))
      n = len(ids_list[-1])
      if not n:
        raise ValueError("prefill needs at least one token")
      if self.position(slot) + n > self.cache_len:
        raise ValueError(
          f"slot {slot}: {self.position(slot)} + {n} tokens exceed cache {self.cache_len}"
        )
    # One key-length bucket for the whole call where the padding allows: a long prompt compiles
    # one (chunk, bucket) shape rather than one per bucket it passes through.
    kv_call = _kv_bucket(
      max(self.position(s) + len(x) for s, x in zip(slots, ids_list)),
      self.cache_len,
      PREFILL_MIN_KV,
    )
    offsets = [0] * len(requests)
    out: list[tuple[int, float] | None] = [None] * len(requests)

    def run(rows: list[int], t: int) -> None:
      padded = rows + [rows[0]] * ((1 << (len(rows) - 1).bit_length()) - len(rows))  # copies
      chunk = np.zeros((len(padded), t), np.int32)
      true_len = np.zeros((len(padded),), np.int32)
      for r, i in enumerate(padded):
        piece = ids_list[i][offsets[i] : offsets[i] + t]
        chunk[r, : len(piece)], true_len[r] = piece, len(piece)
      slot_rows = np.array([slots[i] for i in padded], np.int32)
      kv_len = max(
        kv_call, _kv_bucket(int(self._pos[slot_rows].max()) + t, self.cache_len, PREFILL_MIN_KV)
      )
      self.state, tok, logp = _prefill_rows(
        self.graphdef,
        self.params,
        self.state,
        jnp.asarray(slot_rows),
        jnp.asarray(chunk),
        jnp.asarray(true_len),
        jnp.stack([requests[i][2] for i in padded]),
        sampling,
        kv_len,
      )
      tok, logp = np.asarray(tok), np.asarray(logp)
      for r, i in enumerate(rows):
        self._pos[slots[i]] += true_len[r]
        offsets[i] += int(true_len[r])
        if offsets[i] == len(ids_list[i]):  # its last chunk: the sample counts
          out[i] = (int(tok[r]), float(logp[r]))

    while live := [i for i in range(len(requests)) if offsets[i] < len(ids_list[i])]:
      t = max(_chunks(len(ids_list[i]) - offsets[i], 0, self.cache_len)[0] for i in live)
      group = [i for i in live if self._pos[slots[i]] + t <= self.cache_len]
      # Rows per forward: the largest power of two within max_prefill_tokens (`run` pads the
      # row count to a power of two), at least one.
      rows = 1 << (max(1, self.max_prefill_tokens // t).bit_length() - 1)
      for first in range(0, len(group), rows):
        run(group[first : first + rows], t)
      for i in live:
        if i not in group:  # near the end of its cache: alone, with a chunk that fits
          run(
            [i], _chunks(len(ids_list[i]) - offsets[i], int(self._pos[slots[i]]), self.cache_len)[0]
          )
    return out  # type: ignore[return-value]

  def generate(
    self, active: np.ndarray, rng: jax.Array, sampling: SamplingParams
  ) -> tuple[np.ndarray, np.ndarray]:
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
    self.state, tok, logp = _generate(
      self.graphdef, self.params, self.state, jnp.asarray(active), rng, sampling, kv_len
    )
    self._pos[active] += 1
    return np.asarray(tok), np.asarray(logp)
