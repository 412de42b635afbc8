"""`model.attention` (models/kernels.py): TPU splash attention in Pallas interpret mode and the
`jax.nn.dot_product_attention` call of the cuDNN path (run by JAX's "xla" implementation, which
takes the same arguments: cuDNN itself needs an NVIDIA GPU) against the plain masked softmax
(`qwen._attend`), forward and gradient, with GQA, padding and lengths that are not a block
multiple; the model's logits and loss gradient by kernel; the kernels under shard_map on 8 host
devices (a child process); "auto" keeps the CPU path. The decode steps' Pallas GPU kernel
(`kernels.ragged_decode_attention`) in Pallas interpret mode against the masked softmax, and an
engine that decodes through it (the GPU's choices on this CPU: `_pretend_gpu`) against one that
does not; the same for the TPU's paged-attention decode kernel (`kernels.paged_decode_attention`,
Pallas's TPU interpret mode) over a bfloat16 cache, and for the TPU's prefill kernel
(`kernels.paged_prefill_attention`, JAX's ragged paged-attention kernel, which no interpret mode
of JAX 0.10 runs: on CPU through `ragged_paged_stand_in`, its contract checked against JAX's own
reference).
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coevolve_jax.models import kernels, qwen
from coevolve_jax.models.kernels import (
  fused_attention,
  paged_decode_attention,
  ragged_decode_attention,
  resolve_attention,
)
from coevolve_jax.rollout import generate
from coevolve_jax.rollout.engine import Engine
from coevolve_jax.rollout.sampling import SamplingParams

from host_devices import run_child

B, H = 2, 16
ON_GPU = jax.default_backend() == "gpu"
# The TPU paged kernel's checks run on CPU (TPU interpret mode) and on a TPU (the kernel itself);
# on a GPU the GPU decode kernel's checks run instead.
NOT_ON_GPU = pytest.mark.skipif(ON_GPU, reason="the TPU paged kernel: checked on CPU and TPU")


def _inputs(t: int, n: int, k: int, pad: int = 0, seed: int = 0, dtype=jnp.float32):
  """[B, T, N, H] queries, [B, K, H, T] keys, [B, K, T, H] values (the cache layout), positions
  and validity of a cache-free pass: row 1 starts with `pad` padding tokens (left padding),
  positions the running count of real tokens."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, t, n, H)), dtype)
  keys = jnp.asarray(rng.normal(size=(B, k, H, t)), dtype)
  values = jnp.asarray(rng.normal(size=(B, k, t, H)), dtype)
  valid = np.ones((B, t), bool)
  valid[1, :pad] = False
  pos = jnp.asarray(np.maximum(np.cumsum(valid, axis=1) - 1, 0))
  return q, keys, values, pos, jnp.asarray(valid)


@jax.jit  # one program (op by op, each call compiled every operation on its own)
def _reference(q, keys, values, pos, valid):
  return qwen._attend(q, keys, values, pos, pos, valid)


def _fused(kernel):
  if kernel == "cudnn":
    return functools.partial(fused_attention, "cudnn", implementation="xla")
  return functools.partial(fused_attention, kernel)


@pytest.mark.parametrize("kernel", ["splash", "cudnn"])
@pytest.mark.parametrize(
  "t, n, k, pad",
  [(37, 4, 1, 5), (130, 6, 3, 0)],  # MQA with left padding, GQA of 3; lengths padded to blocks
)
def test_fused_kernel_equals_the_masked_softmax(kernel, t, n, k, pad):
  q, keys, values, pos, valid = _inputs(t, n, k, pad)
  want = _reference(q, keys, values, pos, valid)
  got = _fused(kernel)(q, keys, values, valid if pad else None)
  real = np.asarray(valid)  # padding queries' outputs are never read
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["splash", "cudnn"])
def test_fused_kernel_gradient_equals_the_masked_softmax_gradient(kernel):
  q, keys, values, pos, valid = _inputs(40, 4, 2, pad=3, seed=1)
  weights = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32)
  weights = weights * valid[:, :, None, None]  # a loss of the real tokens only

  def loss(fn, q, keys, values):
    return jnp.sum(fn(q, keys, values) * weights)

  want = jax.jit(
    jax.grad(functools.partial(loss, lambda *a: _reference(*a, pos, valid)), (0, 1, 2))
  )
  got = jax.jit(jax.grad(functools.partial(loss, lambda *a: _fused(kernel)(*a, valid)), (0, 1, 2)))
  for g, w in zip(got(q, keys, values), want(q, keys, values)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_splash_in_bfloat16_stays_within_its_rounding():
  """bfloat16 inputs (8 mantissa bits): within 2e-2 of the float32 softmax of the same inputs,
  as the XLA path in bfloat16 is."""
  q, keys, values, pos, valid = _inputs(128, 4, 2, seed=3, dtype=jnp.bfloat16)
  want = _reference(*(x.astype(jnp.float32) for x in (q, keys, values)), pos, valid)
  xla = _reference(q, keys, values, pos, valid).astype(jnp.float32)
  got = fused_attention("splash", q, keys, values, None).astype(jnp.float32)
  bound = 2e-2
  assert float(jnp.max(jnp.abs(xla - want))) < bound
  assert float(jnp.max(jnp.abs(got - want))) < bound


@pytest.mark.skipif(
  not ON_GPU,
  reason="cuDNN's fused attention runs on an NVIDIA GPU only; its call's layouts and masks are "
  "checked above through JAX's xla implementation of the same call",
)
@pytest.mark.parametrize("t, n, k, pad", [(37, 4, 1, 5), (130, 6, 3, 0), (1000, 16, 8, 17)])
def test_cudnn_on_a_gpu_stays_within_bfloat16_rounding_of_the_masked_softmax(t, n, k, pad):
  """On a GPU, cuDNN itself (bfloat16, the dtype it takes): forward and gradient within the
  bound the XLA path in bfloat16 meets, measured against the float32 softmax of the same inputs
  (forward: 2e-2 absolute, as splash's test; gradient: 2e-2 of the reference's largest entry)."""
  q, keys, values, pos, valid = _inputs(t, n, k, pad, seed=7, dtype=jnp.bfloat16)
  real = np.asarray(valid)
  f32 = lambda xs: [x.astype(jnp.float32) for x in xs]  # noqa: E731
  want = _reference(*f32((q, keys, values)), pos, valid)
  got = jax.jit(functools.partial(fused_attention, "cudnn"))(
    q, keys, values, valid if pad else None
  )
  xla = _reference(q, keys, values, pos, valid)
  for out in (xla, got):
    assert float(np.max(np.abs(np.asarray(out, np.float32)[real] - np.asarray(want)[real]))) < 2e-2
  weights = (
    jnp.asarray(np.random.default_rng(8).normal(size=q.shape), jnp.float32)
    * valid[:, :, None, None]
  )

  def loss(fn, q, keys, values):
    return jnp.sum(fn(q, keys, values).astype(jnp.float32) * weights)

  fused = lambda *a: fused_attention("cudnn", *a, valid if pad else None)  # noqa: E731
  want_g = jax.grad(functools.partial(loss, lambda *a: _reference(*a, pos, valid)), (0, 1, 2))(
    *f32((q, keys, values))
  )
  got_g = jax.jit(jax.grad(functools.partial(loss, fused), (0, 1, 2)))(q, keys, values)
  xla_g = jax.grad(functools.partial(loss, lambda *a: _reference(*a, pos, valid)), (0, 1, 2))(
    q, keys, values
  )
  for name, g, x, w in zip(("q", "k", "v"), got_g, xla_g, want_g):
    w = np.asarray(w)
    scale = float(np.max(np.abs(w)))
    for label, out in (("cudnn", g), ("xla bf16", x)):
      err = float(np.max(np.abs(np.asarray(out, np.float32) - w)))
      assert err < 2e-2 * scale, (name, label, err, scale)


def test_auto_keeps_the_cpu_path_and_bad_choices_are_clear_errors():
  assert resolve_attention("auto") == "blocked"  # this suite runs on CPU
  assert resolve_attention("auto", "tpu") == "splash"
  assert resolve_attention("auto", "gpu") == "cudnn"
  assert resolve_attention("splash", "cpu") == "splash"  # interpret mode
  with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
    resolve_attention("cudnn", "cpu")
  with pytest.raises(ValueError, match="unknown attention kernel 'flash'"):
    resolve_attention("flash")
  with pytest.raises(ValueError, match="unknown attention kernel"):
    qwen.Qwen(qwen.QwenConfig.tiny_cpu(vocab_size=64), rngs=nnx.Rngs(0), attention="flash")
  assert kernels.cudnn_supports(jnp.bfloat16, 128) and not kernels.cudnn_supports(jnp.float32, 128)


def _decode_inputs(n: int, k: int, s: int, lengths, seed: int = 0, dtype=jnp.float32):
  """A decode step's [B, N, H] queries, [B, K, S, H] keys and values (key layout "sh"), and the
  masked softmax's arguments for the same step (`qwen._attend`: keys [B, K, H, S], the query at
  position length - 1 over keys at index == position)."""
  rng = np.random.default_rng(seed)
  b = len(lengths)
  q = jnp.asarray(rng.normal(size=(b, n, H)), dtype)
  keys = jnp.asarray(rng.normal(size=(b, k, s, H)), dtype)
  values = jnp.asarray(rng.normal(size=(b, k, s, H)), dtype)
  lengths = jnp.asarray(lengths, jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  reference = (q[:, None], keys.swapaxes(-1, -2), values, (lengths - 1)[:, None], pos, None)
  return (q, keys, values, lengths), reference


def _masked_softmax(q, keys, values, q_pos, k_pos, _):
  valid = jnp.ones(k_pos.shape, jnp.bool_)
  return qwen._attend(q, keys, values, q_pos, k_pos, valid)[:, 0]


def test_ragged_decode_kernel_equals_the_masked_softmax():
  """Slots of 1, 37, 200 and all 256 entries, GQA of 2 (6 query heads over 3 KV heads): each
  sees its own [0, length), float32 within 1e-5 (interpret mode runs the kernel's own loop,
  splits and final combination); GQA of 2 under shard_map in the 8-device child."""
  k = 3
  args, reference = _decode_inputs(6, k, 256, [1, 37, 200, 256])
  got = ragged_decode_attention(*args)
  want = _masked_softmax(*reference)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert kernels.ragged_decode_splits(256) == (16, 16)
  assert kernels.ragged_decode_splits(1000) is None  # no split into blocks of 16 or more
  with pytest.raises(ValueError, match="cannot split 1000 cache entries"):
    ragged_decode_attention(args[0], *(jnp.zeros((4, k, 1000, H)),) * 2, args[3])


def test_ragged_decode_kernel_in_bfloat16_stays_within_its_rounding():
  """bfloat16 cache and queries: within 2e-2 of the float32 softmax of the same inputs, as the
  XLA path in bfloat16 is."""
  args, reference = _decode_inputs(4, 2, 512, [3, 512, 130, 64], seed=5, dtype=jnp.bfloat16)
  f32 = [
    x.astype(jnp.float32) if x is not None and x.dtype == jnp.bfloat16 else x for x in reference
  ]
  want = _masked_softmax(*f32)
  xla = _masked_softmax(*reference).astype(jnp.float32)
  got = ragged_decode_attention(*args).astype(jnp.float32)
  assert float(jnp.max(jnp.abs(xla - want))) < 2e-2
  assert float(jnp.max(jnp.abs(got - want))) < 2e-2


def _bfloat16_exact(x):
  """`x` rounded to bfloat16 and back: float32 entries the paged kernel's rounding keeps."""
  return x.astype(jnp.bfloat16).astype(jnp.float32)


@NOT_ON_GPU
def test_paged_decode_kernel_equals_the_masked_softmax():
  """TPU's paged decode kernel (Pallas's TPU interpret mode), GQA of 2 (6 query heads over 3 KV
  heads), slots of 1, 37, 200 and all 256 entries: each sees its own [0, length). The kernel
  rounds keys and values to bfloat16 and computes in float32, so over keys and values that
  bfloat16 holds exactly it is the float32 masked softmax within 1e-5, and over the same cache
  stored in bfloat16 it gives that result rounded to bfloat16, bit for bit. Which kernel and key
  layout each backend and cache dtype gets; S it cannot page is a clear error."""
  args, reference = _decode_inputs(6, 3, 256, [1, 37, 200, 256])
  q, keys, values, lengths = args
  keys, values = _bfloat16_exact(keys), _bfloat16_exact(values)
  want = _masked_softmax(reference[0], keys.swapaxes(-1, -2), values, *reference[3:])
  got = paged_decode_attention(q, keys, values, lengths)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  stored = paged_decode_attention(
    q, keys.astype(jnp.bfloat16), values.astype(jnp.bfloat16), lengths
  )
  assert stored.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(stored), np.asarray(got.astype(jnp.bfloat16)))
  assert kernels.paged_decode_blocks(256) == (128, 2)
  assert kernels.paged_decode_blocks(32768) == (128, 4)  # 512 keys per block
  assert kernels.paged_decode_blocks(48) == (16, 3)
  assert kernels.paged_decode_blocks(1000) is None  # pages of 8 entries: under bfloat16's tile
  with pytest.raises(ValueError, match="cannot page 1000 cache entries"):
    paged_decode_attention(q, *(jnp.zeros((4, 3, 1000, H)),) * 2, lengths)
  bf16 = jnp.bfloat16
  assert kernels.decode_kernel("auto", "tpu", bf16) == "paged"
  assert kernels.decode_kernel("auto", "tpu") == "splash"  # float32: the exact XLA paths
  assert kernels.decode_kernel("auto", "cpu", bf16) == "blocked"
  assert kernels.decode_kernel("auto", "gpu") == "ragged"
  assert kernels.key_layout("auto", "tpu", bf16) == "sh"
  assert kernels.key_layout("auto", "tpu", jnp.float32) == "hs"
  assert kernels.key_layout("auto", "cpu", bf16) == "hs"


@NOT_ON_GPU
def test_paged_decode_kernel_reads_no_page_past_a_slot_length():
  """1,024 entries per slot: pages of 128, blocks of 512 keys. NaN in every entry of a block
  that starts at or past a slot's length leaves that slot's output finite and equal to the
  clean cache's: the kernel skips those blocks, where the XLA paths read the bucket whole."""
  lengths = [1, 300, 512, 1024]
  args, _ = _decode_inputs(4, 2, 1024, lengths, seed=3)
  q, keys, values, lengths_b = args
  keys, values = _bfloat16_exact(keys), _bfloat16_exact(values)
  clean = paged_decode_attention(q, keys, values, lengths_b)
  skipped = np.arange(1024)[None, :] >= -(-np.asarray(lengths)[:, None] // 512) * 512  # [B, S]
  poison = lambda x: jnp.where(skipped[:, None, :, None], jnp.nan, x)  # noqa: E731
  got = paged_decode_attention(q, poison(keys), poison(values), lengths_b)
  assert skipped.sum() == 3 * 512  # the slots of 1, 300 and 512 entries: their second block
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_array_equal(np.asarray(got), np.asarray(clean))


def ragged_paged_stand_in(
  q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, **_
) -> jax.Array:
  """JAX's ragged paged-attention kernel's contract (its `ref_ragged_paged_attention`: sequence i
  has queries cu_q_lens[i]:cu_q_lens[i+1], the last q_len of its kv_lens[i] entries, causal; keys
  at the even and values at the odd combined heads of its pages) in jit-able JAX, for CPU, where
  neither Pallas interpret mode runs the kernel (`kernels.ragged_paged_attention_kernel`). It
  computes as the kernel does: scores and the probabilities' product with the values in float32.
  Checked against JAX's reference in `test_the_stand_in_is_the_ragged_paged_kernels_contract`."""
  total, n, h = q.shape
  seqs, pages = page_indices.shape
  kh = kv_pages.shape[2] // 2
  kv = kv_pages[page_indices].reshape(seqs, pages * kv_pages.shape[1], 2 * kh, h)
  tok = jnp.arange(total)
  seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], tok, side="right"), 0, seqs - 1)
  row = kv_lens[seq] - (cu_q_lens[seq + 1] - cu_q_lens[seq]) + tok - cu_q_lens[seq]
  keys, values = (kv[seq, :, c::2].astype(jnp.float32) for c in (0, 1))  # [total, S, K, H]
  qg = q.astype(jnp.float32).reshape(total, kh, n // kh, h)
  scores = jnp.einsum("tkgh,tskh->tkgs", qg, keys) * sm_scale
  seen = jnp.arange(keys.shape[1])[None] <= row[:, None]  # [total, S]
  scores = jnp.where(seen[:, None, None], scores, -jnp.inf)
  out = jnp.einsum("tkgs,tskh->tkgh", jax.nn.softmax(scores, axis=-1), values)
  live = (seq < num_seqs[0]) & (tok < cu_q_lens[num_seqs[0]])
  return jnp.where(live[:, None, None], out.reshape(total, n, h), 0).astype(q.dtype)


def _with_stand_in(monkeypatch=None):
  """`kernels.ragged_paged_attention_kernel` -> `ragged_paged_stand_in` (by monkeypatch, or for
  the rest of a child process)."""
  if monkeypatch is None:
    kernels.ragged_paged_attention_kernel = lambda: ragged_paged_stand_in
  else:
    monkeypatch.setattr(kernels, "ragged_paged_attention_kernel", lambda: ragged_paged_stand_in)


def test_the_stand_in_is_the_ragged_paged_kernels_contract():
  """The CPU stand-in equals JAX's own reference of the kernel (float32 pages, so its rounding of
  the probabilities to the values' dtype does not enter) on ragged sequences: query counts of 3,
  1 (a decode step), 5 and 0, pages scattered in the pool, a padded query buffer; 1e-5."""
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel  # noqa: PLC0415

  rng = np.random.default_rng(11)
  n, kh, h, page, pages = 4, 2, 128, 16, 4
  pool = jnp.asarray(rng.normal(size=(20, page, 2 * kh, h)), jnp.float32)
  table = jnp.asarray(rng.permutation(20)[:16].reshape(4, pages), jnp.int32)
  kv_lens = jnp.asarray([40, 7, 64, 9], jnp.int32)
  cu = jnp.asarray([0, 3, 4, 9, 9], jnp.int32)
  q = jnp.asarray(rng.normal(size=(12, n, h)), jnp.float32)
  num = jnp.asarray([4], jnp.int32)
  want = kernel.ref_ragged_paged_attention(q, pool, kv_lens, table, cu, num, sm_scale=0.3)
  got = jax.jit(functools.partial(ragged_paged_stand_in, sm_scale=0.3))(
    q, pool, kv_lens, table, cu, num
  )
  np.testing.assert_allclose(np.asarray(got)[:9], np.asarray(want), rtol=1e-5, atol=1e-5)


def _prefill_inputs(n, k, s, t, lengths, seed=0):
  """A prefill chunk's [B, T, N, H] queries (H = 128) and [B, K, S, H] bfloat16-exact keys and
  values, and `qwen._attend`'s result for it: row b's T queries at positions
  [length - T, length), keys at index == position."""
  rng = np.random.default_rng(seed)
  b, h = len(lengths), 128
  q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
  keys, values = (
    _bfloat16_exact(jnp.asarray(rng.normal(size=(b, k, s, h)), jnp.float32)) for _ in range(2)
  )
  lengths = jnp.asarray(lengths, jnp.int32)
  q_pos = lengths[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None]
  k_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  want = qwen._attend(q, keys.swapaxes(-1, -2), values, q_pos, k_pos, jnp.ones((b, s), bool))
  return (q, keys, values, lengths), want


@NOT_ON_GPU
def test_paged_prefill_attention_equals_the_masked_softmax(monkeypatch):
  """TPU's ragged paged-attention kernel over a prefill chunk, through its contract (the stand-in
  on CPU, the kernel itself on a TPU): rows of 16 queries ending at entries 16, 100, 517 and
  1,024 of 1,024 (pages of 512: two per row), GQA of 2; each query sees [0, its position]:
  float32 within 1e-5 over bfloat16-exact keys and values. Which shapes the kernel takes."""
  if jax.default_backend() != "tpu":
    _with_stand_in(monkeypatch)
  args, want = _prefill_inputs(4, 2, 1024, 16, [16, 100, 517, 1024])
  got = jax.jit(kernels.paged_prefill_attention)(*args)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert kernels.paged_prefill_page(1024, 2, 128) == 512
  assert kernels.paged_prefill_page(32768, 8, 128) == 512
  assert kernels.paged_prefill_page(48, 4, 128) == 16
  assert kernels.paged_prefill_page(1000, 2, 128) is None  # pages of 8 entries
  assert kernels.paged_prefill_page(1024, 2, 64) is None  # SmolLM2's head size
  assert kernels.paged_prefill_page(1024, 3, 128) is None  # 3 KV heads do not tile
  with pytest.raises(ValueError, match="cannot take 1024 cache entries per slot, 3 KV heads"):
    kernels.paged_prefill_attention(args[0], *(jnp.zeros((4, 3, 1024, 128)),) * 2, args[3])
  bf16 = jnp.bfloat16
  assert kernels.prefill_kernel("auto", "tpu", bf16) == "paged"
  assert kernels.prefill_kernel("auto", "tpu") == "splash"  # float32 cache: the XLA paths
  assert kernels.prefill_kernel("splash", "cpu", bf16) == "splash"  # no interpret mode: XLA
  assert kernels.prefill_kernel("auto", "gpu", bf16) == "cudnn"


# Prompts of 20-60 tokens for the engine tests: one prefill forward, slots of different lengths.
PROMPTS = [
  [int(x) for x in np.random.default_rng(i).integers(0, 64, n)]
  for i, n in enumerate((20, 60, 33, 50))
]


def _counted(monkeypatch, name: str) -> list:
  """Replaces `qwen.<name>` (a decode kernel) by itself, recording its key cache's shape at each
  call (each trace); returns the record."""
  calls: list = []
  real = getattr(qwen, name)
  monkeypatch.setattr(qwen, name, lambda *a: calls.append(a[1].shape) or real(*a))
  return calls


def _pretend_gpu(monkeypatch):
  """The GPU's kernel choices on this CPU (`kernels.default_backend` says "gpu"): "cudnn"
  resolves, the cache keeps keys "sh" and decode steps run the Pallas kernel, in interpret mode
  (the kernel reads JAX's own backend)."""
  monkeypatch.setattr(kernels, "default_backend", lambda: "gpu")


def test_an_engine_decodes_through_the_ragged_kernel_as_through_the_masked_softmax(monkeypatch):
  """With the GPU's choices, the engine keeps keys [B, K, S, H] and every decode step's
  attention goes through the ragged kernel (counted); slots of 5-120 prompt tokens then decode
  the tokens of the "xla" engine, log-probs within 1e-5. A stacked cache (`scan_layers`) here;
  the unrolled one in the 8-device child (`_ragged_decode_on_the_mesh`). Prompts of 20-60
  tokens: one prefill forward (chunks of 64), slots of different lengths."""
  _pretend_gpu(monkeypatch)
  calls = _counted(monkeypatch, "ragged_decode_attention")
  out = {}
  for attention in ("xla", "cudnn"):
    engine = Engine(_tiny(attention), 4, 256, scan_layers=True)
    cache = engine.state.cache
    assert (cache.k[0].shape == cache.v[0].shape) == (attention == "cudnn")
    # Full float32 products (a GPU's default for XLA's is TF32; the kernel's are IEEE).
    with jax.default_matmul_precision("highest"):
      out[attention] = generate(
        engine, PROMPTS, SamplingParams(temperature=0.0), rng=jax.random.key(0), max_new_tokens=4
      )
  assert calls and all(shape[-2] == 256 for shape in calls), calls
  for want, got in zip(out["xla"], out["cudnn"], strict=True):
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)


@NOT_ON_GPU
def test_an_engine_decodes_through_the_paged_kernel_as_through_the_masked_softmax(monkeypatch):
  """With the TPU's choices (`kernels.default_backend` says "tpu": "auto" resolves to "splash")
  and a bfloat16 KV cache, the engine keeps keys [B, K, S, H] and decode steps attend through
  the paged kernel (counted); the same prompts as the GPU's test then decode the "xla" engine's
  greedy tokens with the same cache dtype, log-probs within 2e-3: the XLA path rounds the
  attention probabilities to the cache's bfloat16 before the value product (`qwen._attend`),
  the kernel keeps them in float32 (6e-4 apart here; lengths one entry short or long move them
  by 4e-3 to 3e-2, tried). A stacked cache; the kernel on a mesh in the 8-device child."""
  calls = _counted(monkeypatch, "paged_decode_attention")
  out = {}
  for attention in ("xla", "auto"):
    if attention == "auto":
      monkeypatch.setattr(kernels, "default_backend", lambda: "tpu")
    engine = Engine(_tiny(attention), 4, 256, scan_layers=True, dtype=jnp.bfloat16)
    assert engine.key_layout == ("sh" if attention == "auto" else "hs")
    out[attention] = generate(
      engine, PROMPTS, SamplingParams(temperature=0.0), rng=jax.random.key(0), max_new_tokens=4
    )
  assert calls and all(shape[-2] == 256 for shape in calls), calls
  for want, got in zip(out["xla"], out["auto"], strict=True):
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=2e-3)


@NOT_ON_GPU
def test_an_engine_prefills_through_the_ragged_paged_kernel_on_a_tpu(monkeypatch):
  """On a TPU (`kernels.default_backend` says "tpu"; the kernel's contract by the stand-in on
  this CPU) with a bfloat16 cache and head size 128, every prefill chunk attends through
  `kernels.paged_prefill_attention` (counted), and each prompt's first token (sampled from its
  last chunk's logits) and its log-prob are the "xla" engine's, within 2e-3 (the kernel keeps
  the probabilities in float32, the XLA path rounds them to the cache's bfloat16; see the paged
  decode test; a length one entry long moves them by 1.6e-2, a chunk that ignores the entries
  before it by 0.13, tried). Prompts of 20 to 600 tokens: the longest two take a second chunk
  (after 512), which attends to the entries the first one wrote. Decode steps through the paged
  kernel: the tests above."""
  calls = _counted(monkeypatch, "paged_prefill_attention")
  prompts = PROMPTS[:2] + [[(7 * i) % 64 for i in range(n)] for n in (600, 530)]
  out = {}
  for attention in ("xla", "auto"):
    if attention == "auto":
      monkeypatch.setattr(kernels, "default_backend", lambda: "tpu")
      if jax.default_backend() != "tpu":
        _with_stand_in(monkeypatch)
    engine = Engine(_tiny(attention, head_dim=128), 4, 1024, dtype=jnp.bfloat16)
    out[attention] = generate(
      engine, prompts, SamplingParams(temperature=0.0), rng=jax.random.key(0), max_new_tokens=1
    )
  assert calls, "no prefill chunk went through the kernel"
  for want, got in zip(out["xla"], out["auto"], strict=True):
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=2e-3)


def _tiny(attention: str, stacked: bool = True, head_dim: int = 32):
  cfg = dataclasses.replace(qwen.QwenConfig.tiny_cpu(vocab_size=64), head_dim=head_dim)
  return qwen.Qwen(cfg, rngs=nnx.Rngs(0), stacked=stacked, attention=attention)


@pytest.mark.slow
def test_model_logits_and_loss_gradient_by_kernel():
  """The same weights with "splash" (the training forward and backward) give the "xla" model's
  logits and gradient; a left-padded batch through `__call__` too. ~13 s of compiles, so `make
  test-slow`; the suite's 8-device test compares the sharded model's logits."""
  ids = jnp.asarray(np.random.default_rng(4).integers(0, 64, size=(2, 24)))
  mask = jnp.asarray(np.arange(24)[None] >= np.array([[0], [6]]))
  models = {a: _tiny(a) for a in ("xla", "splash")}

  def loss(model):
    return jnp.mean(model.logits(model.hidden_states(ids)) ** 2)

  grads, logits = {}, {}
  for name, model in models.items():
    graphdef, state = nnx.split(model)
    grads[name] = jax.grad(lambda s, g=graphdef: loss(nnx.merge(g, s)))(state)
    logits[name] = model(ids, attention_mask=mask)
  real = np.asarray(mask)
  np.testing.assert_allclose(logits["splash"][real], logits["xla"][real], rtol=1e-5, atol=1e-5)
  for g, w in zip(jax.tree.leaves(grads["splash"]), jax.tree.leaves(grads["xla"])):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_the_planner_counts_attention_activations_by_kernel():
  """The compiled training step's activations with splash attention (the fused kernels' plan)
  are below the plain softmax's by more than one layer's float32 [N, T, T] scores, which the
  fused kernel never holds; ~20 s of compiles, so `make test-slow`."""
  from coevolve_jax import memory_plan  # noqa: PLC0415

  cfg, t = qwen.QwenConfig.tiny_cpu(vocab_size=64), 1024
  planned = {
    a: memory_plan.compiled_activation_bytes(cfg, "float32", t, t // 2, "full", 1, a)
    for a in ("xla", "splash")
  }
  assert planned["xla"] - planned["splash"] > cfg.num_attention_heads * t * t * 4
  assert memory_plan.planned_attention("auto", "gpu") == "splash"  # cuDNN, planned off a GPU
  assert memory_plan.planned_attention("auto") == "blocked"


def test_kernels_under_shard_map_on_eight_devices():
  """8 host devices: see `_child` (the fused kernels) and `_blocked_decode_on_the_mesh`."""
  run_child(__file__, "mesh", timeout=300)


def _child():
  """On 8 host devices: splash and the cuDNN call under shard_map over batch and head axes equal
  the unsharded kernel and the masked softmax, with KV heads split (tensor 2) and repeated
  (tensor 4 over 2 KV heads); a sharded model's logits with "splash" equal "xla"'s."""
  from coevolve_jax.models import sharding as shd  # noqa: PLC0415

  q, keys, values, pos, valid = _inputs(64, 4, 2, pad=4)
  want = _reference(q, keys, values, pos, valid)
  real = np.asarray(valid)
  for axes in ({"data": 2, "fsdp": 2, "tensor": 2}, {"data": 2, "tensor": 4}):
    mesh = shd.make_mesh(axes)
    for kernel in ("splash", "cudnn"):
      with jax.set_mesh(mesh):
        got = jax.jit(_fused(kernel))(q, keys, values, valid)
        hlo = jax.jit(_fused(kernel)).lower(q, keys, values, valid).as_text()
      assert "shard_map" in hlo or "sdy.manual_computation" in hlo, (kernel, axes)
      np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-5)
  ids = jnp.asarray(np.random.default_rng(5).integers(0, 64, size=(4, 32)))
  mesh = shd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  out = {}
  for attention in ("xla", "splash"):
    model = _tiny(attention)
    with jax.set_mesh(mesh):
      state = jax.device_put(nnx.state(model), shd.tree_shardings(nnx.state(model), mesh))
      graphdef = nnx.graphdef(model)
      out[attention] = jax.jit(lambda s, g=graphdef: nnx.merge(g, s)(ids))(state)
  np.testing.assert_allclose(out["splash"], out["xla"], rtol=1e-5, atol=1e-5)
  _blocked_decode_on_the_mesh(mesh)
  _ragged_decode_on_the_mesh()
  _paged_decode_on_the_mesh()
  print("mesh OK")


def _ragged_decode_on_the_mesh() -> None:
  """The ragged decode kernel under shard_map (slots over data 4, KV heads over tensor 2; over
  tensor 4 the 2 KV heads are replicated and each device computes its slots' every head) equals
  the masked softmax; and an engine with the GPU's choices on a data 4 x tensor 2 mesh decodes
  the "xla" engine's tokens."""
  from coevolve_jax.models import sharding as shd  # noqa: PLC0415

  args, reference = _decode_inputs(4, 2, 256, [1, 90, 256, 17])
  want = _masked_softmax(*reference)
  for axes in ({"data": 4, "tensor": 2}, {"data": 2, "tensor": 4}):
    mesh = shd.make_mesh(axes)
    with jax.set_mesh(mesh):
      got = jax.jit(ragged_decode_attention)(*args)
      hlo = jax.jit(ragged_decode_attention).lower(*args).as_text()
    assert "shard_map" in hlo or "sdy.manual_computation" in hlo, axes
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  mesh = shd.make_mesh({"data": 4, "tensor": 2})
  out, calls = {}, []
  real, ragged = kernels.default_backend, qwen.ragged_decode_attention
  qwen.ragged_decode_attention = lambda *a: calls.append(a[1].shape) or ragged(*a)
  for attention in ("xla", "cudnn"):
    kernels.default_backend = (lambda: "gpu") if attention == "cudnn" else real
    engine = Engine(_tiny(attention, stacked=False), 4, 256, mesh=mesh)
    cache = engine.state.cache
    assert (cache.k[0].shape == cache.v[0].shape) == (attention == "cudnn")
    out[attention] = generate(
      engine, PROMPTS, SamplingParams(temperature=0.0), rng=jax.random.key(0), max_new_tokens=3
    )
  kernels.default_backend, qwen.ragged_decode_attention = real, ragged
  assert calls and all(shape[-2] == 256 for shape in calls), calls  # the whole unrolled cache
  for want_c, got_c in zip(out["xla"], out["cudnn"], strict=True):
    assert got_c.token_ids == want_c.token_ids
    np.testing.assert_allclose(got_c.logprobs, want_c.logprobs, rtol=1e-5, atol=1e-5)


def _paged_decode_on_the_mesh() -> None:
  """The TPU paged decode kernel, and the prefill kernel's wrapper (its contract by the stand-in),
  under shard_map (slots over data 4, KV heads over tensor 2; over tensor 4 the 2 KV heads are
  replicated) equal the masked softmax of bfloat16-exact keys and values; no collective in the
  program."""
  from coevolve_jax.models import sharding as shd  # noqa: PLC0415

  args, reference = _decode_inputs(4, 2, 256, [1, 90, 256, 17])
  q, keys, values, lengths = args
  keys, values = _bfloat16_exact(keys), _bfloat16_exact(values)
  want = _masked_softmax(reference[0], keys.swapaxes(-1, -2), values, *reference[3:])
  for axes in ({"data": 4, "tensor": 2}, {"data": 2, "tensor": 4}):
    mesh = shd.make_mesh(axes)
    with jax.set_mesh(mesh):
      got = jax.jit(paged_decode_attention)(q, keys, values, lengths)
      hlo = jax.jit(paged_decode_attention).lower(q, keys, values, lengths).as_text()
    assert "shard_map" in hlo or "sdy.manual_computation" in hlo, axes
    assert "all-gather" not in hlo and "all_gather" not in hlo, axes
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  _with_stand_in()  # the prefill kernel's contract (no interpret mode runs it on CPU)
  args, want = _prefill_inputs(4, 2, 512, 16, [16, 100, 512, 37])
  for axes in ({"data": 4, "tensor": 2}, {"data": 2, "tensor": 4}):
    mesh = shd.make_mesh(axes)
    with jax.set_mesh(mesh):
      got = jax.jit(kernels.paged_prefill_attention)(*args)
      hlo = jax.jit(kernels.paged_prefill_attention).lower(*args).as_text()
    assert "shard_map" in hlo or "sdy.manual_computation" in hlo, axes
    assert "all-gather" not in hlo and "all_gather" not in hlo, axes
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _blocked_decode_on_the_mesh(mesh) -> None:
  """A sharded decode step (slots over data, KV heads over tensor, weights over fsdp) from a
  stacked 256-entry cache at a 128-key bucket, with the key block lowered to 32: "auto" runs
  `_attend_cached_blocks` (its trip count reduced over the sharded slots) and its logits equal
  "xla"'s plain pass for slots of different lengths."""
  from coevolve_jax.models import sharding as shd  # noqa: PLC0415

  qwen.DECODE_KEY_BLOCK = 32
  calls = []
  real = qwen._attend_cached_blocks
  qwen._attend_cached_blocks = lambda *a: calls.append(a[-1]) or real(*a)
  rng = np.random.default_rng(8)
  lengths = np.array([100, 7, 60, 33])
  prompt = jnp.asarray(rng.integers(0, 64, (4, 100)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(100), (4, 100))
  pos = jnp.asarray(lengths[:, None], jnp.int32)
  logits = {}
  for kernel in ("xla", "auto"):
    calls.clear()
    model = _tiny(kernel)
    k_axes, v_axes = qwen.KVCache.axes(stacked=True)
    cache = qwen.KVCache.zeros(model.config, 4, 256, stacked=True)
    cache = qwen.KVCache(
      tuple(jax.device_put(c, shd.named_sharding(mesh, k_axes)) for c in cache.k),
      tuple(jax.device_put(c, shd.named_sharding(mesh, v_axes)) for c in cache.v),
    )
    state = jax.device_put(nnx.state(model), shd.tree_shardings(nnx.state(model), mesh))
    graphdef = nnx.graphdef(model)

    @jax.jit
    def step(state, cache, graphdef=graphdef):
      m = nnx.merge(graphdef, state)
      _, cache = m.decode(prompt, positions, cache, jnp.zeros(4, jnp.int32), 128)
      hidden, _ = m.decode(prompt[:, :1], pos, cache, pos[:, 0], 128)
      return m.logits(hidden)

    with jax.set_mesh(mesh):
      logits[kernel] = np.asarray(step(state, cache))
    assert len(calls) == (len(model.config.layer_blocks) if kernel == "auto" else 0), calls
  np.testing.assert_allclose(logits["auto"], logits["xla"], rtol=1e-5, atol=1e-5)
  qwen._attend_cached_blocks = real


if __name__ == "__main__":
  if sys.argv[1] == "mesh":
    _child()
