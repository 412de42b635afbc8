"""Token sampling with temperature, top-k and top-p, returning log-probs of the sampled tokens.

The log-prob of a sampled token is taken under the distribution it was actually drawn from:
softmax(logits / T) restricted to the tokens top-k and top-p keep, renormalised over them. The same
function, `processed_logprobs`, scores given tokens, so a trainer that recomputes log-probs with it
gets the sampler's numbers (trainer and sampler must compute the same log-probs for the same
tokens; docs/design.md §5).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to pick the next token.

  Attributes:
    temperature: divides the logits; 0 (or below) means greedy (argmax).
    top_k: keep the k most likely tokens (0 = off).
    top_p: nucleus mass to keep (1.0 = off): the smallest set of most likely tokens whose mass
      reaches top_p (at least the top token).
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if math.isnan(self.temperature):
      raise ValueError("temperature must be a number (<= 0 for greedy), got nan")
    if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
      raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
    if not 0.0 <= self.top_p <= 1.0:
      raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature <= 0.0

  @property
  def truncates(self) -> bool:
    """Whether top-k or top-p leaves tokens out (never when greedy: see `filtered_logits`)."""
    return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


SHIFT_BELOW_TEMPERATURE = 0.25  # see filtered_logits


def filtered_logits(logits_bv: jax.Array, params: SamplingParams) -> jax.Array:
  """Tempered logits with the tokens top-k / top-p drop set to -inf.

  Which tokens are kept is decided under `jax.lax.stop_gradient`: the kept set is piecewise
  constant in the logits, so this is its derivative almost everywhere, and it is the standard
  choice (the mask is a function of the logits, not a parameter). A gradient through the result
  flows only into the kept tokens' logits, as for log_softmax over that set; dropped tokens get
  none.

  Args:
    logits_bv: [..., V] logits (any float dtype; computed in float32), e.g. [B, V] in the sampler
      or [N, P, V] in the trainer; rows are independent.
    params: sampling parameters; greedy counts as temperature 1 with no filtering.
  Returns:
    [..., V] float32 logits / T, -inf outside the kept set; below T = SHIFT_BELOW_TEMPERATURE,
    (logits - row max) / T. The shift changes no probability, and taken before the division it
    keeps a small T exact: z / T at T = 1e-8 has no float32 digits left for the gaps between
    the top logits (log-probs of +1.26 were seen). Above it the shift is left out: it made a
    sampled batch-64 decode step on the 2-core CPU 15% slower (measured 2026-11-30).
  Raises:
    ValueError (from `jax.lax.top_k`): top_k > V.
  """
  scaled = logits_bv.astype(jnp.float32)
  if params.greedy:
    return scaled
  if params.temperature < SHIFT_BELOW_TEMPERATURE:
    scaled = scaled - jnp.max(scaled, axis=-1, keepdims=True)
  scaled = scaled / params.temperature
  if not params.truncates:
    return scaled
  fixed = jax.lax.stop_gradient(scaled)  # the kept set: no gradient (see above)
  drop = jnp.zeros(scaled.shape, bool)
  if params.top_k > 0:
    kth = jax.lax.top_k(fixed, params.top_k)[0][..., -1:]
    drop = fixed < kth
  if params.top_p < 1.0:
    top_k_kept = jnp.where(drop, -jnp.inf, fixed)
    sorted_logits = jnp.flip(jnp.sort(top_k_kept, axis=-1), axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each token
    # At least the top token survives: with top_p <= 0 the count is 0, and index -1 would wrap
    # around to the smallest logit and keep the whole vocabulary.
    cutoff_idx = jnp.maximum(jnp.sum(cum < params.top_p, axis=-1, keepdims=True) - 1, 0)
    cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
    drop = drop | (top_k_kept < cutoff)
  return jnp.where(drop, -jnp.inf, scaled)


def processed_logprobs(
  logits_bv: jax.Array, tokens_b: jax.Array, params: SamplingParams
) -> jax.Array:
  """log p(token) under the distribution `sample` draws from with `params`.

  That is log_softmax(filtered_logits(logits)) at the token: temperature-scaled, restricted to the
  top-k / top-p set and renormalised over it. Greedy decoding reports log_softmax(logits) (T = 1).

  Args:
    logits_bv: [B, V] logits.
    tokens_b: [B] int token ids.
    params: sampling parameters.
  Returns:
    [B] float32 log-probs (-inf for a token outside the kept set).
  """
  return gathered_logprobs(filtered_logits(logits_bv, params), tokens_b)


def gathered_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """log_softmax(logits)[token] along the last axis, as logits[token] - logsumexp(logits).

  Equal to gathering from `jax.nn.log_softmax` but without writing the [..., V] log-softmax: two
  reads of the logits instead of about five passes, which dominates scoring with a large
  vocabulary on CPU.

  Args:
    logits: [..., V] float logits (-inf entries allowed; such a token scores -inf).
    tokens: [...] int token ids.
  Returns:
    [...] float log-probs in the logits' dtype.
  """
  picked = jnp.take_along_axis(logits, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


SAMPLE_BLOCK = 1024  # about the vocabulary entries per block of the two-level inverse CDF


def _sample_block(v: int) -> int:
  """Block length for `sample` and `argmax_last`: a divisor of V near SAMPLE_BLOCK (151,936 =
  128 x 1187), so the [B, V] probabilities or logits reshape into blocks without a padded copy,
  which on CPU cost more than the rest of the sampler; V itself when V is small; SAMPLE_BLOCK
  (with padding) otherwise."""
  if v <= 2 * SAMPLE_BLOCK:
    return v
  near_first = sorted(
    range(SAMPLE_BLOCK // 4, 2 * SAMPLE_BLOCK + 1), key=lambda d: abs(d - SAMPLE_BLOCK)
  )
  for d in near_first:
    if v % d == 0:
      return d
  return SAMPLE_BLOCK


def _in_blocks(x_bv: jax.Array, fill: float) -> tuple[jax.Array, int]:
  """([B, NB, block] view of `x_bv` [B, V] padded with `fill` to whole blocks, block), with
  block = `_sample_block(V)`."""
  b, v = x_bv.shape
  block = _sample_block(v)
  if v % block:
    x_bv = jnp.pad(x_bv, ((0, 0), (0, -v % block)), constant_values=fill)
  return x_bv.reshape(b, -1, block), block


def argmax_last(x_bv: jax.Array) -> jax.Array:
  """`jnp.argmax(x_bv, axis=-1)` in two levels: the max of each block of `_sample_block(V)`
  entries, the first block holding the row's max, then the first index of the max inside it.
  The same index as `jnp.argmax`: ties (the first index), +-inf and NaN (the first NaN, found by
  a separate pass over the blocks, since XLA:CPU's max reduction does not always carry a NaN
  through). XLA:CPU lowers `jnp.argmax` over [B, V] to a scalar loop: at [64, 151,936] float32 on
  the 2-core CPU 43 ms, against 6.6 ms for this (1.1 ms for `jnp.max`; most of the rest is the
  NaN pass), measured 2026-12-03 (docs/benchmarks/rollout.md). The greedy draw (`_greedy`) runs
  it without the NaN pass and calls it whole only for rows whose log-prob shows a NaN or an
  infinite max; on CPU only: on GPU and TPU `jnp.argmax` is one native reduction, and on a
  vocabulary-sharded mesh this adds collectives.

  Args:
    x_bv: [B, V] float array (B >= 1).
  Returns:
    [B] int32 indices.
  """
  return _two_level_argmax(x_bv, nan_pass=True)


def _two_level_argmax(x_bv: jax.Array, nan_pass: bool) -> jax.Array:
  """`argmax_last`; without `nan_pass`, exact only for rows without a NaN."""
  # -inf padding: never above a real entry, and a row of -inf still gives index 0.
  blocks, block = _in_blocks(x_bv, -jnp.inf)
  blk = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1).astype(jnp.int32)  # [B]
  if nan_pass:  # XLA:CPU's max reduction does not always carry a NaN through: found apart
    nan_blocks = jnp.any(jnp.isnan(blocks), axis=-1)  # [B, NB]
    has_nan = jnp.any(nan_blocks, axis=-1)
    blk = jnp.where(has_nan, jnp.argmax(nan_blocks, axis=-1).astype(jnp.int32), blk)
  inner = jnp.take_along_axis(blocks, blk[:, None, None], axis=1)[:, 0]  # [B, block]
  idx = jnp.argmax(inner, axis=-1)
  if nan_pass:
    idx = jnp.where(has_nan, jnp.argmax(jnp.isnan(inner), axis=-1), idx)
  return blk * block + idx.astype(jnp.int32)


def _greedy(x_bv: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(argmax [B] int32, its log-prob [B] float32) of [B, V] logits.

  The argmax's logit is the row's max, so log p = -log(sum(exp(z - max))): one pass over [B, V]
  after the argmax's instead of logsumexp's two. On CPU (see `argmax_last`) the two-level argmax
  runs without its NaN pass, whose boolean reductions cost XLA:CPU as much again as the log-prob
  pass (at [64, 151,936]: 4.2 ms a step against 4.3): that sum is NaN exactly when the row holds
  a NaN or its max is infinite (z - max is then NaN somewhere), and only then, under a
  `lax.cond`, is the whole draw taken again by `argmax_last`. Tokens and log-probs equal
  `jnp.argmax` and the formula above in every row (tests/test_engine.py).
  """

  def draw(tokens):
    top = jnp.take_along_axis(x_bv, tokens[:, None], axis=-1)
    return tokens, -jnp.log(jnp.sum(jnp.exp(x_bv - top), axis=-1))

  if jax.default_backend() != "cpu":
    return draw(jnp.argmax(x_bv, axis=-1).astype(jnp.int32))
  tokens, logp = draw(_two_level_argmax(x_bv, nan_pass=False))
  return jax.lax.cond(
    jnp.any(jnp.isnan(logp)), lambda: draw(argmax_last(x_bv)), lambda: (tokens, logp)
  )


def sample(
  logits_bv: jax.Array, rng: jax.Array, params: SamplingParams
) -> tuple[jax.Array, jax.Array]:
  """Samples one token per row.

  Sampling is by inverse CDF with one uniform per row (a Gumbel draw per vocabulary entry would
  dominate a CPU decode step at V = 152k), in two levels: the row's unnormalised probabilities
  exp(z - max z) are summed in blocks of about `SAMPLE_BLOCK` entries, a cumulative sum over the
  block sums picks the block holding u * total, and a cumulative sum inside it the token. Each
  step reads the [B, V] logits twice (max, then exp and block sums) instead of the
  softmax-cumsum-count passes of a flat inverse CDF; the log-prob reuses max and total.

  Args:
    logits_bv: [B, V] logits.
    rng: one PRNG key for the batch, or [B] keys, one per row (a row's draw then depends only on
      its own key, not on which other rows share the batch).
    params: static sampling parameters.
  Returns:
    (tokens [B] int32, logprobs [B] float32): each log-prob is `processed_logprobs` of the token,
    i.e. under the distribution it was drawn from.
  """
  filtered = filtered_logits(logits_bv, params)
  if params.greedy:
    return _greedy(filtered)
  b = filtered.shape[0]
  top = jnp.max(filtered, axis=-1, keepdims=True)  # finite: the top token is always kept
  unnorm = jnp.exp(filtered - top)  # [B, V], 0 outside the kept set
  blocks, block = _in_blocks(unnorm, 0.0)
  block_mass = jnp.sum(blocks, axis=-1)  # [B, NB]
  block_cdf = jnp.cumsum(block_mass, axis=-1)
  total = block_cdf[:, -1:]
  if rng.ndim == 0:
    u = jax.random.uniform(rng, (b, 1), jnp.float32)
  else:
    u = jax.vmap(lambda k: jax.random.uniform(k, (1,), jnp.float32))(rng)
  target = u * total  # [B, 1] in [0, total)
  # The block holding the target: the first whose cumulative mass exceeds it. Rounding can put
  # the target at the very end; then take the last block that has mass.
  last_block = block_mass.shape[1] - 1 - jnp.argmax((block_mass > 0)[:, ::-1], axis=-1)
  blk = jnp.minimum(jnp.sum(block_cdf <= target, axis=-1), last_block).astype(jnp.int32)
  before = jnp.where(
    blk > 0, jnp.take_along_axis(block_cdf, jnp.maximum(blk - 1, 0)[:, None], axis=-1)[:, 0], 0.0
  )
  inner = jnp.take_along_axis(blocks, blk[:, None, None], axis=1)[:, 0]  # [B, block]
  idx = jnp.sum(before[:, None] + jnp.cumsum(inner, axis=-1) <= target, axis=-1)
  last_in_block = block - 1 - jnp.argmax((inner > 0)[:, ::-1], axis=-1)
  tokens = (blk * block + jnp.minimum(idx, last_in_block)).astype(jnp.int32)
  picked = jnp.take_along_axis(filtered, tokens[:, None], axis=-1)[:, 0]
  return tokens, picked - top[:, 0] - jnp.log(total[:, 0])


@jax.jit
def per_row_keys(keys_b: jax.Array, counts_b: jax.Array) -> jax.Array:
  """[B] keys: row b's key is fold_in(keys_b[b], counts_b[b]).

  With a key per request and its count of tokens sampled so far, every token's randomness depends
  only on (request, token index): the same request samples the same tokens whatever else shares
  the batch, and whenever (host threads, slot order) it is stepped.
  """
  return jax.vmap(jax.random.fold_in)(keys_b, counts_b.astype(jnp.uint32))
