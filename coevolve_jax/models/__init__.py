"""Model families: the Qwen decoders, their Hugging Face checkpoint I/O, and `build` (a run's
model from its config)."""

from coevolve_jax.models.builder import build
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
  "PRESETS",
  "CheckpointFormatError",
  "KVCache",
  "Qwen",
  "QwenConfig",
  "config_from_hf",
  "from_pretrained",
  "generation_eos_ids",
  "hf_config",
  "build",
  "save_pretrained",
]
