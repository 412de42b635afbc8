"""The GRPO objective (CoEvolve paper Eq. 1; DAPO clip-higher; dual-clip PPO; k1/k2/k3 KL).

Shapes: N trajectories (rows), T token positions. All functions are pure and jit-friendly.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

KL_ESTIMATORS = ("k1", "k2", "k3")  # `kl_penalty`'s estimators
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")  # `aggregate` modes


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """Objective settings (the defaults of docs/design.md §1.1)."""

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

  @classmethod
  def from_config(cls, train_cfg: Mapping[str, Any]) -> "GRPOConfig":
    """The objective of a run's `train` config group (an ml_collections ConfigDict or a dict).

    Every GRPOConfig field the group holds is passed by keyword under its own name (clip_eps_low,
    clip_eps_high, dual_clip_c, kl_beta, kl_estimator, loss_agg, loss_norm_tokens, adv_eps,
    scale_by_std in configs/bfcl.py); a field the group lacks keeps its default here
    (kl_log_ratio_clamp is not a config field). Other keys of the group (lr, steps, ...) are
    ignored. Values are taken as they are: `coevolve_jax.config.validate` checks them.
    """
    return cls(
      **{f.name: train_cfg[f.name] for f in dataclasses.fields(cls) if f.name in train_cfg}
    )


def dead_rows(
  rewards_n: np.ndarray, group_ids_n: np.ndarray, keep_n: np.ndarray | None = None
) -> np.ndarray:
  """[N] bool: the rows of "dead" groups, whose kept rows' rewards are all equal (or which keep
  fewer than two rows): `compute_advantages` gives them exactly 0, so they carry no policy
  gradient. DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476) keeps only groups with
  0 < correct < G, which drops them.

  Args:
    rewards_n: [N] float rewards. group_ids_n: [N] group ids. keep_n: [N] bool (None: all kept).
  """
  rewards_n, group_ids_n = np.asarray(rewards_n), np.asarray(group_ids_n)
  keep_n = np.ones(rewards_n.shape, bool) if keep_n is None else np.asarray(keep_n, bool)
  out = np.zeros(rewards_n.shape, bool)
  for g in np.unique(group_ids_n):
    rows = group_ids_n == g
    out[rows] = len(np.unique(rewards_n[rows & keep_n])) < 2
  return out


def loss_rows(
  finishes: Sequence[str],
  rewards_n: np.ndarray,
  group_ids_n: np.ndarray,
  drop_from_loss: Sequence[str] = (),
  drop_dead_groups: bool = False,
) -> np.ndarray:
  """[N] bool: the rollouts a step trains on (`keep`): not ended by a finish in
  `drop_from_loss` (`train.drop_from_loss`, verl's overlong filtering), and with
  `drop_dead_groups` (`train.drop_dead_groups`) not in a group that is dead among those
  (`dead_rows`).

  Args:
    finishes: [N] `Trajectory.finish` values. rewards_n: [N] float. group_ids_n: [N].
  """
  keep = np.array([f not in drop_from_loss for f in finishes], bool)
  if drop_dead_groups:
    keep &= ~dead_rows(rewards_n, group_ids_n, keep)
  return keep


def compute_advantages(
  rewards_n: np.ndarray,
  group_ids_n: np.ndarray,
  eps: float = 1e-6,
  scale_by_std: bool = True,
  keep_n: np.ndarray | None = None,
) -> np.ndarray:
  """Group-relative advantages A_k = (R_k - mean_group(R)) / (std_group(R) + eps) (paper Eq. 1).

  Statistics are per group id (not over the batch); std is the population std (ddof=0). A group
  whose rewards are all equal gets exactly 0 (never NaN). A group of one trajectory gets 0.

  With `keep_n`, rows marked False (trajectories dropped from the loss, `train.drop_from_loss`)
  get advantage 0 and are left out of their group's mean and std: the kept rollouts' advantages
  are those of the group without them (docs/design.md §1.1, "Cut and failed episodes").

  Args:
    rewards_n: [N] float rewards. group_ids_n: [N] group id of each trajectory (any hashable
      numpy dtype; groups may be interleaved). eps: added to the std. scale_by_std: False gives
      R_k - mean_group(R) (Dr. GRPO). keep_n: [N] bool, or None to keep every row.
  Returns:
    [N] float32 advantages.
  Raises:
    ValueError: rewards, group ids (or keep_n) of different shapes, not 1-D, or a non-finite
      reward.
  """
  rewards_n = np.asarray(rewards_n, np.float64)
  group_ids_n = np.asarray(group_ids_n)
  if rewards_n.ndim != 1 or rewards_n.shape != group_ids_n.shape:
    raise ValueError(
      f"rewards {rewards_n.shape} and group ids {group_ids_n.shape} must be the same 1-D shape [N]"
    )
  keep_n = np.ones(rewards_n.shape, bool) if keep_n is None else np.asarray(keep_n)
  if keep_n.shape != rewards_n.shape or keep_n.dtype != bool:
    raise ValueError(f"keep_n must be a bool array of shape {rewards_n.shape}, got {keep_n!r}")
  if not np.all(np.isfinite(rewards_n)):
    raise ValueError(f"non-finite rewards at rows {np.flatnonzero(~np.isfinite(rewards_n))}")
  adv = np.zeros_like(rewards_n)
  for g in np.unique(group_ids_n):
    idx = (group_ids_n == g) & keep_n
    if not idx.any():
      continue
    r = rewards_n[idx]
    if np.all(r == r[0]):  # exact test: r - r.mean() is not exactly 0 for e.g. [0.1] * 3
      continue
    centred = r - r.mean()
    adv[idx] = centred / (r.std() + eps) if scale_by_std else centred
  return adv.astype(np.float32)


def kl_penalty(
  logp_nt: jax.Array, ref_logp_nt: jax.Array, estimator: str, clamp: float
) -> jax.Array:
  """Per-token KL(pi || pi_ref) estimate from sampled tokens (Schulman 2020 k1/k2/k3).

  k3 = exp(ref - logp) - (ref - logp) - 1, with the log-ratio clamped to [-clamp, clamp] BEFORE
  the exponent so a drifting policy cannot overflow.

  A log-prob of -inf means the token lies outside the support of the distribution scored (the
  top-k / top-p set, `trainer.token_logprobs`): where the policy's is -inf the estimate is 0, as
  the token has no mass under pi and so no weight in KL(pi || pi_ref); where only the reference's
  is, the log-ratio sits at -clamp. Neither case has a gradient, and neither makes a NaN.

  Args:
    logp_nt, ref_logp_nt: [N, T] float log-probs (nats, -inf allowed) under the policy and the
      reference.
    estimator: "k1" | "k2" | "k3". clamp: bound on |ref_logp - logp| (nats).
  Returns:
    [N, T] finite per-token estimates (k2, k3 >= 0).
  Raises:
    ValueError: an unknown estimator.
  """
  out, ref_out = _outside(logp_nt), _outside(ref_logp_nt)
  log_ratio = jnp.clip(
    jnp.where(ref_out, -clamp, _finite(ref_logp_nt, ref_out) - _finite(logp_nt, out)),
    -clamp,
    clamp,
  )
  if estimator == "k1":
    kl = -log_ratio
  elif estimator == "k2":
    kl = 0.5 * jnp.square(log_ratio)
  elif estimator == "k3":
    kl = jnp.exp(log_ratio) - log_ratio - 1.0
  else:
    raise ValueError(f"unknown KL estimator {estimator!r}")
  return jnp.where(out, 0.0, kl)


def _outside(logp: jax.Array) -> jax.Array:
  """Where a log-prob is -inf: the token is outside the scored distribution's support (a NaN is
  not, so that it still shows)."""
  return logp == -jnp.inf


def _finite(logp: jax.Array, outside: jax.Array) -> jax.Array:
  """The log-probs with 0 where `outside`: arithmetic on them makes no inf - inf, and `jnp.where`
  sends no gradient into the replaced entries."""
  return jnp.where(outside, 0.0, logp)


def aggregate_denominator(mask_nt: jax.Array, mode: str) -> jax.Array:
  """The divisor of `aggregate`: masked tokens (token-mean) or non-empty rows (seq-mean modes).

  Args:
    mask_nt: [N, T] 0/1 mask. mode: one of the `aggregate` modes.
  Returns:
    float32 scalar (0 when nothing is masked in; `aggregate` then divides by 1).
  Raises:
    ValueError: an unknown mode.
  """
  mask_nt = mask_nt.astype(jnp.float32)
  if mode == "token-mean":
    return jnp.sum(mask_nt)
  if mode in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
    return jnp.sum((jnp.sum(mask_nt, axis=-1) > 0).astype(jnp.float32))
  raise ValueError(f"unknown loss aggregation {mode!r}")


def aggregate(
  loss_nt: jax.Array,
  mask_nt: jax.Array,
  mode: str,
  norm_tokens: float,
  denominator: jax.Array | None = None,
) -> jax.Array:
  """Reduces per-token losses [N, T] to a scalar: sum of row/token terms / denominator.

  token-mean: sum over all tokens / number of tokens (paper Eq. 1).
  seq-mean-token-mean: mean over rows of each row's token mean (rows with no token excluded).
  seq-mean-token-sum-norm: mean over rows of each row's token sum / norm_tokens (Dr. GRPO,
  Liu et al. 2025, with a constant normaliser).

  The numerator is a sum over rows, so a batch split into micro-batches aggregates exactly when
  every micro-batch divides by the whole batch's `aggregate_denominator` and the parts are summed.

  Args:
    loss_nt: [N, T] float per-token losses. mask_nt: [N, T] 0/1 (1 = counted).
    mode: "token-mean" | "seq-mean-token-mean" | "seq-mean-token-sum-norm".
    norm_tokens: the constant of seq-mean-token-sum-norm (tokens).
    denominator: scalar to divide by instead of `aggregate_denominator(mask_nt, mode)`.
  Returns:
    Scalar of loss_nt's dtype (0 when nothing is counted).
  Raises:
    ValueError: an unknown mode.
  """
  mask_nt = mask_nt.astype(loss_nt.dtype)
  if denominator is None:
    denominator = aggregate_denominator(mask_nt, mode)
  denominator = jnp.maximum(denominator.astype(loss_nt.dtype), 1.0)
  if mode == "token-mean":
    return jnp.sum(loss_nt * mask_nt) / denominator
  row_tokens = jnp.sum(mask_nt, axis=-1)
  row_sum = jnp.sum(loss_nt * mask_nt, axis=-1)
  has = (row_tokens > 0).astype(loss_nt.dtype)
  if mode == "seq-mean-token-mean":
    return jnp.sum(row_sum / jnp.maximum(row_tokens, 1.0) * has) / denominator
  if mode == "seq-mean-token-sum-norm":
    return jnp.sum(row_sum / norm_tokens * has) / denominator
  raise ValueError(f"unknown loss aggregation {mode!r}")


def grpo_loss(
  logp_nt: jax.Array,
  old_logp_nt: jax.Array,
  ref_logp_nt: jax.Array | None,
  advantages_n: jax.Array,
  mask_nt: jax.Array,
  cfg: GRPOConfig,
  loss_denominator: jax.Array | None = None,
  token_denominator: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped policy-gradient loss plus beta * KL (the negative of paper Eq. 1's J).

  Per token: pg = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) with r = exp(logp - old_logp)
  (log-ratio clamped to [-20, 20]); for A < 0 and dual_clip_c > 0, pg = min(pg, -A c) (dual-clip
  PPO, Ye et al. 2020); plus kl_beta * kl_penalty(...). Aggregated by `cfg.loss_agg`.

  Log-probs may be -inf: a token outside the top-k / top-p set of the distribution scored
  (docs/design.md §1.1, "Sampling distribution"). Where the current policy's is -inf, its
  probability is 0: the log-ratio sits at -20 (r = exp(-20)) and the KL estimate is 0. Where only
  the old policy's is -inf (the sampler drew the token, so only rounding at the set's edge can
  exclude it), nothing is known of the ratio: r = 1. Such tokens get no gradient; they still count
  in the aggregation's denominators. Nothing here makes a NaN from -inf inputs.

  Args:
    logp_nt: [N, T] float32 log-probs (nats) of the sampled tokens under the current policy.
    old_logp_nt: [N, T] under the policy that sampled them (no gradient flows into it).
    ref_logp_nt: [N, T] under the reference policy (no gradient), or None when kl_beta == 0.
    advantages_n: [N] trajectory advantages, broadcast to tokens, or [N, T] per-token ones (the
      shape of mask_nt; `advantages` module): A in the formula above is then A[n, t].
    mask_nt: [N, T] 1 on tokens the policy sampled, 0 elsewhere.
    cfg: objective settings.
    loss_denominator: divisor of the loss and pg_loss instead of this batch's own
      `aggregate_denominator(mask_nt, cfg.loss_agg)` (for micro-batches of a larger batch).
    token_denominator: divisor of the token-mean metrics (kl, clip_frac, ratio_mean) instead of
      this batch's token count.
  Returns:
    (float32 scalar loss, dict of float32 scalar metrics: pg_loss, clip_frac, ratio_mean, and kl
    when a reference is used).
  Raises:
    ValueError: unknown cfg.loss_agg or cfg.kl_estimator; advantages_n neither [N] nor of
      mask_nt's shape.
  """
  adv = _token_advantages(advantages_n, mask_nt)
  ratio, pg1, pg2, pg = _clipped_surrogate(logp_nt, old_logp_nt, adv, cfg)
  per_token = pg
  metrics = {}
  agg, tok_mean = _loss_aggregators(mask_nt, cfg, loss_denominator, token_denominator)
  if ref_logp_nt is not None and cfg.kl_beta > 0:
    kl = kl_penalty(
      logp_nt, jax.lax.stop_gradient(ref_logp_nt), cfg.kl_estimator, cfg.kl_log_ratio_clamp
    )
    per_token = per_token + cfg.kl_beta * kl
    metrics["kl"] = tok_mean(kl)
  loss = agg(per_token)
  clipped = (pg2 > pg1).astype(jnp.float32)
  metrics.update(pg_loss=agg(pg), clip_frac=tok_mean(clipped), ratio_mean=tok_mean(ratio))
  return loss, metrics


def _token_advantages(advantages_n: jax.Array, mask_nt: jax.Array) -> jax.Array:
  """The advantages of `grpo_loss` in a shape that broadcasts against its [N, T] terms.

  Args:
    advantages_n: [N] trajectory advantages, or [N, T] per-token ones (mask_nt's shape).
    mask_nt: [N, T] target mask (only its shape is used).
  Returns:
    float32 [N, 1] (from [N]) or [N, T].
  Raises:
    ValueError: advantages_n neither [N] nor of mask_nt's shape.
  """
  if jnp.ndim(advantages_n) == 1:  # [N]: the outcome advantage, the program as it always was
    return advantages_n[:, None].astype(jnp.float32)
  if jnp.shape(advantages_n) == jnp.shape(mask_nt):
    return jnp.asarray(advantages_n, jnp.float32)
  raise ValueError(
    f"advantages of shape {jnp.shape(advantages_n)}, want [N] or mask_nt's {jnp.shape(mask_nt)}"
  )


def _importance_log_ratio(logp_nt: jax.Array, old_logp_nt: jax.Array) -> jax.Array:
  """log r = logp - old_logp per token, clamped to [-20, 20]; no gradient into the old log-probs.

  An old log-prob of -inf gives 0 (r = 1), whatever the current one; otherwise a current one of
  -inf gives -20 (r = exp(-20)): see `grpo_loss`.

  Args:
    logp_nt, old_logp_nt: [N, T] float32 log-probs (nats, -inf allowed) under the current policy
      and the policy that sampled the tokens.
  Returns:
    [N, T] float32 finite log-ratios.
  """
  old_logp_nt = jax.lax.stop_gradient(old_logp_nt)
  out, old_out = _outside(logp_nt), _outside(old_logp_nt)
  return jnp.clip(
    jnp.where(
      out | old_out,
      jnp.where(old_out, 0.0, -20.0),
      _finite(logp_nt, out) - _finite(old_logp_nt, old_out),
    ),
    -20.0,
    20.0,
  )


def _clipped_surrogate(
  logp_nt: jax.Array, old_logp_nt: jax.Array, adv: jax.Array, cfg: GRPOConfig
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """The per-token clipped policy-gradient terms of `grpo_loss` (clip-higher and dual clip).

  Args:
    logp_nt, old_logp_nt: [N, T] float32 current and old (sampler-side) log-probs.
    adv: float32 [N, 1] or [N, T] advantages (`_token_advantages`). cfg: the clip settings.
  Returns:
    [N, T] float32 (ratio, pg1 = -A r, pg2 = -A clip(r), pg): pg = max(pg1, pg2), bounded by
    -A c where A < 0 when cfg.dual_clip_c > 0.
  """
  ratio = jnp.exp(_importance_log_ratio(logp_nt, old_logp_nt))
  pg1 = -adv * ratio
  pg2 = -adv * jnp.clip(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
  pg = jnp.maximum(pg1, pg2)
  if cfg.dual_clip_c > 0:
    pg = jnp.where(adv < 0, jnp.minimum(pg, -adv * cfg.dual_clip_c), pg)
  return ratio, pg1, pg2, pg


def _loss_aggregators(
  mask_nt: jax.Array,
  cfg: GRPOConfig,
  loss_denominator: jax.Array | None,
  token_denominator: jax.Array | None,
) -> tuple[Callable[[jax.Array], jax.Array], Callable[[jax.Array], jax.Array]]:
  """The two reductions of `grpo_loss`, each [N, T] float32 -> float32 scalar.

  Args:
    mask_nt: [N, T] 0/1 target mask. cfg: gives the loss's `loss_agg` and `loss_norm_tokens`.
    loss_denominator, token_denominator: see `grpo_loss` (None: this batch's own).
  Returns:
    (agg: `cfg.loss_agg` over loss_denominator, for loss and pg_loss; tok_mean: token-mean over
    token_denominator, for the kl, clip_frac and ratio_mean metrics).
  """
  agg = functools.partial(
    aggregate,
    mask_nt=mask_nt,
    mode=cfg.loss_agg,
    norm_tokens=cfg.loss_norm_tokens,
    denominator=loss_denominator,
  )
  tok_mean = functools.partial(
    aggregate, mask_nt=mask_nt, mode="token-mean", norm_tokens=1.0, denominator=token_denominator
  )
  return agg, tok_mean
