"""Environments for coevolve_jax: plain Python (no JAX), `reset()` / `step(action)`."""
