"""Routing replay for Qwen3-MoE: the trainer scores each token under the experts the rollout
engine routed it to (issue 18, item 6).

The near-tie input: a tiny Qwen3-MoE whose router columns for experts 1 and 2 are one ulp apart
element-wise, so the two logits agree to about an ulp for every token and the rounding
differences between the KV-cached decode and the cache-free training forward pick different
experts. Without replay the trainer's log-probs of sampled tokens then differ from the engine's
by up to tenths of a nat; with replay they agree to float32 rounding, and the router still gets
a gradient.
"""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from host_devices import run_child

from coevolve_jax import grpo
from coevolve_jax.agent import AgentRunner, EpisodeLimits
from coevolve_jax.models import Qwen
from coevolve_jax.models.qwen import SparseMoE
from coevolve_jax.rollout.engine import Engine
from coevolve_jax.rollout.generate import generate
from coevolve_jax.rollout.sampling import SamplingParams
from coevolve_jax.trainer import PolicyTrainer, grpo_micro_loss, make_batch, token_logprobs
from coevolve_jax.types import Task, Trajectory

import kit

MOE = kit.tiny_config(
  vocab_size=64,
  hidden_size=32,
  intermediate_size=64,
  head_dim=8,
  num_experts=4,
  num_experts_per_tok=2,
  moe_intermediate_size=32,
  norm_topk_prob=True,  # weights p_e / (p_a + p_b): the router's gradient needs k >= 2
)
TIED = (1, 2)  # the experts whose router columns are one ulp apart


def _near_tie_model(seed: int = 0) -> Qwen:
  """MOE with experts 1 and 2 tied to within an ulp in every layer's router, and experts strong
  enough (x10) that a flipped choice moves the next-token distribution by much more than
  rounding."""
  model = Qwen(MOE, rngs=nnx.Rngs(seed))
  for block in model.blocks:  # stacked layers: [L_g, D, E] routers, [L_g, E, ...] experts
    gate = np.array(block.mlp.gate[...]) * 20.0
    gate[..., TIED[1]] = np.nextafter(gate[..., TIED[0]], np.float32(np.inf))
    block.mlp.gate[...] = jnp.asarray(gate)
    for name in ("gate_proj", "up_proj", "down_proj"):
      kernel = getattr(block.mlp.experts, name)
      kernel[...] = kernel[...] * 10.0
  return model


# ---------------------------------------------------------------------------------------------
# The MoE block with forced experts.
# ---------------------------------------------------------------------------------------------


def test_replaying_the_routers_own_choice_changes_nothing():
  """Forced experts equal to the router's top-k, or all -1 (nothing recorded), give the block's
  output and router gradient bit for bit: runs without a record keep the old forward."""
  moe = SparseMoE(MOE, rngs=nnx.Rngs(1), dtype=jnp.float32)
  x = jax.random.normal(jax.random.key(2), (2, 5, MOE.hidden_size))

  @nnx.jit
  def run(m, experts):
    def loss(m):
      y, used = m.forward(x, experts)
      return jnp.sum(jnp.sin(y)), (y, used)

    (_, (y, used)), grads = nnx.value_and_grad(loss, has_aux=True)(m)
    return y, used, grads.gate[...]

  y, used, grad = run(moe, None)
  assert used.shape == (2, 5, 2) and used.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m: m(x))(moe)), np.asarray(y))
  for forced in (used.astype(jnp.int16), jnp.full(used.shape, -1, jnp.int16)):
    y2, used2, grad2 = run(moe, forced)
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(used2), np.asarray(used))
    np.testing.assert_array_equal(np.asarray(grad2), np.asarray(grad))


def test_forced_experts_route_tokens_and_take_the_routers_weights_there():
  """A recorded token goes to its recorded experts with weights p_e / sum over them; a token
  marked -1 takes the router's own top-k."""
  moe = SparseMoE(MOE, rngs=nnx.Rngs(3), dtype=jnp.float32)
  x = jax.random.normal(jax.random.key(4), (1, 3, MOE.hidden_size))
  forward = nnx.jit(lambda m, experts: m.forward(x, experts))
  _, own = forward(moe, None)
  forced = np.array([[[3, 0], [-1, -1], [2, 1]]], np.int16)
  y, used = forward(moe, jnp.asarray(forced))
  want_used = forced.astype(np.int32)
  want_used[0, 1] = np.asarray(own)[0, 1]
  np.testing.assert_array_equal(np.asarray(used), want_used)

  xs = np.asarray(x, np.float64)[0]
  gate = np.asarray(moe.gate[...], np.float64)
  g, u, d = (
    np.asarray(getattr(moe.experts, n)[...], np.float64)
    for n in ("gate_proj", "up_proj", "down_proj")
  )
  for t in range(3):
    logits = xs[t] @ gate
    p = np.exp(logits - logits.max())
    p /= p.sum()
    experts = want_used[0, t]
    w = p[experts] / p[experts].sum()
    out = 0.0
    for e, we in zip(experts, w):
      h = xs[t] @ g[e]
      out = out + we * ((h / (1 + np.exp(-h))) * (xs[t] @ u[e])) @ d[e]
    np.testing.assert_allclose(np.asarray(y)[0, t], out, rtol=1e-5, atol=1e-6)


def test_a_routing_record_of_the_wrong_shape_is_refused():
  model = Qwen(MOE, rngs=nnx.Rngs(0))
  ids = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match=r"want \[B, T, L_moe, k\] = \[1, 4, 2, 2\]"):
    model.hidden_states(ids, routing_btlk=jnp.zeros((1, 4, 1, 2), jnp.int32))


# ---------------------------------------------------------------------------------------------
# The engine's record.
# ---------------------------------------------------------------------------------------------


def test_engine_records_the_routing_of_every_consumed_token():
  """Prompt chunks (two prefill calls) and decode steps append, in order, the experts the
  engine's own forwards chose: the record equals a one-shot cached forward over the same tokens
  (no near-ties in this model), the pending token is not in it, and a reset clears it. A dense
  model, or an engine told not to record, has no record."""
  model = Qwen(MOE, rngs=nnx.Rngs(5))
  engine = Engine(model, num_slots=2, cache_len=64)
  sampling = SamplingParams(temperature=1.0)
  first, more = [5, 9, 11, 3, 7], [2, 8, 13]
  tok, _ = engine.prefill(1, first, jax.random.key(0), sampling)
  seq = first + [tok] + more
  tok, _ = engine.prefill(1, [tok] + more, jax.random.key(1), sampling)
  seq.append(tok)
  for i in range(3):
    toks, _ = engine.generate(np.array([False, True]), jax.random.key(10 + i), sampling)
    seq.append(int(toks[1]))
  record = engine.routing(1)
  assert record.shape == (len(seq) - 1, 2, 2) and record.dtype == np.int16
  assert engine.routing(0).shape == (0, 2, 2)

  cache = jax.tree.map(lambda c: c[:1], engine.init_decode_state().cache)
  n = len(seq) - 1
  one_shot = nnx.jit(
    lambda m, ids: m.decode_routed(ids, jnp.arange(n)[None], cache, jnp.zeros(1, jnp.int32))
  )
  _, _, want = one_shot(model, jnp.asarray([seq[:n]]))
  np.testing.assert_array_equal(record, np.asarray(want)[0])
  engine.reset_slot(1)
  assert engine.routing(1).shape == (0, 2, 2)

  assert Engine(model, 1, 64, record_routing=False).routing(0) is None
  dense = Qwen(dataclasses.replace(MOE, num_experts=0, num_experts_per_tok=0), rngs=nnx.Rngs(0))
  assert Engine(dense, 1, 64).routing(0) is None


def test_generate_returns_each_requests_routing():
  engine = Engine(Qwen(MOE, rngs=nnx.Rngs(6)), num_slots=2, cache_len=64)
  prompts = [[4, 5, 6], [7, 8, 9, 10, 11]]
  comps = generate(engine, prompts, SamplingParams(1.0), max_new_tokens=4)
  for prompt, comp in zip(prompts, comps):
    assert comp.routing.shape == (len(prompt) + len(comp.token_ids) - 1, 2, 2)
  # Several decode steps per device call record the same routing as one call per token.
  engine = Engine(Qwen(MOE, rngs=nnx.Rngs(6)), num_slots=2, cache_len=64)
  steps = generate(engine, prompts, SamplingParams(1.0), max_new_tokens=4, decode_steps=3)
  for one, several in zip(comps, steps):
    assert several.token_ids == one.token_ids
    np.testing.assert_array_equal(several.routing, one.routing)


# ---------------------------------------------------------------------------------------------
# Batches and the trainer's checks.
# ---------------------------------------------------------------------------------------------


def _traj(n, routing=None):
  traj = Trajectory(task_id="t", group_id=0)
  traj.extend(list(range(3, 3 + n)), sampled=False)
  traj.loss_mask[-2:] = [1, 1]
  traj.set_routing(routing)
  return traj


def test_make_batch_pads_routing_records_with_minus_one():
  rec = np.arange(4 * 2 * 2, dtype=np.int16).reshape(4, 2, 2) % 4
  with_record, without = _traj(5, rec), _traj(3)
  assert with_record.routing.shape == (5, 2, 2)
  np.testing.assert_array_equal(with_record.routing[:4], rec)
  assert (with_record.routing[4] == -1).all()  # the last token was never consumed
  batch = make_batch([with_record, without], min_len=8)
  assert batch.routing.shape == (2, 8, 2, 2) and batch.routing.dtype == np.int16
  np.testing.assert_array_equal(batch.routing[0, :5], with_record.routing)
  assert (batch.routing[0, 5:] == -1).all() and (batch.routing[1] == -1).all()
  assert batch.rows(np.array([1])).routing.shape == (1, 8, 2, 2)
  assert make_batch([without]).routing is None  # dense / scripted rollouts: no replay
  with pytest.raises(ValueError, match="routing record of shape"):
    _traj(2, rec)
  bad = _traj(5, rec)
  bad.routing = bad.routing[:, :1]
  with pytest.raises(ValueError, match=r"different \[L_moe, k\] shapes"):
    make_batch([with_record, bad])
  bad.routing = with_record.routing[:4]  # one row short of its token ids
  with pytest.raises(ValueError, match="routing of 4 tokens for 5 token ids"):
    make_batch([bad])


def test_the_trainer_refuses_a_routing_record_that_does_not_fit_the_model():
  trainer = PolicyTrainer(
    Qwen(MOE, rngs=nnx.Rngs(0)), optax.sgd(0.0), grpo.GRPOConfig(), sampling=1.0
  )
  batch = make_batch([_traj(5, np.zeros((5, 2, 2), np.int16))], min_len=8)
  for bad, match in (
    (batch.routing[..., :1], r"want \[N, T, L_moe, k\] = \[1, 8, 2, 2\]"),
    (np.full_like(batch.routing, MOE.num_experts), r"outside \[-1, 4\)"),
    (np.full_like(batch.routing, -2), r"outside \[-1, 4\)"),
  ):
    with pytest.raises(ValueError, match=match):
      trainer.logprobs(dataclasses.replace(batch, routing=bad))


# ---------------------------------------------------------------------------------------------
# The near-tie end to end: agent loop on the real engine, trainer with and without replay.
# ---------------------------------------------------------------------------------------------


def _rollouts(model):
  rng = np.random.default_rng(0)
  prompts = rng.integers(7, MOE.vocab_size, (8, 12)).tolist()  # one length: fewer compiles
  tasks = [
    Task(task_id=f"t{i}", env="fake", turns=[p], ground_truth=[[]]) for i, p in enumerate(prompts)
  ]
  runner = AgentRunner(
    Engine(model, num_slots=2, cache_len=64),
    kit.IdChat(),  # ids are the model's vocabulary; replies are cut at the limit or stop at 0
    lambda task, _: kit.StepEnv(task, steps=3),  # two tool observations between three replies
    EpisodeLimits(max_new_tokens=8, max_model_steps=3),
    env_threads=1,
  )
  return runner.run([(t, i) for i, t in enumerate(tasks)], SamplingParams(1.0), jax.random.key(1))


def test_near_tie_routing_is_replayed_by_the_trainer():
  model = _near_tie_model()
  trajs = _rollouts(model)
  for traj in trajs:  # every token the engine consumed is recorded; only the tail is not
    assert traj.routing.shape == (len(traj.token_ids), 2, 2)
    recorded = np.flatnonzero(traj.routing[:, 0, 0] >= 0)
    np.testing.assert_array_equal(recorded, np.arange(len(recorded)))
    assert len(recorded) >= max(i for i, m in enumerate(traj.loss_mask) if m)

  # The near-tie: experts 1 and 2's router logits are within one ulp for about half of all inputs.
  x = np.random.default_rng(1).standard_normal((1000, MOE.hidden_size)).astype(np.float32)
  for i in range(model.config.num_hidden_layers):
    logits = x @ np.asarray(model.layer(i).mlp.gate[...])
    gap = np.abs(logits[:, TIED[0]] - logits[:, TIED[1]])
    assert np.mean(gap <= np.spacing(np.abs(logits[:, TIED[0]]))) > 0.3

  trainer = PolicyTrainer(model, optax.sgd(0.0), grpo.GRPOConfig(), sampling=1.0)
  batch = make_batch(trajs, np.linspace(-1.0, 1.0, len(trajs)))
  mask = batch.target_mask > 0
  assert mask.sum() >= 150
  replayed = np.asarray(trainer.logprobs(batch))
  free = np.asarray(trainer.logprobs(dataclasses.replace(batch, routing=None)))
  gap_replay = np.abs(replayed - batch.sampler_logp)[mask]
  gap_free = np.abs(free - batch.sampler_logp)[mask]
  print(
    f"sampled {mask.sum()}: without replay {int((gap_free > 1e-3).sum())} tokens > 1e-3 "
    f"(max {gap_free.max():.3g}); with replay max {gap_replay.max():.3g}"
  )
  assert gap_replay.max() <= 1e-5
  # Without replay the trainer routes some tokens to other experts than the engine did.
  assert (gap_free > 1e-3).sum() >= 5 and gap_free.max() > 0.05

  # The router keeps a gradient under replay (GRPO loss at the sampler's log-probs).
  graphdef, params = nnx.split(model)
  routing = jnp.asarray(batch.routing)

  def logp_fn(p, tokens, pos, routing):
    return token_logprobs(nnx.merge(graphdef, p), tokens, pos, routing_ntlk=routing)

  loss_fn = grpo_micro_loss(logp_fn, grpo.GRPOConfig(), jnp.asarray(batch.target_mask))
  arrays = {k: jnp.asarray(v) for k, v in vars(batch).items() if k != "sampler_logp"}
  arrays.update(old=jnp.asarray(replayed), routing=routing)
  grads = jax.jit(jax.grad(lambda p: loss_fn(p, arrays)[0]))(params)
  for b, (first, count) in enumerate(model.block_spans):  # stacked: [L_g, D, E] per block
    if not MOE.is_moe_layer(first):
      continue
    stacked = np.asarray(grads["blocks"][b]["mlp"]["gate"][...])
    for j in range(count):
      g = stacked[j]
      assert np.all(np.isfinite(g)) and np.abs(g).max() > 1e-6, first + j


@pytest.mark.slow  # 51 s; make test keeps replay on meshes in tests/test_moe_expert_parallel.py
def test_replay_on_a_mesh_matches_one_device():
  """Runs `_sharded_child` in a fresh interpreter with 8 host devices."""
  run_child(__file__, "sharded")


def _sharded_child():
  """Mesh data=2 x fsdp=2 x expert=2, 2 micro-batches: a batch with a routing record (rows split
  over the data axes with the tokens) gives the single-device trainer's log-probs and update."""
  assert jax.device_count() == 8, jax.devices()
  from coevolve_jax.models.sharding import make_mesh  # noqa: PLC0415

  model = Qwen(MOE, rngs=nnx.Rngs(7))  # no near-ties: the free routing agrees across meshes
  rng = np.random.default_rng(3)
  trajs = []
  for i in range(8):
    n = int(rng.integers(10, 30))
    traj = Trajectory(task_id=f"t{i}", group_id=i)
    traj.extend(rng.integers(1, MOE.vocab_size, n).tolist(), sampled=False)
    traj.loss_mask[n // 2 :] = [1] * (n - n // 2)
    traj.logprobs[n // 2 :] = (-rng.gamma(2.0, 1.0, n - n // 2)).tolist()
    # A recorded routing that is not the router's own choice: replay must change the result.
    traj.set_routing(rng.integers(0, MOE.num_experts, (n - 1, 2, 2)).astype(np.int16))
    trajs.append(traj)
  batch = make_batch(trajs, rng.normal(0, 1, 8), min_len=32, min_targets=16)
  sgd = lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5))  # noqa: E731
  mesh = make_mesh({"data": 2, "fsdp": 2, "expert": 2})
  gcfg = grpo.GRPOConfig()
  graphdef, state = nnx.split(model)
  fresh = lambda: nnx.merge(graphdef, jax.tree.map(jnp.copy, state))  # noqa: E731  (own buffers)
  sharded = PolicyTrainer(fresh(), sgd(), gcfg, 1.0, mesh=mesh, micro_batches=2)
  single = PolicyTrainer(fresh(), sgd(), gcfg, 1.0)
  free = np.asarray(single.logprobs(dataclasses.replace(batch, routing=None)))
  out = []
  for t in (sharded, single):
    old = t.logprobs(batch)
    out.append((np.asarray(old), t.grpo_update(batch, old, None)))
  (olds, ms), (old1, m1) = out
  np.testing.assert_allclose(olds, old1, rtol=1e-5, atol=1e-5)
  assert np.abs(old1 - free).max() > 1e-2  # the record was replayed
  for key in m1:
    np.testing.assert_allclose(ms[key], m1[key], rtol=1e-4, atol=1e-6, err_msg=key)
  for x, y in zip(jax.tree.leaves(sharded.params), jax.tree.leaves(single.params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)
  print("sharded OK")


if __name__ == "__main__":
  if sys.argv[1:] == ["sharded"]:
    _sharded_child()
