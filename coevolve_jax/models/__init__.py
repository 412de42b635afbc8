"""Model families: the Qwen decoders, their Hugging Face checkpoint I/O, and `build` (a run's
model from its config)."""

from coevolve_jax.models.builder import MATMUL_PRECISIONS, apply_matmul_precision, build
from coevolve_jax.models.hf import (
  CheckpointFormatError,
  config_from_hf,
  from_pretrained,
  generation_eos_ids,
  hf_config,
  save_pretrained,
)
from coevolve_jax.models.qwen import PRESETS, KVCache, Qwen, QwenConfig

__all__ = [
  "MATMUL_PRECISIONS",
  "PRESETS",
  "CheckpointFormatError",
  "KVCache",
  "Qwen",
  "QwenConfig",
  "config_from_hf",
  "from_pretrained",
  "generation_eos_ids",
  "hf_config",
  "apply_matmul_precision",
  "build",
  "save_pretrained",
]
