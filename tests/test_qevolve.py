"""Q-Evolve's parts (coevolve_jax/qevolve.py): the pure functions against numpy references
written another way, the critic's transitions, buffer and checkpoint, and a critic that learns
which early step decided an episode (issue 44 items 4 and 5)."""

from __future__ import annotations

import dataclasses

import importlib.util
import itertools
import os
import sys

import jax
import jax.numpy as jnp
import kit
import numpy as np
import pytest
from host_devices import run_child

from coevolve_jax import advantages, grpo, qevolve
from coevolve_jax.trainer import PolicyTrainer, make_optimizer
from coevolve_jax.types import Reply, Trajectory

CFG = qevolve.QEvolveConfig()


def test_step_weights_by_hand():
  # w_t = 0.5 (t / T + d) + 0.5, t = 1..4
  np.testing.assert_allclose(qevolve.step_weights(4, False), [0.625, 0.75, 0.875, 1.0])
  np.testing.assert_allclose(qevolve.step_weights(4, True), [1.125, 1.25, 1.375, 1.5])
  np.testing.assert_allclose(qevolve.step_weights(1, True), [1.5])
  assert qevolve.step_weights(0, True).shape == (0,)
  with pytest.raises(ValueError, match="num_steps"):
    qevolve.step_weights(-1, False)


def test_expectile_loss_by_hand():
  u = jnp.array([-2.0, -0.5, 0.0, 1.0, 3.0])
  np.testing.assert_allclose(
    qevolve.expectile_loss(u, 0.7), [0.3 * 4, 0.3 * 0.25, 0.0, 0.7, 0.7 * 9], rtol=1e-6
  )
  # tau 0.5 is half the squared error: the expectile is the mean
  np.testing.assert_allclose(qevolve.expectile_loss(u, 0.5), 0.5 * np.square(u), rtol=1e-6)


def _iql_reference(v, q, qt, vn, r, d, w, tau, gamma):
  """Per transition, written out (no vectorised helpers)."""
  lv, lq = [], []
  for i in range(len(v)):
    u = qt[i] - v[i]
    lv.append(w[i] * (tau if u >= 0 else 1 - tau) * u * u)
    target = r[i] + (0.0 if d[i] else gamma * vn[i])
    lq.append(w[i] * (target - q[i]) ** 2)
  return np.mean(lv), np.mean(lq)


def test_iql_losses_against_reference_and_their_gradients():
  rng = np.random.default_rng(0)
  b = 7
  v, q, qt, vn, r = (rng.normal(size=b).astype(np.float32) for _ in range(5))
  d = np.array([0, 0, 1, 0, 1, 0, 1], np.float32)
  w = qevolve.step_weights(b, True)
  args = [jnp.asarray(x) for x in (v, q, qt, vn, r, d, w)]
  lv, lq = qevolve.iql_losses(*args, tau=0.7, gamma=0.9)
  ref_v, ref_q = _iql_reference(v, q, qt, vn, r, d, w, 0.7, 0.9)
  np.testing.assert_allclose([lv, lq], [ref_v, ref_q], rtol=1e-5)
  # L_V reaches V only (the target Q is held); L_Q reaches Q only (V(s') is held)
  grads = jax.grad(
    lambda *a: sum(qevolve.iql_losses(*a, tau=0.7, gamma=0.9)), argnums=(0, 1, 2, 3)
  )(*args)
  assert np.abs(grads[0]).sum() > 0 and np.abs(grads[1]).sum() > 0
  np.testing.assert_array_equal(grads[2], 0.0)
  np.testing.assert_array_equal(grads[3], 0.0)
  # v_target "return": L_V on the returns in place of the target Q (the reference with G as qt);
  # L_Q is unchanged, and neither the target Q nor the returns get a gradient
  g = rng.normal(size=b).astype(np.float32)
  lv, lq = qevolve.iql_losses(*args, tau=0.7, gamma=0.9, returns=jnp.asarray(g))
  ref_v, ref_q = _iql_reference(v, q, g, vn, r, d, w, 0.7, 0.9)
  np.testing.assert_allclose([lv, lq], [ref_v, ref_q], rtol=1e-5)
  grads = jax.grad(
    lambda *a: sum(qevolve.iql_losses(*a[:7], tau=0.7, gamma=0.9, returns=a[7])),
    argnums=(2, 7),
  )(*args, jnp.asarray(g))
  np.testing.assert_array_equal(grads[0], 0.0)
  np.testing.assert_array_equal(grads[1], 0.0)


def test_discounted_returns_by_hand_with_episode_ends():
  """G_t = r_t + gamma (1 - done_t) G_{t+1}: episodes end to end (a head critic's flat
  transitions) or one per zero-padded row (a model critic's batch)."""
  r = np.array([0.0, -0.3, 1.0, 0.5, 0.0, 2.0], np.float32)
  d = np.array([0, 0, 1, 1, 0, 1], np.float32)  # episodes of 3, 1 and 2 steps
  want = [-0.3 * 0.5 + 1.0 * 0.25, -0.3 + 0.5 * 1.0, 1.0, 0.5, 0.5 * 2.0, 2.0]
  np.testing.assert_allclose(qevolve.discounted_returns(r, d, 0.5), want, rtol=1e-6)
  rows = np.array([[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]], np.float32)
  done = np.array([[0, 0, 1, 0], [0, 1, 0, 0]], np.float32)  # padding after each episode
  np.testing.assert_allclose(
    qevolve.discounted_returns(rows, done, 0.9), [[0.81, 0.9, 1.0, 0.0], [0.9, 1.0, 0.0, 0.0]],
    rtol=1e-6,
  )  # fmt: skip
  # the head critic's transitions carry them
  model = kit.tiny_model(3, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
  trainer = PolicyTrainer(model, make_optimizer(1e-3, 0.0, 1.0), grpo.GRPOConfig(), 1.0)
  critic = qevolve.Critic(dataclasses.replace(CFG, gamma=0.5), trainer, seed=0)
  eps = [qevolve.episode(_decision_episode(np.random.default_rng(0), good), CFG) for good in (1, 0)]
  feats = [(np.zeros((e.steps, 4)), np.zeros((e.steps, 4))) for e in eps]
  data = critic.transitions(eps, feats)
  want = np.concatenate([[0.5 * e.reward + e.penalties[0], e.reward + e.penalties[1]] for e in eps])
  np.testing.assert_allclose(data["return"], want, rtol=1e-6)


def _gae_reference(r, v, nv, d, gamma, lam):
  """A_t = sum_k (gamma lam)^k delta_{t+k} summed forward to the episode's end (O(M^2))."""
  delta = [r[i] + (0.0 if d[i] else gamma * nv[i]) - v[i] for i in range(len(r))]
  out = []
  for t in range(len(r)):
    total, k = 0.0, 0
    while True:
      total += (gamma * lam) ** k * delta[t + k]
      if d[t + k]:
        break
      k += 1
    out.append(total)
  return out


def test_gae_against_reference_with_episode_ends():
  rng = np.random.default_rng(1)
  d = np.array([0, 0, 1, 1, 0, 1], bool)  # episodes of 3, 1 and 2 steps
  r, v, nv = (rng.normal(size=6) for _ in range(3))
  got = qevolve.gae(r, v, nv, d, 0.99, 0.95)
  np.testing.assert_allclose(got, _gae_reference(r, v, nv, d, 0.99, 0.95), rtol=1e-5)
  # lambda 1 and V = 0: the discounted return of the outcome
  np.testing.assert_allclose(
    qevolve.gae([0, 0, 1.0], [0, 0, 0], [0, 0, 0], [0, 0, 1], 0.5, 1.0), [0.25, 0.5, 1.0]
  )
  with pytest.raises(ValueError, match="end its episode"):
    qevolve.gae([0.0], [0.0], [0.0], [False], 0.9, 0.9)


def _bp_reference(logp, blogp, ref, adv, mask, variant, lo, hi, beta, omega, decay, it):
  """Per token, written out: the surrogate, its clipping and k3, token-mean over the mask."""
  num = clipped = kl_sum = 0.0
  if variant == "bppo":  # one symmetric clip, decayed by the iteration
    lo = hi = hi * decay**it
  for i, j in itertools.product(*map(range, logp.shape)):
    if not mask[i, j]:
      continue
    ratio = np.exp(logp[i, j] - blogp[i, j])
    a = adv[i, j]
    if variant == "bppo":
      a = (omega if a >= 0 else 1 - omega) * a
    unclipped, kept = ratio * a, min(max(ratio, 1 - lo), 1 + hi) * a
    x = ref[i, j] - logp[i, j]
    kl = np.exp(x) - x - 1
    num += -min(unclipped, kept) + (beta * kl if variant == "clip_kl" else 0.0)
    clipped += kept < unclipped
    kl_sum += kl
  n = mask.sum()
  return num / n, clipped / n, kl_sum / n


@pytest.mark.parametrize("variant", qevolve.BP_VARIANTS)
def test_behaviour_proximal_loss_against_reference(variant):
  rng = np.random.default_rng(2)
  shape = (3, 5)
  logp = rng.normal(-1.0, 0.3, shape)
  blogp = logp + rng.normal(0.0, 0.3, shape)  # ratios spread past both clips
  ref = logp + rng.normal(0.0, 0.2, shape)
  adv = rng.normal(size=shape)
  mask = (rng.random(shape) < 0.8).astype(np.float64)
  cfg = qevolve.QEvolveConfig(
    variant=variant, clip_low=0.3, clip_high=0.2, kl_beta=0.05, omega=0.8, clip_decay=0.9
  )
  loss, m = qevolve.behaviour_proximal_loss(
    *(jnp.asarray(x, jnp.float32) for x in (logp, blogp, ref, adv, mask)), cfg, iteration=3
  )
  want, clip_frac, kl = _bp_reference(
    logp, blogp, ref, adv, mask, variant, 0.3, 0.2, 0.05, 0.8, 0.9, 3
  )
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  np.testing.assert_allclose(float(m["clip_frac"]), clip_frac, rtol=1e-6)
  assert 0 < clip_frac < 1
  if variant == "clip_kl":
    np.testing.assert_allclose(float(m["kl"]), kl, rtol=1e-5)
  else:
    assert "kl" not in m


def _traj(segments, reward=1.0, **fields):
  """A trajectory of (length, sampled) segments, token ids 1..; each sampled one a reply."""
  ids, mask, replies = [], [], []
  for n, sampled in segments:
    start = len(ids)
    ids += [3 + (len(ids) + k) % 50 for k in range(n)]
    mask += [int(sampled)] * n
    if sampled:
      replies.append(Reply(start, start + n))
  tr = Trajectory("t", 0, ids, mask, [0.0] * len(ids), reward=reward, replies=replies, **fields)
  return tr


def test_episodes_penalties_and_buffer():
  tr = _traj([(4, False), (3, True), (2, False), (2, True), (2, False), (3, True)], 0.0)
  tr.replies[0].calls, tr.replies[0].observation = ["f({})"], '{"error": "no such file"}'
  tr.replies[1].parse_error = True
  tr.replies[1].observation = '{"error": "no such file"}'
  e = qevolve.episode(tr, CFG)
  assert e.state_pos == (3, 8, 12) and e.action_pos == (6, 10, 15)
  # reply 0: a rejected call; reply 1: failed to parse and answered as before; reply 2: last
  np.testing.assert_allclose(e.penalties, [-0.2, -0.3 - 0.1, 0.0])
  # without recorded replies (a demonstration), the sampled runs, no penalties
  demo = _traj([(4, False), (3, True), (2, False), (2, True)])
  demo.replies = []
  d = qevolve.episode(demo, CFG, "expert")
  assert d.state_pos == (3, 8) and d.penalties == (0.0, 0.0) and d.origin == "expert"
  # an expert episode back as a trajectory to train on: the same replies, sampled
  back = d.trajectory(group_id=-1)
  assert [(r.start, r.end) for r in back.replies] == [(4, 7), (9, 11)]
  assert back.loss_mask == demo.loss_mask and back.token_ids == demo.token_ids
  assert qevolve.episode(back, CFG, "expert") == d
  assert qevolve.episode(_traj([(4, False)]), CFG) is None
  buf = qevolve.ReplayBuffer(2)
  buf.extend([e, d, e])
  assert len(buf) == 2 and list(buf.episodes) == [d, e]  # the oldest went first
  assert buf.sample(5, np.random.default_rng(0), lambda x: x.origin == "expert") == [d]
  again = qevolve.ReplayBuffer(2)
  again.load_state_dict(buf.state_dict())
  assert list(again.episodes) == [d, e]


def test_config_checks():
  with pytest.raises(ValueError, match="mode"):
    qevolve.QEvolveConfig(mode="offline")
  with pytest.raises(ValueError, match="tau"):
    qevolve.QEvolveConfig(tau=1.0)
  with pytest.raises(ValueError, match="v_target"):
    qevolve.QEvolveConfig(v_target="td")
  with pytest.raises(ValueError, match="order"):
    qevolve.QEvolveConfig(order="fit_last")
  with pytest.raises(ValueError, match="invalid_pattern"):
    qevolve.QEvolveConfig(invalid_pattern="(")
  path = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "base.py")
  spec = importlib.util.spec_from_file_location("qevolve_test_base_config", path)
  base = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(base)
  c = base.get_config()
  assert qevolve.QEvolveConfig.from_config(c.qevolve) == CFG  # the config's defaults are these


GOOD, BAD = 7, 9  # the deciding first reply's token


def _decision_episode(rng, good: bool) -> Trajectory:
  """A deterministic task: a fixed prompt, reply 1 (the decision: GOOD or BAD, then end), a
  fixed observation, reply 2 (two filler tokens drawn at random: a later step that does not
  matter). Success iff reply 1 chose GOOD."""
  prompt, r1, obs = [1, 20, 21, 22], [GOOD if good else BAD, 2], [60, 61]
  r2 = [*rng.integers(100, 110, 2).tolist(), 2]
  ids = prompt + r1 + obs + r2
  mask = [0] * len(prompt) + [1] * 2 + [0] * len(obs) + [1] * len(r2)
  a = len(prompt)
  b = a + 2 + len(obs)
  replies = [Reply(a, a + 2), Reply(b, b + len(r2))]
  return Trajectory("d", 0, ids, mask, [0.0] * len(ids), reward=float(good), replies=replies)


@pytest.mark.parametrize("v_target", qevolve.V_TARGETS)
def test_critic_learns_the_deciding_step(tmp_path, v_target):
  """Issue 44 item 5: on episodes where only the first reply decides success, the critic learns
  V that separates the good and bad prefixes (V from the target Q, or from the returns), and its
  advantages (lambda 0: the one-step TD error, from V alone) rank the deciding reply's good
  choice above its bad one and give the later reply, which decides nothing, almost none;
  outcome-only GRPO gives both replies of an episode the same value. Then its checkpoint
  round-trips exactly."""
  model = kit.tiny_model(3, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
  trainer = PolicyTrainer(model, make_optimizer(1e-3, 0.0, 1.0), grpo.GRPOConfig(), 1.0)
  cfg = qevolve.QEvolveConfig(
    updates=40, batch=64, lr=3e-3, replay=8, capacity=64, lam=0.0, v_target=v_target
  )
  critic = qevolve.Critic(cfg, trainer, seed=0)
  rng = np.random.default_rng(0)
  for _ in range(4):
    trajs = [_decision_episode(rng, good) for good in [True, False] * 4]
    eps = [qevolve.episode(t, cfg) for t in trajs]
    metrics = critic.fit(eps, critic.features(eps))
  assert metrics["qevolve/buffer"] == 32 and metrics["qevolve/transitions"] == 32
  test = [_decision_episode(rng, good) for good in [True, False] * 4]
  eps = [qevolve.episode(t, cfg) for t in test]
  feats = critic.features(eps)
  v_second = np.array([critic.values(f[0])[1] for f in feats])  # V(s_2): after the decision
  good, bad = v_second[0::2], v_second[1::2]
  assert good.min() > 0.8 and bad.max() < 0.2, (good, bad)
  reply_adv, m = critic.reply_advantages(eps, feats)
  first, second = (np.array([a[j] for a in reply_adv]) for j in (0, 1))
  gap = first[0::2].min() - first[1::2].max()
  assert gap > 0.5, first
  assert np.abs(second).max() < 0.25 * gap, second
  assert m["qevolve/v_start_success"] == pytest.approx(m["qevolve/v_start_failure"])  # one s_1
  # outcome-only GRPO: both replies of an episode carry the episode's one advantage
  inputs = advantages.AdvantageInputs.from_trajectories(test, grpo.GRPOConfig())
  outcome = advantages.estimate("grpo", inputs)
  per_reply = advantages.spread_over_replies(test, [[a, a] for a in outcome])
  assert all(len(set(row[row != 0].tolist())) == 1 for row in per_reply)
  # the 'qevolve' estimator spreads the critic's reply advantages over the reply tokens
  q_inputs = advantages.AdvantageInputs(
    test, inputs.rewards, inputs.group_ids, None, grpo.GRPOConfig(), qevolve=(cfg, reply_adv)
  )
  tokens = advantages.estimate("qevolve", q_inputs)
  assert tokens.shape[0] == 8 and tokens[0, 0] > tokens[1, 0]  # the decision's first token
  # the features read one micro-batch at a time are the same numbers (the policy is untouched)
  # to float32 rounding: 2 slices of 2 rows are another XLA program than 8 rows at once
  sliced = PolicyTrainer(
    kit.tiny_model(3, hidden_size=32, intermediate_size=64, num_hidden_layers=1),
    make_optimizer(1e-3, 0.0, 1.0),
    grpo.GRPOConfig(),
    1.0,
    micro_batches=2,
  )
  again = qevolve.Critic(cfg, sliced, seed=0).features(eps[:3])  # 3 rows: one of padding
  for (s1, sa1), (s2, sa2) in zip(feats[:3], again):
    np.testing.assert_allclose(s2, s1, rtol=0, atol=1e-6)
    np.testing.assert_allclose(sa2, sa1, rtol=0, atol=1e-6)
  # the checkpoint: the critic's arrays, buffer and RNG come back exactly
  ckpt = qevolve.CriticCheckpointer(str(tmp_path / "qevolve"), keep=2)
  ckpt.save(6, critic)
  other = qevolve.Critic(cfg, trainer, seed=1)
  assert not ckpt.restore(5, other)
  assert ckpt.restore(6, other)
  ckpt.close()
  for a, b in zip(jax.tree.leaves(critic.state), jax.tree.leaves(other.state)):
    np.testing.assert_array_equal(a, b)
  assert list(other.buffer.episodes) == list(critic.buffer.episodes)
  assert other.rng.random() == critic.rng.random()


def test_a_step_reads_the_advantages_and_fits_in_the_configured_order():
  """`Critic.step` in each `order` equals its calls made by hand on a twin critic (same seed):
  advantages then fit (PPO's, the default), or fit then advantages (the paper's), which read the
  fitted heads; only the `fresh` episodes are fitted on and join the buffer."""
  model = kit.tiny_model(3, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
  trainer = PolicyTrainer(model, make_optimizer(1e-3, 0.0, 1.0), grpo.GRPOConfig(), 1.0)
  rng = np.random.default_rng(0)
  first = qevolve.QEvolveConfig(updates=4, batch=16, lr=3e-2, replay=0, lam=0.0)
  eps = [qevolve.episode(_decision_episode(rng, g), first) for g in [True, False] * 3]
  got = {}
  for order in qevolve.ORDERS:
    cfg = dataclasses.replace(first, order=order)
    critic, twin = qevolve.Critic(cfg, trainer, seed=0), qevolve.Critic(cfg, trainer, seed=0)
    adv, metrics = critic.step(eps, [0, 2, 3])
    feats = twin.features(eps)
    fresh = ([eps[j] for j in (0, 2, 3)], [feats[j] for j in (0, 2, 3)])
    if order == "fit_first":
      fitted = twin.fit(*fresh)
      want, m = twin.reply_advantages(eps, feats)
      m.update(fitted)
    else:
      want, m = twin.reply_advantages(eps, feats)
      m.update(twin.fit(*fresh))
    assert metrics == m and metrics["qevolve/buffer"] == 3
    for a, b in zip(adv, want):
      np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(critic.state), jax.tree.leaves(twin.state)):
      np.testing.assert_array_equal(a, b)
    # the same episodes: under the heads before the fit (PPO's order), or after it (the paper's)
    got[order] = np.concatenate(adv)
  assert np.abs(got["fit_first"] - got["advantages_first"]).max() > 1e-3


def test_combine_scales_by_the_groups_reward_deviation_then_whitens():
  """`qevolve.combine` by hand: group 0 (rewards 1, 0: deviation 0.5) doubles its replies'
  advantages, group 1 (its one kept reward: deviation 0) divides by the step's kept rewards'
  deviation instead (not by 1e-6: that multiplied its advantages by a million), a group whose
  every reward agrees in a step where all agree keeps them, a dropped row gets 0; then the kept
  replies are whitened."""
  adv = [np.array([0.5, 0.0]), np.array([-0.5]), np.array([1e-7]), np.array([3.0, 3.0])]
  rewards, groups = np.array([1.0, 0.0, 1.0, 1.0]), np.array([0, 0, 1, 1])
  keep = np.array([True, True, True, False])
  cfg = qevolve.QEvolveConfig(scale="group_std", normalize=False)
  got = qevolve.combine(np.zeros(4), adv, keep, cfg, rewards, groups)
  np.testing.assert_allclose(got[0], [1.0, 0.0], rtol=1e-5)
  np.testing.assert_allclose(got[1], [-1.0], rtol=1e-5)
  # its group's kept rewards agree: scaled by the step's kept rewards' deviation instead (1, 0, 1)
  np.testing.assert_allclose(got[2], [1e-7 / np.std([1.0, 0.0, 1.0])], rtol=1e-5)
  assert got[3] == [0.0, 0.0]
  agreeing = qevolve.combine(np.zeros(2), [np.array([0.3]), np.array([-0.2])], np.ones(2, bool),
                             cfg, np.array([1.0, 1.0]), np.array([0, 0]))  # fmt: skip
  assert agreeing == [[pytest.approx(0.3)], [pytest.approx(-0.2)]]  # nothing to scale by: as is
  whitened = qevolve.combine(np.zeros(4), adv, keep, dataclasses.replace(cfg, normalize=True),
                             rewards, groups)  # fmt: skip
  flat = np.array([1.0, 0.0, -1.0, 1e-7 / np.std([1.0, 0.0, 1.0])])
  np.testing.assert_allclose(
    np.concatenate(whitened[:3]), (flat - flat.mean()) / (flat.std() + 1e-6), rtol=1e-5
  )
  with pytest.raises(ValueError, match="needs the rows' rewards"):
    qevolve.combine(np.zeros(4), adv, keep, cfg)


def test_the_model_critic_learns_the_deciding_step_with_a_network_of_its_own(tmp_path):
  """critic = "model": a 1-layer width-64 network of its own (the policy's vocabulary), trained
  end to end on the same episodes as the head critic's test, separates the good and bad
  prefixes and ranks the deciding reply; its network moved (the policy did not), and its
  checkpoint, network included, round-trips exactly."""
  model = kit.tiny_model(3, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
  trainer = PolicyTrainer(model, make_optimizer(1e-3, 0.0, 1.0), grpo.GRPOConfig(), 1.0)
  policy_before = jax.tree.map(np.asarray, trainer.params)
  cfg = qevolve.QEvolveConfig(
    critic="model", model_layers=1, model_width=64, model_batch=8, updates=40, lr=3e-3,
    replay=8, capacity=64, lam=0.0,
  )  # fmt: skip
  critic = qevolve.make_critic(cfg, trainer, seed=0)
  assert isinstance(critic, qevolve.ModelCritic)
  net = critic.state["trunk"]
  assert net["embed_tokens"].get_value().shape == (trainer.model_config.vocab_size, 64)
  trunk_before = jax.tree.map(np.asarray, net)
  rng = np.random.default_rng(0)
  for _ in range(4):
    eps = [qevolve.episode(_decision_episode(rng, g), cfg) for g in [True, False] * 4]
    metrics = critic.fit(eps, critic.features(eps))
  assert metrics["qevolve/buffer"] == 32 and metrics["qevolve/transitions"] == 32
  eps = [qevolve.episode(_decision_episode(rng, g), cfg) for g in [True, False] * 4]
  feats = critic.features(eps)
  assert feats[0][0].shape == (2, 64)  # the network's own width, not the policy's 32
  v_second = np.array([critic.values(f[0])[1] for f in feats])
  assert v_second[0::2].min() > 0.8 and v_second[1::2].max() < 0.2, v_second
  reply_adv, _ = critic.reply_advantages(eps, feats)
  first = np.array([a[0] for a in reply_adv])
  assert first[0::2].min() - first[1::2].max() > 0.5, first
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - np.asarray(b)).max(),
                                       trunk_before, critic.state["trunk"]))  # fmt: skip
  assert max(moved) > 1e-3  # the network learnt, not only the heads
  for a, b in zip(jax.tree.leaves(policy_before), jax.tree.leaves(trainer.params)):
    np.testing.assert_array_equal(a, b)
  ckpt = qevolve.CriticCheckpointer(str(tmp_path / "qevolve"), keep=2)
  ckpt.save(4, critic)
  other = qevolve.make_critic(cfg, trainer, seed=1)
  assert ckpt.restore(4, other)
  ckpt.close()
  for a, b in zip(jax.tree.leaves(critic.state), jax.tree.leaves(other.state)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(other.features(eps)[0][0], feats[0][0])


def test_planner_counts_the_critic():
  """`memory_plan.critic_bytes` by hand: 7 head copies (w1 split over fsdp 2) and the features."""
  from coevolve_jax import memory_plan  # noqa: PLC0415

  cfg = qevolve.QEvolveConfig(hidden=8, batch=4)
  mesh = {"data": 1, "fsdp": 2, "tensor": 1, "expert": 1}
  head = 64 * 8 * 4 // 2 + 8 * 4 + 8 * 4 + 4
  features = 4 * 64 * (2 * 2 * 3 + 3 * 4)  # 2 rows x 2 x 3 replies, and a batch of 4 x 3 D
  assert memory_plan.critic_bytes(64, cfg, rows=2, max_replies=3, mesh=mesh) == 7 * head + features
  # the "model" critic adds its network and AdamW's moments (float32, fsdp-sharded) at its width
  policy = kit.tiny_config()
  model = qevolve.QEvolveConfig(hidden=8, batch=4, critic="model", model_width=32)
  network = qevolve.critic_model_config(policy, model)
  _, net = memory_plan.parameter_bytes(network, mesh, "float32")
  head = 32 * 8 * 4 // 2 + 8 * 4 + 8 * 4 + 4
  features = 4 * 32 * (2 * 2 * 3)
  got = memory_plan.critic_bytes(policy, model, rows=2, max_replies=3, mesh=mesh)
  assert got == 7 * head + features + 3 * net
  assert net < memory_plan.parameter_bytes(policy, mesh, "float32")[1]


@pytest.mark.slow
def test_the_critic_on_a_mesh_equals_one_device():
  """On 8 host devices (data 2 x fsdp 2 x tensor 2) the heads are sharded by their logical axes
  (w1 over fsdp and tensor) and three fits give the values one device gives (float32, 1e-6);
  the "model" critic's network and AdamW moments are sharded by the policy's rules too, and one
  fit of 5 updates gives one device's values to 1e-6 (its network reads the episodes in a
  sharded forward and backward, which round in another order: 20 updates drift to ~1e-5)."""
  run_child(__file__, "mesh")


def _mesh_child() -> None:
  from coevolve_jax.models import builder, sharding  # noqa: PLC0415

  assert jax.device_count() == 8, jax.devices()
  for kind, fits, updates in (("head", 3, 20), ("model", 1, 5)):
    values = []
    for mesh in (None, sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})):
      model = builder.init(kit.tiny_config(num_hidden_layers=1), seed=0, mesh=mesh)
      trainer = PolicyTrainer(
        model, make_optimizer(1e-3, 0.0, 1.0), grpo.GRPOConfig(), 1.0, mesh=mesh
      )
      cfg = qevolve.QEvolveConfig(
        updates=updates,
        batch=64,
        lr=3e-3,
        critic=kind,
        model_layers=1,
        model_width=64,
        model_batch=8,
      )
      critic = qevolve.make_critic(cfg, trainer, seed=0)
      rng = np.random.default_rng(0)
      for _ in range(fits):
        eps = [qevolve.episode(_decision_episode(rng, g), cfg) for g in [True, False] * 4]
        critic.fit(eps, critic.features(eps))
      values.append(np.stack([critic.values(f[0]) for f in critic.features(eps)]))
      if mesh is not None:
        specs = {k: tuple(x.sharding.spec) for k, x in critic.state["v"].items()}
        assert specs["w1"] == ("fsdp", "tensor") and specs["w2"] == ("tensor",), specs
      if mesh is not None and kind == "model":
        specs = {
          jax.tree_util.keystr(p): tuple(x.sharding.spec)
          for p, x in jax.tree_util.tree_leaves_with_path(critic.state["trunk"])
        }
        assert any("fsdp" in str(v) for v in specs.values()), specs  # not all replicated
        mu = critic.state["opt"][0].mu["trunk"]
        assert jax.tree.leaves(mu)[0].sharding == jax.tree.leaves(critic.state["trunk"])[0].sharding
    assert np.abs(values[0]).max() > 1e-3, (
      kind
    )  # moved from the heads' zero start: 1000x the tolerance
    np.testing.assert_allclose(values[1], values[0], atol=1e-6, err_msg=kind)
  print("mesh OK")


if __name__ == "__main__":
  if sys.argv[1:2] == ["mesh"]:
    _mesh_child()
  else:
    raise SystemExit(f"unknown mode {sys.argv[1:]}")
