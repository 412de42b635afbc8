"""The ahead-compile thread rule (`coevolve_jax.compiling`)."""

import os
import threading

import pytest

from coevolve_jax import compiling


def test_compile_threads_default_is_the_cpu_count_at_most_8():
  assert compiling.compile_threads(0) == min(8, os.cpu_count() or 1)
  assert compiling.compile_threads(3) == 3
  with pytest.raises(ValueError, match="must be >= 0"):
    compiling.compile_threads(-1)


def test_run_all_runs_every_call_then_raises_the_first_error():
  ran, lock = [], threading.Lock()

  def ok(i):
    with lock:
      ran.append(i)

  def bad():
    raise RuntimeError("lowering failed")

  calls = [lambda i=i: ok(i) for i in range(5)]
  with pytest.raises(RuntimeError, match="lowering failed"):
    compiling.run_all([*calls[:2], bad, *calls[2:]], threads=2)
  assert sorted(ran) == list(range(5))
