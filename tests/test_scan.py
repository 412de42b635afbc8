"""Scanned decoder layers (issue 15 item 5): compile time independent of depth, remat policies,
heterogeneous MoE stacks, per-layer Hugging Face names, and the memory that full remat keeps.

The Qwen3-4B figure (activation memory of a 4,096-token sequence) takes minutes to compile on
CPU: benchmarks/scan_bench.py measures it (docs/benchmarks/scan.md); here a narrow model checks
the mechanism.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from coevolve_jax.models import KVCache, Qwen, QwenConfig, from_pretrained, save_pretrained
from coevolve_jax.models.qwen import REMAT_POLICIES, unstack, unstack_state
from coevolve_jax.trainer import token_logprobs
from host_devices import run_child

import kit

TINY = kit.tiny_config(intermediate_size=192, tie_word_embeddings=True)
# Qwen3-MoE with dense layer 2 among sparse ones: blocks (0, 2) (2, 1) (3, 1).
MIXED = dataclasses.replace(
  TINY,
  num_hidden_layers=4,
  num_experts=4,
  num_experts_per_tok=2,
  moe_intermediate_size=32,
  mlp_only_layers=(2,),
  tie_word_embeddings=False,
)


def _loss_and_grad(graphdef):
  def loss(params, tokens, target_pos):
    return -jnp.mean(token_logprobs(nnx.merge(graphdef, params), tokens, target_pos))

  return jax.jit(jax.value_and_grad(loss))


def _hidden_loss_and_grad(graphdef):
  """A cheaper step (no vocabulary projection) for checks that only concern the layers."""

  def loss(params, tokens, target_pos):
    h = nnx.merge(graphdef, params).hidden_states(tokens, output_index_bp=target_pos)
    return jnp.mean(jnp.square(h))

  return jax.jit(jax.value_and_grad(loss))


def _abstract_step(
  cfg: QwenConfig, remat: str, batch: int, seq: int, dtype=jnp.float32, step=_loss_and_grad
):
  """(jitted loss and gradient, abstract params, tokens, target positions): nothing allocated."""
  model = nnx.eval_shape(lambda: Qwen(cfg, rngs=nnx.Rngs(0), dtype=dtype, remat=remat))
  graphdef, params = nnx.split(model)
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  pos = jax.ShapeDtypeStruct((batch, seq // 2), jnp.int32)
  return step(graphdef), params, tokens, pos


def _compile_seconds(layers: int, remat: str) -> float:
  cfg = dataclasses.replace(TINY, num_hidden_layers=layers)
  best = float("inf")
  for _ in range(2):  # the better of two fresh compiles: the machine is shared
    jax.clear_caches()
    fn, params, tokens, pos = _abstract_step(cfg, remat, 2, 128)
    t0 = time.perf_counter()
    fn.lower(params, tokens, pos).compile()
    best = min(best, time.perf_counter() - t0)
  return best


@pytest.mark.slow  # four fresh compiles and a timing: `make test-slow`, benchmarks/scan_bench.py
def test_train_step_compile_time_does_not_grow_with_depth():
  """Once the first block is a real loop, depth adds no compile time: 36 layers compile in at
  most 1.3x the time of 8 (unrolled, 36 layers took 4.3x the time of 2; docs/benchmarks/scan.md).

  Issue 15 asks for 36 layers <= 1.5x 2 layers; measured here 1.4x to 1.8x, depending on the
  load: at 2 layers both blocks are one-step scans that XLA inlines, so the 2-layer graph has no
  loop machinery (and, with remat, XLA merges the recomputation with the forward pass).
  """
  eight, deep = _compile_seconds(8, "none"), _compile_seconds(36, "none")
  assert deep <= 1.3 * eight, (eight, deep)


@pytest.mark.slow  # four fresh compiles and a timing: `make test-slow`, benchmarks/scan_bench.py
def test_rematerialised_train_step_compiles_at_36_layers_within_1_5x_of_2():
  """Issue 15's bound, 36 layers <= 1.5x 2 layers, for full remat (the full-scale configs'
  `model.remat`). On an idle 2-core CPU (2026-12-01, docs/benchmarks/scan.md) full remat measured
  1.25x to 1.38x; without remat 1.54x to 1.60x, the loop machinery that the 2-layer graph (two
  inlined one-step scans) lacks."""
  two, deep = _compile_seconds(2, "full"), _compile_seconds(36, "full")
  assert deep <= 1.5 * two, (two, deep)


def test_lowered_train_step_does_not_grow_with_depth():
  """The deterministic side of the compile-time claim (the timing is the slow test above): the
  lowered loss-and-gradient program of 36 layers is the program of 8 layers (the same number of
  lines and of loops), where unrolled layers would make it 4.5x longer."""

  def lowered(layers):
    fn, *args = _abstract_step(dataclasses.replace(TINY, num_hidden_layers=layers), "full", 2, 64)
    return fn.lower(*args).as_text()

  eight, deep = lowered(8), lowered(36)
  assert deep.count("stablehlo.while") == eight.count("stablehlo.while") >= 2
  assert len(deep.splitlines()) == len(eight.splitlines())


def test_layer_blocks_group_runs_of_one_kind_and_keep_the_last_layer_apart():
  assert TINY.layer_blocks == ((0, 1), (1, 1))
  assert dataclasses.replace(TINY, num_hidden_layers=36).layer_blocks == ((0, 35), (35, 1))
  assert dataclasses.replace(TINY, num_hidden_layers=1).layer_blocks == ((0, 1),)
  assert MIXED.layer_blocks == ((0, 2), (2, 1), (3, 1))
  model = nnx.eval_shape(lambda: Qwen(MIXED, rngs=nnx.Rngs(0)))
  q = model.blocks[0].self_attn.q_proj
  assert q.shape == (2, 64, 4, 16)
  assert q.get_metadata()["out_sharding"] == ("layers", "embed", "q_heads", "head_dim")
  assert model.blocks[0].mlp.experts.up_proj.shape == (2, 4, 64, 32)  # [L_g, E, D, F]
  assert model.blocks[1].mlp.up_proj.shape == (1, 64, 192)
  with pytest.raises(ValueError, match="remat"):
    Qwen(TINY, rngs=nnx.Rngs(0), remat="everything")


def test_remat_policies_agree():
  """Every policy gives the same loss and gradients."""
  model = Qwen(TINY, rngs=nnx.Rngs(1))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 12)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(4, 12, dtype=jnp.int32), (2, 8))
  results = {}
  for remat in REMAT_POLICIES:
    model.remat = remat
    graphdef, params = nnx.split(model)
    results[remat] = _hidden_loss_and_grad(graphdef)(params, tokens, pos)
  for remat in ("full", "save_dots"):
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5),
      results["none"],
      results[remat],
    )


@nnx.jit
def _decode_and_forward(model, tokens):
  b, t = tokens.shape
  cache = KVCache.zeros(model.config, b, 16)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  hidden, cache, routing = model.decode_routed(tokens, positions, cache, jnp.zeros(b, jnp.int32))
  return hidden, cache, routing, model.hidden_states(tokens, routing_btlk=routing)


def test_decode_matches_the_training_scan_in_both_layouts():
  """The KV-cached decode (layer by layer over per-layer caches) gives the hidden states and
  routing of the scanned cache-free forward on a stack of dense and sparse blocks, from the
  stacked model and from its unrolled copy (`unstack`, what the engine decodes), which holds the
  values a model built unrolled from the same seed draws."""
  model = Qwen(MIXED, rngs=nnx.Rngs(1))
  flat = unstack(model)
  assert not flat.stacked and len(flat.layers) == 4
  built = Qwen(MIXED, rngs=nnx.Rngs(1), stacked=False)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(flat), nnx.state(built))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 12)), jnp.int32)
  hidden, cache, routing, want = _decode_and_forward(model, tokens)
  np.testing.assert_allclose(hidden, want, atol=1e-5)
  assert routing.shape == (2, 12, 3, 2)  # MoE layers 0, 1, 3
  assert len(cache.k) == 4 and cache.k[0].shape == (2, 2, 16, 16)
  assert cache.length == 16
  hidden_u, cache_u, routing_u, want_u = _decode_and_forward(flat, tokens)
  np.testing.assert_array_equal(routing_u, routing)
  np.testing.assert_allclose(hidden_u, hidden, atol=1e-6)
  np.testing.assert_allclose(want_u, want, atol=1e-5)
  # The same operations in two fusions (per-layer arrays against slices of the stacks): float32
  # reassociation, 3.5e-6 relative on 2 of 1,024 entries on an AMD EPYC host (AVX2).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), cache_u, cache)


def test_scanned_loss_and_gradient_equal_the_unrolled_ones():
  """The training step's loss and gradient through the scanned stack equal those of the same
  weights run layer by layer (the unrolled layout, how every layer ran before the scan), to
  float32 rounding: the gradient of each stacked parameter, unstacked, is the unrolled
  parameter's gradient (full remat; the policies agree with each other above)."""
  model = Qwen(MIXED, rngs=nnx.Rngs(4), remat="full")
  flat = unstack(model)
  rng = np.random.default_rng(2)
  tokens = jnp.asarray(rng.integers(0, 512, (2, 16)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(6, 16, dtype=jnp.int32), (2, 10))
  graphdef, params = nnx.split(model)
  loss, grads = _loss_and_grad(graphdef)(params, tokens, pos)
  graphdef_u, params_u = nnx.split(flat)
  loss_u, grads_u = _loss_and_grad(graphdef_u)(params_u, tokens, pos)
  np.testing.assert_allclose(loss, loss_u, rtol=1e-6)
  grads = unstack_state(grads, MIXED, nnx.state(flat))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads, grads_u)


def test_stacked_model_saves_and_loads_per_layer_hugging_face_names(tmp_path):
  model = Qwen(MIXED, rngs=nnx.Rngs(2))
  folder = save_pretrained(model, tmp_path / "hf")
  names = set(safetensors.numpy.load_file(folder / "model.safetensors"))
  assert "model.layers.3.self_attn.q_proj.weight" in names
  assert "model.layers.2.mlp.up_proj.weight" in names  # dense (mlp_only_layers)
  assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
  assert not any("blocks" in n for n in names)
  again = from_pretrained(folder, remat="none")
  assert again.remat == "none"
  for (p, a), (q, b) in zip(
    nnx.to_flat_state(nnx.state(model, nnx.Param)),
    nnx.to_flat_state(nnx.state(again, nnx.Param)),
    strict=True,
  ):
    assert p == q
    np.testing.assert_array_equal(a.get_value(), b.get_value())
  np.testing.assert_array_equal(model.layer(1).mlp.gate[...], model.blocks[0].mlp.gate[...][1])


def test_full_remat_keeps_one_hidden_state_per_layer():
  """Per added layer, the compiled step's temporary memory (`memory_analysis()`) grows by about
  one [B, T, D] layer input under full remat, and by much more without remat."""
  batch, seq, d = 1, 256, 128
  cfg = dataclasses.replace(TINY, hidden_size=d, intermediate_size=384, head_dim=32)

  def temp(layers, remat):
    fn, *args = _abstract_step(
      dataclasses.replace(cfg, num_hidden_layers=layers), remat, batch, seq
    )
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes

  carry = batch * seq * d * 4
  full = (temp(6, "full") - temp(3, "full")) / 3
  none = (temp(6, "none") - temp(3, "none")) / 3
  assert full <= 1.25 * carry, (full, carry)
  assert none >= 4 * carry, (none, carry)


def test_last_layer_at_many_positions_runs_in_query_blocks():
  """P = 512 scored positions take the blocked, rematerialised attention path and give the hidden
  states of the full forward there."""
  model = Qwen(TINY, rngs=nnx.Rngs(3))
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, 512, (1, 600)), jnp.int32)
  index = jnp.asarray(np.sort(rng.choice(600, 512, replace=False))[None], jnp.int32)
  forward = nnx.jit(lambda m, t, i: (m.hidden_states(t), m.hidden_states(t, output_index_bp=i)))
  full, picked = forward(model, tokens, index)
  want = jnp.take_along_axis(full, index[..., None], axis=1)
  np.testing.assert_allclose(picked, want, atol=1e-5)


def test_scanned_decode_equals_the_unrolled_decode():
  """Decode under a scan per block of stacked layers (`KVCache(stacked=True)`, the engine's
  `scan_layers`) gives the hidden states, routing and cache entries of the unrolled model's
  layer-by-layer decode, on a stack of dense and sparse blocks: a 12-token prefill chunk, then
  single-token steps at different positions per row."""
  model = Qwen(MIXED, rngs=nnx.Rngs(1))
  flat = unstack(model)
  rng = np.random.default_rng(0)
  b, s = 2, 32
  stacked_cache = KVCache.zeros(MIXED, b, s, stacked=True)
  assert stacked_cache.stacked and [k.shape[0] for k in stacked_cache.k] == [2, 1, 1]
  flat_cache = KVCache.zeros(MIXED, b, s)
  step = nnx.jit(lambda m, ids, pos, c, w: m.decode_routed(ids, pos, c, w, 16))
  write = jnp.array([0, 3], jnp.int32)
  for t in (12, 1, 1):
    ids = jnp.asarray(rng.integers(0, 512, (b, t)), jnp.int32)
    pos = write[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    h_scan, stacked_cache, r_scan = step(model, ids, pos, stacked_cache, write)
    h_flat, flat_cache, r_flat = step(flat, ids, pos, flat_cache, write)
    np.testing.assert_allclose(h_scan, h_flat, atol=1e-5)
    np.testing.assert_array_equal(r_scan, r_flat)
    write = write + t
  per_layer = [
    (k[j], v[j]) for k, v in zip(stacked_cache.k, stacked_cache.v) for j in range(k.shape[0])
  ]
  for (k, v), k_flat, v_flat in zip(per_layer, flat_cache.k, flat_cache.v):
    np.testing.assert_allclose(k, k_flat, atol=1e-5)
    np.testing.assert_allclose(v, v_flat, atol=1e-5)
  with pytest.raises(ValueError, match="needs a stacked model"):
    flat.decode_routed(ids, pos, stacked_cache, write)


def test_scanned_engine_on_a_mesh_decodes_the_unrolled_engine_tokens():
  run_child(__file__, "scanned_engine")


def _scanned_engine_child() -> None:
  """On 8 host devices (data 2 x fsdp 2 x tensor 2): an engine decoding the stacked layers under
  a scan, fed by a trainer's stacked inference weights, samples the tokens of the unrolled
  engine (log-probs to float32 noise; greedy decoding is the same step with another sampler),
  and its stacked cache is sharded as the unrolled one (slots over data x fsdp, KV heads over
  tensor, "layers" unsharded)."""
  from coevolve_jax import grpo  # noqa: PLC0415
  from coevolve_jax.models import sharding  # noqa: PLC0415
  from coevolve_jax.rollout.engine import Engine  # noqa: PLC0415
  from coevolve_jax.rollout.sampling import SamplingParams  # noqa: PLC0415
  from coevolve_jax.trainer import PolicyTrainer, inference_rules, make_optimizer  # noqa: PLC0415

  assert jax.device_count() == 8
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  cfg = dataclasses.replace(TINY, num_hidden_layers=3)
  out = {}
  for scan in (False, True):
    trainer = PolicyTrainer(
      Qwen(cfg, rngs=nnx.Rngs(0)),
      make_optimizer(1e-3, 0.0, 1.0),
      grpo.GRPOConfig(),
      1.0,
      mesh=mesh,
      inference_stacked=scan,
    )
    infer = trainer.inference_params()
    assert any(path[0] == "blocks" for path, _ in nnx.to_flat_state(infer)) == scan
    for path, var in nnx.to_flat_state(infer):
      x, axes = var.get_value(), var.get_metadata()["out_sharding"]
      want = sharding.param_sharding(mesh, axes, x.shape, inference_rules())
      assert x.sharding.is_equivalent_to(want, x.ndim), (path, x.sharding, want)
    engine = Engine(
      trainer.model(), 8, 64, mesh=mesh, weights=trainer.inference_params, scan_layers=scan
    )
    P = jax.sharding.PartitionSpec  # noqa: N806
    lead = (None,) if scan else ()
    for k, v in zip(engine.state.cache.k, engine.state.cache.v):
      for x in (k, v):
        want = jax.sharding.NamedSharding(mesh, P(*lead, ("data", "fsdp"), "tensor", None, None))
        assert x.sharding.is_equivalent_to(want, x.ndim), (scan, x.sharding)
        (shard,) = [s for s in x.addressable_shards if s.device == jax.devices()[0]]
        assert shard.data.nbytes == x.nbytes // 8
    tokens = []
    for temperature in (1.0,):  # sampled: equal tokens need equal logits to float32 noise
      sampling = SamplingParams(temperature=temperature)
      for slot in range(8):
        engine.reset_slot(slot)
      keys = list(jax.random.split(jax.random.key(1), 3))
      prompts = [(0, [1, 2, 3, 4, 5], keys[0]), (3, list(range(7, 30)), keys[1]), (6, [9], keys[2])]
      first = engine.prefill_many(prompts, sampling)
      active = np.zeros(8, bool)
      active[[0, 3, 6]] = True
      steps = [
        engine.generate(active, jax.random.split(jax.random.key(i), 8), sampling) for i in range(6)
      ]
      tokens.append(([t for t, _ in first], [t[[0, 3, 6]].tolist() for t, _ in steps]))
      tokens.append(np.asarray([lp[[0, 3, 6]] for _, lp in steps]))
    out[scan] = tokens
  for a, b in zip(out[False], out[True]):
    if isinstance(a, np.ndarray):
      np.testing.assert_allclose(a, b, atol=1e-5)
    else:
      assert a == b
  print("scanned_engine OK")


if __name__ == "__main__":
  import sys

  if sys.argv[1:2] == ["scanned_engine"]:
    _scanned_engine_child()
  else:
    raise SystemExit(f"unknown mode {sys.argv[1:]}")
