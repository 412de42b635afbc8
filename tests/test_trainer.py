"""Training batches and the jitted GRPO / SFT updates on a tiny random Qwen."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coevolve_jax import grpo
from coevolve_jax.models import Qwen, QwenConfig
from coevolve_jax.trainer import PolicyTrainer, make_batch, make_optimizer
from coevolve_jax.trajectory import Trajectory


@pytest.fixture(scope="module")
def base_model():
  cfg = QwenConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
  return Qwen(cfg, rngs=nnx.Rngs(0))


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
  np.testing.assert_allclose(batch.sampler_logp[0, :6],
                             [a.logprobs[i] for i in (5, 6, 7, 8, 12, 13)], rtol=1e-6)
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
  trainer = PolicyTrainer(_fresh(base_model), make_optimizer(1e-3, 0.0, 1.0),
                          grpo.GRPOConfig(), temperature=0.9)
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
  changed = [not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before),
                                                     jax.tree.leaves(after))]
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


def test_sft_update_lowers_loss(base_model):
  trainer = PolicyTrainer(_fresh(base_model), make_optimizer(3e-3, 0.01, 1.0),
                          grpo.GRPOConfig(), temperature=1.0)
  batch = make_batch(_group(9, 5, [6, 4, 7]), min_len=16, min_targets=8)
  losses = [trainer.sft_update(batch) for _ in range(6)]  # each: the loss before its step
  assert all(np.isfinite(losses))
  assert all(b < a for a, b in zip(losses, losses[1:])), losses
  assert losses[-1] < losses[0] - 1e-3
  assert trainer._sft_step._cache_size() == 1
