"""Memory-efficient attention for long training sequences (`qwen._attend_online`): the same
result and gradient as the plain masked softmax, and a compiled step whose memory does not hold a
[T, S] score matrix.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coevolve_jax.models import qwen
from coevolve_jax.models.qwen import Qwen, _attend_online

import kit

# The reference, the masked softmax, as one compiled program: called op by op, each row's own key
# length compiled every operation of it on its own.
_attend = jax.jit(qwen._attend)

B, N, K, H = 2, 4, 2, 8  # batch, query heads, KV heads (GQA groups of 2), head size


def _inputs(t: int, s: int, seed: int = 0, pad: int = 0, query_index=None):
  """Queries [B, T, N, H], keys [B, K, H, S], values [B, K, S, H], positions and validity; the
  last `pad` keys of row 1 are padding; `query_index` picks the queries' positions."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, t, N, H)), jnp.float32)
  keys = jnp.asarray(rng.normal(size=(B, K, H, s)), jnp.float32)
  values = jnp.asarray(rng.normal(size=(B, K, s, H)), jnp.float32)
  k_pos = jnp.broadcast_to(jnp.arange(s), (B, s))
  valid = np.ones((B, s), bool)
  if pad:
    valid[1, s - pad :] = False
  q_pos = k_pos[:, :t] if query_index is None else jnp.asarray(query_index)
  return q, keys, values, q_pos, k_pos, jnp.asarray(valid)


@pytest.mark.parametrize(
  "t, s, q_block, k_block, pad",
  [(32, 32, 8, 8, 0), (32, 32, 16, 8, 5), (64, 64, 8, 16, 20)],
)
def test_online_attention_equals_the_masked_softmax(t, s, q_block, k_block, pad):
  args = _inputs(t, s, pad=pad)
  want = _attend(*args)
  got = _attend_online(*args, q_block, k_block)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_online_attention_at_chosen_query_positions():
  """Queries at P scattered positions (the last layer of a scoring pass) see every key up to
  their own position, block skipping included."""
  s = 64
  index = np.sort(np.random.default_rng(2).choice(s, 16, replace=False))
  args = _inputs(16, s, query_index=np.broadcast_to(index, (B, 16)))
  np.testing.assert_allclose(_attend_online(*args, 8, 16), _attend(*args), rtol=1e-5, atol=1e-6)


def test_online_attention_gradient_equals_the_masked_softmax_gradient():
  q, keys, values, *rest = _inputs(32, 32, seed=3, pad=7)
  w = jnp.asarray(np.random.default_rng(4).normal(size=(B, 32, N, H)), jnp.float32)

  def loss(fn, q, k, v):
    return jnp.sum(w * fn(q, k, v, *rest))

  want = jax.grad(lambda *a: loss(_attend, *a), argnums=(0, 1, 2))(q, keys, values)
  online = lambda *a: _attend_online(*a, 8, 8)  # noqa: E731
  got = jax.grad(lambda *a: loss(online, *a), argnums=(0, 1, 2))(q, keys, values)
  for g, w_ in zip(got, want):
    np.testing.assert_allclose(g, w_, rtol=1e-4, atol=1e-5)


def test_a_query_that_sees_no_key_gets_zeros_not_nan():
  q, keys, values, q_pos, k_pos, valid = _inputs(16, 16)
  valid = valid.at[1].set(False)  # row 1: a padding row, every key invalid
  out = _attend_online(q, keys, values, q_pos, k_pos, valid, 8, 8)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_array_equal(out[1], 0.0)
  np.testing.assert_allclose(out[0], _attend(q, keys, values, q_pos, k_pos, valid)[0], atol=1e-6)


TINY = kit.tiny_config(
  vocab_size=256, hidden_size=32, intermediate_size=64, head_dim=8, tie_word_embeddings=True
)


def test_model_takes_the_online_path_for_long_sequences_as_accurately_as_the_default(
  monkeypatch,
):
  """With the threshold lowered to 64 keys, a 128-token forward (and its last layer at P scored
  positions) runs `_attend_online`; its loss and every gradient are as close to a float64
  reference as the default path's float32 ones (both differ from it by float32 rounding, about
  5e-5 of a leaf's largest entry here, summed over 2 x 128 tokens)."""
  model = Qwen(TINY, rngs=nnx.Rngs(0), remat="full")
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(5)
  tokens = jnp.asarray(rng.integers(0, 256, (2, 128)), jnp.int32)
  mask = jnp.asarray(np.arange(128)[None] < np.array([[128], [100]]))
  index = jnp.asarray(np.sort(rng.choice(128, 32, replace=False))[None].repeat(2, 0), jnp.int32)

  def loss(p):
    h = nnx.merge(graphdef, p).hidden_states(tokens, attention_mask_bt=mask, output_index_bp=index)
    return jnp.sum(jnp.square(h))

  # A fresh jit per call: each traces the module constants as they are at that moment.
  plain = jax.jit(jax.value_and_grad(loss))(params)
  with jax.enable_x64(True):
    exact = jax.jit(jax.value_and_grad(loss))(jax.tree.map(lambda a: a.astype(jnp.float64), params))
    exact = jax.tree.map(np.asarray, exact)
  calls = []
  real = qwen._attend_online

  def spy(*a):
    calls.append(a[-2:])
    return real(*a)

  monkeypatch.setattr(qwen, "ATTN_ONLINE_MIN_KEYS", 64)
  monkeypatch.setattr(qwen, "ATTN_ONLINE_Q_BLOCK", 16)
  monkeypatch.setattr(qwen, "ATTN_ONLINE_K_BLOCK", 32)
  monkeypatch.setattr(qwen, "_attend_online", spy)
  online = jax.jit(jax.value_and_grad(loss))(params)
  assert (16, 32) in calls  # both the scanned layer (T = 128) and the last (P = 32) went online

  def error(result):
    leaves = zip(jax.tree.leaves(result[1]), jax.tree.leaves(exact[1]))
    grads = max(
      float(np.abs(np.asarray(g, np.float64) - w).max() / np.abs(w).max()) for g, w in leaves
    )
    return abs(float(result[0]) - float(exact[0])) / float(exact[0]), grads

  (online_loss, online_grad), (plain_loss, plain_grad) = error(online), error(plain)
  assert online_loss <= max(2 * plain_loss, 1e-6), (online_loss, plain_loss)
  assert online_grad <= max(2 * plain_grad, 1e-5), (online_grad, plain_grad)
  assert plain_grad < 1e-3  # the float32 paths agree with float64 at all


def test_online_step_holds_no_score_matrix(monkeypatch):
  """The compiled loss and gradient at T = 8,192 (a narrow model, full remat), by XLA's own
  `memory_analysis()`: the online path needs less temporary memory than one [N, T / 8, T]
  float32 score block of the 8-block path (128 MiB), and a tenth of what that path needs
  (measured on CPU: 70 MiB against 1.8 GiB)."""
  cfg = dataclasses.replace(TINY, num_hidden_layers=3)
  t = 8192
  model = nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(0), remat="full"))
  graphdef, params = nnx.split(model)
  tokens = jax.ShapeDtypeStruct((1, t), jnp.int32)

  def temp_bytes():
    def loss(p, tokens):
      return jnp.mean(jnp.square(nnx.merge(graphdef, p).hidden_states(tokens)))

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert qwen.online_attention_blocks(t, t)
  online = temp_bytes()
  monkeypatch.setattr(qwen, "ATTN_ONLINE_MIN_KEYS", 2 * t)
  blocked = temp_bytes()
  one_block_of_scores = cfg.num_attention_heads * (t // 8) * t * 4
  assert online < one_block_of_scores < blocked, (online, blocked)
  assert online < blocked / 10, (online, blocked)


def _ragged_decode(s_max: int, s: int, lengths, block: int, seed: int = 6, t: int = 1):
  """A decode step of B rows at their own lengths: queries [B, T, N, H] at positions
  length - T .. length - 1, a [B, K, H, S_max] key and [B, K, S_max, H] value cache whose
  entries from the first `block` boundary past every row's length on are NaN (a path that reads
  them returns NaN; entries of a read block past a row's length are finite, as in a cache), and
  the [B, s] key positions and validity of a bucket of s entries."""
  rng = np.random.default_rng(seed)
  b = len(lengths)
  q = jnp.asarray(rng.normal(size=(b, t, N, H)), jnp.float32)
  keys = rng.normal(size=(b, K, H, s_max)).astype(np.float32)
  values = rng.normal(size=(b, K, s_max, H)).astype(np.float32)
  end = -(-max(lengths) // block) * block
  keys[..., end:] = np.nan
  values[:, :, end:] = np.nan
  q_pos = jnp.asarray(np.asarray(lengths)[:, None] - t + np.arange(t), jnp.int32)
  k_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
  return q, jnp.asarray(keys), jnp.asarray(values), q_pos, k_pos, jnp.ones((b, s), bool)


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("t, lengths", [(1, (5, 37, 20)), (1, (64, 3, 9)), (2, (40, 2, 17))])
def test_cached_blocks_equal_the_masked_softmax_and_read_no_block_past_the_longest_row(
  stacked, t, lengths
):
  """`_attend_cached_blocks` (a decode step on the CPU path) over a 128-entry bucket of a
  256-entry cache, in blocks of 16, equals `_attend` over the rows' own entries, for rows of
  different lengths (GQA of 2; T = 2 too), from an unrolled or a stacked cache; and it reads no
  block past the one holding the longest row's last entry: the entries after that block are
  NaN, and the plain pass over the bucket, which reads them, returns NaN."""
  s_max, s = 256, 128
  q, keys, values, q_pos, k_pos, valid = _ragged_decode(s_max, s, lengths, 16, t=t)
  if stacked:  # layer 1 of a 3-layer block's stack; the other layers' entries are NaN
    stack_k = jnp.full((3, *keys.shape), jnp.nan).at[1].set(keys)
    stack_v = jnp.full((3, *values.shape), jnp.nan).at[1].set(values)
    read = lambda start, size: qwen._read_stacked_kv_cache(stack_k, stack_v, 1, start, size)  # noqa: E731
  else:
    read = lambda start, size: qwen._read_kv_cache(keys, values, start, size)  # noqa: E731
  got = jax.jit(lambda q: qwen._attend_cached_blocks(q, read, q_pos, k_pos, valid, 16))(q)
  for row, n in enumerate(lengths):  # each row against the plain pass over its own entries
    want = _attend(
      q[row : row + 1],
      keys[row : row + 1, ..., :n],
      values[row : row + 1, :, :n],
      q_pos[row : row + 1],
      k_pos[row : row + 1, :n],
      valid[row : row + 1, :n],
    )
    np.testing.assert_allclose(got[row : row + 1], want, rtol=1e-5, atol=1e-6)
  plain = _attend(q, keys[..., :s], values[:, :, :s], q_pos, k_pos, valid)
  assert np.isnan(np.asarray(plain)).any()  # the test can fail: the bucket holds NaN entries


def test_a_decode_step_takes_the_cached_blocks_as_accurately_as_the_plain_pass(monkeypatch):
  """A tiny model's decode step from a stacked KV cache of 256 entries at a 128-key bucket, with
  the key block lowered to 32: the "auto" kernel on CPU runs `_attend_cached_blocks` (an unrolled
  model with its whole cache as the bucket does not), and its logits equal the "xla" kernel's
  plain pass to float32 rounding for rows of different lengths."""
  monkeypatch.setattr(qwen, "DECODE_KEY_BLOCK", 32)
  calls = []
  real = qwen._attend_cached_blocks
  monkeypatch.setattr(qwen, "_attend_cached_blocks", lambda *a: calls.append(a[-1]) or real(*a))
  rng = np.random.default_rng(7)
  lengths = np.array([100, 7, 60])
  prompt = jnp.asarray(rng.integers(0, 256, (3, 100)), jnp.int32)
  logits, traced = {}, {}
  for kernel in ("xla", "auto"):
    calls.clear()
    model = Qwen(TINY, rngs=nnx.Rngs(0), stacked=True, attention=kernel)
    cache = qwen.KVCache.zeros(TINY, 3, 256, stacked=True)
    # Prefill each row's prompt (positions 0 .. length - 1; the rest of the chunk is never read).
    positions = jnp.broadcast_to(jnp.arange(100), (3, 100))
    decode = nnx.jit(lambda m, *a: m.decode(*a, 128))  # 128: the key bucket, static
    _, cache = decode(model, prompt, positions, cache, jnp.zeros(3, jnp.int32))
    pos = jnp.asarray(lengths[:, None], jnp.int32)
    hidden, _ = decode(model, prompt[:, :1], pos, cache, pos[:, 0])
    logits[kernel], traced[kernel] = np.asarray(model.logits(hidden)), list(calls)
  assert traced == {"xla": [], "auto": [32] * len(TINY.layer_blocks)}  # once per scanned block
  np.testing.assert_allclose(logits["auto"], logits["xla"], rtol=1e-5, atol=1e-5)
