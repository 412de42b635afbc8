"""Ahead-of-time compiles in host threads (`compile.ahead`): the one rule for how many run at
once, shared by the engine's and the trainer's `compile_ahead`."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent import futures

MAX_DEFAULT_THREADS = 8  # each compile of a large model holds its own working memory


def compile_threads(threads: int = 0) -> int:
  """Compiles to run at once: `threads`, or for 0 (`compile.threads`' default) the host's CPU
  count, at most `MAX_DEFAULT_THREADS`.

  Raises:
    ValueError: threads < 0.
  """
  if threads < 0:
    raise ValueError(f"compile threads must be >= 0 (0 = the CPU count, at most 8), got {threads}")
  return threads or min(MAX_DEFAULT_THREADS, os.cpu_count() or 1)


def run_all(calls: Sequence[Callable[[], None]], threads: int = 0) -> None:
  """Runs `calls` (each lowers and compiles programs: XLA compiles outside the GIL) in
  `compile_threads(threads)` host threads; the first error is raised after all have ended."""
  with futures.ThreadPoolExecutor(compile_threads(threads)) as pool:
    for f in [pool.submit(call) for call in calls]:
      f.result()


def use_persistent_cache(cache_dir: str) -> bool:
  """Points JAX's persistent compilation cache at `cache_dir` (`compile.cache_dir`), so a
  process that meets a program an earlier process compiled on the same backend, JAX version and
  flags (a resumed run, a rerun, the next job of a sweep) loads the executable instead of
  compiling it again. JAX stores only programs that took at least
  `jax_persistent_cache_min_compile_time_secs` (1 s by default) to compile.

  "" leaves JAX's own setting as it is (off unless JAX_COMPILATION_CACHE_DIR is set). The
  directory may be on a shared or GCS path (etils epath); in a multi-process job only process 0
  writes entries (JAX's rule), every process reads them. The cache is trusted: an entry is
  executed as it is, so it must not be writable by others. Loads count as compilations in
  `metrics.CompileCounter` (JAX times them as one) and are counted apart as cache hits.

  Returns:
    True when a directory was set. A process that compiled before this call with no cache
    starts using it from the next compilation.
  """
  import jax  # noqa: PLC0415 (this module's thread rule needs no JAX)
  from jax.experimental.compilation_cache import compilation_cache  # noqa: PLC0415

  if not cache_dir:
    return False
  # JAX adds its options to Config as attributes at run time; its type declarations lack them.
  if jax.config.jax_compilation_cache_dir != cache_dir:  # type: ignore[attr-defined]
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    compilation_cache.reset_cache()  # JAX decides once per process whether the cache is used
  return True
