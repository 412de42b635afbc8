"""Token sampling with temperature, top-k and top-p, returning log-probs of the sampled tokens."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to pick the next token.

  temperature: divides the logits; 0 means greedy (argmax).
  top_k: keep the k most likely tokens (0 = off). top_p: nucleus mass to keep (1.0 = off).
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  @property
  def greedy(self) -> bool:
    return self.temperature <= 0.0


def sample(logits_bv: jax.Array, rng: jax.Array, params: SamplingParams) -> tuple[jax.Array,
                                                                               jax.Array]:
  """Samples one token per row.

  Args:
    logits_bv: [B, V] float32 logits.
    rng: PRNG key.
    params: static sampling parameters.
  Returns:
    (tokens [B] int32, logprobs [B] float32). The log-prob is that of the sampled token under the
    temperature-scaled full-vocabulary softmax (log_softmax(logits / T)), which is what the trainer
    recomputes; with greedy decoding T = 1.
  """
  logits_bv = logits_bv.astype(jnp.float32)
  if params.greedy:
    tokens = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    logp = jax.nn.log_softmax(logits_bv, axis=-1)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
  scaled = logits_bv / params.temperature
  filtered = scaled
  if params.top_k > 0:
    kth = jax.lax.top_k(scaled, params.top_k)[0][:, -1:]
    filtered = jnp.where(scaled < kth, -jnp.inf, filtered)
  if params.top_p < 1.0:
    sorted_logits = jnp.sort(filtered, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each token
    # At least the top token survives: with top_p <= 0 the count is 0, and index -1 would wrap
    # around to the smallest logit and keep the whole vocabulary.
    cutoff_idx = jnp.maximum(jnp.sum(cum < params.top_p, axis=-1, keepdims=True) - 1, 0)
    cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
    filtered = jnp.where(filtered < cutoff, -jnp.inf, filtered)
  # Inverse-CDF sampling: one uniform per row instead of one Gumbel draw per vocabulary entry
  # (the latter dominates a CPU decode step at V = 152k).
  probs = jax.nn.softmax(filtered, axis=-1)
  cdf = jnp.cumsum(probs, axis=-1)
  u = jax.random.uniform(rng, (logits_bv.shape[0], 1), jnp.float32) * cdf[:, -1:]
  tokens = jnp.sum(cdf <= u, axis=-1).astype(jnp.int32)
  tokens = jnp.minimum(tokens, logits_bv.shape[-1] - 1)
  logp = jax.nn.log_softmax(scaled, axis=-1)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
