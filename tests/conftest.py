"""Shared fixtures: the kit's tiny model (tests/kit.py) and the loopback Gemini stub.

The runs the tests start keep no compilation cache (`COEVOLVE_CACHE_DIR`, below), and XLA's CPU
backend compiles with LLVM at -O0 (`TEST_XLA_FLAGS`, below). The tests that need 8 host devices
add --xla_force_host_platform_device_count in the child processes they start
(`tests/host_devices.py`).
"""

import os

import pytest

from coevolve_jax.testing.gemini_stub import GeminiStub

# LLVM at -O0 for every program the suite compiles, in this process and in the children, which
# inherit the variable: the suite's time is mostly XLA compiles of tiny programs, and -O0 cuts them
# (docs/testing.md, "Timings"). It changes LLVM's code generation only, not XLA's HLO passes,
# buffer assignment or floating-point semantics (no fast math either way), so what a test compares
# (bits against bits of the same build, figures against transformers' to a tolerance, compiled
# memory) is what the default build computes. XLA reads it when JAX starts its backend (the first
# computation, not an import), so it is set here, before any test module runs one.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

# No compilation cache for the runs the tests start with `compile.cache_dir = "auto"` (this
# process's and the children's, which inherit the variable): few programs recur across tests, and
# storing them cost more than loading saved (docs/benchmarks/compiles.md). The tests of the cache
# name folders of their own.
os.environ.setdefault("COEVOLVE_CACHE_DIR", "")

# Under pytest-xdist (`make test`: one worker per core) PyTorch's intra-op pool would start a
# thread per core in each worker beside XLA's: the transformers references (parity tests, the
# real-weights checks) then fight the other worker for both cores. One thread per worker.
if os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("OMP_NUM_THREADS"):
  os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(scope="module")
def tiny_model():
  """`kit.tiny_model()`: the default tiny Qwen, seed 0; one per test module (copy it before a
  trainer donates its buffers)."""
  import kit  # noqa: PLC0415  (here, not at the top: the kit's imports load JAX and the models)

  return kit.tiny_model()


@pytest.fixture
def gemini_stub():
  """A running `GeminiStub()` (its default feedback responder), closed after the test."""
  with GeminiStub() as stub:
    yield stub
