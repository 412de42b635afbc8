"""KV-cached inference engine over decode slots (the shape of JetStream's `Engine` contract).

A decode state holds `B` slots sharing one KV cache per layer, or per block of stacked layers with
`scan_layers` (`KVCache`: B slots of S entries).
`prefill` runs a request's prompt (or the continuation of a multi-turn conversation) into one slot
and samples its first token; `generate` advances every slot by one token. Both are jitted once per
shape: prompts are cut into power-of-two chunks so that few shapes exist.

Invariant per slot: cache indices [0, next_pos) hold keys of tokens already consumed; `tokens[b]`
is the last sampled token, not yet in the cache. Nothing is written at index >= S: the host checks
`room(slot)` before asking for more.

Routing record (Qwen3-MoE): for each slot the host also keeps the experts every consumed token was
routed to, [next_pos, L_moe, k] (`Engine.routing`), so the trainer can score the tokens under the
same experts (routing replay, `Qwen.hidden_states(routing_btlk=...)`). It costs one small
device-to-host copy per forward and 2 * L_moe * k bytes per consumed token on the host (768 bytes
for Qwen3-30B-A3B: 48 layers x 8 experts).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from coevolve_jax import compiling
from coevolve_jax.models import sharding
from coevolve_jax.models.kernels import key_layout
from coevolve_jax.models.qwen import KVCache, Qwen, routing_dtype, unrolled_template, unstack
from coevolve_jax.rollout.sampling import SamplingParams, per_row_keys, sample


# A decode state's leaves: jax.Array; NamedSharding in the engine's `shardings` of it.
_Leaf = TypeVar("_Leaf")


class DecodeState(NamedTuple, Generic[_Leaf]):
  cache: KVCache  # per layer: keys [B, K, H, S], values [B, K, S, H]; or per block [L_g, B, ...]
  next_pos: _Leaf  # [B] int32: cache index for the next token
  tokens: _Leaf  # [B] int32: last sampled token per slot


class StaleWeightsError(RuntimeError):
  """The engine was asked to decode with weights whose buffers are gone (donated to a training
  step, or deleted): it must be given the trainer's current weights (`Engine(weights=...)`, or
  `load_params` after every update)."""


def _pin(
  state: DecodeState[jax.Array], shardings: DecodeState[NamedSharding] | None
) -> DecodeState[jax.Array]:
  """`state` constrained to the engine's decode-state shardings (a no-op without a mesh), so the
  KV cache leaves every jitted call as it came in: never replicated by the partitioner."""
  return state if shardings is None else jax.lax.with_sharding_constraint(state, shardings)


def _to_host(x, shardings: DecodeState[NamedSharding] | None):
  """An output the host reads (tokens, log-probs, routing) replicated on every device of the
  mesh, so each process of a multi-host mesh holds all of it (no-op without a mesh)."""
  if shardings is None or x is None:
    return x
  return jax.lax.with_sharding_constraint(x, NamedSharding(shardings.tokens.mesh, PartitionSpec()))


def _slot_axis(cache: KVCache) -> int:
  """The slot axis of the cache's arrays: 1 for stacked blocks [L_g, B, ...], else 0."""
  return 1 if cache.stacked else 0


def _window_index(cache: KVCache, local_r, kv_len: int, keys: str) -> tuple[tuple, tuple]:
  """Indices of the entries [0, kv_len) of the slots `local_r` [R] in (key, value) arrays, keys
  in layout `keys` ("hs" or "sh", `KVCache`)."""
  lead = (slice(None),) * _slot_axis(cache)
  values = (*lead, local_r, Ellipsis, slice(0, kv_len), slice(None))  # [.., K, S, H]
  if keys == "sh":
    return values, values
  return (*lead, local_r, Ellipsis, slice(0, kv_len)), values  # keys [.., K, H, S]


def _read_windows(cache: KVCache, local_r, *, kv_len: int, keys: str) -> KVCache:
  """The cache entries [0, kv_len) of the slots `local_r` [R] int32: a KVCache of R rows (keys
  [.., R, K, H, kv_len] or, with `keys` "sh", [.., R, K, kv_len, H]; values
  [.., R, K, kv_len, H]). An index past the slots (a padding row) reads the last slot;
  `_write_windows` drops that row."""
  at_k, at_v = _window_index(cache, local_r, kv_len, keys)
  return KVCache(
    tuple(c.at[at_k].get(mode="clip") for c in cache.k),
    tuple(c.at[at_v].get(mode="clip") for c in cache.v),
  )


def _write_windows(cache: KVCache, windows: KVCache, local_r, *, keys: str) -> KVCache:
  """`cache` with row r of `windows` (`_read_windows`' layout) written back to slot
  `local_r[r]`; rows whose index is past the slots write nothing."""
  at_k, at_v = _window_index(cache, local_r, windows.length, keys)
  return KVCache(
    tuple(c.at[at_k].set(w, mode="drop") for c, w in zip(cache.k, windows.k)),
    tuple(c.at[at_v].set(w, mode="drop") for c, w in zip(cache.v, windows.v)),
  )


def _cache_specs(shardings: DecodeState[NamedSharding]) -> KVCache:
  """The PartitionSpecs of the cache's arrays (a KVCache of specs)."""
  # KVCache is typed for arrays; here its leaves are NamedShardings and the result's specs.
  specs: list[Any] = [tuple(cast(NamedSharding, x).spec for x in part) for part in shardings.cache]
  return KVCache(*specs)


def _slot_entry(shardings: DecodeState[NamedSharding], stacked: bool):
  """The PartitionSpec entry of the cache's slot axis (None: slots not split)."""
  spec = _cache_specs(shardings).k[0]
  axis = 1 if stacked else 0
  return spec[axis] if axis < len(spec) else None


def slot_shards(shardings: DecodeState[NamedSharding] | None, stacked: bool) -> int:
  """How many devices split the cache's slots (1 without a mesh). Device block d holds the
  num_slots / slot_shards consecutive slots from d * num_slots / slot_shards."""
  if shardings is None:
    return 1
  mesh = shardings.tokens.mesh
  return math.prod(mesh.shape[a] for a in sharding.spec_axes(_slot_entry(shardings, stacked)))


def _shard_local(fn, shardings: DecodeState[NamedSharding], stacked: bool, n_caches: int):
  """`fn(*caches, rows)` under `jax.shard_map`: its `n_caches` KVCache arguments and its KVCache
  result laid out as the decode state's cache (rows in the slot axis), the row indices [R]
  split as the slots are. Each device then reads and writes only the slots it holds, with no
  gather of another device's cache window."""
  specs = _cache_specs(shardings)
  rows = PartitionSpec(_slot_entry(shardings, stacked))
  return jax.shard_map(
    fn,
    mesh=shardings.tokens.mesh,
    in_specs=(*(specs,) * n_caches, rows),
    out_specs=specs,
  )


@functools.partial(
  jax.jit,
  static_argnames=("graphdef", "sampling", "kv_len", "shardings"),
  donate_argnames=("state",),
)
def _prefill_rows(
  graphdef,
  params,
  state: DecodeState,
  slots_r,
  chunk_rt,
  true_len_r,
  keys_r,
  sampling,
  kv_len,
  shardings=None,
):
  """One chunk into R slots at once. Rows may repeat a slot only as exact copies (padding); a
  row whose slot is `num_slots` (past the last) is padding that changes nothing. The caller
  keeps every real row's start + t <= kv_len (static): the cache entries [0, kv_len) of the
  rows' slots are all the forward reads and writes.

  On a mesh the rows are laid out as the slots are (`Engine._row_layout`): row block d, the
  rows device d computes, holds only slots of device d's block, so each device reads its rows'
  windows from its own cache shard and writes them back there (`_shard_local`): the
  temporaries per device are its rows' windows, not every row's (tests/test_mesh.py).

  Returns (state, tokens [R], log-probs [R], routing [R, t, L_moe, k] of the chunk's tokens in
  `routing_dtype`, or None for a dense model).
  """
  model = nnx.merge(graphdef, params)
  b, t, stacked = state.next_pos.shape[0], chunk_rt.shape[1], state.cache.stacked
  valid = slots_r < b
  starts = jnp.where(valid, state.next_pos.at[slots_r].get(mode="clip"), 0)
  per_device = b // slot_shards(shardings, stacked)
  local_r = jnp.where(valid, slots_r % per_device, per_device)  # past the slots: written nowhere
  layout = key_layout(model.attention, dtype=state.cache.v[0].dtype)
  read = functools.partial(_read_windows, kv_len=kv_len, keys=layout)
  write = functools.partial(_write_windows, keys=layout)
  if shardings is not None:
    read = _shard_local(read, shardings, stacked, 1)
    write = _shard_local(write, shardings, stacked, 2)
  # Only the rows' slots' first kv_len cache entries (all a forward attends to and writes: the
  # caller keeps starts + t <= kv_len) are copied out and back, not every entry of the slot.
  windows = read(state.cache, local_r)
  positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
  hidden, windows, routing = model.decode_routed(chunk_rt, positions, windows, starts, kv_len)
  last = jnp.take_along_axis(hidden, (true_len_r - 1)[:, None, None], axis=1)[:, 0]
  tok, logp = sample(model.logits(last), keys_r, sampling)
  state = DecodeState(
    write(state.cache, windows, local_r),
    state.next_pos.at[slots_r].set(starts + true_len_r, mode="drop"),
    state.tokens.at[slots_r].set(tok, mode="drop"),
  )
  out = (tok, logp, _small(routing, model))
  return _pin(state, shardings), *(_to_host(x, shardings) for x in out)


@functools.partial(
  jax.jit,
  static_argnames=("graphdef", "sampling", "kv_len", "shardings"),
  donate_argnames=("state",),
)
def _generate(
  graphdef, params, state: DecodeState, active_b, rng, sampling, kv_len, shardings=None
):
  """One decode step. Returns (state, tokens [B], log-probs [B], routing [B, L_moe, k] of the
  pending tokens consumed (`routing_dtype`), or None for a dense model)."""
  model = nnx.merge(graphdef, params)
  s = state.cache.length
  write = jnp.minimum(state.next_pos, s - 1)  # inactive slots may sit at S; never write past it
  hidden, cache, routing = model.decode_routed(
    state.tokens[:, None], write[:, None], state.cache, write, kv_len
  )
  tok, logp = sample(model.logits(hidden[:, 0]), rng, sampling)
  tok = jnp.where(active_b, tok, state.tokens)
  next_pos = jnp.where(active_b, state.next_pos + 1, state.next_pos)
  routing = None if routing is None else routing[:, 0]
  out = (tok, logp, _small(routing, model))
  return _pin(DecodeState(cache, next_pos, tok), shardings), *(_to_host(x, shardings) for x in out)


@functools.partial(
  jax.jit,
  static_argnames=("graphdef", "sampling", "kv_len", "max_steps", "shardings"),
  donate_argnames=("state",),
)
def _generate_steps(
  graphdef,
  params,
  state: DecodeState,
  active_b,
  keys_b,
  counts_b,
  limits_b,
  n_steps,
  stop_ids,
  sampling,
  kv_len,
  max_steps,
  shardings=None,
):
  """Up to `max_steps` decode steps in one dispatch (`Engine.generate_steps`).

  Step j is `_generate`'s step with the keys per_row_keys(keys_b, counts_b + j). The loop
  (`lax.while_loop`) runs while j < n_steps and no active slot has just finished: sampled one of
  `stop_ids` [n] int32, or reached its token limit (`limits_b` [B] int32, tokens it may still
  sample). Returns (state, packed [2 * max_steps + 1, B] int32: tokens of steps 0..max_steps-1,
  their float32 log-probs bitcast to int32, and the number of steps run in the last row (one
  array: one copy to the host per call), routing [max_steps, B, L_moe, k] or None).
  """
  model = nnx.merge(graphdef, params)
  b, s = active_b.shape[0], state.cache.length

  def step(carry):
    state, j, _, toks, logps, routs = carry
    write = jnp.minimum(state.next_pos, s - 1)  # inactive slots may sit at S; never write past it
    hidden, cache, routing = model.decode_routed(
      state.tokens[:, None], write[:, None], state.cache, write, kv_len
    )
    keys = per_row_keys(keys_b, counts_b + j)
    tok, logp = sample(model.logits(hidden[:, 0]), keys, sampling)
    tok = jnp.where(active_b, tok, state.tokens)
    next_pos = jnp.where(active_b, state.next_pos + 1, state.next_pos)
    finished = jnp.any(active_b & (jnp.isin(tok, stop_ids) | (j + 1 >= limits_b)))
    toks, logps = toks.at[j].set(tok), logps.at[j].set(logp)
    if routs is not None:
      routs = routs.at[j].set(_small(routing[:, 0], model))
    state = _pin(DecodeState(cache, next_pos, tok), shardings)
    return state, j + 1, finished, toks, logps, routs

  def cond(carry):
    _, j, finished, *_ = carry
    return (j < n_steps) & ~finished

  routs = None
  if model.config.moe_layers:
    moe, k = len(model.config.moe_layers), model.config.num_experts_per_tok
    routs = jnp.zeros((max_steps, b, moe, k), routing_dtype(model.config.num_experts))
  init = (
    state,
    jnp.int32(0),
    jnp.bool_(False),
    jnp.zeros((max_steps, b), jnp.int32),
    jnp.zeros((max_steps, b), jnp.float32),
    routs,
  )
  state, j, _, toks, logps, routs = jax.lax.while_loop(cond, step, init)
  # The loop's result as the state's layout too (the partitioner sharded the replicated slot
  # counters of the carry over the slots: every program then compiled again for that layout).
  state = _pin(state, shardings)
  packed = jnp.concatenate(
    [toks, jax.lax.bitcast_convert_type(logps, jnp.int32), jnp.broadcast_to(j, (1, b))]
  )
  return state, _to_host(packed, shardings), _to_host(routs, shardings)


def _small(routing, model: Qwen):
  """A routing record in `routing_dtype` (int16 for every Qwen MoE): half the copy to the host."""
  return None if routing is None else routing.astype(routing_dtype(model.config.num_experts))


MAX_PREFILL_CHUNK = 512  # longest prefill chunk (tokens); longer inputs take several
PREFILL_MIN_CHUNK = 16  # shortest prefill chunk (tokens) away from the end of a cache


def _chunks(
  n: int,
  start: int,
  cache_len: int,
  min_chunk: int = PREFILL_MIN_CHUNK,
  max_chunk: int = MAX_PREFILL_CHUNK,
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
  return min(cache_len, max(minimum, _pow2_at_least(n)))


def _kv_buckets(cache_len: int, minimum: int, at_least: int = 1) -> list[int]:
  """Every value `_kv_bucket(n, cache_len, minimum)` takes for n >= at_least, ascending."""
  out, b = [], _kv_bucket(at_least, cache_len, minimum)
  while b < cache_len:
    out.append(b)
    b *= 2
  return [*out, cache_len]


def rows_per_forward(t: int, max_prefill_tokens: int) -> int:
  """Rows one prefill forward of chunk length t takes at most: the largest power of two within
  `max_prefill_tokens` / t (the forward pads its row count to a power of two), at least one."""
  return 1 << (max(1, max_prefill_tokens // t).bit_length() - 1)


def _pow2_at_least(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def prefill_schedule(
  lengths: list[int],
  starts: list[int],
  cache_len: int,
  max_prefill_tokens: int,
  min_chunk: int = PREFILL_MIN_CHUNK,
) -> list[tuple[list[int], int]]:
  """The forwards that prefill requests of `lengths` tokens into slots at cache positions `starts`.

  Rounds, until every request is consumed: each request with tokens left contributes its next
  chunk, of one length t for the round (the largest first `_chunks` size among them, a power of
  two of at most MAX_PREFILL_CHUNK). Requests whose slot has room for t more entries share
  forwards of at most the largest power of two <= max(1, max_prefill_tokens // t) rows, in
  request order; a request too near the end of its cache runs alone with the first `_chunks`
  size that fits. A row takes min(t, tokens left) real tokens.

  Args:
    lengths: tokens per request (each >= 1, and starts[i] + lengths[i] <= cache_len).
    starts: the cache position of each request's slot before the call.
    cache_len: cache entries per slot.
    max_prefill_tokens: most tokens (rows x t) one forward takes.
    min_chunk: the shortest chunk (a power of two); a chunk near the end of a cache may be shorter.
  Returns:
    (request indices of the forward's rows, chunk length t) per forward, in execution order.
  """
  offsets, pos = [0] * len(lengths), list(starts)
  forwards: list[tuple[list[int], int]] = []

  def take(rows: list[int], t: int) -> None:
    forwards.append((rows, t))
    for i in rows:
      step = min(t, lengths[i] - offsets[i])
      offsets[i] += step
      pos[i] += step

  while live := [i for i in range(len(lengths)) if offsets[i] < lengths[i]]:
    t = max(_chunks(lengths[i] - offsets[i], 0, cache_len, min_chunk)[0] for i in live)
    group = [i for i in live if pos[i] + t <= cache_len]
    per_forward = rows_per_forward(t, max_prefill_tokens)
    for first in range(0, len(group), per_forward):
      take(group[first : first + per_forward], t)
    for i in live:
      if i not in group:  # near the end of its cache: alone, with a chunk that fits
        take([i], _chunks(lengths[i] - offsets[i], pos[i], cache_len, min_chunk)[0])
  return forwards


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

  Weights: with `weights` (a callable, e.g. `PolicyTrainer.inference_params`) the engine asks
  for the weights at every prefill and decode call, so it always decodes the trainer's current
  parameters and re-pointing cannot be forgotten; without it, it decodes `model`'s parameters
  until `load_params` points it at others. Either way, weights whose buffers were donated or
  deleted raise `StaleWeightsError` before any work, never a crash.

  Mesh: with a `mesh`, the KV cache is allocated sharded by its logical axes (`KVCache.axes`
  through `models.sharding.LOGICAL_RULES`): slots over (data, fsdp, expert) and KV heads
  over tensor (replicated over tensor where the head count does not divide), and every prefill
  and decode step keeps it so (`_pin`); the model's activations follow the same table
  (`jax.set_mesh` while tracing). Per device the cache holds num_slots / (data * fsdp * expert)
  slots.
  The slot counters (next_pos, tokens: [B] int32) are replicated.

  Args:
    model: a Qwen model (graph, and the weights unless `weights` is given), in either layout:
      without `scan_layers` the engine decodes the unrolled one (`qwen.unstack`; a stacked
      model's weights are copied into it once, or with `weights` only its graph is derived,
      allocating nothing).
    num_slots: max concurrent decodes B.
    cache_len: S, tokens per slot (prompt + all turns).
    dtype: KV cache dtype.
    max_prefill_tokens: most tokens (rows x chunk length) one prefill forward takes; a larger
      batch of prompts runs as several forwards (a single chunk longer than this still runs).
      On a 2-core CPU, 64 prompts of 128 tokens prefilled 10-15% faster as 8 forwards of 1024
      tokens than as one of 8192 (activations that fit the cache); accelerators may want more.
    record_routing: keep each slot's routing record (`routing`) when the model has MoE layers
      (for routing replay in training); no effect on a dense model.
    mesh: a `models.sharding.make_mesh` mesh to shard the KV cache over, or None (one device).
    weights: optional callable returning the nnx.State of parameters to decode with, in the
      engine's layout (unrolled, or stacked with `scan_layers`; `PolicyTrainer.inference_params`
      gives the one its `inference_stacked` names), called at every prefill and decode call.
    scan_layers: decode the stacked model (`Qwen(stacked=True)`, as training holds it) with
      each block of layers under `jax.lax.scan` and the KV cache stacked per block
      (`KVCache(stacked=True)`): prefill and decode programs no longer grow with the depth, so
      they compile in about the same time at 36 layers as at 2, and a step runs at the unrolled
      step's speed on CPU (docs/benchmarks/scan.md). Default off here (the job's
      `engine.scan_layers` turns it on): the unrolled model, one cache buffer per layer.
    prefill_rows: how a prefill forward's row count is padded: "fit" (to the next power of two
      of the rows at hand: least compute, a program per row count) or "full" (always to the most
      a forward of its chunk length takes, `rows_per_forward` capped at the slots: one program
      per chunk length and key bucket, so `prefill_shapes` is small enough to `compile_ahead`).
    prefill_min_chunk: shortest prefill chunk in tokens (a power of two up to
      MAX_PREFILL_CHUNK); shorter inputs are padded to it. Larger: fewer programs, more padding.
    prefill_min_kv: smallest key-length bucket of a prefill forward (a power of two); a fresh
      short prompt attends to this many keys. Larger: fewer programs, more attention work.
  Raises:
    ValueError: num_slots, cache_len or max_prefill_tokens below 1, num_slots that does not
      divide by the mesh's data * fsdp * expert size (the cache would otherwise be replicated),
      `scan_layers` with an unrolled model, an unknown prefill_rows, or a prefill_min_chunk /
      prefill_min_kv that is not a power of two (the chunk at most MAX_PREFILL_CHUNK).
  """

  def __init__(
    self,
    model: Qwen,
    num_slots: int,
    cache_len: int,
    dtype=jnp.float32,
    max_prefill_tokens: int = 1024,
    record_routing: bool = True,
    mesh: Mesh | None = None,
    weights: Callable[[], nnx.State] | None = None,
    scan_layers: bool = False,
    prefill_rows: str = "fit",
    prefill_min_chunk: int = PREFILL_MIN_CHUNK,
    prefill_min_kv: int = PREFILL_MIN_KV,
  ):
    if prefill_rows not in ("fit", "full"):
      raise ValueError(f"prefill_rows must be 'fit' or 'full', got {prefill_rows!r}")
    for name, value, top in (
      ("prefill_min_chunk", prefill_min_chunk, MAX_PREFILL_CHUNK),
      ("prefill_min_kv", prefill_min_kv, None),
    ):
      if value < 1 or value & (value - 1) or (top is not None and value > top):
        bound = f" of at most {top}" if top else ""
        raise ValueError(f"{name} must be a power of two{bound}, got {value}")
    if scan_layers and not model.stacked:
      raise ValueError(
        "scan_layers decodes a stacked model (Qwen(stacked=True)); got an unrolled one"
      )
    if min(num_slots, cache_len, max_prefill_tokens) < 1:
      raise ValueError(
        f"num_slots ({num_slots}), cache_len ({cache_len}) and "
        f"max_prefill_tokens ({max_prefill_tokens}) must be >= 1"
      )
    rows = 1 if mesh is None else sharding.axis_devices(mesh.shape, "batch")
    if num_slots % rows:
      raise ValueError(
        f"num_slots ({num_slots}) must divide by the mesh's data * fsdp * expert size ({rows}): "
        "the KV cache's slots are split over those devices"
      )
    self.mesh = mesh
    self._weights = weights
    self.scan_layers = scan_layers
    if weights is not None:  # holds no buffer it does not use
      graphdef = nnx.graphdef(model) if scan_layers else unrolled_template(model)[0]
      self.graphdef, self.params = graphdef, None
    else:
      self.graphdef, self.params = nnx.split(self._layout(model))
    self.config = model.config
    # The cache's key layout: "sh" where decode steps run a Pallas kernel (GPU; TPU in bfloat16).
    self.key_layout = key_layout(model.attention, dtype=dtype)
    self.num_slots = num_slots
    self.cache_len = cache_len
    self.max_prefill_tokens = max_prefill_tokens
    self.prefill_rows, self.prefill_min_chunk = prefill_rows, prefill_min_chunk
    self.prefill_min_kv = prefill_min_kv
    self.dtype = dtype
    self.shardings = self._state_shardings()
    self.slot_shards = slot_shards(self.shardings, scan_layers)
    self.state = self.init_decode_state()
    # Host mirror of state.next_pos: room checks and kv buckets need no device round trip.
    self._pos = np.zeros((num_slots,), np.int64)
    # Per slot: routing of the consumed tokens, in order, as [n, L_moe, k] pieces (host memory).
    self.record_routing = bool(record_routing) and bool(self.config.moe_layers)
    self._routing: list[list[np.ndarray]] = [[] for _ in range(num_slots)]
    # Per device, each program `compile_ahead` compiled (`compiling.ProgramMemory`).
    self.program_memory: list[compiling.ProgramMemory] = []
    self._work: dict[str, float] = collections.defaultdict(float)  # `pop_work`'s figures

  @property
  def max_concurrent_decodes(self) -> int:
    return self.num_slots

  def _layout(self, model: Qwen) -> Qwen:
    """`model` in the layout the engine decodes (see `scan_layers`)."""
    if self.scan_layers and not model.stacked:
      raise ValueError("an engine with scan_layers decodes stacked models; got an unrolled one")
    return model if self.scan_layers else unstack(model)

  def load_params(self, model: Qwen) -> None:
    """Points the engine at `model`'s weights (after a training step) and stops asking the
    `weights` callable, if one was given. Without `scan_layers` a stacked model is unrolled (a
    copy, `qwen.unstack`)."""
    self.graphdef, self.params = nnx.split(self._layout(model))
    self._weights = None

  def current_params(self) -> nnx.State:
    """The weights the next call decodes with (`weights()` when given, else `params`).

    Raises:
      StaleWeightsError: a weight buffer was donated (to a training step) or deleted.
    """
    params = self._weights() if self._weights is not None else self.params
    assert params is not None  # `params` is set whenever `_weights` is None
    if any(x.is_deleted() for x in jax.tree.leaves(params) if isinstance(x, jax.Array)):
      raise StaleWeightsError(
        "the engine's weights were donated to a training step or deleted: build the Engine with "
        "weights=trainer.inference_params, or call load_params(trainer.model()) after every update"
      )
    return params

  def _ctx(self):
    """The mesh for the model's activation sharding constraints while tracing."""
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def _state_shardings(self) -> DecodeState[NamedSharding] | None:
    """NamedShardings of the decode state on the mesh (None without one); see the class doc."""
    if self.mesh is None:
      return None
    cache = jax.eval_shape(self._zeros)
    key_axes, value_axes = KVCache.axes(self.scan_layers, self.key_layout)

    def shard(axes):
      # Without trailing Nones: the spec the programs' outputs carry, so the fresh state and
      # every later one are the same arguments to JAX's cache (an equal spec written
      # differently is another cache entry: a compile of each program again after the first
      # call, which `compile_ahead` cannot foresee; tests/test_mesh.py).
      def one(x):
        spec = tuple(sharding.param_sharding(self.mesh, axes, x.shape).spec)
        while spec and spec[-1] is None:
          spec = spec[:-1]
        return NamedSharding(self.mesh, PartitionSpec(*spec))

      return one

    replicated = NamedSharding(self.mesh, PartitionSpec())
    cache = KVCache(tuple(map(shard(key_axes), cache.k)), tuple(map(shard(value_axes), cache.v)))
    return DecodeState(cache, replicated, replicated)

  def _zeros(self) -> KVCache:
    return KVCache.zeros(
      self.config,
      self.num_slots,
      self.cache_len,
      self.dtype,
      stacked=self.scan_layers,
      keys=self.key_layout,
    )

  def init_decode_state(self) -> DecodeState:
    """A fresh decode state (zero cache, counters at 0), placed by `shardings` on a mesh."""
    if self.shardings is None:
      cache = self._zeros()
      # Two distinct buffers: the state is donated, and one buffer donated twice is an error.
      return DecodeState(
        cache, jnp.zeros((self.num_slots,), jnp.int32), jnp.zeros((self.num_slots,), jnp.int32)
      )

    def fresh():
      cache = self._zeros()
      zeros = jnp.zeros((self.num_slots,), jnp.int32)
      return DecodeState(cache, zeros, zeros + 0)

    # Each device allocates only its own shard (never the whole cache on one device).
    return jax.jit(fresh, out_shardings=self.shardings)()

  def reset_slot(self, slot: int) -> None:
    """Frees a slot: its next request starts at cache index 0."""
    self.state = self.state._replace(next_pos=self.state.next_pos.at[slot].set(0))
    self._pos[slot] = 0
    self._routing[slot] = []

  def routing(self, slot: int) -> np.ndarray | None:
    """The experts each token consumed into `slot` since its reset was routed to.

    Returns:
      [position(slot), L_moe, k] numpy array (`models.qwen.routing_dtype`, int16 for every Qwen
      MoE): row i holds token i's top-k expert indices in each MoE layer (`config.moe_layers`
      order), as the engine's forward chose them; or None when the model is dense or the engine
      does not record routing. The pending sampled token is not consumed yet, so not included.
    """
    if not self.record_routing:
      return None
    pieces = self._routing[slot]
    if not pieces:
      moe, k = len(self.config.moe_layers), self.config.num_experts_per_tok
      return np.zeros((0, moe, k), routing_dtype(self.config.num_experts))
    if len(pieces) > 1:  # keep the joined record: later calls append to it
      self._routing[slot] = [np.concatenate(pieces)]
    return self._routing[slot][0]

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
    self, requests: Sequence[tuple[int, Sequence[int], jax.Array]], sampling: SamplingParams
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

    Three steps: `_check_prefill` (every request is valid before any work), `prefill_schedule`
    (which requests share which forward, at which chunk length) and `_prefill_forward` (one
    batched forward).

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
    ids_list = self._check_prefill(requests)
    starts = [self.position(s) for s in slots]
    # One key-length bucket for the whole call where the padding allows: a long prompt compiles
    # one (chunk, bucket) shape rather than one per bucket it passes through.
    kv_call = _kv_bucket(
      max(p + len(x) for p, x in zip(starts, ids_list)), self.cache_len, self.prefill_min_kv
    )
    schedule = prefill_schedule(
      [len(x) for x in ids_list],
      starts,
      self.cache_len,
      self.max_prefill_tokens,
      self.prefill_min_chunk,
    )
    offsets = [0] * len(requests)
    out: list[tuple[int, float] | None] = [None] * len(requests)
    forwards = [(part, t) for rows, t in schedule for part in self._split_by_block(rows, slots, t)]
    for rows, t in forwards:
      pieces = [ids_list[i][offsets[i] : offsets[i] + t] for i in rows]
      tok, logp = self._prefill_forward(
        [slots[i] for i in rows], pieces, [requests[i][2] for i in rows], t, sampling, kv_call
      )
      for r, i in enumerate(rows):
        offsets[i] += len(pieces[r])
        if offsets[i] == len(ids_list[i]):  # its last chunk: the sample counts
          out[i] = (int(tok[r]), float(logp[r]))
    return out  # type: ignore[return-value]

  def _check_prefill(
    self, requests: Sequence[tuple[int, Sequence[int], jax.Array]]
  ) -> list[np.ndarray]:
    """Validates every request of `prefill_many` before any work.

    Returns:
      Each request's token ids as a 1-D int32 array, in order.
    Raises:
      ValueError: a slot outside [0, num_slots) or repeated, an empty input, a token id that is
        not an integer in [0, vocab_size), or more tokens than a slot has room for.
    """
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
    return ids_list

  def _prefill_forward(
    self,
    slots_r: list[int],
    pieces_r: list[np.ndarray],
    keys_r: list[jax.Array],
    t: int,
    sampling: SamplingParams,
    min_kv_len: int,
  ) -> tuple[np.ndarray, np.ndarray]:
    """One batched forward: row r appends `pieces_r[r]` (1 to t int32 ids) to slot `slots_r[r]`
    and samples that slot's next token with `keys_r[r]`.

    Rows are laid out by device block and padded (`_row_layout`, `padded_rows`) and every piece
    to length t, so few shapes compile. The forward attends to a key-length bucket of at least
    `min_kv_len` entries, more if a row's new position needs it. Advances the slots' host
    positions by their pieces' lengths.

    Returns:
      (tokens [R] int32, log-probs [R] float32) as numpy, one per real row; a row's sample is
      meaningful only after its request's last piece. Appends each real row's routing to its
      slot's record when recording.
    """
    rows = len(slots_r)
    layout = self._row_layout(slots_r, t)
    chunk = np.zeros((len(layout), t), np.int32)
    true_len = np.ones((len(layout),), np.int32)
    slot_rows = np.full((len(layout),), self.num_slots, np.int32)  # padding: writes nothing
    for p, r in enumerate(layout):
      if r >= 0:
        piece = pieces_r[r]
        chunk[p, : len(piece)], true_len[p], slot_rows[p] = piece, len(piece), slots_r[r]
    keys_p = [keys_r[max(r, 0)] for r in layout]
    end = int(self._pos[slots_r].max()) + t
    kv_len = max(min_kv_len, _kv_bucket(end, self.cache_len, self.prefill_min_kv))
    if end > kv_len:  # _prefill_rows reads and writes the window [0, kv_len) only
      raise RuntimeError(f"prefill forward reaches entry {end} past its key bucket {kv_len}")
    start = time.perf_counter()
    args = self._prefill_args(slot_rows, chunk, true_len, keys_p, sampling, kv_len)
    with self._ctx():
      self.state, tok, logp, routing = _prefill_rows(*args)
    tok, logp = np.asarray(tok), np.asarray(logp)  # the one copy to the host
    self._count_work(
      "prefill", start, forwards=1, tokens=sum(map(len, pieces_r)),
      padded_tokens=chunk.size, key_entries=chunk.size * kv_len,
    )  # fmt: skip
    at = np.zeros((rows,), np.int64)  # the padded row that carries real row r (its first)
    for p, r in reversed(list(enumerate(layout))):
      if r >= 0:
        at[r] = p
    if self.record_routing:
      routing = np.asarray(routing)
      for r in range(rows):
        self._routing[slots_r[r]].append(routing[at[r], : len(pieces_r[r])].copy())
    for r in range(rows):
      self._pos[slots_r[r]] += len(pieces_r[r])
    return tok[at], logp[at]

  def padded_rows(self, rows: int, t: int) -> int:
    """The row count a prefill forward of chunk length t runs at when the device block with the
    most of its requests has `rows` of them (all of them without a mesh): `slot_shards` blocks
    of the next power of two of `rows` ("fit"), or of the most rows a forward of that length
    takes (`rows_per_forward` capped at the slots' next power of two) split over the blocks
    ("full")."""
    if self.prefill_rows == "fit":
      return self.slot_shards * _pow2_at_least(rows)
    full = min(rows_per_forward(t, self.max_prefill_tokens), _pow2_at_least(self.num_slots))
    return self.slot_shards * max(1, full // self.slot_shards)

  def _block_capacity(self, t: int) -> int:
    """The most requests of one device block a forward of chunk length t takes: the forward's
    `rows_per_forward` split over the blocks (at least one each), at most a block's slots."""
    per_block = self.num_slots // self.slot_shards
    return max(1, min(rows_per_forward(t, self.max_prefill_tokens) // self.slot_shards, per_block))

  def _by_block(self, slots: Sequence[int]) -> list[list[int]]:
    """Positions in `slots` grouped by the device block that holds each slot, in order."""
    per_block = self.num_slots // self.slot_shards
    blocks: list[list[int]] = [[] for _ in range(self.slot_shards)]
    for i, slot in enumerate(slots):
      blocks[slot // per_block].append(i)
    return blocks

  def _split_by_block(self, requests: list[int], slots: list[int], t: int) -> list[list[int]]:
    """`requests` (indices into `slots`) as forwards that each take at most `_block_capacity`
    requests of any device block. Without a mesh: one forward of all of them, as given."""
    cap = self._block_capacity(t)
    blocks = [[requests[j] for j in x] for x in self._by_block([slots[i] for i in requests])]
    n = max(-(-len(x) // cap) for x in blocks)
    return [[i for x in blocks for i in x[j * cap : (j + 1) * cap]] for j in range(n)]

  def _row_layout(self, slots_r: list[int], t: int) -> list[int]:
    """Where each row of a prefill forward goes: per padded row, the index of the real row it
    carries (a padding row repeats its block's first real row: identical writes), or -1 for a
    padding row in a block without real rows (its slot is `num_slots`: it writes nothing).
    Row block d (padded_rows / slot_shards rows) holds device d's slots only, as
    `_prefill_rows` needs on a mesh; without one: the rows in order, then copies of row 0."""
    blocks = self._by_block(slots_r)
    width = self.padded_rows(max(map(len, blocks)), t) // self.slot_shards
    layout = []
    for rows in blocks:
      if len(rows) > width:
        raise RuntimeError(f"a prefill forward got {len(rows)} rows of one device, room {width}")
      layout += rows + (rows[:1] if rows else [-1]) * (width - len(rows))
    return layout

  def slot_order(self) -> list[int]:
    """Every slot, in the order to hand them out: round-robin over the device blocks of the
    cache (`slot_shards`), so that requests started together spread over the devices and
    their prefill rows balance; 0 .. num_slots - 1 without a mesh."""
    per_block = self.num_slots // self.slot_shards
    return [d * per_block + j for j in range(per_block) for d in range(self.slot_shards)]

  def _prefill_args(self, slot_rows, chunk, true_len, keys_p, sampling, kv_len) -> tuple:
    """`_prefill_rows`'s arguments, made alike for a call and for `compile_ahead` (one program
    per shape and static argument, whichever made them)."""
    return (
      self.graphdef,
      self.current_params(),
      self.state,
      jnp.asarray(slot_rows),
      jnp.asarray(chunk),
      jnp.asarray(true_len),
      jnp.stack(keys_p),
      sampling,
      kv_len,
      self.shardings,
    )

  def prefill_shapes(self) -> list[tuple[int, int, int]]:
    """Every (rows, chunk length t, key-length bucket) a prefill forward of this engine can run
    at, for one `SamplingParams` (each sampling is its own program): chunk lengths are powers of
    two from `prefill_min_chunk` to MAX_PREFILL_CHUNK (shorter ones only within
    `prefill_min_chunk` of the end of a cache, with the top key buckets), rows `padded_rows` of
    up to `rows_per_forward` requests (and the slots), keys the `prefill_min_kv` buckets from t
    up. A superset of what `prefill_many` runs (tests/test_engine.py); sorted."""
    shapes: set[tuple[int, int, int]] = set()
    # A chunk below prefill_min_chunk is halved from one that passed the end of the cache.
    near_end = max(1, self.cache_len - self.prefill_min_chunk + 1)
    t = 1
    while t <= min(MAX_PREFILL_CHUNK, self.cache_len):
      kvs = _kv_buckets(
        self.cache_len, self.prefill_min_kv, t if t >= self.prefill_min_chunk else near_end
      )
      rows = {self.padded_rows(r, t) for r in range(1, self._block_capacity(t) + 1)}
      shapes.update((r, t, kv) for r in rows for kv in kvs)
      t *= 2
    return sorted(shapes)

  def decode_buckets(self) -> list[int]:
    """Every key-length bucket of a decode step (`generate`, `generate_steps`), ascending."""
    return _kv_buckets(self.cache_len, DECODE_MIN_KV)

  def generate(
    self, active: np.ndarray, rng: jax.Array, sampling: SamplingParams
  ) -> tuple[np.ndarray, np.ndarray]:
    """One decode step for every slot; only `active` ([B] bool) slots advance.

    `rng` is one key for the step, or [B] keys (one per slot: see `sample`).

    Each active slot writes its pending token at cache index `position(slot)` and samples the next
    (and, when recording, appends that token's routing to the slot's record).

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
    args = self._generate_args(active, rng, sampling, kv_len)
    with self._ctx():
      self.state, tok, logp, routing = _generate(*args)
    if self.record_routing:
      routing = np.asarray(routing)
      for slot in np.flatnonzero(active):
        self._routing[slot].append(routing[slot : slot + 1].copy())
    self._pos[active] += 1
    return np.asarray(tok), np.asarray(logp)

  def generate_steps(
    self,
    active: np.ndarray,
    keys: jax.Array,
    counts: np.ndarray,
    limits: np.ndarray,
    stop_ids: Collection[int],
    sampling: SamplingParams,
    max_steps: int,
  ) -> tuple[np.ndarray, np.ndarray]:
    """Up to `max_steps` decode steps in one device call and one copy to the host.

    Step j is what `generate(active, per_row_keys(keys, counts + j), sampling)` would do, with
    the key-length bucket `generate` would choose, in one compiled step for every K: a call with
    K = 1 gives the tokens and log-probs of the K-step call's first step bit for bit, so K only
    changes how many steps a call takes (tests/test_engine.py). (`generate` itself is another
    program, whose logits XLA may round differently in the last bit.) The device stops early, after
    the step in which an active slot finishes: samples one of `stop_ids` or reaches its limit
    (`limits[b]` more tokens); and before the step whose keys would pass the bucket of the
    call's start (the next call takes the next bucket). So every step of a call has the same
    active slots, and a caller that handles the tokens step by step sees what it would have
    seen from single steps.

    Args:
      active: [B] bool, the slots that advance.
      keys: [B] PRNG keys; slot b's step-j token samples with fold_in(keys[b], counts[b] + j).
      counts: [B] int, tokens each slot's request has sampled so far (its key's counter).
      limits: [B] int >= 1 for active slots: tokens the slot may sample before its request
        ends by length (the caller's token limit or the end of its cache room).
      stop_ids: ids that end a slot's request when sampled.
      sampling: static sampling parameters.
      max_steps: K, the most steps of this call (static: one program per K and bucket).
    Returns:
      (tokens [n, B] int32, log-probs [n, B] float32) as numpy, n in [1, max_steps] the steps
      run; inactive slots repeat their last token. Routing (MoE, when recording) is appended per
      step as by `generate`; that is a second copy to the host.
    Raises:
      ValueError: a wrong shape, max_steps < 1, no active slot, an active slot with no room left
        or a limit < 1.
    """
    active = np.asarray(active, bool)
    counts, limits = np.asarray(counts), np.asarray(limits)
    if {active.shape, counts.shape, limits.shape} != {(self.num_slots,)}:
      raise ValueError(f"active, counts and limits must have shape ({self.num_slots},)")
    if max_steps < 1 or not active.any():
      raise ValueError(f"generate_steps needs max_steps >= 1 ({max_steps}) and an active slot")
    full = np.flatnonzero(active & (self._pos >= self.cache_len))
    if full.size:
      raise ValueError(f"slots {full.tolist()} are full (cache {self.cache_len}); end them first")
    if (limits[active] < 1).any():
      raise ValueError(f"active slots need limits >= 1, got {limits[active].tolist()}")
    top = int(self._pos[active].max())
    kv_len = _kv_bucket(top + 1, self.cache_len)  # `generate`'s bucket for the first step
    n_steps = min(max_steps, kv_len - top)  # steps whose writes stay inside that bucket
    start = time.perf_counter()
    args = self._generate_steps_args(
      active, keys, counts, limits, n_steps, stop_ids, sampling, kv_len, max_steps
    )
    with self._ctx():
      self.state, packed, routing = _generate_steps(*args)
    packed = jax.device_get(packed)  # the one copy to the host
    n = int(packed[-1, 0])
    self._count_work(
      "decode", start, calls=1, steps=n, tokens=n * int(active.sum()),
      key_entries=n * self.num_slots * kv_len,
    )  # fmt: skip
    tokens, logps = packed[:n], packed[max_steps : max_steps + n].view(np.float32)
    if self.record_routing:
      routing = np.asarray(routing)
      for slot in np.flatnonzero(active):
        self._routing[slot].extend(routing[j, slot : slot + 1].copy() for j in range(n))
    self._pos[active] += n
    return tokens, logps

  def _count_work(self, what: str, start: float, **counts: int) -> None:
    """Adds a device call's counts and its wall seconds since `start` to `pop_work`'s figures."""
    self._work[f"{what}_seconds"] += time.perf_counter() - start
    for name, n in counts.items():
      self._work[f"{what}_{name}"] += n

  def pop_work(self) -> dict[str, float]:
    """What the engine's prefill forwards and multi-step decode calls (`generate_steps`) did
    since the last call, then starts counting again: where a rollout's time goes.

    Returns:
      {"engine/<name>": value}: prefill_forwards, prefill_tokens (real), prefill_padded_tokens
      (rows x chunk length, padding included), prefill_key_entries (rows x chunk x key bucket:
      what the attention reads), prefill_seconds; decode_calls, decode_steps, decode_tokens
      (steps x active slots), decode_key_entries (steps x slots x key bucket), decode_seconds.
      Seconds are host wall time of each call, its arguments and the copy of its results to the
      host included (every call copies them before returning). Names not yet seen are absent.
    """
    out = {f"engine/{k}": float(v) for k, v in sorted(self._work.items())}
    self._work.clear()
    return out

  def _generate_args(self, active, rng, sampling, kv_len) -> tuple:
    """`_generate`'s arguments (see `_prefill_args`)."""
    return (
      self.graphdef,
      self.current_params(),
      self.state,
      jnp.asarray(active),
      rng,
      sampling,
      kv_len,
      self.shardings,
    )

  def _generate_steps_args(
    self, active, keys, counts, limits, n_steps, stop_ids, sampling, kv_len, max_steps
  ) -> tuple:
    """`_generate_steps`'s arguments (see `_prefill_args`)."""
    stops = np.asarray(sorted(set(stop_ids)) or [-1], np.int32)
    return (
      self.graphdef,
      self.current_params(),
      self.state,
      jnp.asarray(active),
      keys,
      jnp.asarray(counts, jnp.int32),
      jnp.asarray(np.where(active, limits, 1 << 30), jnp.int32),
      jnp.int32(n_steps),
      jnp.asarray(stops),
      sampling,
      kv_len,
      max_steps,
      self.shardings,
    )

  def compile_ahead(
    self,
    samplings: Sequence[SamplingParams],
    stop_ids: Collection[int],
    decode_steps: Sequence[int] = (1,),
    threads: int = 0,
  ) -> int:
    """Compiles every program the batcher and the agent loop can run, before they run them:
    `_prefill_rows` at each of `prefill_shapes()` and `_generate_steps` at each of
    `decode_buckets()` and each K of `decode_steps` (they decode through `generate_steps`, K = 1
    included: `decode_tokens`), for each sampling. Lowered with the arguments a call makes
    (`_prefill_args`, ...), so the calls find them in JAX's cache and compile nothing
    (tests/test_engine.py counts it); nothing runs and the decode state is untouched. The
    single-step `generate` (the JetStream contract's step) is not compiled here.

    Args:
      samplings: the `SamplingParams` the engine will decode with (each is its own program).
      stop_ids: the stop ids `generate_steps` will get (their count is part of its shape).
      decode_steps: the K values decode calls will use.
      threads: compiles at once (`compiling.compile_threads`: 0 = the host's CPU count, at
        most 8).
    Returns:
      The number of programs lowered and compiled (those already compiled are cache hits); each
      one's memory per device is appended to `program_memory`.
    """
    jobs: list[
      tuple[str, Callable, tuple]
    ] = []  # arguments made here: `weights()` is not re-entrant
    b = self.num_slots
    keys = jax.random.split(jax.random.key(0), b)
    active, zeros = np.ones((b,), bool), np.zeros((b,), np.int32)
    for sampling in samplings:
      for rows, t, kv in self.prefill_shapes():
        args = self._prefill_args(
          np.zeros((rows,), np.int32),
          np.zeros((rows, t), np.int32),
          np.ones((rows,), np.int32),
          [keys[0]] * rows,
          sampling,
          kv,
        )
        jobs.append((f"prefill rows={rows} t={t} kv={kv}", _prefill_rows, args))
      for kv in self.decode_buckets():
        for k in sorted(set(decode_steps)):
          args = self._generate_steps_args(
            active, keys, zeros, zeros + 1, k, stop_ids, sampling, kv, k
          )
          jobs.append((f"decode slots={b} kv={kv} steps={k}", _generate_steps, args))
    calls = [functools.partial(self._compile, *job) for job in jobs]
    compiling.run_all(calls, threads)
    return len(jobs)

  def _compile(self, name: str, fn, args: tuple) -> None:
    with self._ctx():  # per thread: the mesh context is thread-local
      memory = compiling.ProgramMemory.of(name, fn.lower(*args).compile())
    if memory is not None:
      self.program_memory.append(memory)  # list.append: one at a time under the GIL


if TYPE_CHECKING:  # mypy checks Engine against the SlotEngine protocol
  from coevolve_jax.rollout.slots import SlotEngine

  def _conforms(engine: Engine) -> SlotEngine:
    return engine
