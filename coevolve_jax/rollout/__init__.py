"""Rollout: the KV-cached engine over decode slots, sampling, and `generate` for prompt lists."""

from coevolve_jax.rollout.engine import Engine
from coevolve_jax.rollout.generate import Completion, generate
from coevolve_jax.rollout.sampling import SamplingParams, processed_logprobs, sample

__all__ = ["Completion", "Engine", "SamplingParams", "generate", "processed_logprobs", "sample"]
