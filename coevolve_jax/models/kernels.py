"""Attention kernels from JAX: for the cache-free passes (training forward and backward,
scoring) TPU splash attention and cuDNN's fused attention, and for the engine's decode steps
JAX's Pallas ragged decode kernel on GPU and its paged-attention kernel on TPU, each run per
device inside `jax.shard_map` over the mesh's batch and head axes.

`model.attention` (`ATTENTION_KERNELS`) chooses, `resolve_attention` turns "auto" into a kernel
for the backend, and `qwen._attend_by_pass` (the one function every attention of the model goes
through) calls `fused_attention` for "splash" and "cudnn" on passes without a KV cache. The last
layer of a scoring pass (queries at chosen positions) and, off a TPU, prefill chunks from a KV
cache keep the XLA paths: the fused kernels mask by index (causal) and segment, not by the
per-slot positions a cache holds.

The kernels assume what the model's cache-free passes guarantee: a valid key's position rises
with its index (positions are the running count of real tokens, or `arange`), so "key position
<= query position among valid keys" is "key index <= query index among valid keys". Padding (a
[B, T] validity mask) becomes splash's segment ids (valid 1, padding 0), where a query of a
padding token sees padding keys only, or cuDNN's sequence lengths after the real tokens are moved
to the front (`_cudnn_local`); a padding token's output is not read.

A decode step (one query per slot) reads each slot's keys only up to that slot's length, where
the XLA paths read every slot to the longest one's bucket, with
- "cudnn" (the "auto" choice on GPU): `ragged_decode_attention`, JAX's Pallas GPU decode kernel
  (`decode_attention.gqa`);
- "splash" (the "auto" choice on TPU) over a bfloat16 cache: `paged_decode_attention`, JAX's
  Pallas TPU paged-attention kernel (`paged_attention`) over the dense cache seen as pages. That
  kernel rounds keys and values to bfloat16 whatever their dtype, so a float32 cache (parity
  runs) keeps the exact XLA paths.
On a TPU, over a bfloat16 cache, a prefill chunk runs `paged_prefill_attention`, JAX's Pallas
TPU ragged paged-attention kernel (`prefill_kernel`), reading each row to its chunk's last entry.
These kernels read keys position-major, so with them the KV cache keeps keys [B, K, S, H]
(`key_layout` "sh", the values' layout) instead of the [B, K, H, S] ("hs") that the XLA:CPU
decode wants (`qwen.KVCache`).

Dimension letters as in qwen.py: B batch, T tokens, N query heads, K key/value heads, H head size,
S cache entries.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from coevolve_jax.models.sharding import active_mesh, param_spec

ATTENTION_KERNELS = ("auto", "xla", "blocked", "splash", "cudnn")
# How a KV cache lays out its keys: "hs" [B, K, H, S] (positions minor: the XLA:CPU decode's
# scores product in the standard layout) or "sh" [B, K, S, H] (as the values; what a Pallas decode
# kernel reads). `key_layout` picks one from `model.attention`.
KEY_LAYOUTS = ("hs", "sh")
# Splash's query and key blocks (its BlockSizes for the forward and both backward kernels):
# MaxText's default for v5p, and a multiple of the TPU's 128 lanes. Shorter passes use one block
# of their own (padded) length.
SPLASH_BLOCK = 512
SPLASH_MIN_BLOCK = 128
# cuDNN's fused attention takes half-precision inputs and head sizes up to 128 (multiples of 8).
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def default_backend() -> str:
  """JAX's default backend, as every kernel choice here reads it (one place, so that a test on
  CPU can run a GPU's choices through their CPU implementations: Pallas interpret mode, the "xla"
  implementation of cuDNN's call)."""
  return jax.default_backend()


def resolve_attention(kernel: str, backend: str | None = None) -> str:
  """The kernel `model.attention` = `kernel` runs on `backend` (default: JAX's).

  "auto": "splash" on TPU, "cudnn" on GPU (where `cudnn_supports` the pass; else "blocked"),
  "blocked" elsewhere, which is the CPU path of every earlier release (query-blocked causal
  passes, key-blocked online softmax from 4,096 keys). "xla": one plain masked softmax.

  Raises:
    ValueError: an unknown kernel, or "cudnn" on a backend other than GPU ("splash" runs in Pallas
      interpret mode off TPU: exact, and slow).
  """
  if kernel not in ATTENTION_KERNELS:
    raise ValueError(f"unknown attention kernel {kernel!r}; known: {', '.join(ATTENTION_KERNELS)}")
  backend = backend or default_backend()
  if kernel == "auto":
    return {"tpu": "splash", "gpu": "cudnn"}.get(backend, "blocked")
  if kernel == "cudnn" and backend != "gpu":
    raise ValueError(
      f"model.attention='cudnn' needs an NVIDIA GPU (JAX's backend here is {backend!r}); use "
      "'auto', 'blocked' or 'xla'"
    )
  return kernel


def decode_kernel(kernel: str, backend: str | None = None, dtype=None) -> str:
  """The attention of a decode step (`qwen._attend_by_pass`) for `model.attention` = `kernel`
  over a KV cache of `dtype` (default float32): "ragged" (`ragged_decode_attention`) where the
  kernel resolves to "cudnn" (a GPU); "paged" (`paged_decode_attention`) where it resolves to
  "splash" (a TPU; Pallas's TPU interpret mode elsewhere) and the cache is bfloat16, the only
  dtype that kernel keeps exact; elsewhere the resolved kernel, whose cached passes take the
  XLA paths ("splash" over a float32 cache decodes as "blocked").

  Raises:
    ValueError: as `resolve_attention`.
  """
  resolved = resolve_attention(kernel, backend)
  if resolved == "cudnn":
    return "ragged"
  if resolved == "splash" and jnp.dtype(jnp.float32 if dtype is None else dtype) == jnp.bfloat16:
    return "paged"
  return resolved


def prefill_kernel(kernel: str, backend: str | None = None, dtype=None) -> str:
  """The attention of a prefill chunk from a KV cache (`qwen._attend_by_pass`) for
  `model.attention` = `kernel` over a cache of `dtype`: "paged" (`paged_prefill_attention`) on a
  TPU where decode steps take the paged kernel (`decode_kernel`; a bfloat16 cache); elsewhere the
  resolved kernel, whose cached passes take the XLA paths (JAX's ragged paged-attention kernel
  runs on TPUs only: neither Pallas interpret mode of JAX 0.10 runs it).

  Raises:
    ValueError: as `resolve_attention`.
  """
  backend = backend or default_backend()
  if backend == "tpu" and decode_kernel(kernel, backend, dtype) == "paged":
    return "paged"
  return resolve_attention(kernel, backend)


def key_layout(kernel: str, backend: str | None = None, dtype=None) -> str:
  """The KV cache's key layout (`KEY_LAYOUTS`) for `model.attention` = `kernel` and a cache of
  `dtype` (default float32): "sh" where decode steps run a Pallas kernel (`decode_kernel`
  "ragged" or "paged"), "hs" elsewhere (every CPU run of the default kernel).

  Raises:
    ValueError: as `resolve_attention`.
  """
  return "sh" if decode_kernel(kernel, backend, dtype) in ("ragged", "paged") else "hs"


def cudnn_supports(dtype, head_dim: int) -> bool:
  """Whether cuDNN's fused attention takes inputs of `dtype` and head size `head_dim`."""
  return jnp.dtype(dtype) in [jnp.dtype(d) for d in CUDNN_DTYPES] and (
    head_dim <= 128 and head_dim % 8 == 0
  )


def _splash_block(t: int) -> int:
  """Splash's block for T tokens: SPLASH_BLOCK, or T rounded up to a multiple of
  SPLASH_MIN_BLOCK when shorter."""
  return min(SPLASH_BLOCK, -(-t // SPLASH_MIN_BLOCK) * SPLASH_MIN_BLOCK)


def _splash_kernel(num_heads: int, t: int, block: int, interpret: bool):
  """A causal multi-head splash kernel for one example ([N, T, H] queries, [K, T, H] keys and
  values; GQA when K < N). Built in each trace (as MaxText does): the kernel holds arrays of the
  trace it was made in."""
  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  mask = masks.MultiHeadMask([masks.CausalMask((t, t)) for _ in range(num_heads)])
  sizes = splash.BlockSizes(
    block_q=block,
    block_kv=block,
    block_kv_compute=block,
    block_q_dkv=block,
    block_kv_dkv=block,
    block_kv_dkv_compute=block,
    block_q_dq=block,
    block_kv_dq=block,
  )
  return splash.make_splash_mha(
    mask, head_shards=1, q_seq_shards=1, block_sizes=sizes, interpret=interpret
  )


def _splash_local(q_bnth, k_bkth, v_bkth, valid_bt, *, interpret: bool):
  """One device's splash attention: [B, N, T, H] (queries pre-scaled) -> [B, N, T, H]."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=g-import-not-at-top
    splash_attention_kernel as splash,
  )

  b, n, t, _ = q_bnth.shape
  block = _splash_block(t)
  padded = -(-t // block) * block
  if padded != t:  # trailing padding: segment 0, after every real token (never seen by one)
    valid_bt = jnp.ones((b, t), jnp.bool_) if valid_bt is None else valid_bt
    grow = lambda x: jnp.pad(x, [(0, 0)] * 2 + [(0, padded - t), (0, 0)])  # noqa: E731
    q_bnth, k_bkth, v_bkth = grow(q_bnth), grow(k_bkth), grow(v_bkth)
    valid_bt = jnp.pad(valid_bt, [(0, 0), (0, padded - t)])
  kernel = _splash_kernel(n, padded, block, interpret)
  if valid_bt is None:  # every token real and no padding: no segment ids to mask by
    out = jax.vmap(kernel)(q_bnth, k_bkth, v_bkth)
  else:
    segments = valid_bt.astype(jnp.int32)
    out = jax.vmap(kernel)(
      q_bnth, k_bkth, v_bkth, segment_ids=splash.SegmentIds(q=segments, kv=segments)
    )
  return out[:, :, :t]


def _cudnn_local(q_btnh, k_btkh, v_btkh, valid_bt, *, implementation: Literal["xla", "cudnn"]):
  """One device's `jax.nn.dot_product_attention` (causal): [B, T, N, H] -> [B, T, N, H].

  Padding: each row's real tokens are moved to its front in their order (a stable sort of the
  validity), attended with cuDNN's own padding mask (`query_seq_lengths` and
  `key_value_seq_lengths` = the real count), and moved back; padding positions' outputs are 0.
  Among real tokens "key index <= query index" is unchanged by the move, so this is the masked
  softmax of a left-padded (or any) row, with O(T) extra memory: cuDNN rejects a broadcast
  [B, 1, 1, T] mask, and a [B, 1, T, T] one would cost T^2 per row.
  """
  if valid_bt is None:
    return jax.nn.dot_product_attention(
      q_btnh, k_btkh, v_btkh, is_causal=True, implementation=implementation
    )
  order = jnp.argsort(~valid_bt, axis=1, stable=True)  # [B, T]: real tokens first, in order
  back = jnp.argsort(order, axis=1)
  take = lambda x, idx: jnp.take_along_axis(x, idx[:, :, None, None], axis=1)  # noqa: E731
  lengths = jnp.sum(valid_bt, axis=1, dtype=jnp.int32)
  out = jax.nn.dot_product_attention(
    take(q_btnh, order),
    take(k_btkh, order),
    take(v_btkh, order),
    is_causal=True,
    query_seq_lengths=lengths,
    key_value_seq_lengths=lengths,
    implementation=implementation,
  )
  return jnp.where(valid_bt[:, :, None, None], take(out, back), 0)


def fused_attention(
  kernel: str,
  q_btnh: jax.Array,
  keys_bkhs: jax.Array,
  values_bksh: jax.Array,
  valid_bt: jax.Array | None,
  *,
  implementation: Literal["xla", "cudnn"] = "cudnn",
) -> jax.Array:
  """Causal self-attention of a cache-free pass by a fused kernel, with GQA.

  Args:
    kernel: "splash" (TPU; Pallas interpret mode elsewhere) or "cudnn".
    q_btnh: [B, T, N, H] queries (not scaled: both kernels are given 1 / sqrt(H) here).
    keys_bkhs: [B, K, H, T] keys, values_bksh: [B, K, T, H] values (`qwen.KVCache`'s layout);
      K divides N.
    valid_bt: [B, T] bool, False at padding, or None when every token is real.
    implementation: for "cudnn", `jax.nn.dot_product_attention`'s implementation (default
      "cudnn"; tests on CPU pass "xla" to check the same call's layouts and masks).
  Returns:
    [B, T, N, H] outputs in the values' dtype. With a mesh active (`jax.set_mesh`), the kernel
    runs per device under `jax.shard_map`: rows split as the "batch" logical axis, heads as
    "act_heads" (the KV heads alike when the head axes divide K; else each device gets the KV
    heads of its query heads, repeated), so it needs no collective.
  Raises:
    ValueError: an unknown kernel.
  """
  b, t, n, h = q_btnh.shape
  kh = keys_bkhs.shape[1]
  if kernel == "splash":
    q = (q_btnh * (h**-0.5)).transpose(0, 2, 1, 3)  # [B, N, T, H]
    k = keys_bkhs.transpose(0, 1, 3, 2).astype(q.dtype)  # [B, K, T, H]
    v = values_bksh
    local = functools.partial(_splash_local, interpret=jax.default_backend() != "tpu")
    head_axis = 1
  elif kernel == "cudnn":
    q = q_btnh
    k = keys_bkhs.transpose(0, 3, 1, 2).astype(q.dtype)  # [B, T, K, H]
    v = values_bksh.transpose(0, 2, 1, 3)
    local = functools.partial(_cudnn_local, implementation=implementation)
    head_axis = 2
  else:
    raise ValueError(f"fused_attention runs 'splash' or 'cudnn', not {kernel!r}")
  mesh = active_mesh()
  if mesh is None:
    out = local(q, k, v, valid_bt)
  else:
    q_spec = param_spec(mesh.shape, _axes(head_axis, "act_heads"), q.shape)
    heads = q_spec[head_axis]
    kv_spec = param_spec(mesh.shape, _axes(head_axis, "act_kv_heads"), k.shape)
    if kv_spec[head_axis] != heads:  # the head axes split N but not K: repeat K to N first
      k, v = (jnp.repeat(x, n // kh, axis=head_axis) for x in (k, v))
      kv_spec = q_spec
    args, specs = [q, k, v], [q_spec, kv_spec, kv_spec]
    if valid_bt is not None:
      args.append(valid_bt)
      specs.append(P(q_spec[0], None))
    with jax.named_scope(f"{kernel}_attention"):
      out = jax.shard_map(
        lambda q, k, v, m=None: local(q, k, v, m),
        mesh=mesh,
        in_specs=tuple(specs),
        out_specs=q_spec,
        # Pallas's output shapes carry no varying-axes type; the body has no collective.
        check_vma=kernel != "splash",
      )(*args)
  out = out.astype(values_bksh.dtype)
  return out.transpose(0, 2, 1, 3) if kernel == "splash" else out


# Keys per inner step of the ragged decode kernel (its block_k; Triton wants a power of two) and
# the most splits of a slot's keys that it reduces in parallel (its k_splits, JAX's default).
RAGGED_DECODE_BLOCK = 128
RAGGED_DECODE_SPLITS = 16


def ragged_decode_splits(s: int) -> tuple[int, int] | None:
  """(k_splits, block_k) of the ragged decode kernel over S cache entries per slot, or None where
  it cannot take S. The kernel needs S = k_splits x part with part >= 16 and a block (a power of
  two of 16 to RAGGED_DECODE_BLOCK) dividing part: the most splits up to RAGGED_DECODE_SPLITS
  that allow it, with the largest such block."""
  splits = RAGGED_DECODE_SPLITS
  while splits >= 1:
    part = s // splits
    if s % splits == 0 and part >= 16 and math.gcd(part, RAGGED_DECODE_BLOCK) >= 16:
      return splits, math.gcd(part, RAGGED_DECODE_BLOCK)
    splits //= 2
  return None


def ragged_decode_attention(
  q_bnh: jax.Array, keys_bksh: jax.Array, values_bksh: jax.Array, lengths_b: jax.Array
) -> jax.Array:
  """A decode step's attention by JAX's Pallas GPU decode kernel
  (`jax.experimental.pallas.ops.gpu.decode_attention.gqa`; Pallas interpret mode off a GPU:
  exact, and slow): slot b attends to its cache entries [0, lengths_b[b]) and the kernel reads
  no entry past them (its loop over key blocks stops at the slot's length), where the XLA paths
  read every slot up to the longest one's bucket. Flash-decoding: each slot's keys are split in
  up to RAGGED_DECODE_SPLITS parts reduced in parallel, then combined.

  Args:
    q_bnh: [B, N, H] queries (not scaled: the kernel scales the scores by 1 / sqrt(H) after the
      product, as `qwen._attend` does); cast to the cache's dtype.
    keys_bksh, values_bksh: [B, K, S, H] keys and values (a KV cache of key layout "sh"); K
      divides N (GQA: query head n reads KV head n // (N / K)).
    lengths_b: [B] int32 entries each slot attends to, in [1, S].
  Returns:
    [B, N, H] outputs in the values' dtype. With a mesh active (`jax.set_mesh`), the kernel runs
    per device under `jax.shard_map`: slots split as the "batch" logical axis, KV heads as
    "act_kv_heads" and the query heads with them (where the head axes do not divide K, the cache
    is replicated over them and each device computes every head of its slots: no cache copy);
    no collective.
  Raises:
    ValueError: S the kernel cannot split (`ragged_decode_splits`).
  """
  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.gpu import decode_attention

  s = keys_bksh.shape[2]
  split = ragged_decode_splits(s)
  if split is None:
    raise ValueError(
      f"the ragged decode kernel cannot split {s} cache entries per slot: it needs at most 16 "
      "parts of equal length, each a multiple of 16 (a power of two from 16 on qualifies)"
    )
  splits, block = split
  interpret = jax.default_backend() != "gpu"

  def local(q, k, v, lengths):
    # The kernel takes [B, S, K, H] and swaps to [B, K, S, H] itself: the two swaps cancel.
    return decode_attention.gqa(
      q.astype(k.dtype),
      k.swapaxes(1, 2),
      v.swapaxes(1, 2),
      kv_seq_len=lengths,
      k_splits=splits,
      block_k=block,
      interpret=interpret,
    )

  return _per_slot(local, "ragged_decode_attention", q_bnh, keys_bksh, values_bksh, lengths_b)


# The TPU paged-attention kernel's page (its page_size: the largest power of two up to this that
# divides S; at least 16, bfloat16's sublane tile) and the most keys it attends to per inner block
# (pages_per_compute_block x page_size).
PAGED_DECODE_PAGE = 128
PAGED_DECODE_BLOCK = 512


def paged_decode_blocks(s: int) -> tuple[int, int] | None:
  """(page_size, pages_per_compute_block) of the TPU paged decode kernel over S cache entries per
  slot, or None where it cannot take S: pages of gcd(S, PAGED_DECODE_PAGE) entries (at least 16),
  and the most pages per block that divide the slot's pages within PAGED_DECODE_BLOCK keys."""
  page = math.gcd(s, PAGED_DECODE_PAGE)
  if page < 16:
    return None
  pages = s // page
  per_block = max(d for d in range(1, PAGED_DECODE_BLOCK // page + 1) if pages % d == 0)
  return page, per_block


def paged_decode_attention(
  q_bnh: jax.Array, keys_bksh: jax.Array, values_bksh: jax.Array, lengths_b: jax.Array
) -> jax.Array:
  """A decode step's attention by JAX's Pallas TPU paged-attention kernel
  (`jax.experimental.pallas.ops.tpu.paged_attention`; Pallas's TPU interpret mode off a TPU:
  exact, and slow): slot b attends to its cache entries [0, lengths_b[b]), and the kernel copies
  no page past them into VMEM (its blocks past a slot's length are skipped), where the XLA paths
  read every slot up to the longest one's bucket.

  The dense cache is read as pages with no copy: [B, K, S, H] is [B K S / page] pages of [page, H]
  (`paged_decode_blocks`), and each (slot, KV head) pair is one of the kernel's sequences, with
  one KV head and the N / K query heads of its group (GQA: query head n reads KV head
  n // (N / K)), its page table the pair's own consecutive pages.

  The kernel rounds keys and values to bfloat16 (its `_maybe_dequantize`) and computes in
  float32; over a bfloat16 cache it is the masked softmax of the same inputs to float32
  rounding (`decode_kernel` picks it only then).

  Args:
    q_bnh: [B, N, H] queries (not scaled: they are scaled by 1 / sqrt(H) here, in float32, as the
      kernel does not scale).
    keys_bksh, values_bksh: [B, K, S, H] keys and values (a KV cache of key layout "sh"); K
      divides N.
    lengths_b: [B] int32 entries each slot attends to, in [1, S].
  Returns:
    [B, N, H] outputs in the values' dtype, under a mesh as `ragged_decode_attention`'s.
  Raises:
    ValueError: S the kernel cannot page (`paged_decode_blocks`).
  """
  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

  s = keys_bksh.shape[2]
  blocks = paged_decode_blocks(s)
  if blocks is None:
    raise ValueError(
      f"the paged decode kernel cannot page {s} cache entries per slot: it needs pages of at "
      "least 16 entries (S a multiple of 16)"
    )
  page, per_block = blocks

  def local(q, k, v, lengths):
    b, kh, _, h = k.shape
    pages = s // page
    as_pages = lambda x: x.reshape(1, b * kh * pages, page, h)  # noqa: E731  no copy
    call = functools.partial(
      paged_attention,
      (q.astype(jnp.float32) * (h**-0.5)).reshape(b * kh, q.shape[1] // kh, h),
      as_pages(k),
      as_pages(v),
      jnp.repeat(lengths.astype(jnp.int32), kh),
      jnp.arange(b * kh * pages, dtype=jnp.int32).reshape(b * kh, pages),
      pages_per_compute_block=per_block,
    )
    if jax.default_backend() == "tpu":
      out = call()
    else:
      with pltpu.force_tpu_interpret_mode():
        out = call()
    return out.reshape(q.shape)

  return _per_slot(local, "paged_decode_attention", q_bnh, keys_bksh, values_bksh, lengths_b)


# The TPU ragged paged-attention kernel over a prefill chunk: its page (the largest power of two
# up to this that divides S, at least 16), one page per key block (its num_kv_pages_per_block),
# so each block's DMA is one copy, and its queries per block (num_queries_per_block, JAX's
# default for that kernel).
PAGED_PREFILL_PAGE = 512
PAGED_PREFILL_QUERIES = 32


def paged_prefill_page(s: int, kv_heads: int, head_dim: int) -> int | None:
  """The page of the TPU ragged paged-attention kernel for a prefill over S cache entries per slot
  with `kv_heads` KV heads (per device) of size `head_dim`, or None where the kernel cannot take
  them: gcd(S, PAGED_PREFILL_PAGE) entries, at least 16; a head size that is a multiple of 128
  (the kernel's softmax statistics are 128 lanes wide); KV heads that its bfloat16 tiles hold
  whole (1, 2, 4, 8 or a multiple of 8: its `get_min_heads_per_blk`)."""
  page = math.gcd(s, PAGED_PREFILL_PAGE)
  heads = kv_heads in (1, 2, 4, 8) or kv_heads % 8 == 0
  return page if page >= 16 and head_dim % 128 == 0 and heads else None


def ragged_paged_attention_kernel():
  """JAX's Pallas TPU ragged paged-attention kernel
  (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`), looked up at each call: the one
  place a test on CPU replaces it (Pallas's interpret modes in JAX 0.10 do not run it: its
  reshape of a VMEM buffer has no interpreter rule)."""
  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel

  return kernel.ragged_paged_attention


def paged_prefill_attention(
  q_btnh: jax.Array, keys_bksh: jax.Array, values_bksh: jax.Array, lengths_b: jax.Array
) -> jax.Array:
  """A prefill chunk's attention from a KV cache by JAX's Pallas TPU ragged paged-attention
  kernel (vLLM's and tunix's TPU kernel for mixed prefill and decode): row b's T queries are at
  cache entries [lengths_b[b] - T, lengths_b[b]) (written there by this pass) and query i
  attends to entries [0, lengths_b[b] - T + i], causally; the kernel copies no page at or past
  lengths_b[b] into VMEM. The XLA paths compute [T, S] scores for every row up to the bucket.

  The kernel reads keys and values interleaved per head from one paged array, so the cache's
  [B, K, S, H] keys and values are copied once into [B S / page] pages of [page, 2K, H] (keys
  at even, values at odd heads; `paged_prefill_page`); each row is one of the kernel's
  sequences, its page table its own consecutive pages, with T queries.

  Args:
    q_btnh: [B, T, N, H] queries (not scaled: the kernel scales the scores by 1 / sqrt(H)).
    keys_bksh, values_bksh: [B, K, S, H] keys and values (a KV cache of key layout "sh"; the
      kernel's tiles are bfloat16's); K divides N (GQA: query head n reads KV head n // (N / K)).
    lengths_b: [B] int32 entries row b attends to, in [T, S].
  Returns:
    [B, T, N, H] outputs in the values' dtype, under a mesh as `ragged_decode_attention`'s.
  Raises:
    ValueError: S, K or H the kernel cannot take (`paged_prefill_page`).
  """
  t, h, s = q_btnh.shape[1], q_btnh.shape[3], keys_bksh.shape[2]
  heads = local_kv_heads(keys_bksh.shape)
  page = paged_prefill_page(s, heads, h)
  if page is None:
    raise ValueError(
      f"the ragged paged-attention kernel cannot take {s} cache entries per slot, {heads} KV "
      f"heads per device of size {h}: it needs S a multiple of 16, H a multiple of 128 and 1, 2, "
      "4, 8 or a multiple of 8 KV heads per device"
    )

  def local(q, k, v, lengths):
    rows, kv_heads = k.shape[0], k.shape[1]
    pages = s // page
    kv = jnp.stack([k, v], axis=-2).transpose(0, 2, 1, 3, 4)  # [b, S, K, 2, H]
    out = ragged_paged_attention_kernel()(
      q.reshape(rows * t, q.shape[2], h),
      kv.reshape(rows * pages, page, 2 * kv_heads, h),
      lengths.astype(jnp.int32),
      jnp.arange(rows * pages, dtype=jnp.int32).reshape(rows, pages),
      jnp.arange(rows + 1, dtype=jnp.int32) * t,
      jnp.full((1,), rows, jnp.int32),
      sm_scale=h**-0.5,
      num_kv_pages_per_block=1,
      num_queries_per_block=min(PAGED_PREFILL_QUERIES, rows * t),
    )
    return out.reshape(q.shape)

  return _per_slot(local, "paged_prefill_attention", q_btnh, keys_bksh, values_bksh, lengths_b)


def local_kv_heads(shape_bksh: tuple[int, ...]) -> int:
  """KV heads on each device of [B, K, S, H] keys or values: K split as "act_kv_heads" over the
  active mesh (the per-slot kernels' split), K without one."""
  mesh = active_mesh()
  kh = shape_bksh[1]
  if mesh is None:
    return kh
  axes = param_spec(mesh.shape, ("batch", "act_kv_heads", None, None), shape_bksh)[1]
  axes = (axes,) if isinstance(axes, str) else axes or ()
  return kh // math.prod(mesh.shape[a] for a in axes)


def _per_slot(local, name: str, q, keys_bksh, values_bksh, lengths_b) -> jax.Array:
  """`local(q, keys, values, lengths)` (a kernel on one device's slots; q [B, N, H] for a decode
  step, [B, T, N, H] for a prefill chunk) on the whole batch: with a mesh active, per device
  under `jax.shard_map`, slots split as the "batch" logical axis, KV heads as "act_kv_heads" and
  the query heads with them (where the head axes do not divide K, the cache is replicated over
  them and each device computes every head of its slots: no cache copy); no collective. Returns
  q's shape in the values' dtype."""
  mesh = active_mesh()
  if mesh is None:
    out = local(q, keys_bksh, values_bksh, lengths_b)
  else:
    kv_spec = param_spec(mesh.shape, ("batch", "act_kv_heads", None, None), keys_bksh.shape)
    q_spec = P(kv_spec[0], *[None] * (q.ndim - 3), kv_spec[1], None)
    with jax.named_scope(name):
      out = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, P(kv_spec[0])),
        out_specs=q_spec,
        check_vma=False,  # Pallas's output shapes carry no varying-axes type; no collective
      )(q, keys_bksh, values_bksh, lengths_b)
  return out.astype(values_bksh.dtype)


def _axes(head_axis: int, heads: str) -> tuple[str | None, ...]:
  """Logical axes of a [B, N, T, H] (head_axis 1) or [B, T, N, H] (head_axis 2) array."""
  return ("batch", heads, "length", None) if head_axis == 1 else ("batch", "length", heads, None)
