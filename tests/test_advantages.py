"""The advantage-estimator seam: the registry, the per-reply spread, and the [N] / [N, P] forms
through `grpo.grpo_loss`, `trainer.make_batch` and `PolicyTrainer.grpo_epoch`."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coevolve_jax import advantages, grpo
from coevolve_jax.advantages import AdvantageInputs, spread_over_replies
from coevolve_jax.config import validate
from coevolve_jax.trainer import PolicyTrainer, make_batch, make_optimizer, target_positions
from coevolve_jax.types import Reply, Trajectory
from test_config import _get_config
from test_grpo import (
  MODES,
  _cfg,
  _loss_and_grad,
  _random_batch,
  ref_aggregate_weights,
  ref_kl,
  ref_kl_grad,
  ref_pg,
)
from test_trainer import _fresh, _traj

import kit


def _episode(seed, parts, group_id=0):
  """test_trainer's `_traj` (parts: (length, sampled) segments) with each sampled segment
  recorded as one reply, as `agent.AgentRunner` records them."""
  tr = _traj(seed, parts, group_id)
  start = 0
  for n, sampled in parts:
    if sampled:
      tr.replies.append(Reply(start, start + n))
    start += n
  return tr


# ---------------------------------------------------------------------------------------------
# The registry and the "grpo" entry.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "cfg",
  [grpo.GRPOConfig(), grpo.GRPOConfig(adv_eps=0.1), grpo.GRPOConfig(scale_by_std=False)],
  ids=["default", "eps", "dr-grpo"],
)
def test_grpo_entry_is_compute_advantages_exactly(cfg):
  """ "grpo" is the loop's call of `grpo.compute_advantages`, bit for bit: continuous rewards,
  interleaved groups, dropped rows, a non-default eps and Dr. GRPO (each of which an entry that
  forgot an argument would get wrong)."""
  rng = np.random.default_rng(0)
  n = 12
  rewards = rng.random(n).astype(np.float32)
  groups = rng.permutation(np.repeat(np.arange(3), 4))
  keep = rng.random(n) < 0.75
  keep[0] = False
  want = grpo.compute_advantages(rewards, groups, cfg.adv_eps, cfg.scale_by_std, keep_n=keep)
  trajs = [
    Trajectory(task_id="t", group_id=int(g), reward=float(r)) for g, r in zip(groups, rewards)
  ]
  inputs = AdvantageInputs(trajs, rewards, groups, keep, cfg)
  got = advantages.get("grpo")(inputs)
  estimated = advantages.estimate("grpo", inputs)
  for x in (got, estimated):
    assert x.dtype == np.float32 and x.shape == (n,)
    np.testing.assert_array_equal(x, want)
  assert want[0] == 0.0 and np.any(want != 0.0)
  np.testing.assert_array_equal(
    advantages.estimate("grpo", AdvantageInputs.from_trajectories(trajs, cfg, keep)), want
  )
  # keep None: every row kept.
  np.testing.assert_array_equal(
    advantages.estimate("grpo", AdvantageInputs(trajs, rewards, groups, None, cfg)),
    grpo.compute_advantages(rewards, groups, cfg.adv_eps, cfg.scale_by_std),
  )


def test_registry_rejects_unknown_and_duplicate_names(monkeypatch):
  monkeypatch.setattr(advantages, "_REGISTRY", dict(advantages._REGISTRY))
  assert advantages.names()[0] == "grpo"
  with pytest.raises(ValueError, match=r"unknown advantage estimator 'gae'; known: \('grpo',"):
    advantages.get("gae")
  with pytest.raises(ValueError, match="'grpo' is already registered"):
    advantages.register("grpo")(lambda inputs: np.zeros(inputs.n, np.float32))
  assert advantages.get("grpo") is advantages.grpo_outcome  # the first one stays
  with pytest.raises(ValueError, match="non-empty str"):
    advantages.register("")

  @advantages.register("zeros")
  def zeros(inputs):
    return np.zeros(inputs.n, np.float32)

  assert advantages.names() == ("grpo", "role_agent", "qevolve", "zeros")
  assert advantages.get("zeros") is zeros
  with pytest.raises(ValueError, match="'zeros' is already registered"):
    advantages.register("zeros")(zeros)


def test_estimate_checks_the_estimators_shape(monkeypatch):
  monkeypatch.setattr(advantages, "_REGISTRY", dict(advantages._REGISTRY))
  trajs = [_episode(0, [(3, False), (4, True)]), _episode(1, [(2, False), (6, True)])]
  inputs = AdvantageInputs.from_trajectories(trajs, grpo.GRPOConfig())
  shapes = {"rows": (3,), "short": (2, 5), "fits": (2, 6), "cube": (2, 6, 1)}
  for name, shape in shapes.items():
    advantages.register(name)(lambda inputs, shape=shape: np.ones(shape))
  assert advantages.estimate("fits", inputs).dtype == np.float32
  with pytest.raises(ValueError, match=r"'rows' gave shape \(3,\), want \[2\] or \[2, P\]"):
    advantages.estimate("rows", inputs)
  with pytest.raises(ValueError, match="'short' gave 5 per-token advantages .* has 6 target"):
    advantages.estimate("short", inputs)
  with pytest.raises(ValueError, match="'cube' gave shape"):
    advantages.estimate("cube", inputs)
  with pytest.raises(ValueError, match="group_ids of shape"):
    AdvantageInputs(trajs, np.zeros(2, np.float32), np.zeros(3), None, grpo.GRPOConfig())
  with pytest.raises(ValueError, match="keep must be a bool array"):
    AdvantageInputs(trajs, np.zeros(2, np.float32), np.zeros(2), np.ones(2), grpo.GRPOConfig())


def test_config_names_a_registered_estimator():
  cfg = _get_config("bfcl.py", "cpu")
  assert cfg.train.advantage_estimator == "grpo"
  validate(cfg)
  # Not an objective field: `GRPOConfig.from_config` passes the train group's fields by name.
  assert "advantage_estimator" not in {f.name for f in dataclasses.fields(grpo.GRPOConfig)}
  cfg.train.advantage_estimator = "gae"
  with pytest.raises(
    ValueError, match=r"^train\.advantage_estimator: unknown advantage estimator 'gae'"
  ):
    validate(cfg)


# ---------------------------------------------------------------------------------------------
# Spreading per-reply values over the replies' tokens.
# ---------------------------------------------------------------------------------------------


def _hand_trajectories():
  # Prompt 0-2, reply [3, 6), tool output 6-7, reply [8, 10): targets 3, 4, 5, 8, 9.
  a = _episode(0, [(3, False), (3, True), (2, False), (2, True)])
  # A reply from position 0 (its first token is no target), output 2, reply [3, 4): targets 1, 3.
  b = _episode(1, [(2, True), (1, False), (1, True)])
  c = _episode(2, [(4, False)])  # no reply, no target
  return [a, b, c]


def test_spread_over_replies_hand_computed():
  trajs = _hand_trajectories()
  assert [target_positions(t) for t in trajs] == [[3, 4, 5, 8, 9], [1, 3], []]
  got = spread_over_replies(trajs, [[0.5, -1.0], [2.0, 3.0], []])
  want = np.array(
    [[0.5, 0.5, 0.5, -1.0, -1.0], [2.0, 3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]],
    np.float32,
  )
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got, want)
  # make_batch lines them up with its targets: each target gets its reply's value.
  batch = make_batch(trajs, got, min_len=8, min_targets=8)
  assert batch.advantages.shape == batch.target_pos.shape == (3, 8)
  for r, (tr, values) in enumerate(zip(trajs, ([0.5, -1.0], [2.0, 3.0], []))):
    for k, pos in enumerate(target_positions(tr)):
      (j,) = [j for j, rep in enumerate(tr.replies) if rep.start <= pos < rep.end]
      assert batch.target_pos[r, k] == pos and batch.advantages[r, k] == values[j]
  assert spread_over_replies([trajs[2]], [[]]).shape == (1, 0)


def test_spread_over_replies_refuses_what_does_not_fit():
  trajs = _hand_trajectories()
  with pytest.raises(ValueError, match="2 rows of reply values for 3 trajectories"):
    spread_over_replies(trajs, [[0.5, -1.0], [2.0, 3.0]])
  with pytest.raises(ValueError, match=r"trajectory 1 \(t\): \(1,\) reply values for 2 replies"):
    spread_over_replies(trajs, [[0.5, -1.0], [2.0], []])
  with pytest.raises(ValueError, match="non-finite"):
    spread_over_replies(trajs, [[0.5, np.nan], [2.0, 3.0], []])
  no_replies = _traj(3, [(2, False), (3, True)])  # sampled tokens but no reply recorded
  with pytest.raises(ValueError, match=r"positions \[2, 3, 4\] are in no reply"):
    spread_over_replies([no_replies], [[]])
  bad = dataclasses.replace(trajs[0], replies=[Reply(3, 7), Reply(8, 10)])  # over a mask-0 token
  with pytest.raises(ValueError, match=r"reply 0 \[3, 7\) covers tokens of loss mask 0"):
    spread_over_replies([bad], [[1.0, 2.0]])
  bad = dataclasses.replace(trajs[0], replies=[Reply(8, 10), Reply(3, 6)])  # out of order
  with pytest.raises(ValueError, match="reply 1 spans"):
    spread_over_replies([bad], [[1.0, 2.0]])
  bad = dataclasses.replace(trajs[0], replies=[Reply(3, 6), Reply(8, 11)])  # past the tokens
  with pytest.raises(ValueError, match=r"reply 1 spans \[8, 11\)"):
    spread_over_replies([bad], [[1.0, 2.0]])


# ---------------------------------------------------------------------------------------------
# grpo_loss with per-token advantages.
# ---------------------------------------------------------------------------------------------


def _ref_loss_per_token(logp, old, ref, adv_nt, mask, cfg):
  """test_grpo's float64 loop reference with A[i, j] in place of A[i]: (loss, grad, metrics)."""
  n, t = logp.shape
  w = ref_aggregate_weights(mask.tolist(), cfg.loss_agg, cfg.loss_norm_tokens)
  w_tok = ref_aggregate_weights(mask.tolist(), "token-mean", 1.0)
  loss, pg_loss, kl_metric, clip_frac, grad = 0.0, 0.0, 0.0, 0.0, np.zeros((n, t))
  for i in range(n):
    for j in range(t):
      lp, r = float(logp[i, j]), float(ref[i, j])
      pg, dpg, clipped = ref_pg(lp, float(old[i, j]), float(adv_nt[i, j]), cfg)
      kl = ref_kl(lp, r, cfg.kl_estimator, cfg.kl_log_ratio_clamp)
      loss += w[i][j] * (pg + cfg.kl_beta * kl)
      pg_loss += w[i][j] * pg
      kl_metric += w_tok[i][j] * kl
      clip_frac += w_tok[i][j] * float(clipped)
      dkl = ref_kl_grad(lp, r, cfg.kl_estimator, cfg.kl_log_ratio_clamp)
      grad[i, j] = w[i][j] * (dpg + cfg.kl_beta * dkl)
  return loss, grad, {"pg_loss": pg_loss, "clip_frac": clip_frac, "kl": kl_metric}


def _loss(logp, old, ref, adv, mask, cfg):
  f32 = lambda x: jnp.asarray(np.asarray(x, np.float32))  # noqa: E731
  (loss, metrics), grad = _loss_and_grad(f32(logp), f32(old), f32(ref), f32(adv), f32(mask), cfg)
  return float(loss), np.asarray(grad), {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("mode", MODES)
def test_loss_with_constant_rows_equals_the_row_form(mode):
  """[N, T] advantages whose row i is A_i everywhere give the [N] form's loss, metrics and
  gradient. Tolerance rtol = 1e-6 (a few float32 ulps): every per-token term is the same
  float32 product either way, but the two are different XLA programs, free to fuse and order
  their sums differently."""
  logp, old, ref, adv, mask = _random_batch(1)
  cfg = _cfg(mode)
  assert np.any(adv < 0) and cfg.dual_clip_c > 0  # the dual-clip branch is met too
  want = _loss(logp, old, ref, adv, mask, cfg)
  got = _loss(logp, old, ref, np.broadcast_to(adv[:, None], mask.shape), mask, cfg)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=0)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=0)
  assert got[2].keys() == want[2].keys()
  for k in want[2]:
    np.testing.assert_allclose(got[2][k], want[2][k], rtol=1e-6, atol=0, err_msg=k)


@pytest.mark.parametrize("mode", MODES)
def test_loss_with_per_token_advantages_matches_the_reference(mode):
  """Non-constant rows (signs changing inside a row, so a row's tokens take different clip
  branches) against the float64 loop reference, at test_grpo's tolerances; the row-mean
  advantage in their place gives a loss the reference tells apart."""
  logp, old, ref, _, mask = _random_batch(2, spread=0.6)
  adv_nt = np.random.default_rng(7).normal(0.0, 1.0, mask.shape)
  cfg = _cfg(mode)
  loss, grad, metrics = _loss(logp, old, ref, adv_nt, mask, cfg)
  want, want_grad, want_metrics = _ref_loss_per_token(logp, old, ref, adv_nt, mask, cfg)
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)
  for k, v in want_metrics.items():
    np.testing.assert_allclose(metrics[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
  assert 0.0 < metrics["clip_frac"] < 1.0
  row_mean = (adv_nt * mask).sum(1) / np.maximum(mask.sum(1), 1.0)
  assert abs(_loss(logp, old, ref, row_mean, mask, cfg)[0] - want) > 1e-3


def test_loss_refuses_advantages_of_another_shape():
  logp, old, ref, adv, mask = _random_batch(0)
  for bad in (np.zeros((6, 8)), np.zeros((6, 9, 1))):
    with pytest.raises(ValueError, match=r"advantages of shape \(6, (8|9, 1)\), want \[N\]"):
      grpo.grpo_loss(*map(jnp.asarray, (logp, old, ref, bad, mask)), _cfg())


# ---------------------------------------------------------------------------------------------
# make_batch.
# ---------------------------------------------------------------------------------------------


def test_make_batch_pads_per_target_advantages():
  """[N, P'] -> [N, P]: each row's first k_r (its target count) values kept, 0 after them
  (what a caller left there ignored, NaN included); P' above or below the batch's P."""
  a = _traj(0, [(5, False), (4, True), (3, False), (2, True)])  # 6 targets
  b = _traj(1, [(7, False), (3, True)])  # 3 targets
  for width in (6, 11):  # P' below and above the batch's P = 8
    adv = np.full((2, width), np.nan)
    adv[0, :6] = np.arange(1, 7)
    adv[1, :3] = [-1.0, -2.0, -3.0]
    batch = make_batch([a, b], adv, min_len=8, min_targets=4)
    assert batch.advantages.dtype == np.float32 and batch.advantages.shape == (2, 8)
    np.testing.assert_array_equal(
      batch.advantages, [[1, 2, 3, 4, 5, 6, 0, 0], [-1, -2, -3, 0, 0, 0, 0, 0]]
    )
    np.testing.assert_array_equal(batch.rows(np.array([1])).advantages, batch.advantages[1:])
  with pytest.raises(ValueError, match=r"cover 5 targets, but row 0 has 6 \(rows \[0\]"):
    make_batch([a, b], np.zeros((2, 5)), min_len=8, min_targets=4)
  with pytest.raises(ValueError, match=r"advantages of shape \(3, 8\), want \[2\] or \[2, P\]"):
    make_batch([a, b], np.zeros((3, 8)), min_len=8, min_targets=4)
  with pytest.raises(ValueError, match=r"advantages of shape \(2, 8, 1\)"):
    make_batch([a, b], np.zeros((2, 8, 1)), min_len=8, min_targets=4)
  adv = np.zeros((2, 6))
  adv[1, 2] = np.inf  # at a target of row 1
  with pytest.raises(ValueError, match=r"non-finite per-target advantages in rows \[1\]"):
    make_batch([a, b], adv, min_len=8, min_targets=4)
  # The [N] form as ever: float32, one per row.
  batch = make_batch([a, b], [0.5, -0.5], min_len=8, min_targets=4)
  assert batch.advantages.dtype == np.float32
  np.testing.assert_array_equal(batch.advantages, [0.5, -0.5])


# ---------------------------------------------------------------------------------------------
# PolicyTrainer.grpo_epoch with both forms.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
  """test_trainer's `one_layer_model`."""
  return kit.tiny_model(
    1,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
  )


LAYOUTS = [  # (length, sampled) segments; each sampled one is a reply
  [(6, False), (4, True), (3, False), (5, True)],
  [(6, False), (2, True), (4, False), (7, True)],
  [(6, False), (6, True)],
  [(5, False), (3, True), (2, False), (1, True), (2, False), (4, True)],
  [(5, False), (8, True), (3, False), (2, True)],
  [(5, False), (1, True), (3, False), (9, True)],
]
ADV = np.array([1.0, -0.5, -0.5, 0.75, -0.75, 0.0], np.float32)
KEEP = np.array([True, True, True, False, True, True])
# Two epochs of [N] advantages (ADV, KEEP, 2 mini-batches of 3 rows, each padded to 4 for 2
# micro-batches), recorded with the code before per-token advantages existed (jax 0.10.2, CPU).
BEFORE = [
  {
    "train/clip_frac": 0.0,
    "train/grad_norm": 1.1548606753349304,
    "train/kl": 0.00036288797855377197,
    "train/loss": 0.15675979852676392,
    "train/pg_loss": 0.1567234992980957,
    "train/ratio_mean": 0.9983736276626587,
    "train/sampler_logp_gap": 6.307287693023682,
    "train/padded_len": 128,
    "train/padded_targets": 32,
  },
  {
    "train/clip_frac": 0.0,
    "train/grad_norm": 1.0045610070228577,
    "train/kl": 0.18018969148397446,
    "train/loss": 0.14733043313026428,
    "train/pg_loss": 0.1293114870786667,
    "train/ratio_mean": 0.9729492366313934,
    "train/sampler_logp_gap": 6.7719879150390625,
    "train/padded_len": 128,
    "train/padded_targets": 32,
  },
]


def _trainer(model):
  trainer = PolicyTrainer(
    _fresh(model),
    make_optimizer(1e-2, 0.01, 1.0),
    grpo.GRPOConfig(kl_beta=0.1),
    1.0,
    micro_batches=2,
  )
  trainer.freeze_reference()
  return trainer


def test_grpo_epoch_takes_both_forms(tiny_model):
  """[N] advantages give the metrics of the code before this seam (`BEFORE`) and [N, P] ones
  whose replies all carry their trajectory's advantage give them too, to float32 rounding (rtol
  1e-5 after two updates); per-reply values that differ within a row and between rows train too,
  with the hand-computed policy loss at ratio 1.

  `BEFORE` was recorded on an earlier session's CPU, where the [N] path reproduced it bit for
  bit; on this project's AMD EPYC VM (2026-12-04) XLA's CPU code sums in another order, 1-3
  float32 ulps off (the KL's exp(d) - d - 1 cancels to 8e-6 relative at 3.6e-4), so a record from
  one machine is held to rounding, not to bits, on every other."""
  trajs = [_episode(50 + i, parts, group_id=i // 3) for i, parts in enumerate(LAYOUTS)]
  trainer = _trainer(tiny_model)
  start = jax.tree.map(jnp.copy, trainer.state)  # its own buffers: the updates donate them
  for want in BEFORE:
    got = trainer.grpo_epoch(trajs, ADV, 2, keep=KEEP)
    assert got.keys() == want.keys()
    for k in want:
      np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)

  trainer.state = start  # the same start (parameters, optimizer, reference), per-token now
  constant = spread_over_replies(trajs, [[a] * len(t.replies) for a, t in zip(ADV, trajs)])
  assert constant.shape == (6, 10)  # rows 4 and 5 have 10 targets
  for want in BEFORE:
    got = trainer.grpo_epoch(trajs, constant, 2, keep=KEEP)
    assert got.keys() == want.keys()
    for k in want:
      np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)

  # Rows 0-2 (the first mini-batch, trained at ratio 1: its old log-probs are the parameters'
  # own) get values that change inside a row; rows 3-5 get 0, so the second mini-batch's policy
  # loss is 0 and the epoch's pg_loss is half the first's: -sum_tokens A / tokens / 2.
  values = [[1.0, -2.0], [0.5, 3.0], [-1.5], [0.0] * 3, [0.0] * 2, [0.0] * 2]
  per_token = spread_over_replies(trajs, values)
  got = trainer.grpo_epoch(trajs, per_token, 2, keep=KEEP)
  n_tok = [len(target_positions(t)) for t in trajs[:3]]  # 9, 9, 6
  want_pg = -(1.0 * 4 - 2.0 * 5 + 0.5 * 2 + 3.0 * 7 - 1.5 * 6) / sum(n_tok) / 2
  assert np.all(per_token[:3, 0] == [1.0, 0.5, -1.5]) and n_tok == [9, 9, 6]
  assert got["train/pg_loss"] == pytest.approx(want_pg, abs=1e-5)
  assert all(np.isfinite(v) for v in got.values()) and got["train/kl"] > 0.0
  assert trainer._grpo_step._cache_size() == 2  # one program for [N], one for this [N, P]
  with pytest.raises(ValueError, match=r"advantages of shape \(5, 10\), want \[6\] or \[6, P\]"):
    trainer.grpo_epoch(trajs, per_token[:5], 2)
  with pytest.raises(ValueError, match="cover 8 targets, but row 0 has 9"):
    trainer.grpo_epoch(trajs, per_token[:, :8], 2)
