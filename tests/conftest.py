"""Shared fixtures: the kit's tiny model (tests/kit.py) and the loopback Gemini stub.

The runs the tests start keep no compilation cache (`COEVOLVE_CACHE_DIR`, below), and XLA's CPU
backend compiles with LLVM at -O0 and its earlier fusion emitters (`TEST_XLA_FLAGS`, below). The
tests that need 8 host devices add --xla_force_host_platform_device_count in the child processes
they start (`tests/host_devices.py`).
"""

import os
import subprocess
import sys

import pytest

from coevolve_jax.testing.gemini_stub import GeminiStub

# Three compile-time settings of XLA's CPU backend for every program the suite compiles, in this
# process and in the children, which inherit the variable: the suite's time is mostly XLA compiles
# of tiny programs (docs/testing.md, "Timings").
# - LLVM at -O0: LLVM's code generation only, not XLA's HLO passes, buffer assignment or
#   floating-point rules (no fast math either way).
# - XLA's earlier fused-loop emitters instead of its MLIR fusion emitters
#   (`--xla_cpu_use_fusion_emitters=false`): the same HLO after the same passes, emitted by the
#   other of XLA:CPU's two code generators; 0.55-0.6x the compile time, execution about 1.3x.
# - One LLVM module per program (`--xla_cpu_parallel_codegen_split_count=1`), compiled on one
#   thread: two pytest-xdist workers on two cores no longer split each other's compiles
#   (0.83-0.92x in three paired runs of three test files).
# Both change the last bits of some elementwise results against the default build (exp, tanh:
# docs/testing.md), which no test depends on: bit-for-bit comparisons are between computations of
# the same build, comparisons with transformers or a reference are to a tolerance. XLA reads the
# variable when JAX starts its backend (the first computation, not an import), so it is set here,
# before any test module runs one.
TEST_XLA_FLAGS = (
  "--xla_backend_optimization_level=0",
  "--xla_cpu_use_fusion_emitters=false",
  "--xla_cpu_parallel_codegen_split_count=1",
)
_CHECKED = "COEVOLVE_TEST_XLA_FLAGS_CHECKED"  # set once; pytest-xdist's workers inherit it


def _xla_accepts(flags: list[str]) -> bool:
  """Whether this jaxlib's XLA accepts every one of `flags`: XLA aborts a process on a flag it
  does not know (a later jaxlib may drop one), so a child interpreter starts a CPU backend with
  them first (about 2 s, once: pytest-xdist's workers inherit the result in `XLA_FLAGS`)."""
  env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
  code = "import jax; jax.devices()"
  try:
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
  except subprocess.TimeoutExpired:
    return False
  return run.returncode == 0


if not os.environ.get(_CHECKED):
  os.environ[_CHECKED] = "1"
  # A flag the caller already set, to any value, is left to the caller.
  _missing = [f for f in TEST_XLA_FLAGS if f.split("=")[0] not in os.environ.get("XLA_FLAGS", "")]
  if _missing and not _xla_accepts(_missing):  # one child for all; each alone only if it fails
    _missing = [f for f in _missing if _xla_accepts([f])]
  if _missing:
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_missing]).strip()

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
