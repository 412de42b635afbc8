"""The GRPO objective (CoEvolve paper Eq. 1; DAPO clip-higher; dual-clip PPO; k1/k2/k3 KL).

Shapes: N trajectories (rows), T token positions. All functions are pure and jit-friendly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """Objective settings (SPEC 1.1 defaults)."""

  clip_eps_low: float = 0.20
  clip_eps_high: float = 0.28
  dual_clip_c: float = 3.0  # lower bound on the loss for negative advantages; 0 disables
  kl_beta: float = 1e-3
  kl_estimator: str = "k3"  # "k1" | "k2" | "k3" (k3 = verl "low_var_kl")
  kl_log_ratio_clamp: float = 20.0  # clamp of (ref_logp - logp) before exp
  loss_agg: str = "token-mean"  # | "seq-mean-token-mean" | "seq-mean-token-sum-norm"
  loss_norm_tokens: float = 4096.0  # constant normaliser for seq-mean-token-sum-norm
  adv_eps: float = 1e-6
  scale_by_std: bool = True


def compute_advantages(rewards_n: np.ndarray, group_ids_n: np.ndarray, eps: float = 1e-6,
                       scale_by_std: bool = True) -> np.ndarray:
  """Group-relative advantages A_k = (R_k - mean_group(R)) / (std_group(R) + eps) (paper Eq. 1).

  Statistics are per group id (not over the batch); std is the population std (ddof=0). A group
  whose rewards are all equal gets exactly 0 (never NaN). A group of one trajectory gets 0.

  Args:
    rewards_n: [N] float rewards. group_ids_n: [N] group id of each trajectory.
  Returns:
    [N] float32 advantages.
  """
  rewards_n = np.asarray(rewards_n, np.float64)
  group_ids_n = np.asarray(group_ids_n)
  adv = np.zeros_like(rewards_n)
  for g in np.unique(group_ids_n):
    idx = group_ids_n == g
    r = rewards_n[idx]
    if np.all(r == r[0]):  # exact test: r - r.mean() is not exactly 0 for e.g. [0.1] * 3
      continue
    centred = r - r.mean()
    adv[idx] = centred / (r.std() + eps) if scale_by_std else centred
  return adv.astype(np.float32)


def kl_penalty(logp_nt: jax.Array, ref_logp_nt: jax.Array, estimator: str,
               clamp: float) -> jax.Array:
  """Per-token KL(pi || pi_ref) estimate from sampled tokens (Schulman 2020 k1/k2/k3).

  k3 = exp(ref - logp) - (ref - logp) - 1, with the log-ratio clamped to [-clamp, clamp] BEFORE
  the exponent so a drifting policy cannot overflow.
  """
  log_ratio = jnp.clip(ref_logp_nt - logp_nt, -clamp, clamp)
  if estimator == "k1":
    return -log_ratio
  if estimator == "k2":
    return 0.5 * jnp.square(log_ratio)
  if estimator == "k3":
    return jnp.exp(log_ratio) - log_ratio - 1.0
  raise ValueError(f"unknown KL estimator {estimator!r}")


def aggregate(loss_nt: jax.Array, mask_nt: jax.Array, mode: str, norm_tokens: float) -> jax.Array:
  """Reduces per-token losses.

  token-mean: sum over all tokens / number of tokens (paper Eq. 1).
  seq-mean-token-mean: mean over rows of each row's token mean (rows with no token excluded).
  seq-mean-token-sum-norm: mean over rows of each row's token sum / norm_tokens (Dr. GRPO).
  """
  mask_nt = mask_nt.astype(loss_nt.dtype)
  if mode == "token-mean":
    return jnp.sum(loss_nt * mask_nt) / jnp.maximum(jnp.sum(mask_nt), 1.0)
  row_tokens = jnp.sum(mask_nt, axis=-1)
  row_sum = jnp.sum(loss_nt * mask_nt, axis=-1)
  has = (row_tokens > 0).astype(loss_nt.dtype)
  if mode == "seq-mean-token-mean":
    row = row_sum / jnp.maximum(row_tokens, 1.0)
    return jnp.sum(row * has) / jnp.maximum(jnp.sum(has), 1.0)
  if mode == "seq-mean-token-sum-norm":
    return jnp.sum(row_sum / norm_tokens * has) / jnp.maximum(jnp.sum(has), 1.0)
  raise ValueError(f"unknown loss aggregation {mode!r}")


def grpo_loss(logp_nt: jax.Array, old_logp_nt: jax.Array, ref_logp_nt: jax.Array | None,
              advantages_n: jax.Array, mask_nt: jax.Array,
              cfg: GRPOConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped policy-gradient loss plus beta * KL (the negative of paper Eq. 1's J).

  Args:
    logp_nt: [N, T] log-probs of the sampled tokens under the current policy.
    old_logp_nt: [N, T] under the policy that sampled them (no gradient).
    ref_logp_nt: [N, T] under the reference policy, or None when kl_beta == 0.
    advantages_n: [N] trajectory advantages, broadcast to tokens.
    mask_nt: [N, T] 1 on tokens the policy sampled.
  Returns:
    (scalar loss, metrics dict of scalars).
  """
  adv = advantages_n[:, None].astype(jnp.float32)
  log_ratio = jnp.clip(logp_nt - jax.lax.stop_gradient(old_logp_nt), -20.0, 20.0)
  ratio = jnp.exp(log_ratio)
  pg1 = -adv * ratio
  pg2 = -adv * jnp.clip(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
  pg = jnp.maximum(pg1, pg2)
  if cfg.dual_clip_c > 0:
    pg = jnp.where(adv < 0, jnp.minimum(pg, -adv * cfg.dual_clip_c), pg)
  per_token = pg
  metrics = {}
  if ref_logp_nt is not None and cfg.kl_beta > 0:
    kl = kl_penalty(logp_nt, jax.lax.stop_gradient(ref_logp_nt), cfg.kl_estimator,
                    cfg.kl_log_ratio_clamp)
    per_token = per_token + cfg.kl_beta * kl
    metrics["kl"] = aggregate(kl, mask_nt, "token-mean", 1.0)
  loss = aggregate(per_token, mask_nt, cfg.loss_agg, cfg.loss_norm_tokens)
  clipped = (pg2 > pg1).astype(jnp.float32)
  metrics.update(
      pg_loss=aggregate(pg, mask_nt, cfg.loss_agg, cfg.loss_norm_tokens),
      clip_frac=aggregate(clipped, mask_nt, "token-mean", 1.0),
      ratio_mean=aggregate(ratio, mask_nt, "token-mean", 1.0),
  )
  return loss, metrics
