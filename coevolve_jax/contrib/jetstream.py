"""Our rollout engine behind JetStream's functional `Engine` contract (google-jetstream 0.2.x).

JetStream's contract: `prefill(params=, existing_prefix=, padded_tokens=, true_length=) -> Prefix`
(the request's KV cache and its first sampled token), `insert(prefix, decode_state, slot)`,
`generate(params, decode_state) -> (decode_state, ResultTokens)` (one token for every slot),
`load_params`, `init_decode_state`, `max_concurrent_decodes`, tokenizer access. When
`google-jetstream` is importable, `JetStreamEngine` subclasses its `engine_api.Engine` and returns
its `ResultTokens`; otherwise it stands alone with an equivalent `ResultTokens` of its own. It is
never a hard dependency: the PyPI release pulls TensorFlow (seqio) and upstream was archived in
January 2026. The agent loop and `generate` use the slot-level `Engine` (rollout/engine.py)
directly and never import this module; this adapter computes with the same jitted prefill / decode
functions.

Per-token log-probs (JetStream 0.2.2 has no field for them) are in `DecodeState.logprobs` after
each `generate` and in `Prefix.logprob` after a prefill.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from coevolve_jax.models.kernels import key_layout
from coevolve_jax.models.qwen import KVCache, Qwen
from coevolve_jax.rollout import engine as engine_lib
from coevolve_jax.rollout.sampling import SamplingParams

try:  # Optional: importing it needs TensorFlow (via seqio), which we do not install.
  from jetstream.engine import engine_api as _jetstream_api  # pytype: disable=import-error
except Exception:  # pylint: disable=broad-except  # ImportError, or its own imports failing
  _jetstream_api = None

JETSTREAM_AVAILABLE = _jetstream_api is not None
# The slot engine's jitted steps, shared so both front ends compute identically.
_prefill_rows = engine_lib._prefill_rows  # pylint: disable=protected-access
_generate_step = engine_lib._generate  # pylint: disable=protected-access
_kv_bucket = engine_lib._kv_bucket  # pylint: disable=protected-access
GREEDY = SamplingParams(temperature=0.0)


class SlotResult(NamedTuple):
  """One slot's output of a step: tokens [1, 1], valid [1, 1] (0/1), lengths [1]."""

  tokens: np.ndarray
  valid: np.ndarray
  lengths: np.ndarray


@struct.dataclass
class _OwnResultTokens:
  """Tokens of one step for all slots in one array, read per slot (JetStream's layout).

  data: [B, 3] int32 columns (token, valid, length so far).
  """

  data: Any
  tokens_idx: tuple[int, int] = struct.field(pytree_node=False, default=(0, 1))
  valid_idx: tuple[int, int] = struct.field(pytree_node=False, default=(1, 2))
  length_idx: tuple[int, int] = struct.field(pytree_node=False, default=(2, 3))
  samples_per_slot: int = struct.field(pytree_node=False, default=1)

  def convert_to_numpy(self) -> "_OwnResultTokens":
    return dataclasses.replace(self, data=np.asarray(self.data))  # what flax's `replace` does

  def get_result_at_slot(self, slot: int) -> SlotResult:
    row = self.data[slot : slot + 1]
    return SlotResult(
      row[:, self.tokens_idx[0] : self.tokens_idx[1]],
      row[:, self.valid_idx[0] : self.valid_idx[1]],
      row[:, self.length_idx[0]],
    )


ResultTokens = _jetstream_api.ResultTokens if JETSTREAM_AVAILABLE else _OwnResultTokens
if TYPE_CHECKING:  # a base class mypy can check (JetStream's Engine is untyped, Any to it)
  _Base = abc.ABC
else:
  _Base = _jetstream_api.Engine if JETSTREAM_AVAILABLE else abc.ABC


class Prefix(NamedTuple):
  """A prefilled request: a one-slot decode state (per layer, keys [1, K, H, S] and values
  [1, K, S, H]), the length in the cache, the first sampled token and its log-prob."""

  state: engine_lib.DecodeState
  length: int
  token: int
  logprob: float


class DecodeState(NamedTuple):
  """All slots: the engine's decode state plus each slot's last log-prob [B] float32."""

  slots: engine_lib.DecodeState
  logprobs: jax.Array


@functools.partial(jax.jit, donate_argnames=("state",))
def _insert(prefix: engine_lib.DecodeState, state: engine_lib.DecodeState, slot):
  put = lambda full, part: jax.lax.dynamic_update_slice_in_dim(full, part, slot, axis=0)  # noqa
  cache = KVCache(
    tuple(map(put, state.cache.k, prefix.cache.k)), tuple(map(put, state.cache.v, prefix.cache.v))
  )
  return engine_lib.DecodeState(
    cache, put(state.next_pos, prefix.next_pos), put(state.tokens, prefix.tokens)
  )


class JetStreamEngine(_Base):
  """JetStream's functional engine over a Qwen model.

  Args:
    model: the Qwen model (its parameters are what `load_params` returns).
    num_slots: max concurrent decodes B.
    cache_len: S, tokens per slot.
    sampling: how tokens are sampled (JetStream's API has no per-call sampling argument).
    seed: PRNG seed; every prefill / generate call draws a fresh key from it.
  """

  def __init__(
    self,
    model: Qwen,
    num_slots: int,
    cache_len: int,
    sampling: SamplingParams = GREEDY,
    seed: int = 0,
  ):
    self._graphdef, self._params = nnx.split(model)
    self._config = model.config
    self._keys = key_layout(model.attention)  # the KV cache's key layout (`qwen.KVCache`)
    self._num_slots, self._cache_len = num_slots, cache_len
    self.sampling = sampling
    self._rng = jax.random.key(seed)

  def _next_key(self) -> jax.Array:
    self._rng, sub = jax.random.split(self._rng)
    return sub

  def load_params(self, *args, **kwargs) -> Any:
    """The model's parameters (an nnx.State); a Qwen passed as `model=` replaces them first."""
    del args
    if kwargs.get("model") is not None:
      self._graphdef, self._params = nnx.split(kwargs["model"])
    return self._params

  def init_decode_state(self, *args, **kwargs) -> DecodeState:
    del args, kwargs
    cache = KVCache.zeros(self._config, self._num_slots, self._cache_len, keys=self._keys)
    zeros = lambda: jnp.zeros((self._num_slots,), jnp.int32)  # noqa: E731  (distinct buffers)
    return DecodeState(
      engine_lib.DecodeState(cache, zeros(), zeros()), jnp.zeros((self._num_slots,), jnp.float32)
    )

  def prefill(
    self,
    *,
    params: Any,
    existing_prefix: Prefix | None = None,
    padded_tokens: jax.Array,
    true_length: int,
  ) -> Prefix:
    """KV cache of `padded_tokens[:true_length]` (appended to `existing_prefix`), first token.

    An `existing_prefix` is consumed (its buffers are donated to the new prefix).

    Raises:
      ValueError: true_length outside [1, len(padded_tokens)], a token id (padding included: it
        is embedded too) outside [0, vocab_size), or the tokens do not fit the cache.
    """
    padded = engine_lib.check_token_ids(padded_tokens, self._config.vocab_size, "padded_tokens")
    if not 1 <= true_length <= padded.shape[0]:
      raise ValueError(f"true_length {true_length} outside [1, {padded.shape[0]}]")
    if existing_prefix is None:
      cache = KVCache.zeros(self._config, 1, self._cache_len, keys=self._keys)
      state = engine_lib.DecodeState(cache, jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32))
      start = 0
    else:
      state, start = existing_prefix.state, existing_prefix.length
    if start + padded.shape[0] > self._cache_len:
      raise ValueError(f"{start} + {padded.shape[0]} tokens exceed the cache ({self._cache_len})")
    kv_len = _kv_bucket(start + padded.shape[0], self._cache_len, engine_lib.PREFILL_MIN_KV)
    state, tok, logp, _ = _prefill_rows(
      self._graphdef,
      params,
      state,
      jnp.zeros((1,), jnp.int32),
      jnp.asarray(padded)[None],
      jnp.asarray([true_length], jnp.int32),
      self._next_key()[None],
      self.sampling,
      kv_len,
    )
    return Prefix(state, start + int(true_length), int(tok[0]), float(logp[0]))

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    """Puts a prefilled request into `slot` (its first token becomes the slot's pending one).

    `decode_state` is consumed (donated); use the returned state.
    """
    slots = _insert(prefix.state, decode_state.slots, jnp.int32(slot))
    return DecodeState(slots, decode_state.logprobs.at[slot].set(prefix.logprob))

  def generate(self, params: Any, decode_state: DecodeState) -> tuple[DecodeState, Any]:
    """One token for every slot that has room; full slots are reported invalid and not written."""
    slots = decode_state.slots
    pos = np.asarray(slots.next_pos)
    active = pos < self._cache_len
    kv_len = _kv_bucket(int(pos[active].max(initial=0)) + 1, self._cache_len)
    slots, tok, logp, _ = _generate_step(
      self._graphdef, params, slots, jnp.asarray(active), self._next_key(), self.sampling, kv_len
    )
    data = jnp.stack([tok, jnp.asarray(active, jnp.int32), slots.next_pos], axis=1)
    result = ResultTokens(
      data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3), samples_per_slot=1
    )
    return DecodeState(slots, jnp.where(jnp.asarray(active), logp, 0.0)), result

  def get_prefix_destination_sharding(self) -> Any:
    return None

  def get_tokenizer(self) -> Any:
    """JetStream's TokenizerParameters (path of tokenizer.json) when available, else our
    tokenizer."""
    from coevolve_jax import tokenizer as tokenizer_lib  # noqa: PLC0415

    if JETSTREAM_AVAILABLE:
      from jetstream.engine import tokenizer_pb2  # noqa: PLC0415  # pytype: disable=import-error

      return tokenizer_pb2.TokenizerParameters(path=tokenizer_lib.tokenizer_dir())
    return tokenizer_lib.get_tokenizer()

  def build_tokenizer(self, metadata: Any) -> Any:
    """Our Qwen tokenizer (JetStream's default builds a SentencePiece one)."""
    from coevolve_jax import tokenizer as tokenizer_lib  # noqa: PLC0415

    del metadata
    return tokenizer_lib.get_tokenizer()

  @property
  def max_concurrent_decodes(self) -> int:
    return self._num_slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self._cache_len

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))

  @property
  def colocated_cpus(self) -> None:
    return None
