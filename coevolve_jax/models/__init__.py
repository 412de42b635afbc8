"""Model families."""

from coevolve_jax.models.qwen import KVCache, Qwen, QwenConfig

__all__ = ["KVCache", "Qwen", "QwenConfig"]
