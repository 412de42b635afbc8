"""Benchmark: model-FLOPs formula against the real module's parameters, the per-chip / per-dollar
comparison, and the command line end to end on CPU."""

import copy
import json
import os
import subprocess
import sys

import pytest

from coevolve_jax import accelerators as prices
from coevolve_jax import benchmark as bench
from coevolve_jax import memory_plan as plan_device_memory
from coevolve_jax.models.qwen import QwenConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("preset", ["qwen3_4b", "qwen2_5_7b"])
def test_dense_flops_are_twice_the_layer_weights(preset):
  """2 FLOPs per weight per token (Kaplan et al. 2020), weights counted from the real module."""
  cfg = QwenConfig.preset(preset)
  count, _ = plan_device_memory.parameter_bytes(preset, {})
  embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
  norms = cfg.num_hidden_layers * 2 * cfg.hidden_size + cfg.hidden_size
  norms += cfg.num_hidden_layers * 2 * cfg.head_dim if cfg.qk_norm else 0
  biases = (
    cfg.num_hidden_layers * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    if cfg.attention_bias
    else 0
  )
  assert bench.model_flops(cfg, 1, 0, 0) == 2 * (count - embed - norms - biases)
  # The output projection: 2 * D * V per token whose logits are computed.
  assert (
    bench.model_flops(cfg, 1, 0, 3) - bench.model_flops(cfg, 1, 0, 0)
    == 3 * 2 * cfg.hidden_size * cfg.vocab_size
  )


def _record(chip, n, rollout, train, preset="qwen3_4b", kind="TPU v5 lite"):
  return {
    "schema": bench.SCHEMA,
    "date": "2026-11-30T00:00:00+00:00",
    "machine": {"device_kind": kind, "device_count": n, "chip": chip},
    "config": {"preset": preset},
    "rollout": {"tokens_per_s": rollout, "mfu": 0.25, "devices": n},
    "train": {"tokens_per_s": train, "mfu": None, "devices": n},
  }


def test_compare_per_chip_and_per_dollar():
  price = prices.chip("v5e")["usd_per_chip_hour"]
  text, rows = bench.compare(
    [_record("v5e", 4, 4000.0, 800.0), _record(None, 1, 50.0, 5.0, kind="cpu")],
    ["v5e-4", "cpu"],
    prices,
  )
  tpu, cpu = rows
  assert tpu["rollout_per_chip"] == 1000.0 and tpu["train_per_chip"] == 200.0
  assert tpu["rollout_per_usd"] == pytest.approx(1000.0 * 3600 / price)
  assert cpu["rollout_per_usd"] is None and cpu["usd_per_chip_hour"] is None
  lines = text.splitlines()
  assert lines[2].startswith("| v5e-4 | TPU v5 lite x 4 | qwen3_4b |")
  assert f"{1000.0 * 3600 / price:.3g}" in lines[2] and "25.00%" in lines[2]
  assert "| n/a |" in lines[3]
  assert prices.PRICES_AS_OF in text
  assert "different models" not in text


def test_compare_warns_on_different_models_and_rejects_other_files():
  text, _ = bench.compare(
    [
      _record("v5e", 4, 1.0, 1.0),
      _record("h100", 8, 1.0, 1.0, "qwen3_0_6b", "NVIDIA H100 80GB HBM3"),
    ],
    ["a", "b"],
    prices,
  )
  assert "different models" in text
  bad = copy.deepcopy(_record("v5e", 4, 1.0, 1.0))
  bad["schema"] = 99
  with pytest.raises(ValueError, match="schema"):
    bench.compare([bad], ["bad"], prices)
  with pytest.raises(ValueError, match="at least one"):
    bench.compare([], [], prices)


def test_bench_and_compare_command_line(tmp_path):
  out = tmp_path / "cpu.json"
  run = subprocess.run(
    [
      sys.executable,
      "-m",
      "coevolve_jax.cli.bench",
      "--config=configs/bfcl.py:cpu",
      "--config.engine.num_slots=2",
      "--prompt_len=16",
      "--gen_len=2",
      "--train_rows=2",
      "--train_seq=32",
      "--repeats=1",
      "--matmul_n=64",
      f"--out={out}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert run.returncode == 0, run.stderr[-3000:]
  rec = json.loads(out.read_text())
  assert rec["machine"]["backend"] == "cpu" and rec["machine"]["device_count"] >= 1
  assert rec["rollout"]["slots"] == 2
  assert rec["rollout"]["decode_tokens_per_s"] == pytest.approx(2 * 2 / rec["rollout"]["decode_s"])
  assert rec["train"]["mfu"] is None and 0 < rec["train"]["of_matmul"]
  assert set(rec["step_breakdown_s"]) == {
    "prefill",
    "decode",
    "old_logprobs",
    "ref_logprobs",
    "update",
    "weight_sync",
  }
  # The arrays the benchmark allocated, as the job does, are what the memory planner plans.
  plan = plan_device_memory.plan(
    "tiny_cpu",
    rec["config"]["mesh"],
    batch=2,
    seq_len=32,
    num_slots=2,
    cache_len=16 + 2 + 1,
    dtype="float32",
    param_dtype="float32",
  )
  memory = rec["memory_bytes_per_device"]
  for key in ("params", "optimizer", "reference", "rollout_weights", "kv_cache"):
    assert memory[key] == getattr(plan, key), key
  assert memory["peak"] is None  # XLA:CPU reports no device memory
  report = tmp_path / "report.md"
  cmp = subprocess.run(
    [sys.executable, "-m", "coevolve_jax.cli.bench", "compare", str(out), f"--report={report}"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert cmp.returncode == 0, cmp.stderr[-3000:]
  assert "| cpu | cpu x" in report.read_text()
  assert (tmp_path / "report.png").stat().st_size > 1000
  missing = subprocess.run(
    [sys.executable, "-m", "coevolve_jax.cli.bench", "compare", str(tmp_path / "nope.json")],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert missing.returncode == 2 and "cannot read" in missing.stderr
