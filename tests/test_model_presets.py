"""Named presets against published parameter counts, logical annotations on every parameter, and
`models.build` (a run's model from its config group).

The preset checks use `nnx.eval_shape`: nothing is allocated, so the 30B preset costs nothing;
`build` is tested on a tiny config put in place of the preset.
"""

import functools
import os
import sys
from decimal import Decimal

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from coevolve_jax import models
from coevolve_jax.models import PRESETS, Qwen, QwenConfig, save_pretrained
from coevolve_jax.models.qwen import count_params
from coevolve_jax.models.sharding import LOGICAL_RULES, make_mesh
from host_devices import run_child

import kit

# Published counts, as printed in each model card ("Number of Parameters" and "... (Non-Embedding)";
# non-embedding excludes the input embedding and an untied output head). Llama 3.2's card gives
# only the total ("Params" 1.23B and 3.21B), SmolLM2's its name (135M): None, nothing to check.
PUBLISHED = {
  "qwen3_0_6b": ("0.6e9", "0.44e9", "Qwen3-0.6B"),
  "qwen3_1_7b": ("1.7e9", "1.4e9", "Qwen3-1.7B"),
  "qwen3_4b": ("4.0e9", "3.6e9", "Qwen3-4B-Instruct-2507"),
  "qwen2_5_7b": ("7.61e9", "6.53e9", "Qwen2.5-7B-Instruct"),
  "qwen3_30b_a3b": ("30.5e9", "29.9e9", "Qwen3-30B-A3B-Instruct-2507"),
  "llama3_2_1b": ("1.23e9", None, "Llama-3.2-1B-Instruct"),
  "llama3_2_3b": ("3.21e9", None, "Llama-3.2-3B-Instruct"),
  "smollm2_135m": ("135e6", None, "SmolLM2-135M-Instruct"),
}


def _check(count: int, published: str):
  """Within 0.5% of the published figure. A figure printed with only two significant digits
  ("1.7B") carries up to +-3% of rounding by itself, so there the check is that the figure is our
  count rounded to the digits printed (the strongest statement such a figure supports)."""
  value = Decimal(published)
  digits = len(value.as_tuple().digits)
  if digits >= 3:
    assert abs(count - value) / value <= Decimal("0.005"), (count, published)
  else:
    exponent = value.as_tuple().exponent
    rounded = Decimal(count).quantize(Decimal(1).scaleb(exponent), rounding="ROUND_HALF_EVEN")
    assert rounded == value, (count, published)


@functools.cache
def _abstract(preset):
  return nnx.eval_shape(lambda: Qwen(QwenConfig.preset(preset), rngs=nnx.Rngs(0)))


def _counts(preset):
  return count_params(QwenConfig.preset(preset), _abstract(preset))


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_counts_match_published(preset):
  counts = _counts(preset)
  total, non_embedding, _ = PUBLISHED[preset]
  _check(counts["total"], total)
  if non_embedding is not None:
    _check(counts["non_embedding"], non_embedding)


def test_check_rejects_a_wrong_count():
  with pytest.raises(AssertionError):
    _check(7_700_000_000, "7.61e9")  # 1.2% off
  with pytest.raises(AssertionError):
    _check(1_760_000_000, "1.7e9")  # rounds to 1.8B


def test_moe_preset_activates_a_tenth_of_its_parameters():
  counts = _counts("qwen3_30b_a3b")
  # 8 of 128 experts per token: about 3.35B of 30.5B ("3.3B activated" in the model card).
  assert 3.2e9 < counts["active"] < 3.4e9


@pytest.mark.parametrize("preset", PRESETS)
def test_every_parameter_has_a_known_logical_axis_per_dimension(preset):
  model = _abstract(preset)
  seen = 0
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    axes = var.get_metadata().get("out_sharding")
    assert axes is not None, f"{path} has no logical annotation"
    assert len(axes) == var.get_value().ndim, (path, axes)
    for name in axes:
      assert name in LOGICAL_RULES, (path, name)
    seen += 1
  assert seen > 0


def test_unknown_preset_is_a_clear_error():
  with pytest.raises(ValueError, match="unknown model preset"):
    QwenConfig.preset("is_moe_layer")


# ---------------------------------------------------------------------------------------------
# models.build
# ---------------------------------------------------------------------------------------------

TINY = kit.tiny_config(
  vocab_size=256,
  hidden_size=32,
  intermediate_size=64,
  num_hidden_layers=1,
  num_attention_heads=2,
  num_key_value_heads=1,
)


def _model_cfg(preset="tiny_cpu", checkpoint="", dtype="float32"):
  return ml_collections.ConfigDict({"preset": preset, "checkpoint": checkpoint, "dtype": dtype})


def _params(model):
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _assert_same(a, b):
  for x, y in zip(_params(a), _params(b), strict=True):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(x, y)


@pytest.fixture
def tiny_preset(monkeypatch):
  """QwenConfig.preset(name) gives TINY for every known name (unknown names still fail)."""
  real = QwenConfig.preset.__func__

  def preset(cls, name, **overrides):
    real(cls, name)  # the name check
    return TINY

  monkeypatch.setattr(QwenConfig, "preset", classmethod(preset))


def test_build_random_init_is_the_preset_under_the_seed(tiny_preset):
  model = models.build(_model_cfg(dtype="bfloat16"), seed=3)
  _assert_same(model, Qwen(TINY, rngs=nnx.Rngs(3), dtype=jnp.bfloat16))
  assert all(x.dtype == jnp.bfloat16 for x in _params(model))
  other = models.build(_model_cfg(dtype="bfloat16"), seed=4)
  assert not np.array_equal(model.embed_tokens[...], other.embed_tokens[...])
  with pytest.raises(ValueError, match="unknown model preset"):
    models.build(_model_cfg(preset="no_such"), seed=0)
  with pytest.raises(TypeError):
    models.build(_model_cfg(dtype="no_such_dtype"), seed=0)


def test_random_init_draws_the_keys_of_flax_s_own_stream(monkeypatch):
  """`next_params_key` (which skips the indexed count update that makes traced construction
  quadratic) gives the parameters and the final count that `rngs.params()` gives, eagerly and
  traced under `nnx.jit` as `builder.init` builds on a mesh."""
  from coevolve_jax.models import qwen

  def build(traced):
    rngs = nnx.Rngs(5)
    if traced:
      model = nnx.jit(lambda r: Qwen(TINY, rngs=r))(rngs)
    else:
      model = Qwen(TINY, rngs=rngs)
    return model, int(rngs.params.count.get_value())

  ours = {traced: build(traced) for traced in (False, True)}
  monkeypatch.setattr(qwen, "next_params_key", lambda rngs: rngs.params())
  for traced in (False, True):
    flax_model, flax_count = build(traced)
    model, count = ours[traced]
    _assert_same(model, flax_model)
    drawn = [p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)) if "norm" not in str(p)]
    assert count == flax_count == len(drawn)  # one key per randomly initialised parameter


def test_build_loads_a_checkpoint_in_the_config_dtype_and_ignores_the_preset(tmp_path):
  saved = Qwen(TINY, rngs=nnx.Rngs(9))
  save_pretrained(saved, tmp_path / "hf")
  model = models.build(_model_cfg(preset="no_such", checkpoint=str(tmp_path / "hf")), seed=0)
  _assert_same(model, saved)
  half = models.build(_model_cfg(checkpoint=str(tmp_path / "hf"), dtype="bfloat16"), seed=0)
  for x, y in zip(_params(half), _params(saved), strict=True):
    np.testing.assert_array_equal(x, y.astype(jnp.bfloat16))
  with pytest.raises(FileNotFoundError):
    models.build(_model_cfg(checkpoint=str(tmp_path / "missing")), seed=0)


def test_build_on_a_mesh_places_parameters_with_the_unsharded_values(tiny_preset, tmp_path):
  mesh = make_mesh({}, devices=jax.devices()[:1])
  save_pretrained(Qwen(TINY, rngs=nnx.Rngs(9)), tmp_path / "hf")
  for cfg in (_model_cfg(), _model_cfg(checkpoint=str(tmp_path / "hf"))):
    placed = models.build(cfg, seed=2, mesh=mesh)
    _assert_same(placed, models.build(cfg, seed=2))
    for x in jax.tree.leaves(nnx.state(placed, nnx.Param)):
      assert isinstance(x.sharding, jax.sharding.NamedSharding) and x.sharding.mesh == mesh


def test_build_on_eight_devices_shards_by_the_logical_rules():
  """`_mesh_child` in a fresh interpreter with 8 host devices."""
  run_child(__file__, "mesh")


def _mesh_child():
  assert jax.device_count() == 8
  P = jax.sharding.PartitionSpec  # noqa: N806
  QwenConfig.preset = classmethod(lambda cls, name: TINY)
  mesh = make_mesh({"fsdp": 2, "tensor": 4})
  placed = models.build(_model_cfg(), seed=1, mesh=mesh)
  _assert_same(placed, models.build(_model_cfg(), seed=1))
  emb = placed.embed_tokens.get_value()
  assert emb.sharding.spec == P("tensor", "fsdp") and len(emb.sharding.device_set) == 8
  print("mesh OK")


if __name__ == "__main__":
  if sys.argv[1:] == ["mesh"]:
    _mesh_child()


def test_matmul_precision_setting_reaches_the_compiled_products():
  """`model.matmul_precision` sets the precision of the float32 products every later trace gets
  (the lowered dot carries it); "default" leaves the backend's own choice; unknown names are
  refused."""
  a = jnp.ones((8, 8), jnp.float32)

  def lowered():
    return jax.jit(lambda x: x @ x).lower(a).as_text()

  try:
    models.apply_matmul_precision({"matmul_precision": "highest"})
    assert "precision = [HIGHEST, HIGHEST]" in lowered()
    models.apply_matmul_precision({"matmul_precision": "high"})
    assert "precision = [HIGH, HIGH]" in lowered()
    models.apply_matmul_precision({})  # absent: the default
    assert "precision = [DEFAULT, DEFAULT]" in lowered()
    with pytest.raises(ValueError, match="matmul_precision must be one of"):
      models.apply_matmul_precision({"matmul_precision": "tf32"})
  finally:
    models.apply_matmul_precision({"matmul_precision": "default"})


def test_init_trace_benchmark_prints_both_draws_and_their_ratio():
  """benchmarks/init_trace.py on the small preset: one row with both timings and the ratio."""
  import subprocess  # noqa: PLC0415

  script = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "init_trace.py")
  out = subprocess.run(
    [sys.executable, script, "--presets=tiny_cpu", "--repeats=1"],
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  ).stdout
  (row,) = [line for line in out.splitlines() if line.startswith("| tiny_cpu")]
  _, _, params, flax_s, ours_s, ratio, _ = [c.strip() for c in row.split("|")]
  f, o, r = float(flax_s), float(ours_s), float(ratio.removesuffix("x"))
  assert float(params.removesuffix("e9")) > 0 and f > 0 and o > 0
  # The ratio is of the unrounded times: within what the printed rounding (0.005 s) allows.
  assert (f - 0.005) / (o + 0.005) - 0.05 <= r <= (f + 0.005) / max(o - 0.005, 1e-9) + 0.05
  assert out.startswith("machine: ")
