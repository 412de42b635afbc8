"""Training batches and the jitted GRPO / SFT updates on a tiny random Qwen."""

import dataclasses
import gc
import sys
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from coevolve_jax import grpo
from coevolve_jax.models import Qwen, QwenConfig
from coevolve_jax.models.qwen import unstack
from coevolve_jax.rollout.generate import generate
from coevolve_jax.rollout.sampling import SamplingParams, filtered_logits, processed_logprobs
from coevolve_jax.trainer import (
  PolicyTrainer,
  accumulate_gradients,
  grpo_micro_loss,
  make_batch,
  make_optimizer,
  split_micro_batches,
)
from coevolve_jax.types import Trajectory
from host_devices import run_child

import kit


@pytest.fixture(scope="module")
def base_model(tiny_model):
  return tiny_model  # the kit's default tiny Qwen (conftest.py)


def _fresh(model):
  """A copy with its own buffers: the trainer donates its parameters at each update."""
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, jax.tree.map(jnp.copy, state))


def _traj(seed, parts, group_id=0):
  """parts: list of (length, sampled) segments, token ids random in [1, 512)."""
  rng = np.random.default_rng(seed)
  tr = Trajectory(task_id="t", group_id=group_id)
  for n, sampled in parts:
    ids = [int(x) for x in rng.integers(1, 512, n)]
    lps = [float(x) for x in -rng.random(n)] if sampled else None
    tr.extend(ids, sampled=sampled, logprobs=lps)
  return tr


def _masked_mean(x, mask):
  x, mask = np.asarray(x), np.asarray(mask)
  return (x * mask).sum(-1) / mask.sum(-1)


# ---------------------------------------------------------------------------------------------
# make_batch.
# ---------------------------------------------------------------------------------------------


def test_make_batch_shapes_masks_and_padding():
  # Multi-turn: prompt, reply, tool output, reply ending in token id 0 (pad id == eos id).
  a = _traj(0, [(5, False), (4, True), (3, False), (2, True)])
  a.token_ids[-1] = 0
  b = _traj(1, [(7, False), (3, True)])
  batch = make_batch([a, b], advantages=[0.5, -0.5], min_len=8, min_targets=4)
  assert batch.tokens.shape == (2, 16)  # 14 tokens -> bucket 16
  assert batch.target_pos.shape == (2, 8)  # 6 sampled -> bucket 8
  for arr in (batch.target_mask, batch.sampler_logp):
    assert arr.shape == (2, 8)
  assert batch.tokens.dtype == np.int32 and batch.target_pos.dtype == np.int32
  assert batch.target_mask.dtype == np.float32 and batch.sampler_logp.dtype == np.float32
  np.testing.assert_array_equal(batch.tokens[0, :14], a.token_ids)
  np.testing.assert_array_equal(batch.tokens[0, 14:], 0)
  np.testing.assert_array_equal(batch.tokens[1, :10], b.token_ids)
  np.testing.assert_array_equal(batch.tokens[1, 10:], 0)
  # Positions of exactly the sampled tokens (the final eos id 0 included), then padding with 1.
  np.testing.assert_array_equal(batch.target_pos[0], [5, 6, 7, 8, 12, 13, 1, 1])
  np.testing.assert_array_equal(batch.target_mask[0], [1, 1, 1, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(batch.target_pos[1], [7, 8, 9, 1, 1, 1, 1, 1])
  np.testing.assert_array_equal(batch.target_mask[1], [1, 1, 1, 0, 0, 0, 0, 0])
  assert batch.tokens[0, batch.target_pos[0, 5]] == 0  # the stop token is a target
  np.testing.assert_allclose(
    batch.sampler_logp[0, :6], [a.logprobs[i] for i in (5, 6, 7, 8, 12, 13)], rtol=1e-6
  )
  np.testing.assert_array_equal(batch.sampler_logp[:, 6:], 0.0)
  np.testing.assert_array_equal(batch.advantages, np.array([0.5, -0.5], np.float32))
  # Every target position is a sampled token (loss_mask == 1), never position 0.
  for r, tr in enumerate((a, b)):
    for p, m in zip(batch.target_pos[r], batch.target_mask[r]):
      if m:
        assert p >= 1 and tr.loss_mask[p] == 1
    assert batch.target_mask[r].sum() == sum(tr.loss_mask[1:])
  sub = batch.rows(np.array([1]))
  np.testing.assert_array_equal(sub.tokens, batch.tokens[1:])
  np.testing.assert_array_equal(sub.advantages, [-0.5])


def test_make_batch_bucketing():
  short = _traj(2, [(100, False), (20, True)])
  long = _traj(3, [(100, False), (29, True)])
  b1 = make_batch([short])
  b2 = make_batch([short, long])
  assert b1.tokens.shape == (1, 128) and b1.target_pos.shape == (1, 32)
  assert b2.tokens.shape == (2, 256) and b2.target_pos.shape == (2, 32)  # 129 tokens -> 256
  b3 = make_batch([_traj(4, [(3, False), (33, True)])])
  assert b3.tokens.shape == (1, 128) and b3.target_pos.shape == (1, 64)  # 33 targets -> 64
  # A first token marked sampled cannot be scored (nothing precedes it) and is skipped.
  c = _traj(5, [(1, True), (2, False), (2, True)])
  bc = make_batch([c], min_len=4, min_targets=2)
  np.testing.assert_array_equal(bc.target_pos, [[3, 4]])
  np.testing.assert_array_equal(bc.advantages, [0.0])


def test_make_batch_listed_buckets():
  """Listed buckets (train.len_buckets / target_buckets): the smallest that holds the batch,
  whatever the default rule would pick; more than the largest is a clear error."""
  trajs = [_traj(2, [(100, False), (20, True)]), _traj(3, [(300, False), (45, True)])]
  b = make_batch(trajs, len_buckets=(1024, 384), target_buckets=(48, 16))
  assert b.tokens.shape == (2, 384) and b.target_pos.shape == (2, 48)  # 345 tokens, 45 targets
  assert make_batch(trajs[:1], len_buckets=(384, 1024), target_buckets=(16, 48)).tokens.shape == (
    1,
    384,
  )
  with pytest.raises(ValueError, match=r"trajectory tokens of 345 exceed .*\[128, 256\]"):
    make_batch(trajs, len_buckets=(128, 256), target_buckets=(64,))
  with pytest.raises(ValueError, match="generated tokens of 45"):
    make_batch(trajs, len_buckets=(512,), target_buckets=(16, 32))


class _CompileOnly:
  """A jitted function that may be lowered but not called."""

  def __init__(self, fn):
    self.lower = fn.lower

  def __call__(self, *args):
    raise AssertionError("compile_ahead ran the program instead of only compiling it")


def test_compile_ahead_covers_every_batch_of_the_buckets(base_model):
  """`PolicyTrainer.compile_ahead` compiles the update and log-prob programs of every (rows,
  T, P) a step can meet, and runs none of them (a forward dispatched there would still be
  running at the first rollouts): GRPO epochs afterwards on batches of any length within the
  buckets (rows that split unevenly, dropped trajectories) compile neither program."""
  from coevolve_jax.metrics import CompileCounter  # noqa: PLC0415

  trainer = PolicyTrainer(
    _fresh(base_model),
    make_optimizer(1e-3, 0.0, 1.0),
    grpo.GRPOConfig(),
    0.9,
    micro_batches=2,
    len_buckets=(32, 64),
    target_buckets=(24,),
  )
  trainer.freeze_reference()
  counter = CompileCounter()
  try:
    # 5 rollouts in 2 mini-batches: rows 3 and 2 (each padded to a multiple of 2 micro-batches).
    # (T, P) pairs: (32, 24), (64, 24).
    logp = trainer._logp
    trainer._logp = _CompileOnly(logp)
    assert trainer.compile_ahead(rollouts=5, mini_batches=2, threads=2) == 2 * 2
    trainer._logp = logp
    programs = ("_grpo_step_fn", "_logp_fn")
    ahead = counter.pop()
    assert all(ahead.get(f"compile/program/{p}") for p in programs)
    rng = np.random.default_rng(0)
    for prompt, most in ((10, 5), (20, 20), (40, 7), (30, 24), (3, 1)):
      trajs = [
        _traj(int(rng.integers(1 << 20)), [(prompt, False), (int(rng.integers(1, most + 1)), True)])
        for _ in range(5)
      ]
      keep = np.array([True, True, False, True, True])
      info = trainer.grpo_epoch(trajs, rng.normal(size=5).astype(np.float32), 2, keep=keep)
      assert np.isfinite(info["train/loss"])
      left = counter.pop()
      assert not any(left.get(f"compile/program/{p}") for p in programs), left
  finally:
    counter.close()
  with pytest.raises(ValueError, match="needs len_buckets and target_buckets"):
    PolicyTrainer(
      _fresh(base_model), make_optimizer(1e-3, 0.0, 1.0), grpo.GRPOConfig(), 0.9
    ).compile_ahead(4, 2)


# ---------------------------------------------------------------------------------------------
# Updates.
# ---------------------------------------------------------------------------------------------


def _group(seed, prompt_len, reply_lens):
  """Trajectories sharing one prompt, each with its own sampled reply."""
  prompt = _traj(seed, [(prompt_len, False)])
  out = []
  for i, n in enumerate(reply_lens):
    tr = _traj(seed + 100 + i, [(n, True)])
    full = Trajectory(task_id="t", group_id=seed)
    full.extend(prompt.token_ids, sampled=False)
    full.extend(tr.token_ids, sampled=True, logprobs=tr.logprobs)
    out.append(full)
  return out


def test_grpo_update_moves_logprobs_and_compiles_once(base_model):
  trainer = PolicyTrainer(
    _fresh(base_model), make_optimizer(1e-3, 0.0, 1.0), grpo.GRPOConfig(), 0.9
  )
  trainer.freeze_reference()
  trajs = _group(7, 6, [5, 5])
  batch = make_batch(trajs, advantages=np.array([1.0, -1.0]), min_len=16, min_targets=8)
  old = trainer.logprobs(batch)
  ref = trainer.logprobs(batch, trainer.ref_params)
  np.testing.assert_allclose(np.asarray(old), np.asarray(ref), atol=1e-6)
  before = jax.tree.map(np.array, trainer.params)

  history = []
  for _ in range(3):
    history.append(trainer.grpo_update(batch, old, ref))
  first = history[0]
  assert all(np.isfinite(v) for m in history for v in m.values())
  # First step: policy == old == reference, so ratio 1, nothing clipped, KL 0, and with equal
  # token counts and advantages +1 / -1 the token-mean loss is 0.
  assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
  assert first["clip_frac"] == 0.0
  assert first["kl"] == pytest.approx(0.0, abs=1e-6)
  assert first["loss"] == pytest.approx(0.0, abs=1e-6)
  assert first["grad_norm"] > 0.0
  assert history[-1]["kl"] > 0.0

  after = jax.tree.map(np.array, trainer.params)
  changed = [
    not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after))
  ]
  assert all(changed)
  new = trainer.logprobs(batch)
  old_mean = _masked_mean(old, batch.target_mask)
  new_mean = _masked_mean(new, batch.target_mask)
  assert new_mean[0] > old_mean[0] + 1e-4  # positive advantage: more likely
  assert new_mean[1] < old_mean[1] - 1e-4  # negative advantage: less likely

  # Same buckets, different lengths and contents: the jitted step is reused, not recompiled.
  assert trainer._grpo_step._cache_size() == 1
  trajs2 = _group(8, 9, [3, 6])
  batch2 = make_batch(trajs2, advantages=np.array([-1.0, 1.0]), min_len=16, min_targets=8)
  assert batch2.tokens.shape == batch.tokens.shape
  assert batch2.target_pos.shape == batch.target_pos.shape
  old2 = trainer.logprobs(batch2)
  trainer.grpo_update(batch2, old2, trainer.logprobs(batch2, trainer.ref_params))
  trainer.grpo_update(batch2, old2, trainer.logprobs(batch2, trainer.ref_params))
  assert trainer._grpo_step._cache_size() == 1
  assert trainer._logp._cache_size() == 1
  # Another objective and back (Q-Evolve's iterations between GRPO steps): each compiled once,
  # and the GRPO step keeps its own objective.
  grpo_step, base_cfg = trainer._grpo_step, trainer.cfg
  trainer.set_objective(dataclasses.replace(base_cfg, clip_eps_low=0.3))
  other_step = trainer._grpo_step
  trainer.grpo_update(batch2, old2, trainer.logprobs(batch2, trainer.ref_params))
  trainer.set_objective(base_cfg)
  assert trainer._grpo_step is grpo_step and grpo_step._cache_size() == 1
  trainer.grpo_update(batch2, old2, trainer.logprobs(batch2, trainer.ref_params))
  trainer.set_objective(dataclasses.replace(base_cfg, clip_eps_low=0.3))
  assert trainer._grpo_step is other_step and other_step._cache_size() == 1


def test_sft_update_lowers_loss(base_model):
  trainer = PolicyTrainer(
    _fresh(base_model), make_optimizer(3e-3, 0.01, 1.0), grpo.GRPOConfig(), 1.0
  )
  batch = make_batch(_group(9, 5, [6, 4, 7]), min_len=16, min_targets=8)
  losses = [trainer.sft_update(batch) for _ in range(6)]  # each: the loss before its step
  assert all(np.isfinite(losses))
  assert all(b < a for a, b in zip(losses, losses[1:])), losses
  assert losses[-1] < losses[0] - 1e-3
  assert trainer._sft_step._cache_size() == 1


# ---------------------------------------------------------------------------------------------
# Micro-batch accumulation, sharded steps.
# ---------------------------------------------------------------------------------------------


def _mixed_batch(n=8, seed=11):
  """n rows of different reply lengths, groups of 4 with mixed advantages."""
  rng = np.random.default_rng(seed)
  trajs = []
  for g in range(n // 4):
    trajs += _group(seed + g, int(rng.integers(4, 9)), [int(x) for x in rng.integers(1, 12, 4)])
  adv = rng.normal(0.0, 1.0, n).astype(np.float32)
  return make_batch(trajs, advantages=adv, min_len=32, min_targets=16)


@pytest.fixture(scope="module")
def one_layer_model():
  return kit.tiny_model(
    1,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
  )


MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@pytest.mark.parametrize("mode", MODES)
def test_accumulated_gradient_does_not_depend_on_the_split(mode):
  """The trainer's micro-batch loss and accumulation, on a cheap log-prob function, for every
  aggregation: 1, 2 and 4 micro-batches give the loss, metrics and gradient of the whole batch
  (rows of different lengths, an empty row, ratios inside and outside the clip range)."""
  rng = np.random.default_rng(0)
  n, t, p, v = 8, 12, 6, 16
  arrays = {
    "tokens": rng.integers(0, v, (n, t)).astype(np.int32),
    "target_pos": np.sort(rng.integers(1, t, (n, p)), axis=1).astype(np.int32),
    "target_mask": (np.arange(p)[None, :] < rng.integers(1, p + 1, (n, 1))).astype(np.float32),
    "advantages": rng.normal(0, 1, n).astype(np.float32),
    "old": -rng.gamma(2.0, 1.0, (n, p)).astype(np.float32),
    "ref": -rng.gamma(2.0, 1.0, (n, p)).astype(np.float32),
  }
  arrays["target_mask"][5] = 0.0
  params = {
    "bias": jnp.asarray(rng.normal(0, 1, v), jnp.float32),
    "scale": jnp.asarray(0.7, jnp.float32),
  }

  def logp_fn(prm, tokens, pos):
    logits = prm["scale"] * prm["bias"][None, None, :] + 0.1 * tokens[:, :, None]
    logp = jax.nn.log_softmax(logits, axis=-1)  # [M, T, V]
    ids = jnp.take_along_axis(tokens, pos, axis=1)
    return jnp.take_along_axis(
      jnp.take_along_axis(logp, pos[..., None], axis=1), ids[..., None], axis=2
    )[..., 0]

  cfg = grpo.GRPOConfig(loss_agg=mode, kl_beta=0.2, loss_norm_tokens=5.0)
  whole = grpo_micro_loss(logp_fn, cfg, jnp.asarray(arrays["target_mask"]))
  (want_loss, want_metrics), want_grads = jax.jit(jax.value_and_grad(whole, has_aux=True))(
    params, jax.tree.map(jnp.asarray, arrays)
  )
  assert 0.0 < float(want_metrics["clip_frac"]) < 1.0
  for k in (1, 2, 4):
    micro = jax.tree.map(lambda x, k=k: split_micro_batches(jnp.asarray(x), k), arrays)
    loss, metrics, grads = jax.jit(accumulate_gradients, static_argnums=(0, 3))(
      whole, params, micro, k
    )
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6, atol=1e-7)
    for key, val in want_metrics.items():
      np.testing.assert_allclose(metrics[key], val, rtol=1e-6, atol=1e-7, err_msg=key)
    for key in params:
      np.testing.assert_allclose(grads[key], want_grads[key], rtol=1e-5, atol=1e-7)
  # Strided split: micro-batch j holds rows j, j + k, ...
  np.testing.assert_array_equal(
    split_micro_batches(np.arange(8), 4), [[0, 4], [1, 5], [2, 6], [3, 7]]
  )


def test_micro_batch_split_does_not_change_the_trainer_update(one_layer_model):
  """Through the real model and jitted step: 1 and 4 micro-batches give the same metrics and
  parameters over two steps (the second at ratio != 1, with clipping). Plain SGD makes the
  parameter change proportional to the accumulated gradient."""
  cfg = grpo.GRPOConfig(loss_agg="seq-mean-token-mean", kl_beta=0.1)
  batch = _mixed_batch()
  results = {}
  for k in (1, 4):
    trainer = PolicyTrainer(_fresh(one_layer_model), optax.sgd(0.5), cfg, 0.9, micro_batches=k)
    trainer.freeze_reference()
    old = trainer.logprobs(batch)
    ref = trainer.logprobs(batch, trainer.ref_params) - 0.05  # KL term non-zero from step 1
    metrics = [trainer.grpo_update(batch, old, ref) for _ in range(2)]
    results[k] = (metrics, jax.tree.map(np.asarray, trainer.params), np.asarray(old))
  (m1, p1, old1), (m4, p4, old4) = results[1], results[4]
  assert m1[1]["clip_frac"] > 0.0  # the second step exercises the clipped branch
  np.testing.assert_allclose(old4, old1, rtol=1e-6, atol=1e-6)
  for a, b in zip(m1, m4):
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-6, err_msg=key)
  for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)):
    np.testing.assert_allclose(y, x, rtol=2e-5, atol=1e-6)


def test_grpo_epoch_equals_the_per_mini_batch_calls(one_layer_model):
  """`grpo_epoch` against the same epoch done by hand (old and reference log-probs of every
  mini-batch first, then one update per mini-batch): identical metrics and parameters; two
  epochs, so the second starts from updated parameters."""
  rng = np.random.default_rng(5)
  trajs = [
    tr for g in range(3) for tr in _group(20 + g, 5 + g, [int(x) for x in rng.integers(1, 9, 4)])
  ]
  cfg = grpo.GRPOConfig(kl_beta=0.1)
  epoch = PolicyTrainer(_fresh(one_layer_model), make_optimizer(1e-2, 0.01, 1.0), cfg, 0.9)
  hand = PolicyTrainer(_fresh(one_layer_model), make_optimizer(1e-2, 0.01, 1.0), cfg, 0.9)
  for t in (epoch, hand):
    t.freeze_reference()
  for seed in (0, 1):
    adv = np.random.default_rng(seed).normal(0.0, 1.0, len(trajs)).astype(np.float32)
    got = epoch.grpo_epoch(trajs, adv, 3)

    batch = make_batch(trajs, adv)
    minis = [batch.rows(idx) for idx in np.array_split(np.arange(len(trajs)), 3)]
    old = [hand.logprobs(mb) for mb in minis]
    ref = [hand.logprobs(mb, hand.ref_params) for mb in minis]
    per_mini = [hand.grpo_update(mb, o, r) for mb, o, r in zip(minis, old, ref)]
    want = {f"train/{k}": float(np.mean([m[k] for m in per_mini])) for k in per_mini[0]}
    want["train/sampler_logp_gap"] = max(
      float(np.max(np.abs((np.asarray(o) - mb.sampler_logp) * mb.target_mask)))
      for mb, o in zip(minis, old)
    )
    want["train/padded_len"] = batch.tokens.shape[1]  # the shape the epoch's step compiled for
    want["train/padded_targets"] = batch.target_pos.shape[1]
    assert got == want
    assert set(want) == {
      f"train/{k}"
      for k in (
        *("loss", "pg_loss", "clip_frac", "ratio_mean", "kl", "grad_norm", "sampler_logp_gap"),
        *("padded_len", "padded_targets"),
      )
    }
    assert got["train/sampler_logp_gap"] > 0.0  # the trajectories' log-probs are made up
    for x, y in zip(jax.tree.leaves(epoch.params), jax.tree.leaves(hand.params)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert epoch._grpo_step._cache_size() == 1  # equal mini-batches: one compiled step


def test_grpo_epoch_drops_trajectories_from_the_loss(one_layer_model):
  """`keep` False (train.drop_from_loss): the trajectory's tokens add nothing and the token-mean
  normaliser leaves them out. Hand-computed: at ratio 1 the token-mean pg loss is
  -sum_k A_k n_k / sum_k n_k over the kept rows only, here -(1 * 4 + 0.5 * 3) / (4 + 3) = -11/14
  (with the dropped rows it would be -(4 - 6 + 1.5 + 10) / 18 = -19/36). The update equals
  training on the kept trajectories alone."""
  trajs = _group(40, 6, [4, 6, 3, 5])  # a 6-token prompt, then n_k = 4, 6, 3, 5 sampled tokens
  adv = np.array([1.0, -1.0, 0.5, 2.0], np.float32)  # the dropped rows' are not 0 on purpose
  keep = np.array([True, False, True, False])
  cfg = grpo.GRPOConfig(kl_beta=0.1)
  dropped = PolicyTrainer(_fresh(one_layer_model), optax.sgd(0.5), cfg, 1.0)
  alone = PolicyTrainer(_fresh(one_layer_model), optax.sgd(0.5), cfg, 1.0)
  for t in (dropped, alone):
    t.freeze_reference()
  got = dropped.grpo_epoch(trajs, adv, 1, keep=keep)
  assert got["train/pg_loss"] == pytest.approx(-11 / 14, abs=1e-5)
  assert got["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
  want = alone.grpo_epoch([trajs[0], trajs[2]], adv[keep], 1)
  for key in ("train/loss", "train/pg_loss", "train/kl", "train/grad_norm"):
    assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
  for x, y in zip(jax.tree.leaves(dropped.params), jax.tree.leaves(alone.params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)
  with pytest.raises(ValueError, match="keep of shape"):
    dropped.grpo_epoch(trajs, adv, 1, keep=keep[:3])


def test_grpo_epoch_refuses_bad_mini_batches_and_advantages(one_layer_model):
  trainer = PolicyTrainer(_fresh(one_layer_model), optax.sgd(0.1), grpo.GRPOConfig(), 1.0)
  trajs = _group(30, 4, [2, 3])
  for bad in (0, 3):
    with pytest.raises(ValueError, match=r"mini_batches must be in \[1, 2\]"):
      trainer.grpo_epoch(trajs, np.zeros(2, np.float32), bad)
  with pytest.raises(ValueError, match="advantages of shape"):
    trainer.grpo_epoch(trajs, np.zeros(3, np.float32), 1)


def test_rows_that_do_not_split_are_padded_with_rows_that_add_nothing(one_layer_model):
  """6 rows over 4 micro-batches: the trainer pads to 8 rows with zero-mask rows, and log-probs,
  metrics and the updated parameters equal the unsplit batch's (seq-mean aggregation: it counts
  rows, so a padding row that counted would show; token-mean counts tokens, which padding rows
  have none of)."""
  batch = make_batch(_group(3, 4, [2, 3, 4, 5, 6, 7]), min_len=16, min_targets=8)  # 6 rows
  batch.advantages = np.linspace(-1.0, 1.0, 6).astype(np.float32)
  for agg in ("seq-mean-token-mean",):
    cfg = grpo.GRPOConfig(loss_agg=agg, kl_beta=0.1)
    out = {}
    for k in (1, 4):
      trainer = PolicyTrainer(_fresh(one_layer_model), optax.sgd(0.5), cfg, 1.0, micro_batches=k)
      trainer.freeze_reference()
      old = trainer.logprobs(batch)
      ref = trainer.logprobs(batch, trainer.ref_params) - 0.05
      metrics = [trainer.grpo_update(batch, old, ref) for _ in range(2)]
      sft = trainer.sft_update(batch)
      out[k] = (np.asarray(old), metrics, sft, jax.tree.map(np.asarray, trainer.params))
    (old1, m1, s1, p1), (old4, m4, s4, p4) = out[1], out[4]
    assert old4.shape == old1.shape == batch.target_pos.shape
    np.testing.assert_allclose(old4, old1, rtol=1e-6, atol=1e-6)
    for a, b in zip(m1, m4):
      for key in a:
        np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-6, err_msg=f"{agg} {key}")
    np.testing.assert_allclose(s4, s1, rtol=2e-5)
    for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)):
      np.testing.assert_allclose(y, x, rtol=2e-5, atol=1e-6)


def test_micro_batches_must_be_positive(base_model):
  with pytest.raises(ValueError, match="micro_batches must be >= 1"):
    PolicyTrainer(_fresh(base_model), optax.sgd(0.1), grpo.GRPOConfig(), 1.0, micro_batches=0)


# ---------------------------------------------------------------------------------------------
# The distribution scored: the sampler's (temperature, top-k, top-p).
# ---------------------------------------------------------------------------------------------


def _engine_trajectories(model, sampling, seed=0):
  """Two-turn episodes sampled by the real engine (`rollout.generate`): prompt, reply, made-up
  observation tokens, reply; the replies carry the engine's log-probs."""
  rng = np.random.default_rng(seed)
  vocab = model.config.vocab_size
  convs = [[int(x) for x in rng.integers(1, vocab, n)] for n in (5, 9, 14, 20)]
  trajs = [Trajectory(task_id="t", group_id=i // 2) for i in range(len(convs))]
  for tr, conv in zip(trajs, convs):
    tr.extend(conv, sampled=False)
  for turn in range(2):
    outs = generate(model, convs, sampling, max_new_tokens=8, rng=jax.random.key(turn))
    for tr, conv, out in zip(trajs, convs, outs):
      obs = [int(x) for x in rng.integers(1, vocab, 3)]
      tr.extend(out.token_ids, sampled=True, logprobs=out.logprobs)
      tr.extend(obs, sampled=False)
      conv += out.token_ids + obs
  return trajs


@pytest.mark.parametrize(
  "sampling",
  [SamplingParams(temperature=0.6, top_p=0.8), SamplingParams(temperature=0.6, top_k=20)],
  ids=["top_p", "top_k"],
)
def test_trainer_scores_under_the_engines_truncated_distribution(sampling):
  """Issue 18: tokens the real engine sampled with top-p (or top-k), scored by a trainer built
  with the same SamplingParams (as loop.py builds it), agree on every generated token to float
  noise, and a GRPO epoch on them sees ratio 1, no trainer / sampler gap and a finite loss.
  Scoring under the full tempered softmax instead (the GRPO path before) is off by the log of the
  kept mass: -log 0.8 = 0.223 on average for top_p = 0.8, several nats for the top 20 of 4096."""
  model = Qwen(QwenConfig.tiny_cpu(vocab_size=4096), rngs=nnx.Rngs(3))
  trajs = _engine_trajectories(model, sampling)
  batch = make_batch(trajs, min_len=32, min_targets=16)
  generated = batch.target_mask > 0
  assert generated.sum() >= 4 * 2 * 4  # at least four tokens per reply
  cfg = grpo.GRPOConfig(kl_beta=0.1)
  trainer = PolicyTrainer(_fresh(model), optax.sgd(0.0), cfg, sampling)
  got = np.asarray(trainer.logprobs(batch))
  assert np.max(np.abs(got - batch.sampler_logp)[generated]) <= 1e-5
  full = PolicyTrainer(_fresh(model), optax.sgd(0.0), cfg, sampling.temperature)
  gap = (batch.sampler_logp - np.asarray(full.logprobs(batch)))[generated]
  if sampling.top_p < 1.0:
    np.testing.assert_allclose(np.mean(gap), -np.log(0.8), atol=2e-3)
  else:
    assert np.min(gap) > 1.0
  trainer.freeze_reference()
  metrics = trainer.grpo_epoch(trajs, np.array([1.0, -1.0, 0.5, -0.5], np.float32), 2)
  assert all(np.isfinite(v) for v in metrics.values()), metrics
  assert metrics["train/sampler_logp_gap"] <= 1e-5 and metrics["train/sampler_set_misses"] == 0
  np.testing.assert_allclose(metrics["train/ratio_mean"], 1.0, atol=1e-5)
  assert metrics["train/kl"] <= 1e-6
  padded = make_batch(trajs)  # the epoch's own buckets: the shape its programs compiled for
  assert (
    metrics["train/padded_len"] == padded.tokens.shape[1] >= max(len(t.token_ids) for t in trajs)
  )
  assert metrics["train/padded_targets"] == padded.target_pos.shape[1]


def test_the_kept_set_is_stop_gradient():
  """d log q(y) / d logits under top-k + top-p is (onehot(y) - q) / T on the kept tokens and 0 on
  the dropped ones: the kept set gets no gradient (docs/design.md §1.1)."""
  logits = jnp.asarray(np.random.default_rng(0).normal(0.0, 2.0, (3, 50)), jnp.float32)
  params = SamplingParams(temperature=0.7, top_k=30, top_p=0.9)
  q = jax.nn.softmax(filtered_logits(logits, params), axis=-1)
  tokens = jnp.argsort(-q, axis=-1)[:, 1]  # a kept token of each row, not the top one
  grad = jax.grad(lambda x: jnp.sum(processed_logprobs(x, tokens, params)))(logits)
  want = (jax.nn.one_hot(tokens, 50) - q) / 0.7
  kept = np.asarray(q > 0)
  assert 0 < kept.sum(-1).min() and kept.sum(-1).max() < 30  # top-p cut inside the top 30
  np.testing.assert_allclose(np.asarray(grad), np.asarray(want), atol=1e-6)
  np.testing.assert_array_equal(np.asarray(grad)[~kept], 0.0)


def test_sharded_step_on_eight_cpu_devices():
  """Runs `_sharded_child` in a fresh interpreter with 8 host devices (the main test process
  keeps its single device)."""
  run_child(__file__, "sharded")


def _sharded_child():
  """8 devices, mesh data=2 x fsdp=2 x tensor=2, 2 micro-batches: parameters and optimizer state
  are sharded, the step donates them, never recompiles, and matches the single-device trainer."""
  assert jax.device_count() == 8, jax.devices()
  from coevolve_jax.models.sharding import make_mesh

  model = kit.tiny_model(0, num_hidden_layers=1)
  mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  gcfg = grpo.GRPOConfig(kl_beta=0.1)
  P = jax.sharding.PartitionSpec  # noqa: N806

  # Same update on 8 devices and on 1: SGD after clipping, so parameters compare gradients (Adam's
  # normalisation would amplify float-order noise in near-zero gradient entries).
  sgd = lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5))  # noqa: E731
  sharded = PolicyTrainer(_fresh(model), sgd(), gcfg, 0.9, mesh=mesh, micro_batches=2)
  single = PolicyTrainer(_fresh(model), sgd(), gcfg, 0.9)
  emb = sharded.params["embed_tokens"].get_value()
  assert emb.sharding.spec == P("tensor", "fsdp"), emb.sharding
  assert len(emb.addressable_shards) == 8 and emb.addressable_shards[0].data.shape == (256, 32)
  kproj = sharded.params["blocks"][0]["self_attn"]["k_proj"].get_value()  # [L_g, D, K, H]
  assert kproj.sharding.spec == P(None, "fsdp", "tensor", None)
  for t in (sharded, single):
    t.freeze_reference()
  for seed in (11, 12):
    batch = _mixed_batch(seed=seed)
    assert batch.tokens.shape == (8, 32)  # one bucket for both batches
    assert batch.target_pos.shape == (8, 16)
    out = []
    for t in (sharded, single):
      old = t.logprobs(batch)
      ref = t.logprobs(batch, t.ref_params)
      before = jax.tree.leaves(t.params)
      out.append((t.grpo_update(batch, old, ref), np.asarray(old)))
      assert all(x.is_deleted() for x in before)  # donated
    (ms, olds), (m1, old1) = out
    assert olds.shape == (8, 16)
    np.testing.assert_allclose(olds, old1, rtol=1e-5, atol=1e-5)
    for key in m1:
      np.testing.assert_allclose(ms[key], m1[key], rtol=1e-4, atol=1e-6, err_msg=key)
  for x, y in zip(jax.tree.leaves(sharded.params), jax.tree.leaves(single.params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)
  assert sharded.params["embed_tokens"].get_value().sharding.spec == emb.sharding.spec
  assert sharded._grpo_step._cache_size() == 1
  assert sharded._logp._cache_size() == 1

  # AdamW (the run's optimizer): its moments shard like their parameters and stay so.
  adam = PolicyTrainer(_fresh(model), make_optimizer(1e-3, 0.01, 1.0), gcfg, 0.9, mesh=mesh)
  mu = adam.opt_state[1][0].mu["embed_tokens"].get_value()
  assert mu.sharding.spec == P("tensor", "fsdp")
  for _ in range(2):
    loss = adam.sft_update(_mixed_batch(seed=14))
    assert np.isfinite(loss)
  mu = adam.opt_state[1][0].mu["embed_tokens"].get_value()
  assert mu.sharding.spec == P("tensor", "fsdp") and adam._sft_step._cache_size() == 1
  print("sharded OK")


if __name__ == "__main__":
  if sys.argv[1:] == ["sharded"]:
    _sharded_child()


def test_a_float32_master_learns_under_bfloat16_compute_as_float32_does(one_layer_model):
  """3 AdamW updates at lr 1e-6: float32 master weights with bfloat16 compute change the weights
  as the all-float32 run does, while bfloat16 weights round nearly every update away (the
  failure this guards against); the engine's bfloat16 copy follows the master."""
  trajs = _group(7, 6, [5, 6, 7, 8]) + _group(8, 6, [4, 5, 6, 9])
  batch = make_batch(trajs, np.array([1, -1, 1, -1, -1, 1, 1, -1], np.float32), 16, 8)

  def run(param_dtype, compute_dtype):
    graphdef, state = nnx.split(one_layer_model)
    # jnp.array copies: the trainer donates its parameters, and the fixture's must survive.
    model = nnx.merge(graphdef, jax.tree.map(lambda x: jnp.array(x, param_dtype), state))
    tx = make_optimizer(1e-6, 0.0, 1.0)
    trainer = PolicyTrainer(model, tx, grpo.GRPOConfig(), 1.0, compute_dtype=compute_dtype)
    flat = lambda: np.concatenate(  # noqa: E731
      [np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(trainer.params)]
    )
    w0 = flat()
    for _ in range(3):
      trainer.grpo_update(batch, trainer.logprobs(batch), None)
    return w0, flat(), trainer

  m0, m3, mixed = run(jnp.float32, jnp.bfloat16)
  f0, f3, _ = run(jnp.float32, None)
  b0, b3, _ = run(jnp.bfloat16, None)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(mixed.params))
  dm, df, db = m3 - m0, f3 - f0, b3 - b0
  changed = (df != 0).mean()
  assert changed > 0.5  # AdamW moves every weight with a gradient by about lr
  assert (dm != 0).mean() == pytest.approx(changed, abs=0.01)
  assert (db != 0).mean() < 0.1  # bfloat16 weights: most updates round away
  np.testing.assert_array_less(np.linalg.norm(m3 - f3) / np.linalg.norm(f3), 1e-3)
  # Same direction: bfloat16 gradients flip Adam's sign only on near-zero gradient entries.
  cosine = dm @ df / (np.linalg.norm(dm) * np.linalg.norm(df))
  assert cosine > 0.99, cosine
  assert db @ df / (np.linalg.norm(db) * np.linalg.norm(df) + 1e-30) < 0.5
  infer = mixed.inference_params()  # unrolled, bfloat16: the engine's copy
  masters = nnx.state(unstack(mixed.model()))
  assert jax.tree.structure(infer) == jax.tree.structure(masters)
  for x, master in zip(jax.tree.leaves(infer), jax.tree.leaves(masters), strict=True):
    assert x.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(x), np.asarray(master.astype(jnp.bfloat16)))
  # The copy is released when an epoch starts (its first update makes it stale), so the copy
  # and the step's activations never coexist; the next call makes the new version's.
  alive = weakref.ref(jax.tree.leaves(infer)[0])
  del infer, x
  mixed.grpo_epoch(trajs, np.array([1, -1, 1, -1, -1, 1, 1, -1], np.float32), 1)
  gc.collect()
  assert alive() is None, "the rollout copy outlived the training step"
  new = jax.tree.leaves(mixed.inference_params())[0]
  assert new.dtype == jnp.bfloat16 and not new.is_deleted()
  mixed.freeze_reference()
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(mixed.ref_params))


def test_warm_start_target_buckets_pad_little_and_leave_the_sft_step_unchanged(one_layer_model):
  """`warmstart.target_buckets`: multiples of 32 up to the longest reply; a batch is padded to the
  smallest that holds its rows. The padding positions add nothing: the SFT loss and the updated
  weights are those of the same batch padded to a larger P."""
  from coevolve_jax.warmstart import target_buckets  # noqa: PLC0415

  demos = [_traj(i, [(5, False), (n, True), (3, False)]) for i, n in enumerate((20, 40, 83))]
  assert target_buckets(demos) == (32, 64, 96)
  assert target_buckets(demos[:1]) == (32,) and target_buckets(demos, granule=64) == (64, 128)
  with pytest.raises(ValueError, match="granule"):
    target_buckets(demos, granule=0)
  small = make_batch(demos[:2], min_len=128, target_buckets=target_buckets(demos))
  assert small.target_pos.shape == (2, 64)  # the batch's own bucket, not the longest demo's
  large = make_batch(demos[:2], min_len=128, min_targets=128)
  assert large.target_pos.shape == (2, 128)
  out = []
  for batch in (small, large):
    trainer = PolicyTrainer(_fresh(one_layer_model), optax.adam(1e-2), grpo.GRPOConfig(), 1.0)
    loss = trainer.sft_update(batch)
    out.append((loss, jax.tree.map(np.asarray, trainer.params)))
  np.testing.assert_allclose(out[0][0], out[1][0], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(out[0][1]), jax.tree.leaves(out[1][1]), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_warm_start_holds_no_more_than_an_update_does(one_layer_model, monkeypatch):
  """The warm-start's steps run beside what a GRPO update runs beside (`memory_plan.
  check_programs`: everything resident but the rollout copy), not beside the run's fresh
  optimizer state and its stale rollout copy as well: before, a Qwen3-4B warm-start on fsdp 8
  held a second AdamW state (3.7 GiB per device) that no plan counted. Measured on live arrays
  at each SFT step's start; afterwards the run's trainer has a fresh optimizer state again."""
  from coevolve_jax import memory_plan  # noqa: PLC0415
  from coevolve_jax.warmstart import warm_start  # noqa: PLC0415

  trainer = PolicyTrainer(
    _fresh(one_layer_model),
    make_optimizer(1e-3, 0.0, 1.0),
    grpo.GRPOConfig(),
    1.0,
    compute_dtype=jnp.bfloat16,
  )
  trainer.freeze_reference()  # as the loop does before the warm-start
  copy_bytes = memory_plan.device_bytes(trainer.inference_params())  # an evaluation's copy
  opt_bytes = memory_plan.device_bytes(trainer.opt_state)
  assert copy_bytes > 0 and opt_bytes > 0
  gc.collect()
  before = memory_plan.device_bytes()
  seen = []
  real = PolicyTrainer.sft_update

  def measured(self, batch):
    gc.collect()
    seen.append(memory_plan.device_bytes())
    return real(self, batch)

  monkeypatch.setattr(PolicyTrainer, "sft_update", measured)
  demos = [_traj(i, [(6, False), (5 + i, True)]) for i in range(4)]
  warm_start(
    trainer,
    demos,
    steps=3,
    batch_size=2,
    lr=1e-3,
    grad_clip=1.0,
    rng=np.random.default_rng(0),
    mesh=None,
    compute_dtype=jnp.bfloat16,
    log=lambda step, loss: None,
    micro_batches=2,
  )
  assert len(seen) == 3
  # One optimizer state (the warm-start's instead of the run's), no rollout copy; the batch's
  # few hundred bytes are the slack. Before the change: before + opt_bytes.
  assert max(seen) <= before - copy_bytes + opt_bytes // 100, (max(seen), before, copy_bytes)
  assert trainer.opt_state is not None and trainer.rollout_copy is None
  fresh = jax.tree.leaves(trainer.opt_state)
  assert all(not np.any(np.asarray(x)) for x in fresh if x.ndim)  # zero moments: a new state
  assert memory_plan.device_bytes(trainer.opt_state) == opt_bytes


@pytest.mark.slow
def test_warmstart_benchmark_prints_both_paddings_and_their_ratio(tmp_path):
  """benchmarks/warmstart_bench.py on a small D0: both rows, P bucketed as documented, and the
  speed-up consistent with the printed seconds."""
  import os  # noqa: PLC0415
  import re  # noqa: PLC0415
  import subprocess  # noqa: PLC0415

  script = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "warmstart_bench.py")
  out = subprocess.run(
    [sys.executable, script, "--initial_tasks=8", "--steps=2", "--repeats=1"]
    + [f"--workdir={tmp_path}"],
    capture_output=True,
    text=True,
    timeout=600,
    check=True,
  ).stdout
  rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()]
  before, now = [r for r in rows if r and r[0].startswith(("longest", "target_buckets"))]
  b, n = float(before[1]), float(now[1])
  assert before[4] == "1.00x" and float(now[2]) <= float(before[2])
  shapes = re.findall(r"\((\d+), (\d+)\)", now[3])  # (T, P) pairs
  assert shapes and all(int(p) % 32 == 0 for _, p in shapes)
  assert abs(float(now[4].removesuffix("x")) - b / n) <= 0.01 + 0.001 * (b + n) / n**2
