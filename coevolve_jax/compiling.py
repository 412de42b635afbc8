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
