"""Golden tests of the GRPO objective against an independent plain-numpy reference (loops)."""

import dataclasses
import functools
import importlib.util
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from coevolve_jax import grpo
from coevolve_jax.grpo import GRPOConfig, compute_advantages, grpo_loss

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ESTIMATORS = ("k1", "k2", "k3")


# ---------------------------------------------------------------------------------------------
# Independent reference (float64, explicit loops over rows and tokens).
# ---------------------------------------------------------------------------------------------


def ref_advantages(rewards, group_ids, eps=1e-6, scale_by_std=True):
  n = len(rewards)
  out = np.zeros(n)
  for i in range(n):
    members = [float(rewards[j]) for j in range(n) if group_ids[j] == group_ids[i]]
    mean = sum(members) / len(members)
    if all(m == members[0] for m in members):
      out[i] = 0.0
      continue
    std = math.sqrt(sum((m - mean) ** 2 for m in members) / len(members))
    out[i] = (rewards[i] - mean) / (std + eps) if scale_by_std else rewards[i] - mean
  return out


def ref_kl(logp, ref_logp, estimator, clamp):
  d = min(max(ref_logp - logp, -clamp), clamp)  # clamp BEFORE exp
  if estimator == "k1":
    return -d
  if estimator == "k2":
    return 0.5 * d * d
  return math.exp(d) - d - 1.0


def ref_kl_grad(logp, ref_logp, estimator, clamp):
  """d kl / d logp (0 where the clamp saturates)."""
  d = ref_logp - logp
  if not -clamp < d < clamp:
    return 0.0
  if estimator == "k1":
    return 1.0
  if estimator == "k2":
    return -d
  return 1.0 - math.exp(d)


def ref_pg(logp, old, adv, cfg):
  """(per-token policy-gradient loss, d loss / d logp, clipped flag)."""
  lr = logp - old
  lr_c = min(max(lr, -20.0), 20.0)
  ratio = math.exp(lr_c)
  dratio = ratio if -20.0 < lr < 20.0 else 0.0
  lo, hi = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high
  pg1 = -adv * ratio
  pg2 = -adv * min(max(ratio, lo), hi)
  if pg1 >= pg2:
    pg, grad = pg1, -adv * dratio
  else:  # the clipped branch is larger: constant in logp
    pg, grad = pg2, 0.0
  if cfg.dual_clip_c > 0 and adv < 0 and -adv * cfg.dual_clip_c < pg:
    pg, grad = -adv * cfg.dual_clip_c, 0.0
  return pg, grad, pg2 > pg1


def ref_aggregate_weights(mask, mode, norm_tokens):
  """Weight w[i][t] such that the aggregated loss is sum_it w[i][t] * loss[i][t]."""
  n, t = len(mask), len(mask[0])
  w = [[0.0] * t for _ in range(n)]
  total = sum(sum(row) for row in mask)
  nonempty = sum(1 for row in mask if sum(row) > 0)
  for i in range(n):
    row_tokens = sum(mask[i])
    for j in range(t):
      if not mask[i][j]:
        continue
      if mode == "token-mean":
        w[i][j] = 1.0 / total
      elif mode == "seq-mean-token-mean":
        w[i][j] = 1.0 / row_tokens / nonempty
      else:
        w[i][j] = 1.0 / norm_tokens / nonempty
  return w


def ref_loss(logp, old, ref, adv, mask, cfg):
  """Returns (loss, d loss / d logp [N, T], metrics) in float64."""
  n, t = logp.shape
  w = ref_aggregate_weights(mask.tolist(), cfg.loss_agg, cfg.loss_norm_tokens)
  w_tok = ref_aggregate_weights(mask.tolist(), "token-mean", 1.0)
  loss, pg_loss, kl_metric, clip_frac = 0.0, 0.0, 0.0, 0.0
  grad = np.zeros((n, t))
  use_kl = ref is not None and cfg.kl_beta > 0
  for i in range(n):
    for j in range(t):
      pg, dpg, clipped = ref_pg(float(logp[i, j]), float(old[i, j]), float(adv[i]), cfg)
      tok, dtok = pg, dpg
      if use_kl:
        kl = ref_kl(float(logp[i, j]), float(ref[i, j]), cfg.kl_estimator, cfg.kl_log_ratio_clamp)
        tok += cfg.kl_beta * kl
        dtok += cfg.kl_beta * ref_kl_grad(
          float(logp[i, j]), float(ref[i, j]), cfg.kl_estimator, cfg.kl_log_ratio_clamp
        )
        kl_metric += w_tok[i][j] * kl
      loss += w[i][j] * tok
      pg_loss += w[i][j] * pg
      clip_frac += w_tok[i][j] * float(clipped)
      grad[i, j] = w[i][j] * dtok
  metrics = {"pg_loss": pg_loss, "clip_frac": clip_frac}
  if use_kl:
    metrics["kl"] = kl_metric
  return loss, grad, metrics


@functools.partial(jax.jit, static_argnames=("cfg",))
def _loss_and_grad(logp, old, ref, adv, mask, cfg):
  f = lambda lp: grpo_loss(lp, old, ref, adv, mask, cfg)  # noqa: E731
  return jax.value_and_grad(f, has_aux=True)(logp)


PAD = (6, 9)  # inputs are embedded in a masked batch of this shape, so that jit compiles rarely


def _cfg(mode="token-mean", estimator="k3", **overrides):
  return dataclasses.replace(
    GRPOConfig(loss_agg=mode, kl_estimator=estimator, kl_beta=0.3, loss_norm_tokens=4.0),
    **overrides,
  )


def _run(logp, old, ref, adv, mask, cfg, pad=True):
  """Our implementation: loss, metrics and jax.grad w.r.t. logp.

  With `pad`, the [n, t] inputs go into the corner of a PAD-shaped batch whose other entries are
  masked (and extra rows have no token): no aggregation mode counts those, so results are equal.
  """
  n, t = np.shape(logp)

  def prep(x, row=False):
    if x is None:
      return None
    x = np.asarray(x, np.float32)
    if pad:
      out = np.zeros(PAD[:1] if row else PAD, np.float32)
      out[tuple(slice(0, k) for k in x.shape)] = x
      x = out
    return jnp.asarray(x)

  (loss, metrics), g = _loss_and_grad(
    prep(logp), prep(old), prep(ref), prep(adv, row=True), prep(mask), cfg
  )
  return float(loss), np.asarray(g)[:n, :t], {k: float(v) for k, v in metrics.items()}


def _random_batch(seed, n=6, t=9, spread=0.4):
  rng = np.random.default_rng(seed)
  logp = -rng.gamma(2.0, 1.0, (n, t))
  old = logp + rng.normal(0.0, spread, (n, t))
  ref = logp + rng.normal(0.0, 1.0, (n, t))
  rewards = rng.integers(0, 2, n).astype(float)
  rewards[0], rewards[1] = 1.0, 0.0  # at least one non-trivial group
  groups = np.array([0, 0, 1, 0, 1, 1][:n])
  adv = ref_advantages(rewards, groups)
  mask = (rng.random((n, t)) < 0.7).astype(float)
  mask[:, 0] = 1.0
  mask[2, :] = 0.0  # a fully masked row
  mask[3, 1:] = 0.0  # a one-token row
  return logp, old, ref, adv, mask


# ---------------------------------------------------------------------------------------------
# Advantages.
# ---------------------------------------------------------------------------------------------


def test_advantages_random_interleaved_groups():
  rng = np.random.default_rng(0)
  for trial in range(20):
    n = int(rng.integers(2, 40))
    groups = rng.integers(0, 5, n)  # ids interleaved through the batch
    rewards = rng.random(n) if trial % 2 else rng.integers(0, 2, n).astype(float)
    got = compute_advantages(rewards, groups)
    assert got.dtype == np.float32 and got.shape == (n,)
    np.testing.assert_allclose(got, ref_advantages(rewards, groups), rtol=1e-5, atol=1e-5)
    perm = rng.permutation(n)  # statistics follow the ids, not the batch order
    np.testing.assert_array_equal(compute_advantages(rewards[perm], groups[perm]), got[perm])


def test_advantages_hand_computed_binary_group():
  got = compute_advantages(np.array([1.0, 0.0, 0.0, 0.0]), np.array([7, 7, 7, 7]))
  std = math.sqrt(0.1875)
  np.testing.assert_allclose(got, [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], rtol=1e-5)
  no_scale = compute_advantages(np.array([1.0, 0.0, 0.0, 0.0]), np.zeros(4), scale_by_std=False)
  np.testing.assert_allclose(no_scale, [0.75, -0.25, -0.25, -0.25], rtol=1e-6)


def test_advantages_per_group_not_whole_batch():
  # Group 0 is all-success, group 1 mixed: group 0 must be 0 even though the batch mean is not 1.
  rewards = np.array([1.0, 0.0, 1.0, 1.0, 1.0])
  groups = np.array([0, 1, 0, 1, 0])
  got = compute_advantages(rewards, groups)
  np.testing.assert_array_equal(got[[0, 2, 4]], 0.0)
  np.testing.assert_allclose(got[[1, 3]], [-1.0, 1.0], rtol=1e-5)


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 1.0 / 3.0, 0.7, 123.456])
def test_advantages_all_equal_group_exactly_zero(value):
  rewards = np.array([value] * 3 + [0.0, 1.0] + [value] * 4)
  groups = np.array([5] * 3 + [6, 6] + [5] * 4)
  got = compute_advantages(rewards, groups)
  assert np.all(np.isfinite(got))
  assert np.all(got[groups == 5] == 0.0), got  # exactly zero, not ~1e-11
  assert got[3] < 0 < got[4]


def test_advantages_singleton_group_is_zero():
  got = compute_advantages(np.array([0.3, 1.0, 0.0]), np.array([1, 2, 2]))
  assert got[0] == 0.0 and np.all(np.isfinite(got))


# ---------------------------------------------------------------------------------------------
# Loss against the reference.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_loss_matches_reference_random(mode, estimator):
  for seed in range(3):
    logp, old, ref, adv, mask = _random_batch(seed)
    cfg = _cfg(mode, estimator)
    loss, grad, metrics = _run(logp, old, ref, adv, mask, cfg)
    want, want_grad, want_metrics = ref_loss(logp, old, ref, adv, mask, cfg)
    np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)
    for k, v in want_metrics.items():
      np.testing.assert_allclose(metrics[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


def test_loss_without_reference_or_beta():
  logp, old, ref, adv, mask = _random_batch(3)
  cfg = _cfg()
  loss_none, _, m_none = _run(logp, old, None, adv, mask, cfg)
  want, _, _ = ref_loss(logp, old, None, adv, mask, cfg)
  np.testing.assert_allclose(loss_none, want, rtol=1e-5, atol=1e-6)
  assert "kl" not in m_none
  loss_b0, _, _ = _run(logp, old, ref, adv, mask, dataclasses.replace(cfg, kl_beta=0.0))
  np.testing.assert_allclose(loss_b0, want, rtol=1e-5, atol=1e-6)


def test_one_token_sequences():
  rng = np.random.default_rng(4)
  logp = -rng.random((5, 1))
  old = logp + rng.normal(0, 0.3, (5, 1))
  ref = logp + rng.normal(0, 0.3, (5, 1))
  adv = np.array([1.0, -1.0, 0.5, -0.5, 0.0])
  mask = np.ones((5, 1))
  for mode in MODES:
    cfg = _cfg(mode)
    loss, grad, _ = _run(logp, old, ref, adv, mask, cfg, pad=False)  # really T = 1
    want, want_grad, _ = ref_loss(logp, old, ref, adv, mask, cfg)
    np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)


def test_fully_masked_rows_and_batch():
  logp, old, ref, adv, mask = _random_batch(5)
  mask[1:, :] = 0.0
  for mode in MODES:
    cfg = _cfg(mode)
    loss, grad, _ = _run(logp, old, ref, adv, mask, cfg)
    want, want_grad, _ = ref_loss(logp, old, ref, adv, mask, cfg)
    np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
    assert np.all(grad[1:] == 0.0)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)
  # Everything masked: loss 0, gradient 0, no NaN.
  for mode in MODES:
    cfg = _cfg(mode)
    loss, grad, metrics = _run(logp, old, ref, adv, np.zeros_like(mask), cfg)
    assert loss == 0.0 and np.all(grad == 0.0)
    assert all(np.isfinite(v) for v in metrics.values())


def test_masked_positions_do_not_leak():
  """Garbage (but finite) values at masked positions change nothing."""
  logp, old, ref, adv, mask = _random_batch(6)
  cfg = _cfg()
  loss, grad, _ = _run(logp, old, ref, adv, mask, cfg)
  off = mask == 0
  logp2, old2, ref2 = logp.copy(), old.copy(), ref.copy()
  logp2[off], old2[off], ref2[off] = -1e4, 50.0, 1e4
  loss2, grad2, _ = _run(logp2, old2, ref2, adv, mask, cfg)
  assert loss2 == pytest.approx(loss, rel=1e-6, abs=1e-7)
  np.testing.assert_allclose(grad2, grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("estimator,mode", list(zip(ESTIMATORS, MODES)))
def test_extreme_log_ratios_finite(estimator, mode):
  big = np.array([[1e4, -1e4, 200.0, -200.0, 89.0, -104.0, 1e30, -1e30]])
  logp = np.concatenate([big, -big, np.zeros_like(big)], axis=0)
  old = np.concatenate([np.zeros_like(big), np.zeros_like(big), big], axis=0)
  ref = np.concatenate([-big, big, -big], axis=0)
  mask = np.ones_like(logp)
  cfg = _cfg(mode, estimator)
  for adv in ([1.0, -1.0, 1.0], [-2.0, 2.0, -0.5]):
    loss, grad, metrics = _run(logp, old, ref, np.array(adv), mask, cfg)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    assert all(np.isfinite(v) for v in metrics.values())
    want, want_grad, _ = ref_loss(logp, old, ref, np.array(adv), mask, cfg)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)


def test_tokens_outside_the_kept_set_hand_computed():
  """-inf log-probs (a token outside the top-k / top-p set scored, trainer.token_logprobs): the
  current policy's -inf is ratio exp(-20) and KL 0, the old policy's is ratio 1, the reference's
  is a KL log-ratio at -20; none has a gradient and masked -inf entries make no NaN."""
  inf = np.inf
  logp = np.array([[-1.0, -inf, -2.0, -1.0, -inf], [-inf, -inf, -inf, -inf, -inf]])
  old = np.array([[-1.0, -1.0, -inf, -1.0, -inf], [-1.0, -inf, 0.0, -inf, -1.0]])
  ref = np.array([[-1.0, -1.0, -2.0, -inf, -inf], [-1.0, -1.0, -inf, -inf, -inf]])
  mask = np.array([[1, 1, 1, 1, 0], [1, 0, 0, 0, 0]], float)
  adv = np.array([1.0, -1.0])
  e20 = math.exp(-20.0)
  # Per token (row 0, A = 1): pg -1, -e20, -1, -1; (row 1, A = -1): 0.8 (clipped at 1 - 0.2).
  pg = [-1.0, -e20, -1.0, -1.0, 0.8]
  kl = [0.0, 0.0, 0.0, e20 + 19.0, 0.0]  # k3 at log-ratio -20 on the reference's -inf only
  cfg = _cfg(kl_beta=0.5)
  loss, grad, metrics = _run(logp, old, ref, adv, mask, cfg)
  assert loss == pytest.approx(sum(pg) / 5 + 0.5 * sum(kl) / 5, rel=1e-6)  # 1.46
  assert metrics["pg_loss"] == pytest.approx(sum(pg) / 5, rel=1e-6)  # -0.44
  assert metrics["kl"] == pytest.approx(sum(kl) / 5, rel=1e-6)  # 3.8
  assert metrics["clip_frac"] == pytest.approx(1 / 5) and metrics["ratio_mean"] == pytest.approx(
    (3 + 2 * e20) / 5
  )
  np.testing.assert_allclose(grad, [[-0.2, 0, 0, -0.2, 0], [0, 0, 0, 0, 0]], atol=1e-7)
  # The estimators one by one: the policy's -inf gives 0, the reference's alone the clamp.
  lp = jnp.array([-inf, -1.0, -inf, -1.0])
  rf = jnp.array([-1.0, -inf, -inf, -1.5])
  for est, at_clamp in (("k1", 20.0), ("k2", 200.0), ("k3", e20 + 19.0)):
    got = np.asarray(grpo.kl_penalty(lp, rf, est, 20.0))
    want_last = ref_kl(-1.0, -1.5, est, 20.0)
    np.testing.assert_allclose(got, [0.0, at_clamp, 0.0, want_last], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Hand-computed values.
# ---------------------------------------------------------------------------------------------


def _hand_batch():
  # ratio == 1 everywhere, so each token's pg loss is -A of its row. Row lengths 1, 3, 0.
  logp = np.full((3, 4), -1.0)
  adv = np.array([1.0, -2.0, 5.0])
  mask = np.array([[1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], float)
  return logp, adv, mask


@pytest.mark.parametrize(
  "mode,want",
  [
    ("token-mean", (-1.0 + 3 * 2.0) / 4),  # 1.25
    ("seq-mean-token-mean", (-1.0 + 2.0) / 2),  # 0.5; the empty row is not counted
    ("seq-mean-token-sum-norm", (-1.0 / 4 + 6.0 / 4) / 2),  # 0.625 with norm_tokens = 4
  ],
)
def test_aggregation_hand_computed(mode, want):
  logp, adv, mask = _hand_batch()
  cfg = _cfg(mode)  # ref == logp: KL is exactly 0 for every estimator
  loss, grad, metrics = _run(logp, logp, logp, adv, mask, cfg)
  assert loss == pytest.approx(want, rel=1e-6)
  assert metrics["pg_loss"] == pytest.approx(want, rel=1e-6)
  # d loss / d logp = -A * ratio * weight.
  w = np.array(ref_aggregate_weights(mask.tolist(), mode, 4.0))
  np.testing.assert_allclose(grad, -adv[:, None] * w, rtol=1e-6)


def test_aggregation_direct():
  loss_nt = jnp.array([[1.0, 2.0, 3.0, 4.0], [10.0, 0.0, 0.0, 0.0]])
  mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0]])
  assert float(grpo.aggregate(loss_nt, mask, "token-mean", 1.0)) == pytest.approx(16.0 / 4)
  assert float(grpo.aggregate(loss_nt, mask, "seq-mean-token-mean", 1.0)) == pytest.approx(6.0)
  assert float(grpo.aggregate(loss_nt, mask, "seq-mean-token-sum-norm", 2.0)) == pytest.approx(
    (6.0 / 2 + 10.0 / 2) / 2
  )
  with pytest.raises(ValueError):
    grpo.aggregate(loss_nt, mask, "sum", 1.0)


@pytest.mark.parametrize(
  "ratio,adv,want_pg,want_grad",
  [
    (1.25, 1.0, -1.25, -1.25),  # inside [0.8, 1.28]: unclipped (a symmetric 0.2 would clip)
    (1.5, 1.0, -1.28, 0.0),  # above 1 + eps_high: clipped, no gradient
    (0.5, 1.0, -0.5, -0.5),  # below 1 - eps_low with A > 0: pessimistic min keeps ratio
    (0.75, -1.0, 0.8, 0.0),  # below 1 - eps_low with A < 0: clipped at 0.8
    (0.85, -1.0, 0.85, 0.85),  # inside: unclipped
    (1.5, -1.0, 1.5, 1.5),  # above with A < 0: ratio kept (not yet at dual clip)
    (2.9, -1.0, 2.9, 2.9),  # just below c = 3
    (5.0, -1.0, 3.0, 0.0),  # dual clip: bounded at c * |A|
    (5.0, -2.0, 6.0, 0.0),  # dual clip scales with |A|
    (5.0, 1.0, -1.28, 0.0),  # no dual clip for positive advantages
  ],
)
def test_clip_asymmetry_and_dual_clip(ratio, adv, want_pg, want_grad):
  logp = np.array([[math.log(ratio)]])
  old = np.zeros((1, 1))
  cfg = _cfg()  # ref == logp: no KL term
  loss, grad, metrics = _run(logp, old, logp, np.array([adv]), np.ones((1, 1)), cfg)
  assert loss == pytest.approx(want_pg, rel=1e-5)
  assert float(grad[0, 0]) == pytest.approx(want_grad, rel=1e-5, abs=1e-7)
  # Dual clip disabled: the loss for a negative advantage is unbounded in the ratio.
  loss0, _, _ = _run(
    logp, old, logp, np.array([adv]), np.ones((1, 1)), dataclasses.replace(cfg, dual_clip_c=0.0)
  )
  if adv < 0:
    assert loss0 == pytest.approx(max(-adv * ratio, -adv * min(max(ratio, 0.8), 1.28)), rel=1e-5)
  _ = metrics


def test_clip_frac_metric():
  logp = np.log(np.array([[1.5, 1.0, 0.5, 1.1]]))
  loss, _, metrics = _run(
    logp, np.zeros_like(logp), logp, np.array([1.0]), np.ones_like(logp), _cfg()
  )
  # Only the 1.5 token takes the clipped branch (0.5 keeps the unclipped, more pessimistic one).
  assert metrics["clip_frac"] == pytest.approx(0.25)
  assert metrics["ratio_mean"] == pytest.approx((1.5 + 1.0 + 0.5 + 1.1) / 4, rel=1e-6)
  assert loss == pytest.approx(-(1.28 + 1.0 + 0.5 + 1.1) / 4, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# KL.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [-3.0, -0.5, 0.0, 0.25, 2.0])
def test_kl_estimators_hand_computed(d):
  logp = jnp.array([[0.0]])
  ref = jnp.array([[d]])  # ref - logp = d
  k1 = float(grpo.kl_penalty(logp, ref, "k1", 20.0)[0, 0])
  k2 = float(grpo.kl_penalty(logp, ref, "k2", 20.0)[0, 0])
  k3 = float(grpo.kl_penalty(logp, ref, "k3", 20.0)[0, 0])
  assert k1 == pytest.approx(-d, abs=1e-7)
  assert k2 == pytest.approx(0.5 * d * d, abs=1e-7)
  assert k3 == pytest.approx(math.exp(d) - d - 1.0, rel=1e-5, abs=1e-7)
  assert k3 >= 0.0 and k2 >= 0.0
  with pytest.raises(ValueError):
    grpo.kl_penalty(logp, ref, "k4", 20.0)


def test_k3_clamps_before_exp_float32_overflow():
  # ref - logp = 100: exp(100) = inf in float32, so a clamp applied after exp would give inf.
  with np.errstate(over="ignore"):
    assert not np.isfinite(np.exp(np.float32(100.0)))
  logp = jnp.array([[-100.0, 0.0, -95.0]], jnp.float32)
  ref = jnp.array([[0.0, -100.0, 0.0]], jnp.float32)
  kl = np.asarray(grpo.kl_penalty(logp, ref, "k3", 20.0))
  np.testing.assert_allclose(
    kl[0], [math.exp(20.0) - 21.0, math.exp(-20.0) + 19.0, math.exp(20.0) - 21.0], rtol=1e-6
  )
  g = jax.grad(lambda lp: jnp.sum(grpo.kl_penalty(lp, ref, "k3", 20.0)))(logp)
  assert np.all(np.isfinite(np.asarray(g)))
  # A custom clamp is honoured.
  kl5 = np.asarray(grpo.kl_penalty(logp, ref, "k3", 5.0))
  np.testing.assert_allclose(
    kl5[0], [math.exp(5.0) - 6.0, math.exp(-5.0) + 4.0, math.exp(5.0) - 6.0], rtol=1e-6
  )
  # Through the full loss.
  cfg = _cfg()
  assert cfg.kl_estimator == "k3" and cfg.kl_log_ratio_clamp == 20.0
  loss, grad, metrics = _run(
    np.asarray(logp), np.asarray(logp), np.asarray(ref), np.array([0.0]), np.ones((1, 3)), cfg
  )
  assert np.isfinite(loss) and np.all(np.isfinite(grad))
  assert metrics["kl"] == pytest.approx(float(kl.mean()), rel=1e-6)
  assert loss == pytest.approx(cfg.kl_beta * float(kl.mean()), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# Whole-batch denominators (micro-batches) and input checks.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_parts_with_whole_batch_denominators_sum_to_the_reference(mode):
  """Rows split in two parts, each aggregated with the whole batch's denominators: the parts'
  losses and metrics add up to the reference's values for the whole batch."""
  logp, old, ref, adv, mask = _random_batch(7)
  cfg = _cfg(mode, "k2")
  want, want_grad, want_metrics = ref_loss(logp, old, ref, adv, mask, cfg)
  loss_den = grpo.aggregate_denominator(jnp.asarray(mask), mode)
  token_den = grpo.aggregate_denominator(jnp.asarray(mask), "token-mean")
  assert float(token_den) == mask.sum()
  assert float(grpo.aggregate_denominator(jnp.asarray(mask), "seq-mean-token-mean")) == 5.0
  total, metrics, grads = 0.0, {}, []
  for rows in (np.array([0, 2, 5]), np.array([1, 3, 4])):
    f = lambda lp, rows=rows: grpo_loss(  # noqa: E731
      lp,
      jnp.asarray(old[rows], jnp.float32),
      jnp.asarray(ref[rows], jnp.float32),
      jnp.asarray(adv[rows], jnp.float32),
      jnp.asarray(mask[rows], jnp.float32),
      cfg,
      loss_den,
      token_den,
    )
    (loss, m), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp[rows], jnp.float32))
    total += float(loss)
    for k, v in m.items():
      metrics[k] = metrics.get(k, 0.0) + float(v)
    grads.append((rows, np.asarray(g)))
  np.testing.assert_allclose(total, want, rtol=1e-5, atol=1e-6)
  for k, v in want_metrics.items():
    np.testing.assert_allclose(metrics[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
  for rows, g in grads:
    np.testing.assert_allclose(g, want_grad[rows], rtol=1e-4, atol=1e-6)
  with pytest.raises(ValueError):
    grpo.aggregate_denominator(jnp.asarray(mask), "sum")


def test_advantages_leave_dropped_rows_out_of_the_group_statistics():
  """train.drop_from_loss: a dropped rollout (cut by the context, failed environment) gets 0 and
  does not count in its group's mean and std; the kept ones get the advantages of the group
  without it. Hand-computed: group 3 keeps rewards [1, 0, 1]: mean 2/3, std sqrt(2/9)."""
  rewards = np.array([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
  groups = np.array([3, 3, 3, 3, 3, 4, 4, 5, 5])
  keep = np.array([True, True, False, True, False, True, False, False, False])
  got = compute_advantages(rewards, groups, keep_n=keep)
  s = math.sqrt(2.0 / 9.0)
  want = [1 / 3 / s, -2 / 3 / s, 0.0, 1 / 3 / s, 0.0, 0.0, 0.0, 0.0, 0.0]  # 0.7071, -1.4142
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=0.0)
  assert np.all(got[~keep] == 0.0)  # and groups 4 (one kept) and 5 (none kept) are exactly 0
  # Kept in the statistics as reward 0 (no keep_n), the same rewards give other advantages.
  assert not np.allclose(compute_advantages(rewards, groups)[keep], got[keep])
  np.testing.assert_array_equal(
    compute_advantages(rewards, groups, keep_n=np.ones(9, bool)),
    compute_advantages(rewards, groups),
  )
  no_scale = compute_advantages(rewards, groups, scale_by_std=False, keep_n=keep)
  np.testing.assert_allclose(no_scale[:5], [1 / 3, -2 / 3, 0.0, 1 / 3, 0.0], rtol=1e-6)
  for bad in (np.ones(8, bool), np.ones(9, int)):
    with pytest.raises(ValueError, match="keep_n"):
      compute_advantages(rewards, groups, keep_n=bad)


def test_advantages_reject_bad_input():
  with pytest.raises(ValueError, match="same 1-D shape"):
    compute_advantages(np.zeros(3), np.zeros(4))
  with pytest.raises(ValueError, match="same 1-D shape"):
    compute_advantages(np.zeros((2, 2)), np.zeros((2, 2)))
  with pytest.raises(ValueError, match="non-finite rewards at rows \\[1\\]"):
    compute_advantages(np.array([0.0, np.nan, 1.0]), np.zeros(3))


# ---------------------------------------------------------------------------------------------
# The objective's settings from a run config.
# ---------------------------------------------------------------------------------------------

_CONFIGS = os.path.join(os.path.dirname(__file__), os.pardir, "configs")


def _get_config(name, variant=""):
  spec = importlib.util.spec_from_file_location(f"grpo_test_{name}", os.path.join(_CONFIGS, name))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant)


def test_known_estimators_and_aggregations_are_the_ones_the_functions_accept():
  assert grpo.KL_ESTIMATORS == ESTIMATORS and grpo.LOSS_AGGS == MODES
  x = jnp.zeros((1, 2))
  for estimator in grpo.KL_ESTIMATORS:
    grpo.kl_penalty(x, x, estimator, 1.0)
  for mode in grpo.LOSS_AGGS:
    grpo.aggregate(x, x, mode, 1.0)
  with pytest.raises(ValueError):
    grpo.kl_penalty(x, x, "k4", 1.0)


@pytest.mark.parametrize(
  "name,variant", [("bfcl.py", ""), ("bfcl.py", "cpu"), ("appworld.py", ""), ("appworld.py", "cpu")]
)
def test_from_config_of_the_shipped_configs_is_the_default_objective(name, variant):
  train = _get_config(name, variant).train
  got = GRPOConfig.from_config(train)
  assert got == GRPOConfig()  # the configs' defaults are GRPOConfig's
  # What loop.py built by hand before from_config existed: the same objective.
  assert got == GRPOConfig(
    clip_eps_low=train.clip_eps_low,
    clip_eps_high=train.clip_eps_high,
    dual_clip_c=train.dual_clip_c,
    kl_beta=train.kl_beta,
    kl_estimator=train.kl_estimator,
    loss_agg=train.loss_agg,
  )


@pytest.mark.parametrize(
  "field,value",
  [
    ("scale_by_std", False),
    ("adv_eps", 1e-3),
    ("loss_norm_tokens", 1024.0),
    ("clip_eps_high", 0.3),
    ("kl_estimator", "k2"),
    ("loss_agg", "seq-mean-token-mean"),
  ],
)
def test_from_config_takes_each_field_by_name(field, value):
  train = _get_config("bfcl.py").train
  train[field] = value
  got = GRPOConfig.from_config(train)
  assert getattr(got, field) == value
  assert got == dataclasses.replace(GRPOConfig(), **{field: value})  # and nothing else changed
  # A plain dict works alike; keys that are not objective settings are ignored.
  assert GRPOConfig.from_config({field: value, "lr": 1.0}) == got


def test_new_objective_fields_are_reachable_from_the_command_line():
  argv = [
    "main",
    f"--config={os.path.join(_CONFIGS, 'bfcl.py')}:cpu",
    "--config.train.scale_by_std=False",
    "--config.train.adv_eps=0.01",
    "--config.train.loss_norm_tokens=2048",
  ]
  fv = flags.FlagValues()  # as coevolve_jax/main.py declares --config, on a private registry
  config_flags.DEFINE_config_file(
    "config", None, "", flag_values=fv, lock_config=True, sys_argv=argv
  )
  fv(argv)
  got = GRPOConfig.from_config(fv.config.train)
  assert got.scale_by_std is False and got.adv_eps == 0.01 and got.loss_norm_tokens == 2048.0
