"""The ahead-compile thread rule (`coevolve_jax.compiling`)."""

import json
import os
import subprocess
import sys
import threading

import pytest
from jax._src import compilation_cache as cc  # the reader JAX itself uses for an entry

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


_CACHED_PROGRAM = """
import json, sys, jax, jax.numpy as jnp, numpy as np
from coevolve_jax import compiling
from coevolve_jax.metrics import CompileCounter
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # store even this small one
compiling.enable_cache(sys.argv[1])  # prints "compilation cache: ..." (torn entries removed)
counter = CompileCounter()
def mixed(x):
  return jnp.tanh(x @ x.T).sum(axis=0) * 2.0
out = jax.jit(mixed)(np.arange(12.0, dtype=np.float32).reshape(3, 4))
print(json.dumps({"values": np.asarray(out).tolist(), "figures": counter.pop()}))
"""


def _run_fresh_process(cache_dir):
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  proc = subprocess.run(
    [sys.executable, "-c", _CACHED_PROGRAM, cache_dir],
    env=dict(env, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Error reading persistent compilation cache entry" not in proc.stderr
  lines = proc.stdout.strip().splitlines()
  assert lines[0].startswith(f"compilation cache: {cache_dir}")
  out = json.loads(lines[-1])
  return out["values"], {**out["figures"], "line": lines[0]}


def test_a_second_process_loads_the_program_from_the_persistent_cache(tmp_path):
  """`compile.cache_dir`: the first process compiles and stores the program, a second one loads
  it (one cache hit, still one program in `compile/count`) and computes the same values."""
  cache_dir = str(tmp_path / "xla")
  first_values, first = _run_fresh_process(cache_dir)
  assert first["compile/count"] == 1 and first["compile/cache_hits"] == 0, first
  assert os.listdir(cache_dir)
  second_values, second = _run_fresh_process(cache_dir)
  assert second["compile/count"] == 1 and second["compile/cache_hits"] == 1, second
  assert second["compile/program/mixed"] == 1
  assert second_values == first_values


def test_an_entry_torn_by_a_kill_is_removed_counted_and_written_again(tmp_path):
  """JAX writes a cache entry in place and never rewrites one that exists, so an entry cut by a
  kill cost every later process a warning and a compile. The start-up removes it (counted in
  its line), the process compiles and stores the program again, and the next one loads it."""
  cache_dir = str(tmp_path / "xla")
  first_values, _ = _run_fresh_process(cache_dir)
  (entry,) = [
    n for n in os.listdir(cache_dir) if n.startswith("jit_mixed") and n.endswith("-cache")
  ]
  path = os.path.join(cache_dir, entry)
  with open(path, "rb") as f:
    data = f.read()
  with open(path, "wb") as f:
    f.write(data[: len(data) // 2])  # the write a SIGKILL cut
  values, figures = _run_fresh_process(cache_dir)
  assert figures["line"] == f"compilation cache: {cache_dir} (1 torn entries removed)"
  assert figures["compile/cache_hits"] == 0 and values == first_values
  with open(path, "rb") as f:
    again = f.read()
  # Written again, whole: JAX's own reader takes it (the bytes are not the first process's: an
  # entry holds a serialized executable that differs from one compile to the next on some CPUs).
  assert len(again) > len(data) // 2
  cc.extract_executable_and_time(cc.decompress_executable(again))
  values, figures = _run_fresh_process(cache_dir)
  assert figures["line"] == f"compilation cache: {cache_dir}"
  assert figures["compile/cache_hits"] == 1 and values == first_values
  # Entries from before the last completed scan are not read again (a large cache costs each
  # start-up only its new entries): a cut one that old is left to JAX's warning.
  with open(path, "wb") as f:
    f.write(data[: len(data) // 2])
  scanned = os.stat(os.path.join(cache_dir, ".coevolve-scanned")).st_mtime
  os.utime(path, (scanned - 60, scanned - 60))
  assert compiling.remove_torn_entries(cache_dir) == 0 and os.path.exists(path)
  os.utime(path, None)  # written after it: read, and removed
  assert compiling.remove_torn_entries(cache_dir) == 1 and not os.path.exists(path)


def test_auto_is_the_users_cache_on_one_process_and_the_workdirs_on_several(monkeypatch):
  monkeypatch.setenv("COEVOLVE_CACHE_DIR", "/x/cache")
  assert compiling.resolve_cache_dir("auto", "/runs/a") == "/x/cache"
  assert compiling.resolve_cache_dir("auto", "/runs/a", 2) == "/x/cache"
  monkeypatch.setenv("COEVOLVE_CACHE_DIR", "")  # set empty: none of ours
  assert compiling.resolve_cache_dir("auto", "/runs/a", 2) == ""
  monkeypatch.delenv("COEVOLVE_CACHE_DIR")
  assert compiling.resolve_cache_dir("auto", "/runs/a", 2) == "/runs/a/compile_cache"
  monkeypatch.setenv("XDG_CACHE_HOME", "/home/u/.cache")
  assert compiling.resolve_cache_dir("auto", None) == "/home/u/.cache/coevolve_jax/xla"
  assert compiling.resolve_cache_dir("", "/runs/a") == ""
  assert compiling.resolve_cache_dir("/mine", "/runs/a", 2) == "/mine"


def test_an_empty_cache_dir_leaves_jax_setting_alone():
  import jax  # noqa: PLC0415

  before = jax.config.jax_compilation_cache_dir
  assert compiling.use_persistent_cache("") is False
  assert jax.config.jax_compilation_cache_dir == before
