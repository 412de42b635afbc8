"""Rollout: the KV-cached engine over decode slots, the slot-engine interface the agent loop
drives (`SlotEngine`), sampling, and `generate` for prompt lists."""

from coevolve_jax.rollout.engine import Engine
from coevolve_jax.rollout.generate import Completion, generate
from coevolve_jax.rollout.sampling import SamplingParams, processed_logprobs, sample
from coevolve_jax.rollout.slots import SlotEngine

__all__ = [
  "Completion",
  "Engine",
  "SamplingParams",
  "SlotEngine",
  "generate",
  "processed_logprobs",
  "sample",
]
