"""coevolve_jax: CoEvolve (agent-data mutual evolution) for tool-using Qwen agents, in JAX."""

import os

__version__ = "0.1.0"


def _xla_cpu_defaults() -> None:
  """Routes XLA:CPU matrix multiplies to XNNPACK (`--xla_cpu_use_xnnpack=true`).

  XLA:CPU's default dot emitter reaches about 0.84x of torch's (oneDNN) matmul rate on the
  [4096, 512] x [512, 151936] logits product here; with XNNPACK it matches it (0.98x), which is
  what benchmarks/model_forward.py needs. Only CPU flags change, so TPU and GPU runs are
  unaffected. It must run before JAX initialises its backend; set COEVOLVE_XLA_CPU_DEFAULTS=0 (or
  pass your own --xla_cpu_use_xnnpack / --xla_cpu_use_onednn) to opt out.
  """
  if os.environ.get("COEVOLVE_XLA_CPU_DEFAULTS", "1") == "0":
    return
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_cpu_use_xnnpack" not in flags and "--xla_cpu_use_onednn" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_use_xnnpack=true".strip()


_xla_cpu_defaults()
