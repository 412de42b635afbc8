"""One process on a mesh of 8 host devices: what the main job allocates is sharded as the
logical-axis table says, through set-up, rollout, a GRPO step and a restore onto another mesh.

The job's objects are built as `loop.CoEvolveRun._setup` builds them (`models.build` on the
mesh, `PolicyTrainer(mesh=..., compute_dtype=...)`, `Engine(mesh=..., weights=trainer.
inference_params)`, `RunCheckpointer`), on a small model so that the check stays fast; the whole
job on two meshes and on one device is `test_mesh_run.py` (slow). Also: the engine's and the
trainer's `compile_ahead` on the mesh leave nothing to compile.
"""

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from host_devices import run_child

import kit


def test_every_leaf_is_sharded_by_the_table_after_setup_step_and_restore(tmp_path):
  run_child(__file__, "layout", str(tmp_path))


def _nbytes_per_device(x: jax.Array) -> int:
  """Bytes of `x` that device 0 holds."""
  (shard,) = [s for s in x.addressable_shards if s.device == jax.devices()[0]]
  return shard.data.nbytes


def _tiny_config():
  return kit.tiny_config(tie_word_embeddings=True)


def _layout_child(tmp: str) -> None:
  from coevolve_jax import grpo
  from coevolve_jax.checkpoint import RunCheckpointer
  from coevolve_jax.models import builder, sharding
  from coevolve_jax.rollout.engine import Engine
  from coevolve_jax.rollout.sampling import SamplingParams
  from coevolve_jax.trainer import PolicyTrainer, inference_rules, make_optimizer
  from coevolve_jax.types import Trajectory

  assert jax.device_count() == 8, jax.devices()
  P = jax.sharding.PartitionSpec  # noqa: N806
  cfg = _tiny_config()

  def build(mesh):
    # As the loop does: float32 master weights initialised onto the mesh, bfloat16 compute.
    model = builder.init(cfg, seed=0, dtype=jnp.float32, mesh=mesh)
    trainer = PolicyTrainer(
      model,
      make_optimizer(1e-3, 0.01, 1.0),
      grpo.GRPOConfig(kl_beta=0.05),
      1.0,
      mesh=mesh,
      compute_dtype=jnp.bfloat16,
    )
    engine = Engine(
      model,
      num_slots=8,
      cache_len=64,
      dtype=jnp.bfloat16,
      mesh=mesh,
      weights=trainer.inference_params,
    )
    return trainer, engine

  def check_params(tree, mesh, rules, dtype, what):
    """Every Param leaf carries the table's sharding, in `dtype`; count what device 0 holds."""
    flat = nnx.to_flat_state(tree)
    assert flat, what
    held = total = 0
    for path, var in flat:
      x = var.get_value()
      axes = var.get_metadata()["out_sharding"]
      want = sharding.param_sharding(mesh, axes, x.shape, rules)
      assert x.sharding.is_equivalent_to(want, x.ndim), (what, path, x.sharding, want)
      assert x.dtype == dtype, (what, path, x.dtype)
      held += _nbytes_per_device(x)
      total += x.nbytes
    return held, total

  def check_opt_state(opt_state, params, mesh, what):
    """AdamW's moments shard like their parameters (float32); counters are replicated."""
    want = sharding.tree_shardings(params, mesh)
    moments = 0
    for state in jax.tree.leaves(opt_state, is_leaf=lambda s: hasattr(s, "mu")):
      if hasattr(state, "mu"):
        for m in (state.mu, state.nu):
          for x, w in zip(jax.tree.leaves(m), jax.tree.leaves(want)):
            assert x.sharding.is_equivalent_to(w, x.ndim), (what, x.sharding, w)
            assert x.dtype == jnp.float32
            moments += 1
    assert moments == 2 * len(jax.tree.leaves(params)), what
    for x in jax.tree.leaves(opt_state):
      if x.ndim == 0:
        assert x.sharding.is_fully_replicated, (what, x.sharding)

  def check_cache(engine, mesh, what):
    batch_axes = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1)
    heads = "tensor" if mesh.shape["tensor"] > 1 else None
    batch = batch_axes[0] if len(batch_axes) == 1 else (batch_axes or None)
    for k, v in zip(engine.state.cache.k, engine.state.cache.v):
      assert k.sharding.is_equivalent_to(
        jax.sharding.NamedSharding(mesh, P(batch, heads, None, None)), 4
      ), (what, k.sharding)
      assert v.sharding.is_equivalent_to(
        jax.sharding.NamedSharding(mesh, P(batch, heads, None, None)), 4
      ), (what, v.sharding)
      # Device 0 holds its slots' share of its KV heads, never the whole cache.
      rows = math.prod(mesh.shape[a] for a in ("data", "fsdp"))
      tp = mesh.shape["tensor"]
      assert _nbytes_per_device(k) == k.nbytes // (rows * tp), (what, k.shape)
    assert engine.state.cache.k[0].dtype == jnp.bfloat16

  def check_all(trainer, engine, mesh, what, reference=True):
    held, total = check_params(trainer.params, mesh, sharding.LOGICAL_RULES, jnp.float32, what)
    # fsdp=8: every parameter but the norms (64 floats each) is split 8 ways on device 0.
    norms = 4 * 64 * (2 * cfg.num_hidden_layers + 1) + 4 * 16 * 2 * cfg.num_hidden_layers
    if mesh.shape["fsdp"] == 8:
      assert held == (total - norms) // 8 + norms, (what, held, total)
    check_opt_state(trainer.opt_state, trainer.params, mesh, what)
    if reference:
      check_params(trainer.ref_params, mesh, sharding.LOGICAL_RULES, jnp.bfloat16, what)
    infer, _ = check_params(
      trainer.inference_params(), mesh, inference_rules(), jnp.bfloat16, what + " weights"
    )
    check_cache(engine, mesh, what)
    return held, infer

  mesh_a = sharding.make_mesh({"fsdp": 8})
  mesh_b = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})

  # Set-up.
  trainer, engine = build(mesh_a)
  trainer.freeze_reference()
  check_all(trainer, engine, mesh_a, "set-up")
  emb = trainer.params["embed_tokens"].get_value()
  assert emb.sharding.spec == P(None, "fsdp"), emb.sharding  # vocab x embed: embed over fsdp
  infer_emb = trainer.inference_params()["embed_tokens"].get_value()
  assert infer_emb.sharding.is_fully_replicated  # gathered over fsdp for decoding

  # Rollout: prefill two conversations and decode; the cache keeps its sharding.
  sampling = SamplingParams(temperature=1.0)
  keys = list(jax.random.split(jax.random.key(0), 2))
  engine.prefill_many([(0, [1, 2, 3, 4, 5], keys[0]), (5, [7, 8, 9], keys[1])], sampling)
  active = np.zeros(8, bool)
  active[[0, 5]] = True
  for i in range(4):
    engine.generate(active, jax.random.split(jax.random.key(i), 8), sampling)
  check_cache(engine, mesh_a, "after decode")

  # A GRPO step on 8 trajectories (mini-batch rows split over the 8 devices).
  rng = np.random.default_rng(0)
  trajs = []
  for i in range(8):
    ids = [int(x) for x in rng.integers(1, 512, 24)]
    trajs.append(
      Trajectory(
        task_id=f"t{i}",
        group_id=i // 4,
        token_ids=ids,
        loss_mask=[0] * 8 + [1] * 16,
        logprobs=[-6.0] * 24,
        reward=float(i % 2),
      )
    )
  version = trainer.inference_params()
  metrics = trainer.grpo_epoch(trajs, np.where(np.arange(8) % 2, 1.0, -1.0), 1)
  assert np.isfinite(metrics["train/loss"])
  assert trainer.inference_params() is not version  # a new version after the update
  check_all(trainer, engine, mesh_a, "after a GRPO step")
  # The engine decodes the new weights with no re-pointing.
  engine.generate(active, jax.random.split(jax.random.key(9), 8), sampling)
  check_cache(engine, mesh_a, "after decode with the new weights")

  # Checkpoint on mesh A, restore onto mesh B: values kept, shardings B's.
  ckpt = RunCheckpointer(f"{tmp}/checkpoints", keep=2)
  ckpt.save(1, trainer.state, {"step": 1})
  ckpt.wait()
  saved = jax.tree.map(np.asarray, trainer.state)
  trainer_b, engine_b = build(mesh_b)
  trainer_b.freeze_reference()
  state, meta = ckpt.restore(1, like=trainer_b.state)
  ckpt.close()
  trainer_b.state = state
  assert meta == {"step": 1}
  check_all(trainer_b, engine_b, mesh_b, "after restore on another mesh")
  restored = jax.tree.map(np.asarray, trainer_b.state)
  for x, y in zip(jax.tree.leaves(saved), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(x, y)
  emb_b = trainer_b.params["embed_tokens"].get_value()
  assert emb_b.sharding.spec == P("tensor", "fsdp"), emb_b.sharding
  _planner_agrees(cfg, [(mesh_a, trainer, engine), (mesh_b, trainer_b, engine_b)])
  print("layout OK")


def _planner_agrees(cfg, jobs) -> None:
  """The memory planner's per-device figures equal the bytes device 0 holds of the arrays the
  job allocates (parameters, optimizer, reference, rollout weights, KV cache) for each
  `(mesh, trainer, engine)` of `jobs` (built as the loop builds them, from `cfg`), and, for every
  preset, its parameter figures equal the job's shardings' shard shapes (abstract)."""
  from coevolve_jax import memory_plan as plan_device_memory
  from coevolve_jax.models import PRESETS, sharding
  from coevolve_jax.models.qwen import Qwen, QwenConfig
  from coevolve_jax.trainer import inference_rules

  def held(tree) -> int:
    return sum(_nbytes_per_device(x) for x in jax.tree.leaves(tree))

  abstract = {  # shapes only, once for every mesh
    preset: nnx.state(
      nnx.eval_shape(lambda p=preset: Qwen(QwenConfig.preset(p), rngs=nnx.Rngs(0))), nnx.Param
    )
    for preset in PRESETS
  }
  for mesh, trainer, engine in jobs:
    sizes = dict(mesh.shape)
    # The engines' construction arguments (`build` above): 8 slots of 64 tokens.
    plan = plan_device_memory.plan(
      cfg, sizes, batch=8, seq_len=64, num_slots=8, cache_len=64, dtype="bfloat16"
    )
    got = {
      "params": held(trainer.params),
      "optimizer": held(trainer.opt_state),
      "reference": held(trainer.ref_params),
      "rollout_weights": held(trainer.inference_params()),
      "kv_cache": held(engine.state.cache),
    }
    want = {k: getattr(plan, k) for k in got}
    assert got == want, (sizes, got, want)

    for preset, state in abstract.items():  # the job's shardings against the planner's sums
      for rules, dtype, figure in (
        (
          sharding.LOGICAL_RULES,
          "float32",
          plan_device_memory.parameter_bytes(preset, sizes, "float32")[1],
        ),
        (
          inference_rules(),
          "bfloat16",
          plan_device_memory.rollout_weights_bytes(preset, sizes, "bfloat16", "float32"),
        ),
      ):
        shardings = sharding.tree_shardings(state, mesh, rules)
        job = sum(
          math.prod(sh.shard_shape(x.shape)) * jnp.dtype(dtype).itemsize
          for x, sh in zip(jax.tree.leaves(state), jax.tree.leaves(shardings))
        )
        assert job == figure, (preset, sizes, job, figure)


@pytest.mark.slow  # about 45 s of one worker; make test keeps the single-device checks
def test_compile_ahead_on_a_mesh_leaves_nothing_to_compile():
  """`compile_ahead` with sharded parameters, a sharded KV cache and sharded batch rows (data 2
  x fsdp 4, bfloat16 compute, scanned layers): the calls compile none of the engine's or the
  train step's programs (single-device checks: tests/test_engine.py, tests/test_trainer.py)."""
  run_child(__file__, "compile_ahead", timeout=600)


def _compile_ahead_child() -> None:
  from coevolve_jax import grpo
  from coevolve_jax.metrics import CompileCounter
  from coevolve_jax.models import builder, sharding
  from coevolve_jax.rollout import generate
  from coevolve_jax.rollout.engine import Engine
  from coevolve_jax.rollout.sampling import SamplingParams
  from coevolve_jax.trainer import PolicyTrainer, make_optimizer
  from coevolve_jax.types import Trajectory

  assert jax.device_count() == 8, jax.devices()
  cfg = _tiny_config()
  mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
  model = builder.init(cfg, seed=0, dtype=jnp.float32, mesh=mesh)
  sampling = SamplingParams(temperature=0.8)
  trainer = PolicyTrainer(
    model,
    make_optimizer(1e-3, 0.01, 1.0),
    grpo.GRPOConfig(kl_beta=0.05),
    sampling,
    mesh=mesh,
    compute_dtype=jnp.bfloat16,
    inference_stacked=True,
    len_buckets=(64, 128),
    target_buckets=(32,),
  )
  trainer.freeze_reference()
  engine = Engine(
    model,
    num_slots=8,
    cache_len=128,
    dtype=jnp.bfloat16,
    max_prefill_tokens=256,
    mesh=mesh,
    weights=trainer.inference_params,
    scan_layers=True,
    prefill_rows="full",
    prefill_min_chunk=32,
    prefill_min_kv=64,
  )
  programs = ("_prefill_rows", "_generate_steps", "_grpo_step_fn", "_logp_fn")
  counter = CompileCounter()
  engine.compile_ahead([sampling], stop_ids=[3], decode_steps=(4,), threads=2)
  assert trainer.compile_ahead(rollouts=8, mini_batches=2) == 2  # rows 4; (64, 32), (128, 32)
  ahead = counter.pop()
  assert all(ahead.get(f"compile/program/{p}") for p in programs), ahead
  # Issue 39 item 4: each compiled program's memory per device, and the start-up check's peaks.
  from coevolve_jax import memory_plan

  names = sorted(p.name for p in engine.program_memory + trainer.program_memory)
  assert [n for n in names if not n.startswith("prefill ")] == [
    "decode slots=8 kv=128 steps=4",
    "grpo update rows=4 T=128 P=32",
    "grpo update rows=4 T=64 P=32",
    "weight sync",  # float32 master -> bfloat16 rollout copy
  ], names
  assert "prefill rows=8 t=64 kv=128" in names
  update = max(trainer.program_memory, key=lambda p: p.arguments)
  sync = next(p for p in trainer.program_memory if p.name == "weight sync")
  copy_tree = trainer.inference_params()
  # The sync's output per device is the rollout copy as that device holds it (bfloat16, fsdp
  # gathered: the inference layout), plus XLA's table of output pointers (8 bytes a leaf).
  held, leaves = memory_plan.device_bytes(copy_tree), len(jax.tree.leaves(copy_tree))
  assert held <= sync.outputs <= held + 8 * leaves and sync.aliased == 0, (sync, held)
  assert sync.arguments == memory_plan.device_bytes(trainer.params)  # the float32 master shard
  state = (trainer.params, trainer.opt_state)
  whole = sum(x.nbytes for x in jax.tree.leaves(state))
  # The update's inputs per device: its shards of parameters and optimizer state (and the
  # rows), not the whole (sharded over 8 devices: data 2 x fsdp 4).
  assert memory_plan.device_bytes(state) <= update.arguments < whole / 2, (update, whole)
  copy = memory_plan.device_bytes(copy_tree)
  resident = memory_plan.device_bytes()
  check = memory_plan.check_programs(
    engine.program_memory, trainer.program_memory, resident, copy, 1 << 40, "test"
  )
  kinds = [p.name.split()[0] for p, _ in check.peaks]
  assert kinds == ["prefill", "decode", "grpo", "weight"]
  assert all(peak == resident + p.added for p, peak in check.peaks[:2])
  assert all(peak == resident - copy + p.added for p, peak in check.peaks[2:]) and not check.over
  rng = np.random.default_rng(0)
  for step in range(2):
    prompts = [[int(x) for x in rng.integers(4, 512, int(rng.integers(5, 60)))] for _ in range(8)]
    done = generate(
      engine,
      prompts,
      sampling,
      max_new_tokens=16,
      stop_ids=[3],
      rng=jax.random.key(step),
      decode_steps=4,
    )
    trajs = []
    for p, c in zip(prompts, done):
      tr = Trajectory(task_id="t", group_id=0)
      tr.extend(p, sampled=False)
      tr.extend(c.token_ids, sampled=True, logprobs=c.logprobs)
      trajs.append(tr)
    info = trainer.grpo_epoch(trajs, rng.normal(size=8).astype(np.float32), 2)
    assert np.isfinite(info["train/loss"])
    left = counter.pop()
    assert not any(left.get(f"compile/program/{p}") for p in programs), (step, left)
  counter.close()
  print("compile_ahead OK")


def test_prefill_reads_and_writes_only_each_devices_own_cache_shard():
  """On data 2 x fsdp 4 a prefill forward's rows are laid out as the cache's slots are, so each
  device reads and writes only its own slots: tokens, log-probs and cache equal the
  single-device engine's (uneven device blocks, empty ones, two chunks, a continuation; both
  cache layouts), the compiled prefill's temporaries per device are a fraction of its cache
  shard, and its HLO has no collective of a cache window (the earlier prefill all-gathered
  every row's window onto every device: 1.02x the per-device cache in temporaries at the
  shape below, against 0.31x now)."""
  run_child(__file__, "prefill_shards", timeout=600)


def _prefill_shards_child() -> None:
  import re

  from coevolve_jax.models import builder, sharding
  from coevolve_jax.rollout import engine as engine_mod
  from coevolve_jax.rollout.sampling import SamplingParams

  assert jax.device_count() == 8, jax.devices()
  cfg = _tiny_config()
  mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
  greedy = SamplingParams(temperature=0.0)
  rng = np.random.default_rng(0)

  def ids(n):
    return [int(x) for x in rng.integers(4, cfg.vocab_size, n)]

  # 16 slots, 2 per device block: requests on blocks 0 (both slots), 3 and 7 (4 rows, block 0
  # the fullest); the other blocks get padding rows, which must write nothing. 40 tokens run as
  # a chunk of 32 and one of 8; then a continuation of two of the slots.
  first = [(0, ids(40)), (1, ids(7)), (6, ids(12)), (15, ids(3))]
  then = [(1, ids(9)), (15, ids(20))]
  for scan in (True, False):
    results = []
    for on in (None, mesh):
      model = builder.init(cfg, seed=0, dtype=jnp.float32, mesh=on)
      engine = engine_mod.Engine(
        model, num_slots=16, cache_len=128, mesh=on, scan_layers=scan, prefill_min_chunk=8
      )
      assert engine.slot_shards == (8 if on is not None else 1)
      key = jax.random.key(1)
      out = [engine.prefill_many([(s, x, key) for s, x in first], greedy)]
      out.append(engine.prefill_many([(s, x, key) for s, x in then], greedy))
      cache = [np.asarray(c) for c in (*engine.state.cache.k, *engine.state.cache.v)]
      results.append((out, cache, np.asarray(engine.state.next_pos)))
    (out_a, cache_a, pos_a), (out_b, cache_b, pos_b) = results
    for call_a, call_b in zip(out_a, out_b):
      assert [t for t, _ in call_a] == [t for t, _ in call_b], (scan, call_a, call_b)
      np.testing.assert_allclose([lp for _, lp in call_a], [lp for _, lp in call_b], atol=1e-5)
    np.testing.assert_array_equal(pos_a, pos_b)
    assert pos_a.tolist() == [40, 16, 0, 0, 0, 0, 12, 0] + [0] * 7 + [23], pos_a
    for a, b in zip(cache_a, cache_b):
      np.testing.assert_allclose(a, b, atol=1e-5)
    untouched = [s for s in range(16) if pos_a[s] == 0]
    slot_axis = 1 if scan else 0
    for b in cache_b:  # padding rows wrote nothing
      assert not np.take(b, untouched, axis=slot_axis).any(), scan

  # Memory and HLO at a rollout-like shape: 64 slots of 8192 entries, 64 rows of 64 tokens into
  # a 512-key window. A float32 cache: XLA:CPU converts a bfloat16 cache to float32 around a
  # scatter (a whole-shard copy TPU and GPU do not make), which would hide what is measured.
  model = builder.init(cfg, seed=0, dtype=jnp.float32, mesh=mesh)
  engine = engine_mod.Engine(
    model, num_slots=64, cache_len=8192, mesh=mesh, scan_layers=True, max_prefill_tokens=4096
  )
  rows, t, kv = 64, 64, 512
  args = engine._prefill_args(
    np.arange(rows, dtype=np.int32),
    np.ones((rows, t), np.int32),
    np.full((rows,), t, np.int32),
    [jax.random.key(0)] * rows,
    greedy,
    kv,
  )
  with engine._ctx():
    compiled = engine_mod._prefill_rows.lower(*args).compile()
  shard = sum(_nbytes_per_device(c) for c in (*engine.state.cache.k, *engine.state.cache.v))
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < shard / 2, (temp, shard)
  hlo = compiled.as_text()
  results = re.findall(
    r"= \S+?\[([\d,]*)\]\S* (?:all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)",
    hlo,
  )
  assert results, "no collective at all: the pattern no longer matches XLA's HLO text"
  k, h = cfg.num_key_value_heads, cfg.head_dim
  for dims in results:
    shape = tuple(int(d) for d in dims.split(",") if d)
    assert shape[-3:] not in ((k, h, kv), (k, kv, h)), f"a cache window crosses devices: {shape}"
  print("prefill_shards OK")


if __name__ == "__main__":
  if sys.argv[1:2] == ["layout"]:
    _layout_child(sys.argv[2])
  elif sys.argv[1:2] == ["compile_ahead"]:
    _compile_ahead_child()
  elif sys.argv[1:2] == ["prefill_shards"]:
    _prefill_shards_child()
  else:
    raise SystemExit(f"unknown mode {sys.argv[1:]}")
