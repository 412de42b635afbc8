"""Named presets against published parameter counts, and logical annotations on every parameter.

Everything here uses `nnx.eval_shape`: nothing is allocated, so the 30B preset costs nothing.
"""

import functools
from decimal import Decimal

import pytest
from flax import nnx

from coevolve_jax.models import PRESETS, Qwen, QwenConfig
from coevolve_jax.models.qwen import count_params
from coevolve_jax.models.sharding import LOGICAL_RULES

# Published counts, as printed in each model card ("Number of Parameters" and "... (Non-Embedding)";
# non-embedding excludes the input embedding and an untied output head).
PUBLISHED = {
  "qwen3_0_6b": ("0.6e9", "0.44e9", "Qwen3-0.6B"),
  "qwen3_1_7b": ("1.7e9", "1.4e9", "Qwen3-1.7B"),
  "qwen3_4b": ("4.0e9", "3.6e9", "Qwen3-4B-Instruct-2507"),
  "qwen2_5_7b": ("7.61e9", "6.53e9", "Qwen2.5-7B-Instruct"),
  "qwen3_30b_a3b": ("30.5e9", "29.9e9", "Qwen3-30B-A3B-Instruct-2507"),
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
