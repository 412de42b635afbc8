"""coevolve_jax: CoEvolve (agent-data mutual evolution) for tool-using Qwen agents, in JAX."""

__version__ = "0.1.0"
