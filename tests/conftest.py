"""Shared fixtures: the kit's tiny model (tests/kit.py) and the loopback Gemini stub.

The runs the tests start keep no compilation cache (`COEVOLVE_CACHE_DIR`, below). No XLA flags
here: the tests that need 8 host devices set --xla_force_host_platform_device_count in the child
processes they start (tests/host_devices.py).
"""

import os

import pytest

from coevolve_jax.testing.gemini_stub import GeminiStub

# No compilation cache for the runs the tests start with `compile.cache_dir = "auto"` (this
# process's and the children's, which inherit the variable): few programs recur across tests, and
# storing them cost more than loading saved (docs/benchmarks/compiles.md). The tests of the cache
# name folders of their own.
os.environ.setdefault("COEVOLVE_CACHE_DIR", "")


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
