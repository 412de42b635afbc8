"""Ahead-of-time compiles in host threads (`compile.ahead`): the one rule for how many run at
once, shared by the engine's and the trainer's `compile_ahead`."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any
from concurrent import futures

import jax

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
  `compile_threads(threads)` host threads; the first error is raised after all have ended. On
  KeyboardInterrupt the calls not yet started are cancelled and those running are not waited
  for.

  With several processes the calls run one at a time, in order: a call that places host data
  on a mesh spanning processes (the trainer's places padding batches) may make collectives,
  which every process must issue in the same order; threads would interleave them differently
  on each process and deadlock the job (seen at GRPO step 1 on 2 loopback processes).
  """
  if jax.process_count() > 1:
    threads = 1
  pool = futures.ThreadPoolExecutor(compile_threads(threads))
  interrupted = False
  try:
    for f in [pool.submit(call) for call in calls]:
      f.result()
  except KeyboardInterrupt:  # Ctrl-C / SIGTERM
    interrupted = True
    raise
  finally:
    pool.shutdown(wait=not interrupted, cancel_futures=interrupted)


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
  """One compiled program's memory on one device, from XLA's buffer assignment
  (`Compiled.memory_analysis()`, the backend the program was compiled for; SPMD programs are
  per device). Bytes.

  Attributes:
    name: what the program is and its shape, e.g. "prefill rows=8 t=64 kv=512".
    temp: temporaries (activations, scores, copies) live during the call.
    arguments / outputs: the call's inputs and results.
    aliased: outputs written in place of donated inputs (no new memory).
  """

  name: str
  temp: int
  arguments: int
  outputs: int
  aliased: int

  @property
  def added(self) -> int:
    """What a call allocates beyond its (resident) inputs: temporaries and new outputs."""
    return self.temp + max(0, self.outputs - self.aliased)

  @classmethod
  def of(cls, name: str, compiled: Any) -> "ProgramMemory | None":
    """The figures of `compiled` (a `jax.stages.Compiled`), or None where the backend gives
    none."""
    try:
      m = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):
      return None
    if m is None:
      return None
    return cls(
      name,
      int(m.temp_size_in_bytes),
      int(m.argument_size_in_bytes),
      int(m.output_size_in_bytes),
      int(m.alias_size_in_bytes),
    )


AUTO_CACHE = "auto"  # `compile.cache_dir`'s default (`resolve_cache_dir`)
CACHE_ENV = "COEVOLVE_CACHE_DIR"  # the folder of "auto" when set (empty: none of ours)
_ENTRY_SUFFIX = "-cache"  # JAX's file cache: <key>-cache (and <key>-atime with eviction on)


def resolve_cache_dir(setting: str, workdir: str | None, processes: int = 1) -> str:
  """The compilation cache folder of `compile.cache_dir = setting`.

  "auto" (the default): $COEVOLVE_CACHE_DIR when it is set (set but empty: none of ours);
  else, on one process, a folder of the user's shared by every run, resume, evaluation,
  benchmark and ablation on this machine ($XDG_CACHE_HOME/coevolve_jax/xla, else
  ~/.cache/coevolve_jax/xla), and on several processes `<workdir>/compile_cache`, which every
  process sees (checked at start-up: only process 0 writes entries, and the others must read
  them). JAX keys every entry by the program, backend, JAX version and flags, so sharing a
  folder never loads a program compiled for another setting. "" leaves JAX's own setting
  (JAX_COMPILATION_CACHE_DIR, else off); anything else is the folder.
  """
  if setting != AUTO_CACHE:
    return setting
  if CACHE_ENV in os.environ:
    return os.environ[CACHE_ENV]
  if processes > 1 and workdir:
    return os.path.join(workdir, "compile_cache")
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "coevolve_jax", "xla")


_SCANNED = ".coevolve-scanned"  # its mtime: when the last completed scan of the folder started


def remove_torn_entries(cache_dir: str) -> int:
  """Deletes the entries of a local JAX file cache that do not decode (a process killed while
  JAX wrote one: JAX writes entries in place, without a temporary file, and never rewrites an
  entry that exists, so a torn one would cost a warning and a compile in every later process).

  Only entries written since the last completed scan of the folder are read (a marker file's
  mtime is that scan's start), so a large shared cache costs a start-up only its new entries.
  Returns how many were removed; a folder that is not local (gs://) or not there is left alone.
  """
  from jax._src import compilation_cache as cc  # noqa: PLC0415 (JAX's own entry codec)

  if "://" in cache_dir or not os.path.isdir(cache_dir):
    return 0
  marker = os.path.join(cache_dir, _SCANNED)
  started = time.time()
  try:
    since = os.stat(marker).st_mtime
  except OSError:
    since = 0.0
  torn = 0
  for entry in os.scandir(cache_dir):
    if not entry.name.endswith(_ENTRY_SUFFIX):
      continue
    try:
      if entry.stat().st_mtime < since:
        continue
      with open(entry.path, "rb") as f:
        cc.extract_executable_and_time(cc.decompress_executable(f.read()))
    except OSError:
      continue  # vanished or unreadable: not ours to judge
    except Exception:  # zlib / zstd / struct errors of a cut entry
      with contextlib.suppress(OSError):
        os.remove(entry.path)
        torn += 1
      with contextlib.suppress(OSError):
        os.remove(entry.path[: -len(_ENTRY_SUFFIX)] + "-atime")
  with contextlib.suppress(OSError):  # a read-only folder: scanned again next time
    with open(marker, "w"):
      pass
    os.utime(marker, (started, started))
  return torn


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


def enable_cache(setting: str, workdir: str | None = None, *, primary: bool = True) -> None:
  """`compile.cache_dir = setting` for this process, before its first compile: the folder of
  `resolve_cache_dir` with the torn entries removed (by the `primary` process, the only one JAX
  lets write entries) and JAX pointed at it; prints one line saying where (and how many torn
  entries were removed). Programs are stored however quickly they compiled (JAX's
  `jax_persistent_cache_min_compile_time_secs` set to 0 unless its environment variable is set).
  Several processes are read from `jax.process_count()`."""
  import jax  # noqa: PLC0415 (this module's thread rule needs no JAX)

  cache_dir = resolve_cache_dir(setting, workdir, jax.process_count())
  torn = remove_torn_entries(cache_dir) if primary and cache_dir else 0
  if cache_dir and "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    # Every program, not only those over JAX's 1 s default: a resume then compiles nothing
    # (the CPU preset's 38 quicker programs of 100 were compiled again at each resume).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  if use_persistent_cache(cache_dir):
    print(f"compilation cache: {cache_dir}" + (f" ({torn} torn entries removed)" if torn else ""))
