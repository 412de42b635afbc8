"""Memory planning from shapes: parameter counts, per-device shards, optimizer, KV cache, CLI."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from coevolve_jax import memory_plan
from coevolve_jax.models.qwen import Qwen, QwenConfig
from coevolve_jax.trainer import token_logprobs
from host_devices import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
  "preset,published",
  [
    ("qwen3_0_6b", 0.596e9),  # Qwen3-0.6B model card: 0.6B (0.44B non-embedding)
    ("qwen3_4b", 4.02e9),  # Qwen3-4B model card: 4.0B
    ("qwen2_5_7b", 7.61e9),  # Qwen2.5-7B model card: 7.61B
  ],
)
def test_parameter_count_matches_published(preset, published):
  count, nbytes = memory_plan.parameter_bytes(preset, {})
  assert abs(count - published) / published < 0.005
  assert nbytes == count * 2  # bfloat16, one device


def test_optimizer_is_two_moments_and_a_count():
  p = memory_plan.plan(
    "tiny_cpu", {}, batch=1, seq_len=8, num_slots=1, cache_len=8, dtype="float32"
  )
  assert p.optimizer == 2 * p.params + 4  # AdamW mu and nu in the parameter dtype + int32 count
  sharded = memory_plan.plan(
    "tiny_cpu", {"fsdp": 4}, batch=1, seq_len=8, num_slots=1, cache_len=8, dtype="float32"
  )
  assert sharded.optimizer == 2 * sharded.params + 4


def test_kv_cache_matches_hand_formula():
  cfg = QwenConfig.preset("qwen3_0_6b")
  got = memory_plan.kv_cache_bytes(
    "qwen3_0_6b", {"fsdp": 4, "tensor": 2}, num_slots=64, cache_len=32768
  )
  # k and v, per layer: slots over data*fsdp, kv heads over tensor, bf16.
  want = (
    2
    * cfg.num_hidden_layers
    * (64 // 4)
    * 32768
    * (cfg.num_key_value_heads // 2)
    * cfg.head_dim
    * 2
  )
  assert got == want


def test_non_dividing_mesh_axes_leave_the_dimension_replicated_as_the_job_does():
  # 10 rows do not split over 4 devices: the job keeps them whole (sharding.param_spec).
  assert memory_plan.shard_bytes((10, 3), jnp.float32, ("embed", None), {"fsdp": 4}) == 10 * 3 * 4
  assert memory_plan.shard_bytes((12, 3), jnp.float32, ("embed", None), {"fsdp": 4}) == 36
  with pytest.raises(KeyError, match="no sharding rule"):
    memory_plan.shard_bytes((4,), jnp.float32, ("nonexistent",), {})
  with pytest.raises(ValueError, match="logical axes"):
    memory_plan.shard_bytes((4, 4), jnp.float32, ("embed",), {})


def test_activations_scale_with_sequences_per_device():
  kw = dict(seq_len=256, num_slots=1, cache_len=8, dtype="float32")
  one = memory_plan.plan("tiny_cpu", {}, batch=4, **kw)
  split = memory_plan.plan("tiny_cpu", {"data": 2, "fsdp": 2}, batch=4, **kw)
  assert one.activations == 4 * split.activations
  micro = memory_plan.plan("tiny_cpu", {}, batch=4, micro_batches=4, **kw)
  assert micro.activations == split.activations
  # Without remat some kept activations (MLP, heads, vocabulary) are tensor-sharded; full remat
  # keeps only each layer's [B, T, D] input, which is not.
  kept = memory_plan.plan("tiny_cpu", {}, batch=4, remat="none", **kw)
  tensor = memory_plan.plan("tiny_cpu", {"tensor": 2}, batch=4, remat="none", **kw)
  assert kept.activations / 2 < tensor.activations < kept.activations
  assert one.activations < kept.activations


def test_activations_are_a_lower_bound_of_compiled_temporaries():
  """The saved residuals exclude parameters and transients, so XLA's own temporaries for the
  same gradient computation (CPU compile) must be at least as large."""
  cfg = QwenConfig.preset("tiny_cpu")
  graphdef, state = nnx.split(Qwen(cfg, rngs=nnx.Rngs(0)))

  def loss(s, tok, pos):
    return jnp.sum(token_logprobs(nnx.merge(graphdef, s), tok, pos))

  b, t = 2, 128
  compiled = (
    jax.jit(jax.grad(loss))
    .lower(state, jnp.zeros((b, t), jnp.int32), jnp.ones((b, t // 2), jnp.int32))
    .compile()
  )
  temp = compiled.memory_analysis().temp_size_in_bytes
  p = memory_plan.plan(
    "tiny_cpu", {}, batch=b, seq_len=t, num_slots=1, cache_len=8, dtype="float32"
  )
  assert 0 < p.activations <= temp
  # The compiled figure is that step's own temporaries less those of a 16-token step: more than
  # the residuals (it holds the recomputed layer and the logit chunks too), less than all.
  c = memory_plan.plan(
    "tiny_cpu",
    {},
    batch=b,
    seq_len=t,
    num_slots=1,
    cache_len=8,
    dtype="float32",
    activations="compiled",
  )
  assert c.activation_source == "compiled" and p.activation_source == "residuals"
  assert p.activations < c.activations < temp
  assert c.static == p.static
  with pytest.raises(ValueError, match="activations must be one of"):
    memory_plan.plan("tiny_cpu", {}, batch=1, seq_len=8, num_slots=1, cache_len=8, activations="x")


def test_parse_mesh():
  assert memory_plan.parse_mesh("fsdp=8,tensor=2") == {
    "data": 1,
    "fsdp": 8,
    "tensor": 2,
    "expert": 1,
  }
  for bad in ("fsdp", "model=2", "fsdp=x", "fsdp=0"):
    with pytest.raises(ValueError, match="bad mesh"):
      memory_plan.parse_mesh(bad)


def test_unknown_preset():
  with pytest.raises(ValueError, match="unknown model preset"):
    memory_plan.plan("qwen9_1t", {}, batch=1, seq_len=8, num_slots=1, cache_len=8)


def test_per_device_params_equal_real_shards_on_8_cpu_devices():
  """The planner's parameter bytes per device equal what JAX actually puts on device 0."""
  script = textwrap.dedent("""
      import jax
      from flax import nnx
      from coevolve_jax import memory_plan
      from coevolve_jax.models import sharding
      from coevolve_jax.models.qwen import Qwen, QwenConfig
      mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
      with jax.set_mesh(mesh):
        model = Qwen(QwenConfig.preset("tiny_cpu"), rngs=nnx.Rngs(0))
        state = nnx.state(model, nnx.Param)
        specs = nnx.get_partition_spec(state)
      real = 0
      for var, spec in zip(jax.tree.leaves(state), jax.tree.leaves(specs)):
        arr = jax.device_put(var, jax.sharding.NamedSharding(mesh, sharding.logical_to_spec(spec)))
        dev0 = mesh.devices.flat[0]
        real += sum(s.data.nbytes for s in arr.addressable_shards if s.device == dev0)
      planned = memory_plan.parameter_bytes("tiny_cpu", {"fsdp": 4, "tensor": 2}, "float32")
      print(real, planned[1])
  """)
  out = subprocess.run(
    [sys.executable, "-c", script],
    cwd=ROOT,
    env=child_env(8),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  real, planned = map(int, out.stdout.split()[-2:])
  assert real == planned


def test_cli_sweep_prints_table():
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "coevolve_jax.cli.plan_device_memory",
      "--preset=tiny_cpu",
      "--devices=1,2",
      "--batch=2",
      "--seq_len=128",
      "--num_slots=2",
      "--cache_len=256",
      "--dtype=float32",
      "--chip=v5e",
      # The table and its rows, not the compiled activation figure (its own tests above): the
      # residual estimate spares this test two compiles.
      "--activations=residuals",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  rows = [line for line in out.stdout.splitlines() if line.startswith("| tiny_cpu")]
  assert len(rows) == 2 and rows[0].endswith("yes |")
  bad = subprocess.run(
    [sys.executable, "-m", "coevolve_jax.cli.plan_device_memory", "--mesh=fsdp=0"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert bad.returncode != 0 and "bad mesh size" in bad.stderr


def _cpu_preset_config():
  import importlib.util

  spec = importlib.util.spec_from_file_location(
    "bfcl_config", os.path.join(ROOT, "configs/bfcl.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config("cpu")


def test_device_bytes_counts_each_buffer_once():
  """An array and another array object on its buffer (as orbax keeps the per-device arrays of
  what it saves until the save finishes) are one buffer: counted twice, the job's memory check
  after a checkpoint read 1.8x the real resident bytes on CPU."""
  x, y = jnp.ones((256, 128), jnp.float32), jnp.zeros((64,), jnp.float32)
  alias = x.addressable_data(0)
  assert alias is not x and alias.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
  assert memory_plan.device_bytes([x, y]) == x.nbytes + y.nbytes
  assert memory_plan.device_bytes([x, alias, y]) == memory_plan.device_bytes([x, x, y])
  assert memory_plan.device_bytes([x, alias, y]) == x.nbytes + y.nbytes
  before = memory_plan.device_bytes()
  views = [x.addressable_data(i) for i in range(len(x.devices()))]  # new arrays, no new memory
  assert memory_plan.device_bytes() == before and views


def test_a_warm_start_step_puts_no_more_rows_on_a_device_than_an_update_slice():
  """`warmstart_micro_batches`: the fewest slices whose rows per device do not exceed a GRPO
  update slice's (`_sequences_per_device`), counted by hand; 1 in the CPU preset (its runs are
  unchanged)."""
  cfg = _cpu_preset_config()
  cfg.rollout.tasks_per_step, cfg.rollout.group_size, cfg.train.mini_batches = 32, 8, 4  # 64 rows
  fsdp4 = {"fsdp": 4}
  cfg.warmstart.batch_size = 8  # 2 rows a device; an update with 4 slices: 64 / (4 x 4) = 4
  assert memory_plan.warmstart_micro_batches(cfg, fsdp4, 4) == 1
  cfg.warmstart.batch_size = 32  # 8 rows a device against 4: two slices
  assert memory_plan.warmstart_micro_batches(cfg, fsdp4, 4) == 2
  assert memory_plan.warmstart_micro_batches(cfg, fsdp4, 16) == 8  # against 1 row: 8 slices
  cfg.warmstart.batch_size = 33  # rounded up: ceil(33 / (4 x 4)) = 3 rows, ceil(33 / 20) = 2
  assert memory_plan.warmstart_micro_batches(cfg, fsdp4, 8) == 5  # against 64 / 32 = 2 rows
  # data 2 (tensor does not split rows): 17 rows, then 9, then 6, against 64 / 8 = 8.
  assert memory_plan.warmstart_micro_batches(cfg, {"data": 2, "tensor": 4}, 4) == 3
  assert memory_plan.warmstart_micro_batches(_cpu_preset_config(), {"fsdp": 1}, 1) == 1


def test_a_run_that_cannot_fit_stops_with_the_planners_table():
  """`fit_run` against a device size: static memory over it is a MemoryError with the table;
  with `train.micro_batches = 0` (auto) the fewest slices whose worst-case mini-batch fits are
  chosen, confirmed by the compiled step's figure; a fixed count that does not fit is a
  MemoryError that says what to change; nothing known (CPU), no check."""
  cfg = _cpu_preset_config()
  mesh = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}
  cfg.train.micro_batches = 0
  cfg.engine.cache_len = 512  # the worst-case sequence: shorter compiles, the same logic
  rows = cfg.rollout.tasks_per_step * cfg.rollout.group_size // cfg.train.mini_batches
  choices = memory_plan.micro_batch_choices(cfg, mesh)
  assert choices == [k for k in range(1, rows + 1) if rows % k == 0]
  assert memory_plan.micro_batch_choices(cfg, {"fsdp": rows}) == [1]
  one = memory_plan.plan_for_run(cfg, mesh, 1, activations="compiled")
  two = memory_plan.plan_for_run(cfg, mesh, 2, activations="compiled")
  assert one.seq_len == cfg.engine.cache_len and one.param_dtype == "float32"
  assert one.batch == rows and two.activations < one.activations and two.static == one.static
  assert memory_plan.fit_run(cfg, mesh, None) == (1, None)
  k, plan = memory_plan.fit_run(cfg, mesh, one.total)
  assert k == 1 and plan.activation_source == "compiled" and plan.total == one.total
  # Room for two slices' activations but not one's: auto picks 2.
  k, plan = memory_plan.fit_run(cfg, mesh, two.total)
  assert k == 2 and plan.micro_batches == 2
  # Without the compiled confirmation (the job on CPU) the residual estimate decides.
  residual_one = memory_plan.plan_for_run(cfg, mesh, 1)
  k, plan = memory_plan.fit_run(cfg, mesh, residual_one.total, confirm_compiled=False)
  assert k == 1 and plan.activation_source == "residuals" and plan.total == residual_one.total
  # The same device with the count fixed at 1: stop, and say how.
  cfg.train.micro_batches = 1
  with pytest.raises(MemoryError, match="train.micro_batches = 0") as e:
    memory_plan.fit_run(cfg, mesh, two.total)
  assert "| tiny_cpu | 1,1,1,1 |" in str(e.value)
  with pytest.raises(MemoryError, match="before any activation") as e:
    memory_plan.fit_run(cfg, mesh, one.static - 1)
  assert "| tiny_cpu | 1,1,1,1 |" in str(e.value) and "mesh.fsdp" in str(e.value)


def test_a_checkpoint_run_is_planned_from_its_config_json(tmp_path):
  """With `model.checkpoint`, the plan is the checkpoint's model (its config.json, no tensor
  read): a saved tiny_cpu plans exactly as the preset; a folder without config.json is an
  error naming it."""
  from coevolve_jax.models import save_pretrained
  from coevolve_jax.models.builder import init

  save_pretrained(init(QwenConfig.preset("tiny_cpu"), seed=0), str(tmp_path / "ckpt"))
  cfg = _cpu_preset_config()
  mesh = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}
  want = memory_plan.plan_for_run(cfg, mesh)
  cfg.model.checkpoint = str(tmp_path / "ckpt")
  cfg.model.preset = "qwen3_4b"  # not read with a checkpoint
  got = memory_plan.plan_for_run(cfg, mesh)
  assert got.preset == "qwen3-2x128" and want.preset == "tiny_cpu"
  assert dataclasses.replace(got, preset="tiny_cpu") == want
  cfg.model.checkpoint = str(tmp_path / "missing")
  with pytest.raises(FileNotFoundError, match="config.json not found"):
    memory_plan.plan_for_run(cfg, mesh)


def test_check_programs_adds_each_programs_allocation_to_what_is_resident():
  """Issue 39 item 4: the start-up check from compiled programs: the largest prefill, decode and
  update (by what each allocates beyond its inputs: temporaries + outputs not written in place),
  each on top of the resident bytes, the update without the rollout copy it releases first."""
  from coevolve_jax.compiling import ProgramMemory  # noqa: PLC0415

  gib = memory_plan.GIB
  engine = [
    ProgramMemory("prefill rows=8 t=64 kv=512", 3 * gib, 9 * gib, 9 * gib, 9 * gib),
    ProgramMemory("prefill rows=4 t=128 kv=512", 2 * gib, 9 * gib, 9 * gib, 9 * gib),
    ProgramMemory("decode slots=8 kv=512 steps=4", gib // 2, 9 * gib, 10 * gib, 9 * gib),
  ]
  update = [ProgramMemory("grpo update rows=4 T=512 P=64", 6 * gib, 12 * gib, 8 * gib, 7 * gib)]
  check = memory_plan.check_programs(engine, update, 20 * gib, 4 * gib, 24 * gib, "device")
  peaks = {p.name: b / gib for p, b in check.peaks}
  assert peaks == {
    "prefill rows=8 t=64 kv=512": 23.0,  # 20 + 3 (outputs all aliased)
    "decode slots=8 kv=512 steps=4": 21.5,  # 20 + 0.5 + 1 new output
    "grpo update rows=4 T=512 P=64": 23.0,  # 20 - 4 + 6 + 1
  }
  assert check.over == []
  tight = memory_plan.check_programs(engine, update, 20 * gib, 4 * gib, 22 * gib, "device")
  assert [p.name for p, _ in tight.over] == [
    "prefill rows=8 t=64 kv=512",
    "grpo update rows=4 T=512 P=64",
  ]
  text = "\n".join(tight.lines())
  assert "resident 20.00 GiB (of which rollout weight copy 4.00 GiB)" in text
  assert "prefill rows=8 t=64 kv=512: +3.00 GiB -> 23.00 GiB" in text
  assert text.endswith("limit 22.0 GiB (device)")
